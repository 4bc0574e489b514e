"""Every shipped detection config builds its detector by name; mmcv's
fuse_conv_bn keeps what it computes."""
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config

from ..test_models.test_fuse_conv_bn import (assert_fusion_keeps_outputs,
                                             randomise_bn)

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIGS = sorted(
    glob.glob(osp.join(ROOT, 'configs', 'detection', '*.py')) +
    glob.glob(osp.join(ROOT, 'configs', 'demo', '*coco*.py')))


def test_expected_configs_are_shipped():
    names = {osp.basename(p) for p in CONFIGS}
    assert {
        'faster-rcnn_r50-kcla_fpn_1x_coco.py',
        'faster-rcnn_r101-kcla_fpn_1x_coco.py',
        'mask-rcnn_r50-kcla_fpn_1x_coco.py',
        'mask-rcnn_r101-kcla_fpn_1x_coco.py',
        'faster-rcnn_r50-kcla_kcla-fpn_1x_coco.py',
        'mask-rcnn_r50-kcla_kcla-fpn_1x_coco.py',
    } <= names


@pytest.mark.parametrize('path', CONFIGS, ids=osp.basename)
def test_config_builds_detector(path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    import kcla_mm  # noqa: F401  (the configs' custom_imports)
    cfg = Config.fromfile(path)
    assert cfg.custom_imports['imports'] == ['kcla_mm']
    # resume, load_from and test.py under torch's weights_only loading
    assert dict(type='SafeLoadHook') in cfg.custom_hooks
    backbone = cfg.model.backbone
    # External Attention alone runs on mmdet's own ResNet
    expected = 'ResNet' if '_r50-ea_' in path else 'ResNetKCLA'
    assert backbone.type == expected
    if 'coco' in osp.basename(path) and 'synthetic' not in path:
        # the authors' recipe: 1x schedule, batch 16, lr 0.02
        assert backbone.frozen_stages == 1 and backbone.norm_eval
        assert cfg.train_cfg.max_epochs == 12
        assert cfg.auto_scale_lr.base_batch_size == 16
        assert cfg.optim_wrapper.optimizer.lr == 0.02
    cfg.model.backbone.init_cfg = None  # no download in tests
    model = MODELS.build(cfg.model)
    assert type(model.backbone).__name__ == expected
    neck = 'KCLAFPN' if 'kcla-fpn' in osp.basename(path) else 'FPN'
    assert type(model.neck).__name__ == neck
    model.eval()
    with torch.no_grad():
        feats = model.extract_feat(torch.rand(1, 3, 64, 64))
    assert len(feats) == 5 and all(f.shape[1] == cfg.model.neck.out_channels
                                   for f in feats)
    x = torch.rand(1, 3, 64, 64)
    assert_fusion_keeps_outputs(randomise_bn(model),
                                lambda m: m.extract_feat(x),
                                rtol=1e-3, atol=1e-5)
