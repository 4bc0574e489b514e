"""What the fused KCLA ops' backwards cannot do raises errors naming
``kcla_impl='torch'``, whose PyTorch ops do it.

They have first derivatives only: under ``create_graph=True`` their
gradients still equal the PyTorch path's, differentiating those gradients
again (a gradient penalty) raises. They take one gradient at a time:
batched gradients (``is_grads_batched=True``, a vectorized jacobian) raise.
"""
import pytest
import torch

import kcla_mm.ops.kcla_branch as kcla_branch_mod
from kcla_mm.ops import has_device_impl, kcla_state_update
from kcla_mm.ops.kcla_branch import GradHandoff, kcla_branch, relu_pool
from kcla_mm.ops.kcla_adapter import kcla_adapter
from kcla_mm.ops.kcla_heads import kcla_heads
from ..test_models.test_resnet_kcla_impls import fused_and_torch
from .test_kcla_adapter import conv_module, make_adapter_case
from .test_kcla_branch import make_case
from .test_kcla_heads import make_heads_case
from .test_kcla_state import make_inputs

pytestmark = pytest.mark.skipif(
    not has_device_impl('cpu', 'branch'),
    reason='needs kcla_mm._ext built with the CPU kernels')

REMEDY = "kcla_impl='torch'"


def fused_and_torch_models():
    """A float64 ResNet-18-KCLA on the fused path (four stages: first
    layer, continued states, adapters; training BNs, no drop-path), the
    same weights on the torch path, and an input for both."""
    fused, reference = (m.double() for m in fused_and_torch(
        'cpu', depth=18, kcla_drop_path=0.0))
    return fused, reference, torch.rand(2, 3, 64, 64, dtype=torch.float64)


def input_gradient(model, x):
    """d(sum of squared outputs)/dx with ``create_graph=True``."""
    x = x.clone().requires_grad_()
    loss = sum(out.square().sum() for out in model(x))
    grad, = torch.autograd.grad(loss, x, create_graph=True)
    return grad


def test_gradient_penalty_through_resnet_kcla():
    fused, reference, x = fused_and_torch_models()

    grad = input_gradient(fused, x)
    expected = input_gradient(reference, x)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert grad.requires_grad
    with pytest.raises(RuntimeError, match=REMEDY):
        grad.square().sum().backward()

    expected.square().sum().backward()
    v_grads = [layer.v_conv.weight.grad for layer in reference.layer4_attn]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
               for g in v_grads)


def test_state_update_second_derivative_raises():
    gen = torch.Generator().manual_seed(0)
    x, u = torch.randn(2, 2, 8, 5, 7, generator=gen,
                       dtype=torch.float64).unbind(0)
    w = torch.rand(2, 2, generator=gen, dtype=torch.float64) + 0.5
    z = w + 2
    grads = []
    for impl in ('fused', 'torch'):
        xi = x.clone().requires_grad_()
        u_next, agg = kcla_state_update(xi, w, z, u, impl=impl)
        loss = u_next.sin().sum() + agg.square().sum()
        grads.append(torch.autograd.grad(loss, xi, create_graph=True)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError, match=REMEDY):
        grads[0].sum().backward()


def test_plain_backward_returns_plain_gradients():
    # without create_graph the gradients are plain tensors, no barrier
    x = torch.rand(1, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    w = torch.ones(1, 1, dtype=torch.float64)
    u_next, agg = kcla_state_update(x, w, w + 1, impl='fused')
    grad, = torch.autograd.grad(agg.sum(), x)
    assert not grad.requires_grad and grad.grad_fn is None
    torch.testing.assert_close(grad, torch.full_like(x, 1 / (2 + 1e-3)))


def test_batched_gradients_raise_and_torch_path_computes_them():
    # the jacobian of stage 4's first outputs by vmap over the backward;
    # the fused backward had failed with "Cannot access data pointer of
    # Tensor that doesn't have storage"
    fused, reference, x = fused_and_torch_models()
    jacobians = []
    for model in (fused, reference):
        xi = x.clone().requires_grad_()
        out = model(xi)[-1]
        rows = torch.eye(out.numel(), dtype=out.dtype)[:3].view(3, *out.shape)
        if model is fused:
            with pytest.raises(RuntimeError, match=REMEDY):
                torch.autograd.grad(out, xi, rows, retain_graph=True,
                                    is_grads_batched=True)
        else:
            jacobians.append(torch.autograd.grad(
                out, xi, rows, retain_graph=True, is_grads_batched=True)[0])
        # the same rows one at a time: the reference for both paths
        jacobians.append(torch.stack([
            torch.autograd.grad(out, xi, row, retain_graph=True)[0]
            for row in rows]))
    fused_rows, batched, reference_rows = jacobians
    torch.testing.assert_close(batched, reference_rows, rtol=1e-10,
                               atol=1e-14)
    torch.testing.assert_close(fused_rows, reference_rows, rtol=1e-10,
                               atol=1e-14)


@pytest.mark.parametrize('one_call', [True, False])
def test_branch_ops_first_order_and_unbatched(one_call, monkeypatch):
    """relu_pool and kcla_branch under create_graph=True give the plain
    backward's gradients, which raise when differentiated; batched
    gradients raise."""
    if not one_call:  # the per-kernel path, as devices without 'layer' run
        monkeypatch.setattr(kcla_branch_mod, 'layer_supported',
                            lambda x, impl='auto': False)
    s, u, w, z, gate, weight, norm, keep = make_case(torch.float64)
    w.requires_grad_()

    def outputs(s):
        handoff = GradHandoff()
        x, pooled = relu_pool(s * 1.0, None, handoff)
        out, u_next = kcla_branch(x, u, w, z, gate, weight, norm, keep,
                                  out_in_place=True, x_handoff=handoff)
        return out.square().sum() + u_next.sin().sum() + pooled.sum()

    s = s.requires_grad_()
    check_first_order_and_unbatched(lambda: outputs(s), (s, w))


def check_first_order_and_unbatched(loss, inputs):
    """The gradients of ``loss()`` under create_graph=True equal the plain
    ones and raise when differentiated; batched gradients raise."""
    plain = torch.autograd.grad(loss(), inputs)
    guarded = torch.autograd.grad(loss(), inputs, create_graph=True)
    for a, b in zip(guarded, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        assert a.requires_grad
    with pytest.raises(RuntimeError, match=REMEDY):
        guarded[0].sum().backward()
    with pytest.raises(RuntimeError, match=REMEDY):
        torch.autograd.grad(loss(), inputs[0],
                            torch.ones(2, dtype=inputs[0].dtype),
                            is_grads_batched=True)


def heads_loss(pooled, z, q_kernel, k_kernel, norm_d, gate_weight):
    w, z_next, gate = kcla_heads(pooled, z, q_kernel, k_kernel, norm_d,
                                 gate_weight, 1e-6, 10.0)
    return w.sin().sum() + z_next.square().sum() + gate.square().sum()


def state_loss(x, u, w, z):
    u_next, agg = kcla_state_update(x, w, z, u, impl='fused')
    return u_next.sin().sum() + agg.square().sum()


def adapter_case():
    u, z, weight, stride, bn, k_kernel, norm_d = make_adapter_case(
        16, 2, 32, 4, 2, 8, 6)
    return u, z, conv_module(weight, stride, 4), stride, bn.train(), \
        k_kernel, norm_d


def adapter_loss(u, z, conv, stride, bn, k_kernel, norm_d):
    u_out, z_out = kcla_adapter(u, z, conv, stride, bn, k_kernel, norm_d,
                                10.0)
    return u_out.sin().sum() + z_out.square().sum()


@pytest.mark.parametrize('loss,case', [
    (heads_loss, lambda: make_heads_case(torch.float64)),
    (state_loss, lambda: make_inputs(torch.float64)),
    (adapter_loss, adapter_case),
], ids=['heads', 'state', 'adapter'])
def test_heads_state_adapter_ops_first_order_and_unbatched(loss, case):
    """kcla_heads, the fused state update and kcla_adapter (C++ autograd
    Functions like the branch's) under create_graph=True give the plain
    backward's gradients, which raise when differentiated; batched
    gradients raise."""
    inputs = [t.detach().requires_grad_() if isinstance(t, torch.Tensor)
              else t for t in case()]
    check_first_order_and_unbatched(lambda: loss(*inputs), inputs[:2])
