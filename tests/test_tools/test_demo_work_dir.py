"""The demos refuse a ``--work-dir`` they cannot write into with one
``error:`` line (exit code 1, no traceback), before they generate data or
train."""
import os.path as osp
import subprocess
import sys

import pytest

from .helpers import ROOT


@pytest.mark.parametrize('demo', ['demo.py', 'seg_demo.py'])
@pytest.mark.parametrize('where', ['a file', 'under a file'])
def test_demo_refuses_a_work_dir_it_cannot_write(demo, where, tmp_path):
    blocker = tmp_path / 'taken'
    blocker.write_text('a file')
    work_dir = blocker if where == 'a file' else blocker / 'work'
    result = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', demo), '--work-dir',
         str(work_dir), '--data-root', str(tmp_path / 'data')],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith(f'error: --work-dir {work_dir}: ')
    assert 'Traceback' not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['taken']
    assert blocker.read_text() == 'a file'
