"""kcla_mm._ext compiles and links with CUDA here, without a GPU.

Runs tools/check_cuda_build.sh: a separate virtualenv with torch 2.14.1 (a
CUDA 13.0 build) and the machine's nvcc build the extension out of tree
with FORCE_CUDA=1 and check it defines the CUDA launchers. Slow (minutes);
skipped only where no nvcc exists.
"""
import os
import os.path as osp
import shutil
import subprocess

import pytest

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CUDA_HOME = os.environ.get('CUDA_HOME', '/usr/local/cuda')


@pytest.mark.slow
@pytest.mark.skipif(
    not osp.exists(osp.join(CUDA_HOME, 'bin', 'nvcc'))
    and shutil.which('nvcc') is None,
    reason='no CUDA toolkit (nvcc) on this machine')
def test_extension_builds_with_cuda(tmp_path):
    result = subprocess.run(
        ['bash', osp.join(ROOT, 'tools', 'check_cuda_build.sh')],
        cwd=ROOT,
        env=dict(os.environ, KCLA_CUDA_BUILD_DIR=str(tmp_path / 'build')),
        capture_output=True,
        text=True,
        timeout=40 * 60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    assert '[cuda-check] ok:' in result.stdout
