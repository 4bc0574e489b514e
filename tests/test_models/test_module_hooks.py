"""Hooks on a KCLA layer's submodules see their calls on the default path.

The fused kernels and the matmul forms read the weights of the depthwise
conv, the branch BN, the ECA query / key convs, the gate, the adapter's
conv and BN and the block's last BN instead of calling them. A submodule
with a hook of its own (or any global module hook) is called instead, as
the PyTorch path calls it: feature probes see its output, hook-based FLOP
counters count it, and ``torch.nn.utils.prune`` (which recomputes the
pruned weight in a forward pre-hook) trains as the same mask applied by a
parametrization (no hook: fused kernels) does. Float64, against the
``kcla_impl='torch'`` path or that parametrized twin.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune
from mmcv.cnn import get_model_complexity_info

from kcla_mm.models import ResNetKCLA
from kcla_mm.ops import has_device_impl
from .test_resnet_kcla_impls import fused_and_torch

pytestmark = pytest.mark.skipif(
    not has_device_impl('cpu', 'branch'),
    reason='needs kcla_mm._ext built with the CPU kernels')

# ResNet-50 layout: layer2_attn.0 re-initialises the state (an adapter),
# layer2_attn.1 continues it; layer2.1.bn3 is the last BN of its block
SUBMODULES = ('layer2_attn.1.v_conv', 'layer2_attn.1.bn',
              'layer2_attn.1.drop_path', 'layer2_attn.1.q_conv',
              'layer2_attn.1.k_conv', 'layer2_attn.1.gate',
              'layer2_attn.0.adapter.conv', 'layer2_attn.0.adapter.bn',
              'layer2_attn.0.adapter.k_conv', 'layer2.1.bn3')


def float64_pair():
    """ResNet-50-KCLA (base width 16) on the default path and the same
    weights on the torch path, float64, drop-path 0.2 (the default)."""
    return [m.double() for m in fused_and_torch('cpu')]


def run(model, x, train):
    """Outputs of one forward (with a backward in training), the same
    drop-path draws for every model."""
    model.train(train)
    torch.manual_seed(1)
    if not train:
        with torch.no_grad():
            return model(x)
    outs = model(x)
    sum(o.square().mean() for o in outs).backward()
    return outs


@pytest.mark.parametrize('train', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('name', SUBMODULES)
def test_forward_hook_sees_the_torch_paths_call(name, train):
    models = float64_pair()
    seen = [[], []]
    for model, calls in zip(models, seen):
        model.get_submodule(name).register_forward_hook(
            lambda mod, args, out, calls=calls: calls.append(
                out.detach().clone()))
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    outs = [run(model, x, train) for model in models]
    # one call per forward (none in the adapter's recompute yet: that
    # comes in backward, on both paths alike)
    assert len(seen[0]) == len(seen[1]) >= 1
    for a, b in zip(*seen):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if train:
        # atol as in test_resnet_kcla_impls: float64 round-off through 50
        # layers leaves up to ~3e-13 of a gradient's largest entry on its
        # small entries (measured 9e-12 at conv1.weight on torch 2.1)
        for (pname, p), q in zip(models[0].named_parameters(),
                                 models[1].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9,
                                       atol=1e-10, msg=pname)


def test_backward_hook_on_the_depthwise_conv():
    models = float64_pair()
    seen = [[], []]
    for model, grads in zip(models, seen):
        model.layer3_attn[2].v_conv.register_full_backward_hook(
            lambda mod, grad_in, grad_out, grads=grads: grads.append(
                grad_out[0].clone()))
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    for model in models:
        run(model, x, train=True)
    assert len(seen[0]) == len(seen[1]) == 1
    torch.testing.assert_close(seen[0][0], seen[1][0], rtol=1e-10,
                               atol=1e-12)


def test_global_hook_sees_every_kcla_submodule():
    fused, _ = float64_pair()
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    expected = run(fused, x, train=False)
    names = {m: n for n, m in fused.named_modules()}
    called = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: called.append(names.get(mod)))
    try:
        outs = run(fused, x, train=False)
    finally:
        handle.remove()
    for a, b in zip(outs, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for layers in ('layer1_attn', 'layer2_attn', 'layer3_attn',
                   'layer4_attn'):
        for i, layer in enumerate(getattr(fused, layers)):
            for sub in ('v_conv', 'bn', 'q_conv', 'k_conv', 'gate'):
                assert called.count(f'{layers}.{i}.{sub}') == 1, (
                    f'{layers}.{i}.{sub}')
    assert called.count('layer2_attn.0.adapter.conv') == 1


@pytest.mark.parametrize('train', [False, True], ids=['eval', 'train'])
def test_block_relu_hook_sees_all_three_calls(train):
    """A Bottleneck calls its ReLU three times (mmdet's too); a KCLA layer
    applies the block's last ReLU itself unless that ReLU has a hook."""
    fused, _ = float64_pair()
    plain = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False,
                       layer_attention=None).double()
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    expected = run(fused, x, train)
    outs, seen = {}, {}
    for name, model in (('kcla', fused), ('plain', plain)):
        calls = seen[name] = []
        model.layer2[1].relu.register_forward_hook(
            lambda mod, args, out, calls=calls: calls.append(out.clone()))
        outs[name] = run(model, x, train)
    assert len(seen['kcla']) == len(seen['plain']) == 3
    # the last call gives the block's output, the KCLA layer's input
    layer_inputs = []
    fused.layer2_attn[1].register_forward_pre_hook(
        lambda mod, args: layer_inputs.append(args[0].clone()))
    run(fused, x, train)
    torch.testing.assert_close(seen['kcla'][2], layer_inputs[0], rtol=1e-10,
                               atol=1e-10)
    for a, b in zip(outs['kcla'], expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class Mask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer('mask', mask)

    def forward(self, weight):
        return weight * self.mask


def test_pruned_convs_train_as_their_mask():
    """l1_unstructured on a depthwise conv, an adapter conv and a query
    conv: three SGD steps equal those of the same masks as
    parametrizations (weights read by the fused kernels)."""
    pruned, masked = (m.double() for m in fused_and_torch(
        'cpu', kcla_drop_path=0.0))
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    for name in ('layer2_attn.1.v_conv', 'layer3_attn.0.adapter.conv',
                 'layer3_attn.2.q_conv'):
        prune.l1_unstructured(pruned.get_submodule(name), 'weight', 0.5)
        mask = pruned.get_submodule(name).weight_mask
        assert 0 < mask.sum() < mask.numel()
        parametrize.register_parametrization(masked.get_submodule(name),
                                             'weight', Mask(mask))
    losses = [[], []]
    for model, model_losses in zip((pruned, masked), losses):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = sum(o.square().mean() for o in model(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model_losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)
    assert losses[0][2] < losses[0][0]
    torch.testing.assert_close(
        pruned.layer2_attn[1].v_conv.weight_orig,
        masked.layer2_attn[1].v_conv.parametrizations.weight.original,
        rtol=1e-10, atol=1e-12)


def test_mmcv_flops_counter_counts_the_fused_layers():
    fused, reference = fused_and_torch('cpu')
    counts = [
        get_model_complexity_info(m.eval(), (3, 64, 64), as_strings=False,
                                  print_per_layer_stat=False)
        for m in (fused, reference)
    ]
    assert counts[0] == counts[1]
