"""The README's main job through mmdet's own train.py/test.py, kept short."""
import json
import os.path as osp
import subprocess
import sys

import pytest

from .helpers import ROOT, assert_demo_rejects


@pytest.mark.slow
def test_demo_trains_tests_and_reloads_with_same_coco_ap(tmp_path):
    work_dir = tmp_path / 'work'
    result = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'demo.py'), '--work-dir',
         str(work_dir), '--data-root', str(tmp_path / 'data'),
         '--max-iters', '6'],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    with open(work_dir / 'demo_metrics.json') as f:
        summary = json.load(f)
    keys = {'bbox_mAP', 'bbox_mAP_50', 'bbox_mAP_75', 'bbox_mAP_s',
            'bbox_mAP_m', 'bbox_mAP_l'}
    assert set(summary['after_training']) == keys
    assert summary['after_training'] == summary['after_reload']
    assert all(-1.0 <= v <= 1.0 for v in summary['after_reload'].values())
    assert osp.isfile(summary['checkpoint'])
    assert summary['checkpoint'].endswith('iter_6.pth')
    assert (work_dir / 'predictions.png').stat().st_size > 0
    assert 'reloaded checkpoint gives the same AP: yes' in result.stdout


@pytest.mark.parametrize('value', ['0', '-5'])
def test_demo_rejects_max_iters_below_one(value, tmp_path):
    """--max-iters 0 used to run train.py for nothing and then fail looking
    for its metrics; now argparse names the option before anything runs."""
    assert_demo_rejects('demo.py', '--max-iters', value, tmp_path)
