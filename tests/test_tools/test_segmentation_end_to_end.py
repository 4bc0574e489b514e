"""Every shipped segmentation config: one short epoch with mmseg's own
tools/train.py, then tools/test.py on the saved checkpoint, on a synthetic
copy of its dataset converted by its converter."""
import glob
import json
import os.path as osp
import subprocess
import sys

import pytest
import torch

from .helpers import (ROOT, make_synthetic_lesion_dataset, mmseg_tool,
                      seg_short_run_options)

CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', 'segmentation',
                                    '*.py')))
LAYOUTS = {  # config dataset -> (synthetic layout, its size options)
    'isic2017': ('isic2017', ['--num-train', '6', '--num-val', '2',
                              '--num-test', '2']),
    'isic2018': ('isic2018', ['--num-train', '10', '--num-val', '0',
                              '--num-test', '0']),
    'kvasir-seg': ('kvasir', ['--num', '10']),
}
LESION_METRICS = ('lesion_IoU', 'lesion_Dice', 'mean_image_IoU',
                  'mean_image_Dice', 'Sensitivity', 'Specificity', 'mIoU',
                  'mDice')


@pytest.fixture(scope='module')
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp('lesions')
    return {name: make_synthetic_lesion_dataset(root, layout, counts)
            for name, (layout, counts) in LAYOUTS.items()}


def dataset_of(path):
    return next(name for name in LAYOUTS if f'_{name}-' in path)


def run(cmd):
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]


@pytest.mark.slow
@pytest.mark.parametrize('config', [
    pytest.param(
        c,
        marks=pytest.mark.skipif(
            '_amp-' in c and not torch.cuda.is_available(),
            reason="mmengine's AmpOptimWrapper refuses to build without a "
            'GPU')) for c in CONFIGS
], ids=osp.basename)
def test_config_trains_and_tests_with_mmseg_tools(config, datasets,
                                                  tmp_path):
    options = seg_short_run_options(datasets[dataset_of(config)])
    work_dir = tmp_path / 'work'
    run([sys.executable, mmseg_tool('train.py'), config, '--work-dir',
         str(work_dir), '--cfg-options', *options])
    checkpoint = work_dir / 'epoch_1.pth'
    assert checkpoint.is_file()
    run([sys.executable, mmseg_tool('test.py'), config, str(checkpoint),
         '--work-dir', str(tmp_path / 'test'), '--cfg-options', *options])
    [result] = glob.glob(str(tmp_path / 'test' / '*' / '*.json'))
    with open(result) as f:
        metrics = json.load(f)
    assert set(LESION_METRICS) <= set(metrics)
    for name in ('lesion_IoU', 'lesion_Dice', 'mIoU', 'mDice'):
        assert 0.0 <= metrics[name] <= 100.0, (name, metrics[name])
