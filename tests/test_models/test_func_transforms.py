"""torch.func transforms (grad, vmap) and forward-mode AD over ResNetKCLA.

The extension's autograd Functions have no functorch rules and its
kernels carry no tangents, so inside a transform or a dual level a KCLA
layer takes its PyTorch path whatever ``kcla_impl`` says
(``kcla_mm.ops.ext_loader.torch_ops_only``). The transformed results are
compared with plain autograd over the same model, which outside the
transform runs the fused kernels; forward-mode tangents with central
finite differences.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

from kcla_mm.models import ResNetKCLA


def build(impl: str) -> ResNetKCLA:
    """A float64 ResNet-18-KCLA in eval mode: four stages, so the first
    layer, continued states and three adapters."""
    torch.manual_seed(0)
    return ResNetKCLA(18, base_channels=16, head_dim=16,
                      kcla_impl=impl).double().eval()


def loss_of(model, params, x):
    outs = torch.func.functional_call(model, params, (x, ))
    return sum(out.square().mean() for out in outs)


def autograd_grads(model, x):
    """{name: d loss / d param} by ``Tensor.backward``."""
    model.zero_grad()
    loss_of(model, dict(model.named_parameters()), x).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize('impl', ['auto', 'fused'])
def test_func_grad_equals_autograd(impl):
    model = build(impl)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    grads = torch.func.grad(loss_of, argnums=1)(model, params, x)
    expected = autograd_grads(model, x)
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-10,
                                   atol=1e-13, msg=name)


def test_vmap_per_sample_gradients():
    model = build('auto')
    x = torch.rand(3, 3, 64, 64, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p, sample):
        return loss_of(model, p, sample.unsqueeze(0))

    per_sample = torch.func.vmap(torch.func.grad(sample_loss),
                                 in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        expected = autograd_grads(model, x[i:i + 1])
        for name in expected:
            torch.testing.assert_close(per_sample[name][i], expected[name],
                                       rtol=1e-10, atol=1e-13, msg=name)


def test_vmap_forward_equals_batched_forward():
    model = build('auto')
    x = torch.rand(3, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        got = torch.func.vmap(
            lambda sample: model(sample.unsqueeze(0)))(x)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.squeeze(1), b, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize('grad_mode', [False, True])
def test_forward_mode_tangents_equal_finite_differences(grad_mode):
    # under no_grad the fused inference ops had run and dropped the
    # KCLA layers' tangents; with grad, the Functions have no jvp
    model = build('auto')
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    direction = torch.rand_like(x)
    with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
        outs = model(fwAD.make_dual(x, direction))
        tangents = [fwAD.unpack_dual(out).tangent for out in outs]
    step = 1e-6
    with torch.no_grad():
        plus, minus = model(x + step * direction), model(x - step * direction)
    for tangent, hi, lo in zip(tangents, plus, minus):
        expected = (hi - lo) / (2 * step)
        torch.testing.assert_close(tangent, expected, rtol=1e-6,
                                   atol=1e-6 * expected.abs().max().item())
