"""Inputs at the edges for ResNetKCLA (every layer attention, KCLA on its
fused and PyTorch paths) and the ResNet-UNet: all-zero images, batch size 1
with train-mode BatchNorm, odd and very small spatial sizes, non-contiguous
and channels_last inputs.

Defined behaviour (asserted below):

* All-zero images: every feature is 0, so every KCLA key has norm 0; the
  outputs and all gradients are finite (KCLA divides by max(|K|, key_eps)).
  MRLA-light with batch-statistics BN (``norm_eval=False``) is the
  exception for gradients: on a constant image every train-mode BN sees
  zero variance and scales its gradient by 1 / sqrt(BN eps) ~ 316, and
  MRLA-light's branch (BN without a following ReLU, drop-path masks making
  the gradient uneven) passes it on, so it overflows after a few blocks.
  That is BatchNorm's, not the attention's; only its forward is asserted.
* Batch size 1 in train mode: like ``nn.BatchNorm2d``, a train-mode BN
  fails only where it sees one value per channel, i.e. a 1x1 feature map:
  ``ValueError: Expected more than 1 value per channel when training``.
  A ResNet at 32x32 has a 1x1 stage 4, so batch 1 raises with
  ``norm_eval=False`` and trains with ``norm_eval=True`` (BN statistics
  frozen, the default); at 64x64 (2x2 stage 4) it trains either way. The
  fused KCLA branch raises the same error as the PyTorch path.
* Odd sizes: every stage has the shape of mmdet's ResNet of the same
  config, whatever the layer attention.
* Strided views and channels_last tensors give the contiguous input's
  outputs and gradients (to float round-off).
"""
import pytest
import torch
from mmdet.models.backbones import ResNet

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers import KCLALayer

VARIANTS = [
    pytest.param('KCLA', 'fused', id='kcla-fused'),
    pytest.param('KCLA', 'torch', id='kcla-torch'),
    pytest.param('LA', 'auto', id='la'),
    pytest.param('MRLA-light', 'auto', id='mrla-light'),
]
R18 = dict(depth=18, base_channels=8, head_dim=8)
R50 = dict(depth=50, base_channels=16, head_dim=16)
# the KCLA authors' segmentation encoder (as tests/test_models/test_res_unet)
SMALL_ENCODER = dict(
    depth=18,
    stem_channels=16,
    stage_channels=(32, 64, 128, 128),
    strides=(2, 2, 2, 1),
    stem_stride=1,
    stem_pool=False,
    with_stem_out=True,
    head_dim=16,
    norm_eval=False,
    zero_init_residual=False)
BN_ONE_VALUE = 'Expected more than 1 value per channel when training'


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """One intra-op thread: faster for these small tensors, and steady when
    the cores are shared (spinning OpenMP workers slow down 10-50x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def backbone(arch, layer_attention, impl, **kwargs):
    return ResNetKCLA(**arch, layer_attention=layer_attention,
                      kcla_impl=impl, **kwargs)


def unet(norm_eval=False):
    """SMALL_ENCODER + ResUNetHead with KCLA decoder attention (mmseg)."""
    import kcla_mm  # noqa: F401  (registers the head)
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    with DefaultScope.overwrite_default_scope('mmseg'):
        head = MODELS.build(
            dict(type='ResUNetHead', in_channels=[16, 32, 64, 128, 128],
                 in_index=[0, 1, 2, 3, 4], channels=16,
                 decoder_channels=[64, 32, 16, 16], num_classes=2,
                 dropout_ratio=0.0, norm_cfg=dict(type='BN'),
                 decoder_attention=dict(type='KCLADecoderAttention',
                                        head_dim=16)))
    encoder = ResNetKCLA(**dict(SMALL_ENCODER, norm_eval=norm_eval))
    return torch.nn.Sequential(encoder, head)


def loss_of(outs):
    """A loss whose gradient differs between positions and channels."""
    gen = torch.Generator().manual_seed(0)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
               for o in outs)


def assert_finite_backward(model, outs, x):
    loss_of(outs).backward()
    assert torch.isfinite(x.grad).all()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name


# --------------------------------------------------------------------------
# all-zero images (KCLA keys of norm 0)
# --------------------------------------------------------------------------
@pytest.mark.parametrize('layer_attention,impl', VARIANTS)
@pytest.mark.parametrize('arch,norm_eval', [
    pytest.param(R18, False, id='r18-batch-stats'),
    pytest.param(R18, True, id='r18-frozen-stats'),
    pytest.param(R50, False, id='r50-batch-stats'),
    pytest.param(R50, True, id='r50-frozen-stats'),
])
def test_all_zero_images_finite_outputs_and_gradients(
        layer_attention, impl, arch, norm_eval):
    torch.manual_seed(0)
    model = backbone(arch, layer_attention, impl, norm_eval=norm_eval)
    model.train()
    x = torch.zeros(2, 3, 16, 16, requires_grad=True)
    outs = model(x)
    # every feature, hence every key, is exactly 0
    assert all(torch.equal(o, torch.zeros_like(o)) for o in outs)
    if layer_attention == 'MRLA-light' and not norm_eval:
        return  # gradients overflow in BN, see the module docstring
    assert_finite_backward(model, outs, x)


def test_all_zero_images_unet_trains():
    torch.manual_seed(0)
    model = unet().train()
    x = torch.zeros(2, 3, 16, 16, requires_grad=True)
    logits = model(x)
    assert tuple(logits.shape) == (2, 2, 16, 16)
    assert torch.isfinite(logits).all()
    assert_finite_backward(model, logits, x)


# --------------------------------------------------------------------------
# batch size 1 with BN in train mode
# --------------------------------------------------------------------------
@pytest.mark.parametrize('layer_attention,impl', VARIANTS)
def test_batch_one_raises_only_where_a_train_bn_sees_one_value(
        layer_attention, impl):
    torch.manual_seed(0)
    # 48x48: stage 4 is 2x2, batch statistics over 4 values train fine
    model = backbone(R18, layer_attention, impl, norm_eval=False).train()
    x = torch.rand(1, 3, 48, 48, requires_grad=True)
    outs = model(x)
    assert [tuple(o.shape[2:]) for o in outs] == [(12, 12), (6, 6), (3, 3),
                                                 (2, 2)]
    assert_finite_backward(model, outs, x)
    # 32x32: stage 4 is 1x1, one value per channel in every stage-4 BN
    with pytest.raises(ValueError, match=BN_ONE_VALUE):
        model(torch.rand(1, 3, 32, 32))
    # norm_eval=True (the default) keeps every BN on running statistics
    model = backbone(R18, layer_attention, impl, norm_eval=True).train()
    x = torch.rand(1, 3, 32, 32, requires_grad=True)
    outs = model(x)
    assert tuple(outs[-1].shape) == (1, 64, 1, 1)
    assert_finite_backward(model, outs, x)


@pytest.mark.parametrize('impl', ['fused', 'torch'])
def test_kcla_layer_one_value_per_channel_same_error_on_both_paths(impl):
    """The fused branch computes its own BN statistics; it refuses a single
    value per channel as nn.BatchNorm2d (the PyTorch path) does."""
    layer = KCLALayer(8, head_dim=4, impl=impl).train()
    with pytest.raises(ValueError, match=BN_ONE_VALUE):
        layer(torch.rand(1, 8, 1, 1))
    # two values per channel (batch 2 at 1x1, batch 1 at 1x2) are fine
    for shape in ((2, 8, 1, 1), (1, 8, 1, 2)):
        out, _ = layer(torch.rand(shape))
        assert torch.isfinite(out).all()
    with torch.no_grad():  # eval: running statistics, any size
        out, _ = layer.eval()(torch.rand(1, 8, 1, 1))
    assert torch.isfinite(out).all()


def test_kcla_paths_agree_at_tiny_planes_and_without_running_stats():
    torch.manual_seed(0)
    fused = KCLALayer(8, head_dim=4, impl='fused', drop_path=0.0)
    plain = KCLALayer(8, head_dim=4, impl='torch', drop_path=0.0)
    plain.load_state_dict(fused.state_dict())
    x = torch.rand(2, 8, 1, 1)
    torch.testing.assert_close(fused(x)[0], plain(x)[0], rtol=1e-5,
                               atol=1e-5)
    # a BN without running statistics normalises by the batch in eval too
    cfg = dict(type='BN', track_running_stats=False)
    fused = KCLALayer(8, head_dim=4, impl='fused', norm_cfg=cfg).eval()
    plain = KCLALayer(8, head_dim=4, impl='torch', norm_cfg=cfg).eval()
    plain.load_state_dict(fused.state_dict())
    x = torch.rand(2, 8, 3, 5)
    with torch.no_grad():
        torch.testing.assert_close(fused(x)[0], plain(x)[0], rtol=1e-5,
                                   atol=1e-5)


def test_unet_batch_one_trains_at_16_and_raises_at_8():
    """The UNet encoder (stem stride 1, no pool) keeps 2x2 at stage 4 for
    16x16 inputs; at 8x8 its stages 4 and 5 are 1x1."""
    torch.manual_seed(0)
    model = unet().train()
    x = torch.rand(1, 3, 16, 16, requires_grad=True)
    logits = model(x)
    assert tuple(logits.shape) == (1, 2, 16, 16)
    assert_finite_backward(model, logits, x)
    with pytest.raises(ValueError, match=BN_ONE_VALUE):
        model[0](torch.rand(1, 3, 8, 8))


# --------------------------------------------------------------------------
# odd and very small sizes
# --------------------------------------------------------------------------
def mmdet_shapes(arch, x, **kwargs):
    kwargs = dict(kwargs)
    ref = ResNet(arch['depth'], base_channels=arch['base_channels'],
                 **kwargs)
    ref.eval()  # mmdet's train() returns None
    with torch.no_grad():
        return [tuple(o.shape) for o in ref(x)]


CONFIGS = [
    pytest.param(dict(), id='default'),
    pytest.param(dict(strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)),
                 id='dilated'),
    pytest.param(dict(deep_stem=True, avg_down=True),
                 id='deep-stem-avg-down'),
    # style moves Bottleneck's stride to its first 1x1 conv
    pytest.param(dict(style='caffe'), id='caffe'),
    pytest.param(dict(num_stages=3, strides=(1, 2, 2), dilations=(1, 1, 1),
                      out_indices=(2, )), id='3-stages'),
]


@pytest.mark.parametrize('config', CONFIGS)
@pytest.mark.parametrize('arch', [pytest.param(R18, id='r18'),
                                  pytest.param(R50, id='r50')])
def test_odd_sizes_match_mmdet_resnet_shapes(arch, config):
    """33x65 is odd at strides 2 to 16 (17x33, 9x17, 5x9, 3x5)."""
    torch.manual_seed(0)
    x = torch.rand(1, 3, 33, 65)
    expected = mmdet_shapes(arch, x, **config)
    for layer_attention in (None, 'KCLA', 'LA', 'MRLA-light'):
        model = ResNetKCLA(**arch, layer_attention=layer_attention,
                           **config).eval()
        with torch.no_grad():
            outs = model(x)
        assert [tuple(o.shape) for o in outs] == expected, layer_attention
        assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize('layer_attention,impl', VARIANTS)
def test_225x301_every_stride(layer_attention, impl):
    torch.manual_seed(0)
    x = torch.rand(1, 3, 225, 301)
    model = backbone(R18, layer_attention, impl).eval()
    with torch.no_grad():
        outs = model(x)
    assert [tuple(o.shape) for o in outs] == mmdet_shapes(R18, x) == [
        (1, 8, 57, 76), (1, 16, 29, 38), (1, 32, 15, 19), (1, 64, 8, 10)]
    assert all(torch.isfinite(o).all() for o in outs)


def test_fused_and_torch_agree_at_odd_sizes_with_gradients():
    """The training kernels at 17x23 (odd planes), float64."""
    torch.manual_seed(0)
    fused = backbone(R18, 'KCLA', 'fused', norm_eval=False)
    plain = backbone(R18, 'KCLA', 'torch', norm_eval=False)
    plain.load_state_dict(fused.state_dict())
    x = torch.rand(2, 3, 17, 23, dtype=torch.float64)
    results = []
    for model in (fused, plain):
        model.double().train()
        torch.manual_seed(1)  # same drop-path masks
        xi = x.clone().requires_grad_()
        outs = model(xi)
        loss_of(outs).backward()
        results.append([o.detach() for o in outs] + [xi.grad] +
                       [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_unet_odd_size_keeps_the_input_resolution():
    torch.manual_seed(0)
    model = unet().train()
    x = torch.rand(2, 3, 17, 23, requires_grad=True)
    feats = model[0](x)
    # stem stride 1, then ceil-halving: 17 -> 9 -> 5 -> 3 -> 3
    assert [tuple(f.shape[2:]) for f in feats] == [
        (17, 23), (9, 12), (5, 6), (3, 3), (3, 3)]
    logits = model[1](feats)
    assert tuple(logits.shape) == (2, 2, 17, 23)
    assert_finite_backward(model, logits, x)


@pytest.mark.parametrize('layer_attention,impl', VARIANTS)
@pytest.mark.parametrize('arch', [pytest.param(R18, id='r18'),
                                  pytest.param(R50, id='r50')])
def test_32x32_images(arch, layer_attention, impl):
    torch.manual_seed(0)
    x = torch.rand(1, 3, 32, 32)
    model = backbone(arch, layer_attention, impl).eval()
    with torch.no_grad():
        outs = model(x)
    assert [tuple(o.shape) for o in outs] == mmdet_shapes(arch, x)
    assert tuple(outs[-1].shape[2:]) == (1, 1)
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize('impl', ['fused', 'torch'])
@pytest.mark.parametrize('size', [(1, 1), (7, 5)])
def test_tiny_images_run_as_mmdet_resnet(size, impl):
    torch.manual_seed(0)
    x = torch.rand(2, 3, *size)
    model = backbone(R18, 'KCLA', impl).eval()
    with torch.no_grad():
        outs = model(x)
    assert [tuple(o.shape) for o in outs] == mmdet_shapes(R18, x)
    assert all(torch.isfinite(o).all() for o in outs)


# --------------------------------------------------------------------------
# strided views and channels_last
# --------------------------------------------------------------------------
def views_of(x):
    """Non-contiguous tensors equal to ``x`` (B, C, H, W): a transposed
    copy, a crop of a larger tensor, channels_last."""
    b, c, h, w = x.shape
    wide = torch.zeros(b, c + 2, h + 3, w + 5, dtype=x.dtype)
    wide[:, 1:c + 1, 2:h + 2, 4:w + 4] = x
    return {
        'transposed': x.transpose(2, 3).contiguous().transpose(2, 3),
        'sliced': wide[:, 1:c + 1, 2:h + 2, 4:w + 4],
        'channels_last': x.contiguous(memory_format=torch.channels_last),
    }


def run(model, x, seed=1):
    """Outputs and gradients (input's, then parameters') of one step."""
    model.zero_grad()
    torch.manual_seed(seed)  # same drop-path masks
    x = x.detach().requires_grad_()
    outs = model(x)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    loss_of(outs).backward()
    return [o.detach() for o in outs] + [x.grad] + [
        p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same(ref, got, tol):
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        scale = a.abs().max().clamp_min(1.0)
        torch.testing.assert_close(a / scale, b / scale, rtol=0, atol=tol)


@pytest.mark.parametrize('layer_attention,impl', VARIANTS)
def test_strided_and_channels_last_inputs_match_contiguous(
        layer_attention, impl):
    """Training step (train-mode BN, drop-path): outputs and gradients, in
    float64 (stage 4's BN over 2 values amplifies float32 round-off)."""
    torch.manual_seed(0)
    model = backbone(R18, layer_attention, impl, norm_eval=False)
    model.double().train()
    x = torch.rand(2, 3, 17, 23, dtype=torch.float64)
    ref = run(model, x)
    for name, view in views_of(x).items():
        assert not view.is_contiguous(), name
        # channels_last takes other conv kernels: round-off only
        assert_same(ref, run(model, view), 1e-9)


@pytest.mark.parametrize('impl', ['fused', 'torch'])
def test_strided_and_channels_last_inputs_inference(impl):
    """No-grad eval (the fused path's folded-BN inference kernel)."""
    torch.manual_seed(0)
    model = backbone(R18, 'KCLA', impl).eval()
    x = torch.rand(2, 3, 17, 23)
    with torch.no_grad():
        ref = model(x)
        for name, view in views_of(x).items():
            assert_same(ref, model(view),
                        1e-4 if name == 'channels_last' else 1e-6)


def test_channels_last_model_and_input_kcla_fused():
    torch.manual_seed(0)
    model = backbone(R18, 'KCLA', 'fused', norm_eval=False)
    model.double().train()
    x = torch.rand(2, 3, 17, 23, dtype=torch.float64)
    ref = run(model, x)
    model = model.to(memory_format=torch.channels_last)
    assert model.layer1_attn[0].v_conv.weight.is_contiguous(
        memory_format=torch.channels_last)
    assert_same(ref, run(model, x.contiguous(
        memory_format=torch.channels_last)), 1e-9)


def test_unet_channels_last_and_sliced_inputs_match_contiguous():
    torch.manual_seed(0)
    model = unet().double().train()
    x = torch.rand(2, 3, 17, 23, dtype=torch.float64)
    ref = run(model, x)
    for name, view in views_of(x).items():
        assert_same(ref, run(model, view), 1e-9)

