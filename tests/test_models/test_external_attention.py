"""ExternalAttention (and EAHead) against the paper's equations, as an mmdet
ResNet / ResNetKCLA block plugin and as an mmseg decode head."""
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import kcla_mm  # noqa: F401  (registers the modules)
from kcla_mm.models.layers import ExternalAttention
from ..test_tools.helpers import (ROOT, data_options, make_synthetic_coco,
                                  mmdet_tool)

EA_DEMO_CONFIG = osp.join(ROOT, 'configs', 'demo',
                          'faster-rcnn_r50s-kcla-ea_fpn_synthetic-coco.py')
EA_PLUGIN = dict(
    cfg=dict(type='ExternalAttention', num_slots=8, num_heads=2),
    stages=(False, False, True, True),
    position='after_conv3')


def build_seg(cfg: dict) -> nn.Module:
    """Build from mmseg's MODELS in mmseg's scope, as mmseg's runner does
    (other tests may leave mmdet's as the global default scope)."""
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    with DefaultScope.overwrite_default_scope('mmseg'):
        return MODELS.build(cfg)


def naive_external_attention(ea: ExternalAttention, x: torch.Tensor,
                             double_normalization: bool) -> torch.Tensor:
    """The paper's equations with explicit sums, from ``ea``'s weights
    (its norm, if any, a BN in eval mode)."""
    b, c, h, w = x.shape
    g, s = ea.num_heads, ea.num_slots
    d, n = c // g, h * w
    w1 = ea.conv1.weight[:, :, 0, 0]
    feat = torch.einsum('oc,bcn->bon', w1, x.reshape(b, c, n)) + \
        ea.conv1.bias.view(1, c, 1)
    feat = feat.reshape(b, g, d, n)
    m_k = ea.linear_0.weight[:, :, 0]  # (S, d)
    m_v = ea.linear_1.weight[:, :, 0]  # (d, S)
    logits = torch.einsum('sd,bgdn->bgsn', m_k, feat)
    e = torch.exp(logits - logits.amax(dim=(2, 3), keepdim=True))
    if double_normalization:
        a_hat = e / e.sum(dim=3, keepdim=True)  # softmax over positions n
        attn = a_hat / (1e-9 + a_hat.sum(dim=2, keepdim=True))  # l1 over s
    else:
        attn = e / e.sum(dim=2, keepdim=True)  # softmax over slots s
    f_out = torch.einsum('ds,bgsn->bgdn', m_v, attn).reshape(b, c, n)
    y = torch.einsum('oc,bcn->bon', ea.conv2.weight[:, :, 0, 0], f_out)
    if ea.norm_name:
        bn = getattr(ea, ea.norm_name)
        y = (y - bn.running_mean.view(1, c, 1)) / torch.sqrt(
            bn.running_var.view(1, c, 1) + bn.eps) * bn.weight.view(
                1, c, 1) + bn.bias.view(1, c, 1)
    else:
        y = y + ea.conv2.bias.view(1, c, 1)
    out = x + y.reshape(b, c, h, w)
    return out.relu() if ea.with_relu else out


def randomise(module: nn.Module) -> None:
    """Random weights and BN statistics, so that no term is trivial."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for name, buf in module.named_buffers():
            if name.endswith('running_mean'):
                buf.copy_(torch.randn_like(buf))
            elif name.endswith('running_var'):
                buf.copy_(torch.rand_like(buf) + 0.5)


@pytest.mark.parametrize('num_heads,double,norm_cfg,with_relu', [
    (1, True, dict(type='BN'), True),
    (4, True, dict(type='BN'), True),
    (2, False, dict(type='BN'), True),
    (2, True, None, False),
])
def test_matches_naive_equations_float64(num_heads, double, norm_cfg,
                                         with_relu):
    ea = ExternalAttention(
        16,
        num_slots=6,
        num_heads=num_heads,
        norm_cfg=norm_cfg,
        with_relu=with_relu,
        double_normalization=double).double().eval()
    randomise(ea)
    x = torch.randn(2, 16, 5, 7, dtype=torch.float64)
    out = ea(x)
    assert out.shape == x.shape and out.dtype == torch.float64
    torch.testing.assert_close(
        out, naive_external_attention(ea, x, double), rtol=1e-10,
        atol=1e-10)


def test_single_head_is_eanet_module():
    """With one head: the authors' parameter names and shapes
    (conv1, linear_0 = M_k (S, C, 1), linear_1 = M_v (C, S, 1), conv2)."""
    ea = ExternalAttention(32, num_slots=64)
    shapes = {k: tuple(v.shape) for k, v in ea.state_dict().items()}
    assert shapes['conv1.weight'] == (32, 32, 1, 1)
    assert shapes['conv1.bias'] == (32, )
    assert shapes['linear_0.weight'] == (64, 32, 1)
    assert shapes['linear_1.weight'] == (32, 64, 1)
    assert shapes['conv2.weight'] == (32, 32, 1, 1)
    assert 'conv2.bias' not in shapes and shapes['bn.weight'] == (32, )


def test_double_normalisation_properties():
    ea = ExternalAttention(16, num_slots=8, num_heads=2).double()
    randomise(ea)
    maps = {}
    for name in ('softmax', 'l1'):
        getattr(ea.normalize, name).register_forward_hook(
            lambda m, i, o, name=name: maps.__setitem__(name, o))
    x = torch.randn(3, 16, 6, 5, dtype=torch.float64)
    attn = ea.attention_map(x)
    softmax, l1 = maps['softmax'], maps['l1']  # (B * h, S, N)
    assert softmax.shape == l1.shape == (3 * 2, 8, 30)
    # before the l1 step: each slot's weights over the N positions sum to 1
    torch.testing.assert_close(softmax.sum(dim=2), torch.ones(6, 8,
                                                              dtype=x.dtype))
    # after it: each position's weights over the S slots sum to 1
    torch.testing.assert_close(l1.sum(dim=1), torch.ones(6, 30,
                                                         dtype=x.dtype))
    assert (l1 > 0).all()
    torch.testing.assert_close(attn, l1.view(3, 2, 8, 30))
    # and not the other way round (the two steps do not commute)
    assert (l1.sum(dim=2) - 1).abs().max() > 1e-3


def test_single_normalisation_is_softmax_over_slots():
    ea = ExternalAttention(16, num_slots=8, double_normalization=False)
    assert isinstance(ea.normalize, nn.Softmax) and ea.normalize.dim == 1
    attn = ea.attention_map(torch.randn(2, 16, 4, 4))
    torch.testing.assert_close(attn.sum(dim=2), torch.ones(2, 1, 16))


def test_attention_map_is_slots_by_positions_linear_in_n():
    ea = ExternalAttention(32, num_slots=16, num_heads=4)
    sizes = {}
    for side in (4, 8, 16, 32):
        attn = ea.attention_map(torch.rand(2, 32, side, side))
        assert attn.shape == (2, 4, 16, side * side)  # (B, h, S, N)
        sizes[side] = attn.numel()
    assert [sizes[s] / sizes[4] for s in (4, 8, 16, 32)] == [1, 4, 16, 64]


@pytest.mark.parametrize('pretrained', [False, True])
def test_init_survives_the_backbone_init(tmp_path, pretrained):
    """A generic init_cfg (Kaiming convs, BN weight 1) is applied before the
    plugins re-apply theirs; a Pretrained one skips the children's
    init_weights, and the construction-time init stays."""
    from mmdet.registry import MODELS
    plugin = dict(EA_PLUGIN, cfg=dict(EA_PLUGIN['cfg'], zero_init=True))
    cfg = dict(type='ResNet', depth=50, base_channels=4, plugins=[plugin])
    if pretrained:
        path = str(tmp_path / 'r50.pth')
        torch.save(MODELS.build(dict(cfg, plugins=None)).state_dict(), path)
        cfg['init_cfg'] = dict(type='Pretrained', checkpoint=path)
    backbone = MODELS.build(cfg)
    backbone.init_weights()
    if pretrained:
        checkpoint = torch.load(path)
        torch.testing.assert_close(backbone.conv1.weight,
                                   checkpoint['conv1.weight'])
    plugins = [m for m in backbone.modules()
               if isinstance(m, ExternalAttention)]
    assert len(plugins) == 9
    for ea in plugins:
        torch.testing.assert_close(ea.linear_0.weight,
                                   ea.linear_1.weight.permute(1, 0, 2))
        assert torch.all(ea.conv1.bias == 0)
        assert torch.all(ea.bn.weight == 0) and torch.all(ea.bn.bias == 0)


def test_authors_init_statistics():
    """M_k = M_v^T, both N(0, 2 / d) with d the channels per head; the 1x1
    convs N(0, 2 / C); BN weight 1, bias 0."""
    ea = ExternalAttention(512, num_slots=64, num_heads=2)
    torch.testing.assert_close(ea.linear_0.weight,
                               ea.linear_1.weight.permute(1, 0, 2))
    assert abs(ea.linear_1.weight.std().item() - (2 / 256)**0.5) < 0.005
    for conv in (ea.conv1, ea.conv2):
        assert abs(conv.weight.std().item() - (2 / 512)**0.5) < 0.002
    assert torch.all(ea.bn.weight == 1) and torch.all(ea.bn.bias == 0)


@pytest.mark.parametrize('backbone', [
    dict(type='ResNet', depth=50, base_channels=4, norm_eval=False),
    dict(type='ResNetKCLA', depth=50, base_channels=4, head_dim=16,
         norm_eval=False, kcla_drop_path=0.0),
], ids=['mmdet-ResNet', 'ResNetKCLA'])
def test_builds_by_name_as_resnet_plugin(backbone):
    from mmdet.registry import MODELS
    model = MODELS.build(dict(backbone, plugins=[EA_PLUGIN]))
    names = {n for n, m in model.named_modules()
             if isinstance(m, ExternalAttention)}
    # after conv3 of every bottleneck of stages 3 and 4 (6 + 3 blocks)
    assert names == {f'layer3.{i}.external_attention' for i in range(6)} | {
        f'layer4.{i}.external_attention' for i in range(3)}
    assert model.layer3[0].external_attention.in_channels == 64
    assert model.layer4[0].external_attention.in_channels == 128
    assert model.layer4[0].external_attention.num_heads == 2
    model.train()
    x = torch.rand(2, 3, 64, 64, requires_grad=True)
    outs = model(x)
    assert [tuple(o.shape) for o in outs] == [(2, 16, 16, 16), (2, 32, 8, 8),
                                             (2, 64, 4, 4), (2, 128, 2, 2)]
    sum(o.square().mean() for o in outs).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    ea_params = [(n, p) for n, p in model.named_parameters()
                 if 'external_attention' in n]
    assert len(ea_params) == 9 * 7  # conv1 w+b, M_k, M_v, conv2, bn w+b
    for name, p in ea_params:
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    # the memories learn (a zero gradient would mean a dead branch)
    assert model.layer4[2].external_attention.linear_0.weight.grad.abs(
    ).sum() > 0
    assert model.layer4[2].external_attention.linear_1.weight.grad.abs(
    ).sum() > 0


@pytest.mark.parametrize('norm_cfg', [dict(type='BN'), None])
def test_zero_init_plugin_leaves_a_resnet_unchanged(norm_cfg):
    """with_relu=False, zero_init=True (the detection configs): at init the
    plugin is the identity, so a pretrained ResNet computes what it did."""
    from mmdet.registry import MODELS
    torch.manual_seed(0)
    plain = MODELS.build(dict(type='ResNet', depth=50, base_channels=4))
    plugin = dict(EA_PLUGIN, cfg=dict(EA_PLUGIN['cfg'], with_relu=False,
                                      zero_init=True, norm_cfg=norm_cfg))
    with_ea = MODELS.build(
        dict(type='ResNet', depth=50, base_channels=4, plugins=[plugin]))
    missing = with_ea.load_state_dict(plain.state_dict(), strict=False)
    assert missing.unexpected_keys == []
    assert all('external_attention' in k for k in missing.missing_keys)
    plain.eval()
    with_ea.eval()
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(plain(x), with_ea(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the authors' init does change it
    authors = MODELS.build(
        dict(type='ResNet', depth=50, base_channels=4, plugins=[EA_PLUGIN]))
    authors.load_state_dict(plain.state_dict(), strict=False)
    authors.eval()
    with torch.no_grad():
        assert not torch.allclose(plain(x)[-1], authors(x)[-1])


def test_resnet_kcla_rejects_unknown_plugin_position():
    from mmdet.registry import MODELS
    with pytest.raises(ValueError, match="after_conv4"):
        MODELS.build(
            dict(type='ResNetKCLA', depth=50, base_channels=4, head_dim=16,
                 plugins=[dict(EA_PLUGIN, position='after_conv4')]))


@pytest.mark.parametrize('path', [
    'configs/detection/faster-rcnn_r50-ea_fpn_1x_coco.py',
    'configs/detection/faster-rcnn_r50-kcla-ea_fpn_1x_coco.py',
    'configs/demo/faster-rcnn_r50s-kcla-ea_fpn_synthetic-coco.py',
], ids=osp.basename)
def test_ea_configs_build_detectors_with_plugins(path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    register_all_modules()
    cfg = Config.fromfile(osp.join(ROOT, path))
    assert cfg.custom_imports['imports'] == ['kcla_mm']
    cfg.model.backbone.init_cfg = None  # no download in tests
    model = MODELS.build(cfg.model)
    expected = 'ResNet' if 'r50-ea_' in path else 'ResNetKCLA'
    assert type(model.backbone).__name__ == expected
    stages = {n.split('.')[0] for n, m in model.backbone.named_modules()
              if isinstance(m, ExternalAttention)}
    assert stages == {'layer3', 'layer4'}
    model.eval()
    with torch.no_grad():
        feats = model.extract_feat(torch.rand(1, 3, 64, 64))
    assert len(feats) == 5


def test_ea_head_builds_from_mmseg_registry_logits_and_loss():
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    head = build_seg(
        dict(
            type='EAHead',
            in_channels=32,
            channels=16,
            ea_channels=24,
            num_slots=8,
            num_heads=2,
            num_classes=3,
            norm_cfg=dict(type='BN'),
            loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)))
    assert head.ea.in_channels == 24 and head.ea.num_heads == 2
    assert head.conv_in.conv.kernel_size == (3, 3)
    inputs = [torch.rand(2, 32, 12, 10)]
    assert tuple(head(inputs).shape) == (2, 3, 12, 10)
    samples = []
    for _ in range(2):
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=torch.randint(0, 3, (1, 48, 40)))
        samples.append(sample)
    losses = head.loss(inputs, samples, dict())
    assert set(losses) == {'loss_ce', 'acc_seg'}
    assert torch.isfinite(losses['loss_ce']) and losses['loss_ce'] > 0
    losses['loss_ce'].backward()
    for name, p in head.ea.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_ea_head_without_norm_uses_biased_conv():
    head = build_seg(
        dict(type='EAHead', in_channels=8, channels=8, num_classes=2,
             num_slots=4))
    assert head.ea.norm_name is None and head.ea.conv2.bias is not None
    assert tuple(head([torch.rand(1, 8, 6, 6)]).shape) == (1, 2, 6, 6)


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_slots=0), r'num_slots must be a positive int, got 0'),
    (dict(num_slots=2.5), r'num_slots must be a positive int, got 2\.5'),
    (dict(num_heads=3), r'num_heads=3 must divide in_channels \(16\); '
     r'allowed: divisors of 16'),
    (dict(num_heads='2'), r"num_heads must be a positive int, got '2'"),
    (dict(num_heads=True), r'num_heads must be a positive int, got True'),
    (dict(double_normalization=1),
     r'double_normalization must be a bool, got 1'),
    (dict(with_relu=None), r'with_relu must be a bool, got None'),
    (dict(eps=-1.0), r'eps must be a float >= 0, got -1\.0'),
])
def test_bad_config_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match='ExternalAttention: ' + match):
        ExternalAttention(16, **kwargs)


@pytest.mark.parametrize('shape,match', [
    ((2, 8, 4, 4), r'input has 8 channels, the layer was built for '
     r'channels=16'),
    ((16, 4, 4), r'input must be 4-D \(B, C, H, W\), got shape '
     r'\(16, 4, 4\)'),
])
def test_bad_input_raises_value_error(shape, match):
    ea = ExternalAttention(16, num_slots=4)
    for fn in (ea, ea.attention_map):
        with pytest.raises(ValueError, match=match):
            fn(torch.rand(*shape))


@pytest.mark.parametrize('kwargs,match', [
    (dict(kernel_size=2), r'EAHead: kernel_size must be a positive odd int, '
     r'got 2'),
    (dict(num_heads=5), r'EAHead: ExternalAttention: num_heads=5 must '
     r'divide in_channels \(8\)'),
    (dict(ea_channels=0), r'EAHead: ea_channels must be a positive int or '
     r'None \(= channels\), got 0'),
    (dict(input_transform='multiple_select', in_channels=[8, 8],
          in_index=[0, 1]), r"EAHead: input_transform='multiple_select' is "
     r"not supported; allowed: None or 'resize_concat'"),
])
def test_ea_head_bad_config(kwargs, match):
    cfg = dict(type='EAHead', in_channels=8, channels=8, num_classes=2)
    with pytest.raises(ValueError, match=match):
        build_seg(dict(cfg, **kwargs))


@pytest.mark.slow
def test_ea_detector_trains_through_mmdet_train_py(tmp_path):
    """The synthetic EA config (ResNet-50-KCLA at 1/4 width with EA
    plugins) trains 3 iterations and validates through mmdet's own
    tools/train.py; the checkpoint holds the plugins' weights."""
    root = make_synthetic_coco(tmp_path / 'data', 6, 2)
    work_dir = tmp_path / 'work'
    result = subprocess.run(
        [sys.executable, mmdet_tool('train.py'), EA_DEMO_CONFIG,
         '--work-dir', str(work_dir), '--cfg-options'] + data_options(root) +
        ['train_cfg.max_iters=3', 'train_cfg.val_interval=3',
         'train_dataloader.batch_size=2', 'val_dataloader.batch_size=2',
         'default_hooks.logger.interval=1',
         'default_hooks.checkpoint.interval=3'],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    losses = [float(v) for v in re.findall(r' loss: ([-\d.e+naif]+)', output)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert re.search(r'coco/bbox_mAP: -?[\d.]+', output)
    state = torch.load(work_dir / 'iter_3.pth', map_location='cpu',
                       weights_only=False)['state_dict']
    ea_keys = [k for k in state if '.external_attention.' in k]
    # 6 + 3 plugins, each conv1 w/b, M_k, M_v, conv2, bn w/b/mean/var/count
    assert len(ea_keys) == 9 * 10
    assert state['backbone.layer4.2.external_attention.linear_0.weight'
                 ].shape == (32, 512, 1)
