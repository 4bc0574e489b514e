"""ResNetKCLA: mmdet ResNet's interface, KCLA's extras, registries."""
import copy

import pytest
import torch
from mmdet.models.backbones import ResNet
from torch.nn.modules.batchnorm import _BatchNorm

from kcla_mm.models import KCLALayer, LayerAttention, MRLALight, ResNetKCLA


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_parameter_overhead_r50_r101():
    extra50 = n_params(ResNetKCLA(50)) - n_params(ResNet(50))
    assert 0.29e6 <= extra50 <= 0.31e6, extra50
    # The authors' 0.533M counts modules their code builds but never uses
    # (layer1.attention.0's adapter, block 11's channel conv); without them:
    extra101 = n_params(ResNetKCLA(101)) - n_params(ResNet(101))
    assert 0.48e6 <= extra101 <= 0.54e6, extra101


def sgd_step(model, optimizer, x):
    model(x)[-1].square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize('depth', [50, 101])
def test_kcla_off_resumes_an_mmdet_resnet_optimizer_state(depth):
    """layer_attention=None registers its modules in mmdet's order (the
    same state_dict and named_parameters), so the optimizer state of an
    mmdet ResNet run (SGD momentum buffers, matched by position) loads and
    the next step gives mmdet's parameters."""
    torch.manual_seed(0)
    ref = ResNet(depth, norm_eval=False)
    ours = ResNetKCLA(depth, layer_attention=None, norm_eval=False)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_parameters()] == \
        [n for n, _ in ref.named_parameters()]
    x = torch.rand(2, 3, 64, 64)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sgd_step(ref, ref_sgd, x)
    ours.load_state_dict(ref.state_dict())
    ours_sgd = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    # a copy, as from a checkpoint file (a state_dict shares its tensors)
    ours_sgd.load_state_dict(copy.deepcopy(ref_sgd.state_dict()))
    sgd_step(ref, ref_sgd, x)
    sgd_step(ours, ours_sgd, x)
    for (name, want), got in zip(ref.state_dict().items(),
                                 ours.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize('depth', [18, 34, 50, 101, 152])
def test_kcla_off_equals_mmdet_resnet(depth):
    torch.manual_seed(0)
    ref = ResNet(depth, base_channels=16, norm_eval=False)
    ours = ResNetKCLA(depth, base_channels=16, layer_attention=None,
                      norm_eval=False)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    ref.train()
    ours.train()
    for a, b in zip(ref(x), ours(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize('kwargs', [
    dict(deep_stem=True, avg_down=True),
    dict(style='caffe', strides=(1, 2, 2, 1), dilations=(1, 1, 1, 2)),
    dict(num_stages=3, out_indices=(1, 2), strides=(1, 2, 2),
         dilations=(1, 1, 1)),
])
def test_kcla_off_equals_mmdet_resnet_options(kwargs):
    torch.manual_seed(0)
    ref = ResNet(50, base_channels=16, **kwargs)
    ours = ResNetKCLA(50, base_channels=16, layer_attention=None, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.eval()  # mmdet's train() returns None
    ours.eval()
    x = torch.randn(1, 3, 64, 64)
    for a, b in zip(ref(x), ours(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_builds_by_name_and_gives_stage_outputs(scope):
    import kcla_mm  # noqa: F401
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    model = MODELS.build(dict(type='ResNetKCLA', depth=50))
    assert isinstance(model, ResNetKCLA)
    model.init_weights()
    model.eval()
    with torch.no_grad():
        outs = model(torch.rand(2, 3, 224, 224))
    assert [tuple(o.shape) for o in outs] == [(2, 256, 56, 56),
                                             (2, 512, 28, 28),
                                             (2, 1024, 14, 14),
                                             (2, 2048, 7, 7)]


def test_gradients_reach_every_trainable_parameter():
    model = ResNetKCLA(50, norm_eval=False, frozen_stages=1).train()
    outs = model(torch.rand(2, 3, 96, 96))
    sum(o.mean() for o in outs).backward()
    trainable = [(n, p) for n, p in model.named_parameters()
                 if p.requires_grad]
    missing = [n for n, p in trainable if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for _, p in trainable)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any(n.startswith('layer1_attn') for n in frozen)


def test_ddp_without_find_unused_parameters(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group(
        'gloo', init_method=f'file://{tmp_path}/rendezvous', rank=0,
        world_size=1)
    try:
        model = DistributedDataParallel(
            ResNetKCLA(18, base_channels=16, head_dim=16, norm_eval=False),
            find_unused_parameters=False)
        for _ in range(2):  # an unused parameter fails the 2nd iteration
            outs = model(torch.rand(2, 3, 64, 64))
            sum(o.mean() for o in outs).backward()
    finally:
        dist.destroy_process_group()


def test_first_layer_has_no_adapter_and_init_blocks():
    model = ResNetKCLA(101)
    assert model.layer1_attn[0].adapter is None
    assert model.layer2_attn[0].adapter.conv.stride == (2, 2)
    assert model.layer3_attn[11].adapter is not None
    assert model.layer3_attn[11].adapter.conv is None  # same width
    assert model.layer3_attn[10].adapter is None


def test_dilated_backbone_adapter_follows_real_stride():
    model = ResNetKCLA(50, base_channels=16, head_dim=16,
                       strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4))
    assert model.layer3_attn[0].adapter.conv.stride == (1, 1)
    model.eval()
    outs = model(torch.rand(1, 3, 64, 64))
    assert [o.shape[-1] for o in outs] == [16, 8, 8, 8]


@pytest.mark.parametrize('kind,cls', [('KCLA', KCLALayer),
                                      ('LA', LayerAttention),
                                      ('MRLA-light', MRLALight)])
def test_layer_attention_variants(kind, cls):
    model = ResNetKCLA(50, base_channels=16, head_dim=16,
                       layer_attention=kind, norm_eval=False).train()
    assert isinstance(model.layer3_attn[2], cls)
    outs = model(torch.rand(2, 3, 64, 64))
    assert [tuple(o.shape) for o in outs] == [(2, 64, 16, 16), (2, 128, 8, 8),
                                             (2, 256, 4, 4), (2, 512, 2, 2)]
    sum(o.mean() for o in outs).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize('layer_attention', ['KCLA', 'LA', 'MRLA-light',
                                             None])
def test_with_cp_gives_same_outputs_gradients_and_running_stats(
        layer_attention):
    """With every BN in training mode: the recomputation in backward must
    not update the running statistics a second time (torch's checkpoint
    alone would). In float64: with_cp runs the block's add and ReLU outside
    the KCLA layers, float32 round-off of another order."""
    torch.manual_seed(0)
    models = [ResNetKCLA(50, base_channels=16, head_dim=16, with_cp=cp,
                         norm_eval=False,
                         layer_attention=layer_attention).double()
              for cp in (False, True)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    results = []
    for model in models:
        model.train()
        torch.manual_seed(1)  # same drop-path masks
        inp = x.clone().requires_grad_()
        outs = model(inp)
        sum((o * o).mean() for o in outs).backward()
        results.append([o.detach() for o in outs] + [inp.grad] +
                       [p.grad for p in model.parameters()] +
                       list(model.buffers()))
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_frozen_stages_and_norm_eval_survive_train():
    model = ResNetKCLA(50, base_channels=16, head_dim=16, frozen_stages=2,
                       norm_eval=True)
    model.train()
    for name in ('layer1', 'layer2', 'layer1_attn', 'layer2_attn'):
        module = getattr(model, name)
        assert not module.training
        assert all(not p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in model.layer3_attn.parameters())
    assert all(not m.training for m in model.modules()
               if isinstance(m, _BatchNorm))
    model = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False)
    model.train()
    assert model.layer3_attn[0].norm.training


def test_zero_init_residual_and_kcla_init():
    model = ResNetKCLA(50)
    model.init_weights()
    assert (model.layer2[0].norm3.weight == 0).all()
    layer = model.layer2_attn[1]
    assert (layer.norm.weight == 1).all() and (layer.norm.bias == 0).all()
    bound = (6 / (layer.gate.in_features + layer.gate.out_features))**0.5
    assert layer.gate.weight.abs().max() <= bound
    assert layer.gate.weight.std() > 0
    # kcla_norm_init sets only the branch BN, over the backbone's BN init
    model = ResNetKCLA(18, kcla_norm_init=0.1)
    model.init_weights()
    assert (model.layer2_attn[1].norm.weight == 0.1).all()
    assert (model.layer2_attn[0].adapter.bn.weight == 1).all()
    assert (model.layer2[0].bn1.weight == 1).all()


def test_float16_autocast_forward_r50_is_finite():
    model = ResNetKCLA(50).eval()
    x = torch.rand(1, 3, 128, 128) * 255  # unnormalised pixels: large keys
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.float16):
        outs = model(x)
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(depth=42), ValueError, 'depth must be one of \\[18, 34, 50, 101, '
     '152\\], got 42'),
    (dict(depth=50, out_indices=(0, 4)), ValueError,
     'out_indices must be .* ints in \\[0, 3\\]'),
    (dict(depth=50, head_dim=96), ValueError,
     'stage 1, 256 channels.*head_dim=96 must divide the channels'),
    (dict(depth=50, num_stages=5), ValueError, 'num_stages must be an int in'),
    (dict(depth=50, strides=(1, 2)), ValueError, 'strides must be a sequence'
     ' of 4 ints'),
    (dict(depth=50, style='tf'), ValueError, "style must be 'pytorch'"),
    (dict(depth=50, frozen_stages=7), ValueError, 'frozen_stages must be'),
    (dict(depth=50, layer_attention='SE'), ValueError,
     'layer_attention must be one of'),
    (dict(depth=50, kcla_impl='cuda'), ValueError, 'kcla_impl must be one of'),
    (dict(depth=50, state_init_blocks=(11, )), ValueError,
     'state_init_blocks must be .* containing 0'),
    (dict(depth=50, kcla_drop_path=2.0), ValueError, 'drop_path must be'),
    (dict(depth=18, kcla_norm_init=0.0), ValueError, 'norm_init must be'),
    (dict(depth=50, pretrained='a.pth', init_cfg=dict(type='Pretrained')),
     ValueError, 'init_cfg and pretrained cannot be set'),
])
def test_bad_config_raises_naming_option(kwargs, error, message):
    with pytest.raises(error, match=message):
        ResNetKCLA(**kwargs)


def test_bad_input_raises_naming_shape():
    model = ResNetKCLA(18, base_channels=16, head_dim=16)
    with pytest.raises(ValueError, match='in_channels=3, got shape '
                       '\\(2, 4, 32, 32\\)'):
        model(torch.rand(2, 4, 32, 32))
    with pytest.raises(ValueError, match='got shape \\(3, 32, 32\\)'):
        model(torch.rand(3, 32, 32))
    with pytest.raises(TypeError, match='input must be a Tensor'):
        model([torch.rand(1, 3, 32, 32)])


def test_dcn_and_plugins_match_mmdet_resnet():
    """mmcv's DCN in stages 3-4 and a ContextBlock plugin, KCLA off."""
    torch.manual_seed(0)
    kwargs = dict(
        base_channels=16,
        dcn=dict(type='DCN', deform_groups=1, fallback_on_stride=False),
        stage_with_dcn=(False, False, True, True),
        plugins=[
            dict(cfg=dict(type='ContextBlock', ratio=1. / 4),
                 stages=(False, True, True, True), position='after_conv3')
        ])
    ref = ResNet(50, **kwargs)
    ours = ResNetKCLA(50, layer_attention=None, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.eval()
    ours.eval()
    x = torch.randn(1, 3, 128, 128)  # mmcv's CPU DCN needs maps >= 3x3
    for a, b in zip(ref(x), ours(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with_kcla = ResNetKCLA(50, head_dim=16, **kwargs).train()
    outs = with_kcla(x.expand(2, -1, -1, -1))
    sum(o.mean() for o in outs).backward()
    assert with_kcla.layer3[0].conv2.weight.grad is not None
    assert with_kcla.layer3[0].context_block.channel_add_conv[0].weight.grad \
        is not None


def test_pretrained_argument_is_deprecated_alias_of_init_cfg():
    with pytest.warns(UserWarning, match='pretrained is deprecated'):
        model = ResNetKCLA(18, pretrained='some.pth')
    assert model.init_cfg == dict(type='Pretrained', checkpoint='some.pth')
    with pytest.raises(TypeError, match='pretrained must be a str or None'):
        ResNetKCLA(18, pretrained=3)


@pytest.mark.parametrize('with_cp', [False, True])
def test_mrla_light_shares_the_blocks_downsample(with_cp):
    """MRLA-light's X_in is the block's own shortcut: each downsample runs
    once per forward (its BN counts one training step, not two)."""
    torch.manual_seed(0)
    model = ResNetKCLA(depth=50, base_channels=8, layer_attention='MRLA-light',
                       head_dim=8, norm_eval=False, with_cp=with_cp).train()
    calls = []
    downsamples = [block.downsample for name in model.res_layers
                   for block in getattr(model, name)
                   if block.downsample is not None]
    for ds in downsamples:
        ds.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    sum(o.sum() for o in model(x)).backward()
    assert len(downsamples) == 4
    # also with with_cp: the shared shortcut is computed outside the
    # checkpointed block, so backward does not re-run it
    assert len(calls) == 4
    assert all(int(ds[1].num_batches_tracked) == 1 for ds in downsamples)
    assert all(p.grad is not None for p in model.parameters()
               if p.requires_grad)
