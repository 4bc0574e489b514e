"""The segmentation demo through mmseg's own train.py/test.py, kept short."""
import json
import os.path as osp
import subprocess
import sys

import pytest
from PIL import Image

from .helpers import ROOT, assert_demo_rejects


@pytest.mark.slow
def test_seg_demo_trains_tests_and_draws_predictions(tmp_path):
    work_dir = tmp_path / 'work'
    result = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'seg_demo.py'),
         '--work-dir', str(work_dir), '--data-root', str(tmp_path / 'data'),
         '--num-images', '20', '--max-iters', '4', '--num-shown', '2'],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    # the converter's seeded 70/10/20 split of the 20 synthetic images
    for split, count in (('train', 14), ('val', 2), ('test', 4)):
        images = (tmp_path / 'data' / 'img_dir' / split).iterdir()
        assert len(list(images)) == count, split
    with open(work_dir / 'seg_demo_metrics.json') as f:
        summary = json.load(f)
    names = {'lesion_IoU', 'lesion_Dice', 'mean_image_IoU',
             'mean_image_Dice', 'mIoU', 'mDice'}
    for key in ('val_after_training', 'test_after_reload'):
        assert set(summary[key]) == names
        assert all(0.0 <= v <= 100.0 for v in summary[key].values())
    assert summary['checkpoint'].endswith('iter_4.pth')
    # 2 rows of image | ground truth | prediction, 128x128 synthetic images
    with Image.open(work_dir / 'predictions.png') as picture:
        assert picture.size == (3 * 128, 2 * 128)
    assert 'Lesion segmentation metrics' in result.stdout


@pytest.mark.parametrize('option, value', [('--num-images', '0'),
                                           ('--max-iters', '0'),
                                           ('--num-shown', '0'),
                                           ('--num-shown', '-1')])
def test_seg_demo_rejects_counts_below_one(option, value, tmp_path):
    """Counts below one stop the demo before it generates data or trains
    (--num-shown 0 used to fail after training, and -1 to show all test
    images but the last)."""
    assert_demo_rejects('seg_demo.py', option, value, tmp_path)
