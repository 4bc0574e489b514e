"""The fused KCLA branch kernels equal the same equations in plain PyTorch."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kcla_mm.ops import get_ext
from kcla_mm.ops.kcla_branch import kcla_branch, kcla_branch_inference

EPS = 1e-3


def reference_branch(x, u, w, z, gate, weight, norm, keep):
    """Spec steps 4-8 with torch ops (BN as nn.BatchNorm2d does it)."""
    b, c, h, wd = x.shape
    g = w.shape[1]
    rep = c // g
    u_next = w.repeat_interleave(rep, 1).view(b, c, 1, 1) * x
    if u is not None:
        u_next = u + u_next
    agg = u_next / (z.repeat_interleave(rep, 1).view(b, c, 1, 1) + EPS)
    o = F.conv2d(agg, weight, padding=1, groups=c)
    o = o * gate.repeat_interleave(rep, 1).view(b, c, 1, 1)
    y = F.relu(norm(o)) * keep.view(b, 1, 1, 1)
    return x + y, u_next


def relu_mask(x):
    """The bit mask kcla_bn_relu_add_forward fills: (B, C, ceil(HW / 8))."""
    b, c, h, w = x.shape
    return torch.empty((b, c, (h * w + 7) // 8), dtype=torch.uint8)


def make_case(dtype=torch.float32, b=3, c=12, h=7, w=5, g=3, seed=0,
              with_u=True):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) *
                (hi - lo) + lo).to(dtype)

    x = rand(b, c, h, w)
    u = rand(b, c, h, w) if with_u else None
    wt = rand(b, g, lo=0.5, hi=3.0)
    z = wt + rand(b, g, lo=0.5, hi=4.0)
    gate = rand(b, g, lo=0.1, hi=0.9)
    weight = rand(c, 1, 3, 3)
    keep = torch.tensor([1.25, 0.0, 1.25, 1.25][:b], dtype=dtype)
    norm = nn.BatchNorm2d(c).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(c, lo=0.5, hi=1.5))
        norm.bias.copy_(rand(c, lo=-0.3, hi=0.3))
        norm.running_mean.copy_(rand(c, lo=-0.2, hi=0.2))
        norm.running_var.copy_(rand(c, lo=0.5, hi=2.0))
    return x, u, wt, z, gate, weight, norm, keep


def clone_norm(norm):
    other = nn.BatchNorm2d(norm.num_features).to(norm.weight.dtype)
    other.load_state_dict(norm.state_dict())
    return other


@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('with_u', [True, False])
def test_branch_matches_reference_values_grads_and_running_stats(
        training, with_u):
    x, u, w, z, gate, weight, norm, keep = make_case(with_u=with_u)
    ref_norm = clone_norm(norm)
    norm.train(training)
    ref_norm.train(training)
    leaves = [t for t in (x, u, w, z, gate, weight) if t is not None]
    for t in leaves:
        t.requires_grad_()
    fused = kcla_branch(x, u, w, z, gate, weight, norm, keep, EPS)
    ref = reference_branch(x, u, w, z, gate, weight, ref_norm, keep)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    grads = [torch.randn_like(fused[0]), torch.randn_like(fused[1])]
    params = [norm.weight, norm.bias]
    ref_params = [ref_norm.weight, ref_norm.bias]
    g_fused = torch.autograd.grad(fused, leaves + params, grads)
    g_ref = torch.autograd.grad(ref, leaves + ref_params, grads)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.running_mean, ref_norm.running_mean)
    torch.testing.assert_close(norm.running_var, ref_norm.running_var)


@pytest.mark.parametrize('training', [True, False])
def test_branch_gradcheck_float64(training):
    x, u, w, z, gate, weight, norm, keep = make_case(
        torch.float64, b=2, c=4, h=4, w=3, g=2)
    norm.train(training)

    inputs = [t.clone().requires_grad_() for t in (x, u, w, z, gate, weight)]
    assert torch.autograd.gradcheck(
        lambda *a: kcla_branch(*a, norm, keep[:2], EPS), inputs)
    # gradients w.r.t. the BN affine parameters, against the reference
    out = kcla_branch(*inputs, norm, keep[:2], EPS)
    ref_norm = clone_norm(norm).train(training)
    ref = reference_branch(*inputs, ref_norm, keep[:2])
    seed = [torch.randn_like(out[0]), torch.randn_like(out[1])]
    ga = torch.autograd.grad(out, [norm.weight, norm.bias], seed)
    gb = torch.autograd.grad(ref, [ref_norm.weight, ref_norm.bias], seed)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('with_u', [True, False])
def test_inference_kernel_matches_reference_and_updates_in_place(with_u):
    x, u, w, z, gate, weight, norm, keep = make_case(with_u=with_u)
    norm.eval()
    ref = reference_branch(x, u, w, z, gate, weight, norm,
                           torch.ones_like(keep))
    state = None if u is None else u.clone()
    with torch.no_grad():
        out, u_next = kcla_branch_inference(x, state, w, z, gate, weight,
                                            norm, EPS)
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u_next, ref[1], rtol=1e-6, atol=1e-6)
    if with_u:
        assert u_next is state  # the incoming state was updated in place


@pytest.mark.parametrize('size', [(1, 1), (2, 9), (13, 1), (28, 28)])
def test_odd_and_tiny_planes(size):
    x, u, w, z, gate, weight, norm, keep = make_case(
        b=2, c=4, h=size[0], w=size[1], g=2)
    norm.train()
    ref_norm = clone_norm(norm)
    fused = kcla_branch(x, u, w, z, gate, weight, norm, keep[:2], EPS)
    ref = reference_branch(x, u, w, z, gate, weight, ref_norm, keep[:2])
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_raw_branch_ops_name_bad_arguments():
    ext = get_ext()
    x, u, w, z, gate, weight, norm, keep = make_case()
    u_next, o = torch.empty_like(x), torch.empty_like(x)
    with pytest.raises(RuntimeError, match='argument `weight` must be '
                       '\\(C, 1, 3, 3\\)'):
        ext.kcla_branch_forward(x, u, w, z, gate, weight[:, :, :2].contiguous(),
                                u_next, o, EPS)
    with pytest.raises(RuntimeError, match='argument `gate` must have the '
                       'shape of `w`'):
        ext.kcla_branch_forward(x, u, w, z, gate[:, :1].contiguous(), weight,
                                u_next, o, EPS)
    with pytest.raises(RuntimeError, match='argument `x` must be float32 or '
                       'float64'):
        ext.kcla_branch_forward(x.half(), None, w.half(), z.half(),
                                gate.half(), weight.half(), u_next.half(),
                                o.half(), EPS)
    with pytest.raises(RuntimeError, match='argument `u` is on meta'):
        ext.kcla_branch_forward(x, u.to('meta'), w, z, gate, weight, u_next,
                                o, EPS)
    with pytest.raises(RuntimeError, match='argument `keep` must be \\(B,\\)'):
        ext.kcla_bn_relu_add_forward(o, x, torch.ones(12), torch.ones(12),
                                     torch.ones(5), torch.empty_like(x),
                                     relu_mask(x))
    with pytest.raises(RuntimeError, match='argument `mask` must be uint8'):
        ext.kcla_bn_relu_add_forward(o, x, torch.ones(12), torch.ones(12),
                                     torch.ones(3), torch.empty_like(x),
                                     relu_mask(x).float())
    with pytest.raises(RuntimeError, match='argument `mask` must be '
                       '\\(B, C, ceil\\(H \\* W / 8\\)\\)'):
        ext.kcla_bn_relu_add_forward(o, x, torch.ones(12), torch.ones(12),
                                     torch.ones(3), torch.empty_like(x),
                                     relu_mask(x)[..., :-1].contiguous())
    with pytest.raises(RuntimeError, match="unknown op group 'fused'"):
        ext.device_types('fused')


def test_gradients_stay_accurate_when_feature_mean_dwarfs_std():
    """Post-ReLU features give BN inputs with |mean| >> std; the backward
    must not cancel catastrophically (it did when using sum(g * o))."""
    x, u, w, z, gate, weight, norm, keep = make_case(b=4, c=8, h=9, w=9,
                                                     g=2)
    x = x + 300.0
    u = u + 300.0 * z.repeat_interleave(4, 1).view(4, 8, 1, 1)
    weight = weight.abs() + 0.1  # o ~ 300 * gate * sum(weight), std ~ 1
    ref_norm = clone_norm(norm).train()
    norm.train()
    leaves = [t.clone().requires_grad_() for t in (x, u, w, z, gate, weight)]
    ref_leaves = [t.double().detach().requires_grad_() for t in leaves]
    fused = kcla_branch(*leaves, norm, keep, EPS)
    ref = reference_branch(*ref_leaves, ref_norm.double(), keep.double())
    seed = [torch.randn_like(fused[0]), torch.randn_like(fused[1])]
    g_fused = torch.autograd.grad(fused, leaves, seed)
    g_ref = torch.autograd.grad(ref, ref_leaves, [s.double() for s in seed])
    for a, b in zip(g_fused, g_ref):
        scale = b.abs().max()
        assert (a.double() - b).abs().max() <= 2e-3 * scale, \
            f'{(a.double() - b).abs().max()} vs {scale}'
