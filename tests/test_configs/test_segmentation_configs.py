"""Every shipped segmentation config builds its segmentor by name; mmcv's
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
    glob.glob(osp.join(ROOT, 'configs', 'segmentation', '*.py')) +
    glob.glob(osp.join(ROOT, 'configs', 'demo', 'res-unet*.py')))
DATASETS = ('isic2017', 'isic2018', 'kvasir-seg')
VARIANTS = {  # name prefix -> (encoder attention, decoder attention)
    'res-unet_r18s_': (None, None),
    'res-unet_r18s-kcla_': ('KCLA', None),
    'res-unet_r18s-mrla-light_': ('MRLA-light', None),
    'res-unet-kcla_r18s-kcla_': ('KCLA', 'KCLADecoderAttention'),
    'res-unet-ea_r18s_': (None, None),  # External Attention, one dataset
}
OPTIONAL_VARIANTS = ('res-unet-ea_r18s_', )


def variant(path):
    name = osp.basename(path)
    return VARIANTS[max((p for p in VARIANTS if name.startswith(p)), key=len)]


def test_every_variant_is_shipped_for_every_dataset():
    names = {osp.basename(p) for p in CONFIGS}
    for dataset in DATASETS:
        for prefix in set(VARIANTS) - set(OPTIONAL_VARIANTS):
            assert f'{prefix}300e_{dataset}-256x256.py' in names


@pytest.mark.parametrize('path', CONFIGS, ids=osp.basename)
def test_config_builds_segmentor(path):
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules()
    import kcla_mm  # noqa: F401  (the configs' custom_imports)
    cfg = Config.fromfile(path)
    assert cfg.custom_imports['imports'] == ['kcla_mm']
    # resume, load_from and test.py under torch's weights_only loading
    assert dict(type='SafeLoadHook') in cfg.custom_hooks
    encoder_attention, decoder_attention = variant(path)
    backbone, head = cfg.model.backbone, cfg.model.decode_head
    assert backbone.layer_attention == encoder_attention
    assert (head.get('decoder_attention') or {}).get('type') == \
        decoder_attention
    # the authors' recipe: AdamW lr 1e-3 wd 1e-2, BCE + Dice
    assert cfg.optim_wrapper.optimizer.type == 'AdamW'
    assert cfg.optim_wrapper.optimizer.lr == 1e-3
    assert cfg.optim_wrapper.optimizer.weight_decay == 1e-2
    ce, dice = head.loss_decode
    assert (ce.type, dice.type) == ('CrossEntropyLoss', 'DiceLoss')
    # Dice of the lesion channel only (see the base config)
    assert dice.ignore_index == 0 and not dice.use_sigmoid
    assert head.num_classes == 2 and head.get('out_channels', 2) == 2
    assert cfg.val_evaluator.type == 'LesionMetric'
    if 'demo' not in path:
        resize = [t for t in cfg.train_pipeline if t.type == 'Resize']
        assert resize[0].scale == (256, 256)
        assert cfg.train_cfg.max_epochs == 300
        assert cfg.train_dataloader.batch_size == 8
    model = MODELS.build(cfg.model)
    assert type(model.backbone).__name__ == 'ResNetKCLA'
    assert type(model.decode_head).__name__ == 'ResUNetHead'
    bottleneck = type(model.decode_head.bottleneck_attention).__name__
    assert bottleneck == ('ExternalAttention' if '-ea_' in path else
                          'NoneType')
    model.init_weights()
    model.eval()
    with torch.no_grad():
        logits = model._forward(torch.rand(1, 3, 64, 64))
    assert logits.shape == (1, 2, 64, 64)
    x = torch.rand(1, 3, 64, 64)
    assert_fusion_keeps_outputs(randomise_bn(model),
                                lambda m: [m._forward(x)],
                                rtol=1e-3, atol=1e-5)
