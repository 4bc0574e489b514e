"""ResUNetHead, KCLADecoderAttention and ResNetKCLA's UNet encoder options."""
import pytest
from mmengine.config import ConfigDict
import torch
import torch.nn.functional as F

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.necks import KCLADecoderAttention
from .naive_kcla import naive_bn_eval, naive_kcla, randomise

# the KCLA authors' small segmentation encoder (head dim 16, docs/method.md)
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
SMALL_IN_CHANNELS = [16, 32, 64, 128, 128]
DECODER_CHANNELS = [64, 32, 16, 16]


def build_head(decoder_attention=None, in_channels=SMALL_IN_CHANNELS,
               decoder_channels=DECODER_CHANNELS, channels=None, **kwargs):
    import kcla_mm  # noqa: F401 (registers the head)
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    cfg = dict(
        type='ResUNetHead',
        in_channels=in_channels,
        in_index=list(range(len(in_channels))),
        channels=channels or decoder_channels[-1],
        decoder_channels=decoder_channels,
        num_classes=2,
        dropout_ratio=0.0,
        norm_cfg=dict(type='BN'),
        decoder_attention=decoder_attention,
        **kwargs)
    with DefaultScope.overwrite_default_scope('mmseg'):
        return MODELS.build(cfg)


def test_small_encoder_shapes_and_stem_output():
    torch.manual_seed(0)
    model = ResNetKCLA(**SMALL_ENCODER).eval()
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        outs = model(x)
    assert [tuple(o.shape) for o in outs] == [
        (2, 16, 64, 48), (2, 32, 32, 24), (2, 64, 16, 12), (2, 128, 8, 6),
        (2, 128, 8, 6)]
    # the stem output is ReLU(BN(Conv7x7, stride 1)(x)), no max-pool
    with torch.no_grad():
        stem = F.relu(naive_bn_eval(
            F.conv2d(x, model.conv1.weight, stride=1, padding=3),
            model.norm1))
    torch.testing.assert_close(outs[0], stem, rtol=1e-5, atol=1e-5)
    # stage 4 keeps width and resolution: its adapter has no conv
    assert model.layer4_attn[0].adapter.conv is None
    assert model.layer3_attn[0].adapter.conv.stride == (2, 2)
    assert [m.num_heads for m in (model.layer1_attn[0], model.layer4_attn[1])
            ] == [2, 8]


def test_default_encoder_unchanged_by_the_new_options():
    torch.manual_seed(0)
    ref = ResNetKCLA(depth=18, base_channels=16, head_dim=16).eval()
    torch.manual_seed(0)
    ours = ResNetKCLA(depth=18, base_channels=16, head_dim=16,
                      stage_channels=(16, 32, 64, 128), stem_stride=2,
                      stem_pool=True).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(ref(x), ours(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize('kwargs, match', [
    (dict(stem_stride=3), 'stem_stride must be 1 or 2, got 3'),
    (dict(stage_channels=(32, 64)), 'stage_channels must be a sequence of 4'),
    (dict(stage_channels=(32, 64, 0, 128)), 'stage_channels'),
    (dict(stem_pool='no'), 'stem_pool must be a bool'),
    (dict(with_stem_out=1), 'with_stem_out must be a bool'),
])
def test_encoder_bad_options_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ResNetKCLA(depth=18, **kwargs)


def naive_decoder(head, feats):
    """The UNet decoder by hand (eval mode): resize, concat, conv-BN-ReLU."""
    layers = list(head.decoder_attention.layers) \
        if head.decoder_attention is not None else []
    x = feats[-1]
    stage_inputs = []
    for i, (skip, block) in enumerate(zip(feats[-2::-1], head.up_blocks)):
        x = F.interpolate(x, size=skip.shape[2:], mode='bilinear',
                          align_corners=head.align_corners)
        x = torch.cat([skip, x], 1)
        for conv_module in block:
            x = F.conv2d(x, conv_module.conv.weight, conv_module.conv.bias,
                         padding=1)
            x = F.relu(naive_bn_eval(x, conv_module.bn))
        if layers:
            stage_inputs.append(x)
            x = naive_kcla(layers[:i + 1], stage_inputs)[-1]
    return F.conv2d(x, head.conv_seg.weight, head.conv_seg.bias)


def randomise_bns(module, seed):
    gen = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.data = torch.rand(m.num_features, generator=gen) + 0.5
            m.bias.data = torch.randn(m.num_features, generator=gen) * 0.1
            m.running_mean = torch.randn(m.num_features, generator=gen) * 0.1
            m.running_var = torch.rand(m.num_features, generator=gen) + 0.5


@pytest.mark.parametrize('with_kcla', [False, True])
def test_head_equals_naive_unet_decoder(with_kcla):
    torch.manual_seed(0)
    head = build_head(
        dict(type='KCLADecoderAttention', head_dim=16) if with_kcla else None)
    randomise_bns(head, 1)
    if with_kcla:
        for i, layer in enumerate(head.decoder_attention.layers):
            randomise(layer, i + 2)
    head.eval()
    sizes = [(30, 22), (15, 11), (8, 6), (4, 3), (4, 3)]
    feats = [torch.randn(2, c, *hw)
             for c, hw in zip(SMALL_IN_CHANNELS, sizes)]
    with torch.no_grad():
        ours = head(feats)
        expected = naive_decoder(head, feats)
    assert ours.shape == (2, 2, 30, 22)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


def test_decoder_attention_chains_state_across_stages():
    attn = KCLADecoderAttention(DECODER_CHANNELS, head_dim=16)
    adapters = [layer.adapter for layer in attn.layers]
    assert adapters[0] is None
    assert all(a.resize for a in adapters[1:])
    # widths 64 -> 32 -> 16 change through the grouped 1x1 conv; 16 -> 16 not
    assert [a.conv is not None for a in adapters[1:]] == [True, True, False]


def test_resnet50_encoder_with_stem_output_any_depth():
    torch.manual_seed(0)
    encoder = ResNetKCLA(depth=50, base_channels=16, head_dim=16,
                         with_stem_out=True).eval()
    head = build_head(
        dict(type='KCLADecoderAttention', head_dim=16),
        in_channels=[16, 64, 128, 256, 512],
        decoder_channels=[128, 64, 32, 16]).eval()
    x = torch.randn(1, 3, 65, 97)  # odd sizes through every stride
    with torch.no_grad():
        logits = head(encoder(x))
    assert logits.shape == (1, 2, 33, 49)  # the stem's resolution
    assert torch.isfinite(logits).all()


def build_segmentor(registry):
    """A binary KCLA ResNet-UNet (encoder and decoder attention)."""
    return registry.build(
        dict(
            type='EncoderDecoder',
            data_preprocessor=dict(type='SegDataPreProcessor'),
            backbone=dict(type='ResNetKCLA', **SMALL_ENCODER),
            decode_head=dict(
                type='ResUNetHead',
                in_channels=SMALL_IN_CHANNELS,
                in_index=[0, 1, 2, 3, 4],
                channels=16,
                decoder_channels=DECODER_CHANNELS,
                num_classes=2,
                norm_cfg=dict(type='BN'),
                decoder_attention=dict(
                    type='KCLADecoderAttention', head_dim=16),
                loss_decode=[
                    dict(type='CrossEntropyLoss', avg_non_ignore=True),
                    dict(type='DiceLoss', use_sigmoid=False, naive_dice=True,
                         eps=1.0, ignore_index=0)
                ]),
            test_cfg=ConfigDict(mode='whole')))


def test_binary_loss_and_prediction_through_encoder_decoder():
    import kcla_mm  # noqa: F401
    from mmengine.registry import DefaultScope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    torch.manual_seed(0)
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = build_segmentor(MODELS)
    model.init_weights()
    samples = []
    for _ in range(2):
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(
            data=(torch.rand(1, 32, 32) > 0.5).long())
        sample.set_metainfo(dict(img_shape=(32, 32), ori_shape=(32, 32),
                                 pad_shape=(32, 32)))
        samples.append(sample)
    inputs = torch.randn(2, 3, 32, 32)
    losses = model.loss(inputs, samples)
    assert set(losses) >= {'decode.loss_ce', 'decode.loss_dice'}
    total = sum(v for k, v in losses.items() if 'loss' in k)
    assert torch.isfinite(total)
    total.backward()
    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None
                                       or not torch.isfinite(p.grad).all())]
    assert not no_grad, no_grad
    model.eval()
    with torch.no_grad():
        preds = model.predict(inputs, samples)
    assert preds[0].pred_sem_seg.data.shape == (1, 32, 32)
    assert set(preds[0].pred_sem_seg.data.unique().tolist()) <= {0, 1}


@pytest.mark.parametrize('kwargs, match', [
    (dict(decoder_channels=[64, 32, 16]), 'decoder_channels must be 4'),
    (dict(decoder_channels=[64, 32, 16, 8], channels=16),
     r'channels \(16\) must equal the last decoder stage'),
    (dict(decoder_attention=dict(type='KCLADecoderAttention', head_dim=24)),
     'head_dim=24 must divide'),
    (dict(decoder_attention='KCLA'), 'decoder_attention must be a config'),
    (dict(num_convs=0), 'num_convs must be an int >= 1'),
    (dict(in_channels=[16]), 'in_channels must be a sequence of at least 2'),
])
def test_head_bad_options_are_named(kwargs, match):
    args = dict(decoder_attention=None)
    args.update(kwargs)
    if 'in_channels' in kwargs:
        args['decoder_channels'] = [16]
    with pytest.raises(ValueError, match=match):
        build_head(**args)


def test_head_rejects_features_of_the_wrong_width():
    head = build_head()
    feats = [torch.randn(1, c, 8, 8) for c in [16, 32, 64, 128, 64]]
    with pytest.raises(ValueError, match='built for in_channels'):
        head(feats)


def test_bottleneck_attention_runs_on_the_coarsest_feature():
    torch.manual_seed(0)
    head = build_head(
        bottleneck_attention=dict(type='ExternalAttention', num_slots=8))
    plain = build_head()
    plain.load_state_dict(head.state_dict(), strict=False)
    head.eval()
    plain.eval()
    feats = [torch.randn(1, c, s, s)
             for c, s in zip(SMALL_IN_CHANNELS, [16, 8, 4, 2, 2])]
    with torch.no_grad():
        ours = head(feats)
        expected = plain(feats[:-1] + [head.bottleneck_attention(feats[-1])])
    assert head.bottleneck_attention.in_channels == 128
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match='bottleneck_attention must be a'):
        build_head(bottleneck_attention=['ExternalAttention'])


def test_ea_head_on_the_medical_encoder_as_decode_or_auxiliary_head():
    import kcla_mm  # noqa: F401
    from mmengine.registry import DefaultScope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    ea_head = dict(type='EAHead', in_channels=128, in_index=4, channels=32,
                   ea_channels=64, num_slots=16, num_classes=2,
                   norm_cfg=dict(type='BN'))
    cfg = dict(
        type='EncoderDecoder',
        data_preprocessor=dict(type='SegDataPreProcessor'),
        backbone=dict(type='ResNetKCLA', **SMALL_ENCODER),
        decode_head=ea_head,
        auxiliary_head=dict(ea_head, loss_decode=dict(
            type='CrossEntropyLoss', loss_weight=0.4)),
        test_cfg=ConfigDict(mode='whole'))
    torch.manual_seed(0)
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = MODELS.build(cfg)
    model.init_weights()
    sample = SegDataSample()
    sample.gt_sem_seg = PixelData(data=(torch.rand(1, 32, 32) > 0.5).long())
    sample.set_metainfo(dict(img_shape=(32, 32), ori_shape=(32, 32),
                             pad_shape=(32, 32)))
    losses = model.loss(torch.randn(2, 3, 32, 32), [sample, sample])
    assert {'decode.loss_ce', 'aux.loss_ce'} <= set(losses)
    assert all(torch.isfinite(v) for k, v in losses.items() if 'loss' in k)
    model.eval()
    with torch.no_grad():
        logits = model._forward(torch.randn(1, 3, 32, 32))
    assert logits.shape == (1, 2, 4, 4)  # the encoder's 1/8 resolution
