"""mmdet's own tools with kcla_mm configs: bad paths and checkpoints."""
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

from .helpers import (DEMO_CONFIG, ROOT, data_options, make_synthetic_coco,
                      mmdet_tool)


def run_tool(args, cwd):
    return subprocess.run([sys.executable] + args, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_missing_data_root_names_the_annotation_path(tmp_path):
    root = str(tmp_path / 'no_such_dataset') + '/'
    result = run_tool([
        mmdet_tool('train.py'), DEMO_CONFIG, '--work-dir',
        str(tmp_path / 'work'), '--cfg-options', *data_options(root)
    ], ROOT)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('FileNotFoundError'), last
    assert root + 'annotations/instances_train2017.json' in last


@pytest.mark.slow
def test_mismatched_checkpoint_reports_the_keys(tmp_path):
    from mmdet.registry import MODELS
    import kcla_mm  # noqa: F401
    data_root = make_synthetic_coco(tmp_path / 'data', 4, 2)
    # a checkpoint of the same detector for 5 classes, not 3
    cfg = Config.fromfile(DEMO_CONFIG)
    cfg.model.roi_head.bbox_head.num_classes = 5
    checkpoint = tmp_path / 'five_classes.pth'
    torch.save({'state_dict': MODELS.build(cfg.model).state_dict()},
               checkpoint)
    result = run_tool([
        mmdet_tool('test.py'), DEMO_CONFIG,
        str(checkpoint), '--work-dir',
        str(tmp_path / 'work'), '--cfg-options',
        *data_options(data_root)
    ], ROOT)
    log = result.stdout + result.stderr
    assert 'do not match exactly' in log
    for key, shape in (('roi_head.bbox_head.fc_cls.weight', '[6, 256]'),
                       ('roi_head.bbox_head.fc_reg.weight', '[20, 256]')):
        assert f'size mismatch for {key}' in log, log[-3000:]
        assert shape in log
