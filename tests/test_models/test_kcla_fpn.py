"""KCLAFPN: mmdet FPN's interface and outputs, plus KCLA across levels."""
import pytest
import torch
from mmdet.models.necks import FPN

from kcla_mm.models.necks.kcla_fpn import KCLAFPN
from .naive_kcla import naive_kcla, randomise

IN_CHANNELS = [8, 16, 32, 64]
SIZES = [(20, 28), (10, 14), (5, 7), (3, 4)]


def inputs(batch=2):
    return [torch.randn(batch, c, *hw) for c, hw in zip(IN_CHANNELS, SIZES)]


@pytest.mark.parametrize('kwargs', [
    dict(num_outs=5),  # Faster/Mask R-CNN: P6 by max-pooling
    dict(num_outs=5, start_level=1, add_extra_convs='on_input'),  # RetinaNet
    dict(num_outs=3, end_level=2),
])
def test_builds_by_name_with_fpn_shaped_outputs(kwargs):
    import kcla_mm  # noqa: F401 (registers KCLAFPN)
    from mmdet.registry import MODELS
    torch.manual_seed(0)
    neck = MODELS.build(
        dict(type='KCLAFPN', in_channels=IN_CHANNELS, out_channels=32,
             head_dim=16, **kwargs))
    fpn = FPN(IN_CHANNELS, 32, **kwargs)
    assert isinstance(neck, KCLAFPN)
    x = inputs()
    ours, ref = neck(x), fpn(x)
    assert len(ours) == len(ref) == kwargs['num_outs']
    assert [o.shape for o in ours] == [r.shape for r in ref]


def test_equals_fpn_plus_naive_kcla_over_levels():
    torch.manual_seed(0)
    neck = KCLAFPN(IN_CHANNELS, 32, num_outs=5, head_dim=16).eval()
    for i, layer in enumerate(neck.level_attentions):
        randomise(layer, i)
    fpn = FPN(IN_CHANNELS, 32, num_outs=5).eval()
    missing, unexpected = fpn.load_state_dict(neck.state_dict(), strict=False)
    assert not missing
    assert all(k.startswith('level_attentions.') for k in unexpected)
    x = inputs()
    with torch.no_grad():
        ours = neck(x)
        expected = naive_kcla(list(neck.level_attentions), list(fpn(x)))
    for level, (a, b) in enumerate(zip(ours, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                   msg=f'level {level}')


def test_level_zero_starts_the_state_later_levels_resize_it():
    neck = KCLAFPN(IN_CHANNELS, 32, num_outs=5, head_dim=16)
    adapters = [layer.adapter for layer in neck.level_attentions]
    assert adapters[0] is None
    assert all(a.resize and a.conv is None for a in adapters[1:])


@pytest.mark.parametrize('impl', ['torch', 'fused'])
def test_gradients_reach_every_parameter(impl):
    torch.manual_seed(0)
    neck = KCLAFPN(IN_CHANNELS, 32, num_outs=5, head_dim=16,
                   kcla_impl=impl).train()
    x = [t.requires_grad_() for t in inputs()]
    sum((o * torch.cos(o)).sum() for o in neck(x)).backward()
    missing = [n for n, p in neck.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in neck.parameters())
    # one training batch per BN: the resizing adapters, recomputed in
    # backward, count theirs once
    counts = {n: int(m.num_batches_tracked) for n, m in neck.named_modules()
              if isinstance(m, torch.nn.BatchNorm2d)}
    assert any('adapter' in n for n in counts)
    assert set(counts.values()) == {1}, counts


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(head_dim=24), ValueError, 'head_dim=24 must divide'),
    (dict(head_dim=16, kcla_drop_path=1.5), ValueError, 'kcla_drop_path'),
    (dict(head_dim=16, kcla_impl='cuda'), ValueError,
     'kcla_impl must be one of'),
])
def test_bad_config_is_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        KCLAFPN(IN_CHANNELS, 32, num_outs=5, **kwargs)


def test_bad_input_is_named():
    neck = KCLAFPN(IN_CHANNELS, 32, num_outs=5, head_dim=16)
    with pytest.raises(ValueError, match='got 3 input levels'):
        neck(inputs()[:3])
    with pytest.raises(TypeError, match='in_channels must be a list'):
        KCLAFPN(64, 32, num_outs=5)
