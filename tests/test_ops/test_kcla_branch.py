"""The fused KCLA branch kernels equal the same equations in plain PyTorch."""
import copy
import os
import os.path as osp
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kcla_mm.ops.kcla_branch as kcla_branch_mod
from kcla_mm.ops import get_ext, has_device_impl
from kcla_mm.ops.kcla_branch import (GradHandoff, StateTape, kcla_branch,
                                     kcla_branch_inference,
                                     kcla_layer_inference, relu_pool,
                                     release_invertible)

EPS = 1e-3


def reference_branch(x, u, w, z, gate, weight, norm, keep):
    """docs/method.md §2, steps 4-8, with torch ops (BN as nn.BatchNorm2d
    does it)."""
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
    """A bit mask of the branch ops: (B, C, ceil(HW / 8)) uint8."""
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
    other = nn.BatchNorm2d(norm.num_features, momentum=norm.momentum,
                           track_running_stats=norm.track_running_stats).to(
                               norm.weight.dtype)
    other.load_state_dict(norm.state_dict())
    return other


@pytest.fixture(params=['one_call', 'per_kernel'])
def branch_path(request, monkeypatch):
    """The CPU's one-call training kernels, or the per-kernel path (what
    devices without the 'layer' group, CUDA, run) forced on the CPU."""
    if request.param == 'per_kernel':
        monkeypatch.setattr(kcla_branch_mod, 'layer_supported',
                            lambda x, impl='auto': False)
    return request.param


def check_branch_against_reference(case, training, steps=1,
                                   scaled_atol=False):
    """Values, gradients (inputs, BN affine) and running statistics of
    kcla_branch against reference_branch over `steps` steps. Gradients
    agree to atol 1e-5, times their largest value with `scaled_atol`
    (float32 sums over many terms)."""
    x, u, w, z, gate, weight, norm, keep = case
    ref_norm = clone_norm(norm)
    norm.train(training)
    ref_norm.train(training)
    leaves = [t.requires_grad_() for t in (x, u, w, z, gate, weight)
              if t is not None]
    for _ in range(steps):
        fused = kcla_branch(x, u, w, z, gate, weight, norm, keep, EPS)
        ref = reference_branch(x, u, w, z, gate, weight, ref_norm, keep)
        for a, b in zip(fused, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        gen = torch.Generator().manual_seed(1)
        grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype)
                 for t in fused]
        g_fused = torch.autograd.grad(fused, leaves + [norm.weight,
                                                       norm.bias], grads)
        g_ref = torch.autograd.grad(ref, leaves + [ref_norm.weight,
                                                   ref_norm.bias], grads)
        for a, b in zip(g_fused, g_ref):
            scale = max(1.0, b.abs().max().item()) if scaled_atol else 1.0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)
        for name in ('running_mean', 'running_var', 'num_batches_tracked'):
            torch.testing.assert_close(getattr(norm, name),
                                       getattr(ref_norm, name))


@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('with_u', [True, False])
def test_branch_matches_reference_values_grads_and_running_stats(
        training, with_u, branch_path):
    check_branch_against_reference(make_case(with_u=with_u), training)


@pytest.mark.parametrize('training', [True, False])
def test_branch_with_a_constant_state(training, branch_path):
    """An incoming state that needs no gradient (a frozen predecessor's):
    the backward writes none for it (the kernels' scratch takes it), and
    the other gradients must still match the reference."""
    x, u, w, z, gate, weight, norm, keep = make_case()
    ref_norm = clone_norm(norm).train(training)
    norm.train(training)
    leaves = [t.requires_grad_() for t in (x, w, z, gate, weight)]
    fused = kcla_branch(x, u, w, z, gate, weight, norm, keep, EPS)
    ref = reference_branch(x, u, w, z, gate, weight, ref_norm, keep)
    seed = [torch.randn_like(fused[0]), torch.randn_like(fused[1])]
    g_fused = torch.autograd.grad(fused, leaves, seed)
    g_ref = torch.autograd.grad(ref, leaves, seed)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('training', [True, False])
def test_branch_gradcheck_float64(training, branch_path):
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
def test_odd_and_tiny_planes(size, branch_path):
    x, u, w, z, gate, weight, norm, keep = make_case(
        b=2, c=4, h=size[0], w=size[1], g=2)
    norm.train()
    ref_norm = clone_norm(norm)
    fused = kcla_branch(x, u, w, z, gate, weight, norm, keep[:2], EPS)
    ref = reference_branch(x, u, w, z, gate, weight, ref_norm, keep[:2])
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('b,c,g,h,w', [(3, 12, 3, 7, 7), (2, 8, 2, 8, 8),
                                       (1, 9, 3, 3, 3), (4, 4100, 1025, 8, 8),
                                       (2, 32, 2, 7, 7)])
def test_small_planes_in_lane_groups(b, c, g, h, w, training, branch_path):
    """Planes of up to 64 values, which the AVX2 kernels take eight at a
    time: groups across two samples and two heads (12 channels), whole
    groups only (16 planes of 64 values), a group and one plane left over
    (9 planes of 9), maps over 4 MiB (run a block of channels at a time),
    and heads of 16 channels (each group within one head, whose state
    loops then run over the group's eight planes at once)."""
    case = make_case(b=b, c=c, h=h, w=w, g=g)
    check_branch_against_reference(case, training, scaled_atol=True)


@pytest.mark.parametrize('c,g', [(12, 3), (32, 2)])
def test_lane_groups_without_state_gradients(c, g):
    """7x7 planes in lane groups with a constant incoming state and no
    gradient for u_next (the kernels' scratch stands in for both, for runs
    of four and of eight planes in one head)."""
    x, u, w, z, gate, weight, norm, keep = make_case(b=2, c=c, h=7, w=7, g=g)
    ref_norm = clone_norm(norm).train()
    norm.train()
    leaves = [t.requires_grad_() for t in (x, w, z, gate, weight)]
    fused, _ = kcla_branch(x, u, w, z, gate, weight, norm, keep[:2], EPS)
    ref, _ = reference_branch(x, u, w, z, gate, weight, ref_norm, keep[:2])
    seed = torch.randn_like(fused)
    for a, b in zip(torch.autograd.grad(fused, leaves, seed),
                    torch.autograd.grad(ref, leaves, seed)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def reference_heads(pooled, q_kernel, k_kernel, norm_d, gate_weight, z,
                    key_eps=1e-6):
    """docs/method.md §2, steps 1-3, with torch ops: (w, z_next, gate), each
    (B, G)."""
    b, c = pooled.shape
    g = norm_d.shape[0]
    pad = (q_kernel.numel() - 1) // 2
    q, k = (F.conv1d(pooled[:, None], kern.view(1, 1, -1), padding=pad)
            .view(b, g, c // g) for kern in (q_kernel, k_kernel))
    norm = k.norm(dim=-1)
    w = torch.exp(torch.clamp(norm / norm_d, max=10.0))
    rel = (q * k).sum(-1) / norm.clamp_min(key_eps)
    gate = torch.sigmoid(rel @ gate_weight.t())
    return w, w if z is None else z + w, gate


# the CUDA launchers of the 'layer' group (not yet verified on a GPU:
# kcla_mm.ops.kcla_branch.UNVERIFIED_LAYER_DEVICES), called directly
CUDA_LAYER = pytest.param('cuda', marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and has_device_impl('cuda', 'layer')),
    reason="needs a GPU and kcla_mm._ext's CUDA 'layer' kernels"))


@pytest.mark.parametrize('device', ['cpu', CUDA_LAYER])
@pytest.mark.parametrize('size', [(1, 1), (5, 7), (9, 9)])
@pytest.mark.parametrize('with_u,with_tail,with_residual',
                         [(True, True, True), (False, False, False),
                          (True, False, True), (False, True, False)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('channels', [12, 60])
def test_layer_inference_matches_reference(channels, dtype, with_u,
                                           with_tail, with_residual, size,
                                           device):
    """kcla_layer_inference: ReLU(tail BN(s) + r), GAP, heads, branch, in one
    call, against torch ops on the CPU; s overwritten, u updated in place.
    60 channels: each thread's share of a sample holds whole lane groups of
    small planes (and leftovers)."""
    x, u, _, z, _, weight, norm, _ = make_case(
        dtype, b=3, c=channels, h=size[0], w=size[1], g=3, with_u=with_u)
    norm.eval()
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(x.shape, generator=gen, dtype=dtype)
    r = torch.randn(x.shape, generator=gen, dtype=dtype) \
        if with_residual else None
    tail = clone_norm(norm).eval() if with_tail else None
    if tail is not None:
        with torch.no_grad():
            tail.running_mean.add_(0.1)
            tail.weight.mul_(0.9)
    q_kernel, k_kernel = (torch.randn(5, generator=gen, dtype=dtype)
                          for _ in range(2))
    # temperatures growing with the head width keep w = exp(|K| / norm_d)
    # below its clamp, so u_next = u + w x stays in float32's range of
    # exact comparison
    norm_d = (torch.rand(3, generator=gen, dtype=dtype) + 0.7) * channels / 12
    gate_weight = torch.randn(3, 3, generator=gen, dtype=dtype)
    z_in = None if u is None else z
    with torch.no_grad():
        xr = s if tail is None else tail(s)
        xr = F.relu(xr if r is None else xr + r)
        w, z_next, gate = reference_heads(xr.mean((2, 3)), q_kernel,
                                          k_kernel, norm_d, gate_weight, z_in)
        ref_out, ref_u = reference_branch(xr, u, w, z_next, gate, weight,
                                          norm, torch.ones(3, dtype=dtype))
        state = None if u is None else u.to(device, copy=True)
        s_in = s.to(device, copy=True)

        def moved(t):
            return None if t is None else copy.deepcopy(t).to(device)

        out, u_next, z_got = kcla_layer_inference(
            s_in, moved(r), state, moved(z_in), q_kernel.to(device),
            k_kernel.to(device), norm_d.to(device), gate_weight.to(device),
            weight.to(device), moved(norm), EPS, 1e-6, 10.0, moved(tail))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(z_got.cpu(), z_next, **tol)
    torch.testing.assert_close(out.cpu(), ref_out, **tol)
    torch.testing.assert_close(u_next.cpu(), ref_u, **tol)
    assert out is s_in
    if with_u:
        assert u_next is state


def test_raw_layer_inference_names_bad_arguments():
    ext = get_ext()
    x, u, w, z, gate, weight, _, _ = make_case()
    ones, zeros, kern = torch.ones(12), torch.zeros(12), torch.rand(3)
    norm_d, gate_w = torch.ones(3), torch.rand(3, 3)

    def call(**change):
        args = dict(s=x.clone(), residual=None, tail_weight=None,
                    tail_bias=None, tail_mean=None, tail_var=None, u=u, z=z,
                    q_kernel=kern, k_kernel=kern, norm_d=norm_d,
                    gate_weight=gate_w, weight=weight, bn_weight=ones,
                    bn_bias=zeros, bn_mean=zeros, bn_var=ones,
                    u_next=u.clone(), w=torch.empty_like(w),
                    z_next=torch.empty_like(w), gate=torch.empty_like(w),
                    eps=EPS, key_eps=1e-6, max_log_weight=10.0, bn_eps=1e-5,
                    tail_eps=1e-5)
        args.update(change)
        ext.kcla_layer_inference(**args)

    call()  # valid
    # the ECA kernels as Conv1d keeps them, (1, 1, k), and norm_d as a
    # (1, G, 1, 1, 1) buffer
    call(q_kernel=kern.view(1, 1, 3), k_kernel=kern.view(1, 1, 3),
         norm_d=norm_d.view(1, 3, 1, 1, 1))
    with pytest.raises(RuntimeError, match='argument `k_kernel` must hold an '
                       'odd number of elements, as many as `q_kernel`'):
        call(k_kernel=torch.rand(5))
    with pytest.raises(RuntimeError, match='`q_kernel` must hold an odd'):
        call(q_kernel=torch.rand(4), k_kernel=torch.rand(4))
    with pytest.raises(RuntimeError, match='`gate_weight` must be \\(G, G\\) '
                       'with G = 3'):
        call(gate_weight=torch.rand(3, 2))
    with pytest.raises(RuntimeError, match='`norm_d` must hold G = 3 '
                       'elements'):
        call(norm_d=torch.ones(4))
    with pytest.raises(RuntimeError, match='`u` and `z` must be given '
                       'together'):
        call(z=None)
    with pytest.raises(RuntimeError, match='`tail_weight`, `tail_bias`, '
                       '`tail_mean` and `tail_var` must be given together'):
        call(tail_weight=ones, tail_bias=zeros)
    with pytest.raises(RuntimeError, match='argument `bn_var` must be \\(C,\\) '
                       'with C = 12'):
        call(bn_var=torch.ones(6))
    with pytest.raises(RuntimeError, match='BN eps must be positive'):
        call(bn_eps=0.0)
    with pytest.raises(RuntimeError, match='argument `residual` must have '
                       'the shape of `s`'):
        call(residual=x[:, :6].contiguous())
    with pytest.raises(RuntimeError, match='argument `z_next` must have the '
                       'shape of `w`'):
        call(z_next=torch.empty(3, 2))


def test_raw_branch_ops_name_bad_arguments():
    ext = get_ext()
    x, u, w, z, gate, weight, norm, keep = make_case()
    u_next, out = torch.empty_like(x), torch.empty_like(x)
    scale, shift = torch.ones(12), torch.zeros(12)
    stats = x.new_empty((3, 12, 2))
    with pytest.raises(RuntimeError, match='argument `weight` must be '
                       '\\(C, 1, 3, 3\\)'):
        ext.kcla_branch_stats(x, u, w, z, gate,
                              weight[:, :, :2].contiguous(), u_next, stats,
                              EPS)
    with pytest.raises(RuntimeError, match='argument `gate` must have the '
                       'shape of `w`'):
        ext.kcla_branch_forward(x, u, w, z, gate[:, :1].contiguous(), weight,
                                scale, shift, keep, u_next, out, None, EPS)
    with pytest.raises(RuntimeError, match='argument `x` must be float32 or '
                       'float64'):
        ext.kcla_branch_stats(x.half(), None, w.half(), z.half(),
                              gate.half(), weight.half(), u_next.half(),
                              stats.half(), EPS)
    with pytest.raises(RuntimeError, match='argument `u` is on meta'):
        ext.kcla_branch_stats(x, u.to('meta'), w, z, gate, weight, u_next,
                              stats, EPS)
    with pytest.raises(RuntimeError, match='argument `stats` must be '
                       '\\(B, C, 2\\)'):
        ext.kcla_branch_stats(x, u, w, z, gate, weight, u_next,
                              stats[..., 0].contiguous(),
                              EPS)
    with pytest.raises(RuntimeError, match='argument `keep` must be \\(B,\\)'):
        ext.kcla_branch_apply(x, u_next, z, gate, weight, scale, shift,
                              torch.ones(5), out, relu_mask(x), EPS)
    with pytest.raises(RuntimeError, match='argument `mask` must be uint8'):
        ext.kcla_branch_apply(x, u_next, z, gate, weight, scale, shift, keep,
                              out, relu_mask(x).float(), EPS)
    with pytest.raises(RuntimeError, match='argument `mask` must be '
                       '\\(B, C, ceil\\(H \\* W / 8\\)\\)'):
        ext.kcla_relu_pool_forward(x.clone(), None, relu_mask(x)[..., :-1]
                                   .contiguous(), x.new_empty((3, 12)))
    with pytest.raises(RuntimeError, match='kcla_relu_pool_forward: argument '
                       '`residual` must have the shape of `s`'):
        ext.kcla_relu_pool_forward(x.clone(), x[:, :6].contiguous(), None,
                                   x.new_empty((3, 12)))
    with pytest.raises(RuntimeError, match='kcla_branch_bn_sums: argument '
                       '`z` must be \\(B, G\\)'):
        ext.kcla_branch_bn_sums(x, u_next, z[0].contiguous(), gate, weight,
                                keep, relu_mask(x), scale, stats, EPS)
    with pytest.raises(RuntimeError, match='kcla_branch_backward: argument '
                       '`out` must be contiguous'):
        ext.kcla_branch_backward(
            x, None, out.transpose(2, 3), u_next, w, z, gate, weight, scale,
            shift, keep, relu_mask(x), scale, scale, scale, out, None, None,
            stats, x.new_empty((3, 12, 3)), x.new_empty((3, 12, 9)), EPS)
    with pytest.raises(RuntimeError, match="unknown op group 'fused'"):
        ext.device_types('fused')


@pytest.mark.parametrize('training', [True, False])
def test_branch_on_maps_larger_than_the_kept_conv_limit(training,
                                                        branch_path):
    """Maps over 4 MiB: the one-call kernels recompute the conv in their
    second passes instead of keeping it."""
    case = make_case(b=2, c=64, h=96, w=96, g=4)
    assert case[0].numel() * 4 > 4 << 20
    check_branch_against_reference(case, training, scaled_atol=True)


@pytest.mark.parametrize('momentum,track', [(None, True), (0.3, False)])
def test_branch_running_stats_cumulative_and_untracked(momentum, track,
                                                       branch_path):
    """BN with momentum=None (a cumulative average) over three steps, and
    without running statistics (batch statistics in eval mode too)."""
    x, u, w, z, gate, weight, _, keep = make_case()
    norm = nn.BatchNorm2d(12, momentum=momentum, track_running_stats=track)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.3, 0.3)
    check_branch_against_reference((x, u, w, z, gate, weight, norm, keep),
                                   training=True, steps=3)
    if not track:
        check_branch_against_reference(
            (x, u, w, z, gate, weight, norm, keep), training=False)


def test_raw_one_call_training_ops_name_bad_arguments():
    ext = get_ext()
    x, u, w, z, gate, weight, norm, keep = make_case()
    u_next, out, mask = torch.empty_like(x), torch.empty_like(x), \
        relu_mask(x)
    ch = [torch.ones(12) for _ in range(4)]
    with pytest.raises(RuntimeError, match='kcla_branch_train_forward: '
                       '`running_mean` and `running_var` must be given '
                       'together'):
        ext.kcla_branch_train_forward(
            x, u, w, z, gate, weight, norm.weight.detach(),
            norm.bias.detach(), norm.running_mean, None, keep, u_next, out,
            mask, *ch, 0.1, 1e-5, EPS)
    with pytest.raises(RuntimeError, match='argument `running_var` has '
                       'dtype Double but `x` has dtype Float'):
        ext.kcla_branch_train_forward(
            x, u, w, z, gate, weight, norm.weight.detach(),
            norm.bias.detach(), norm.running_mean, norm.running_var.double(),
            keep, u_next, out, mask, *ch, 0.1, 1e-5, EPS)
    with pytest.raises(RuntimeError, match='argument `invstd` must be '
                       '\\(C,\\)'):
        ext.kcla_branch_train_forward(
            x, u, w, z, gate, weight, norm.weight.detach(),
            norm.bias.detach(), None, None, keep, u_next, out, mask, ch[0],
            torch.ones(5), ch[2], ch[3], 0.1, 1e-5, EPS)
    grads = [torch.empty_like(w) for _ in range(3)]
    with pytest.raises(RuntimeError, match='kcla_branch_train_backward: '
                       'argument `grad_weight` must be \\(C, 1, 3, 3\\)'):
        ext.kcla_branch_train_backward(
            x, None, out, u_next, w, z, gate, weight, *ch[:2], keep, mask,
            *ch[2:], torch.empty_like(x), None, None, *grads,
            torch.empty(12, 9), torch.ones(12), torch.ones(12), True, EPS)
    with pytest.raises(RuntimeError, match='argument `grad_gate` must have '
                       'the shape of `w`'):
        ext.kcla_branch_train_backward(
            x, None, out, u_next, w, z, gate, weight, *ch[:2], keep, mask,
            *ch[2:], torch.empty_like(x), None, None, *grads[:2],
            torch.empty(3, 2), torch.empty_like(weight), torch.ones(12),
            torch.ones(12), False, EPS)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('with_residual', [False, True])
@pytest.mark.parametrize('size', [(1, 1), (3, 3), (4, 4), (5, 7), (7, 7),
                                  (9, 9)])
def test_relu_pool_matches_relu_and_mean(size, with_residual, dtype):
    """relu_pool: ReLU(s [+ residual]) in place, the mean per plane, and
    their gradients (against F.relu + mean; float64 gradcheck). Planes of
    whole 8-value chunks (4x4) and with values left over (the AVX2 copy
    runs float32 planes in 8-value chunks, the rest in scalar code)."""
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, *size, generator=gen, dtype=dtype)
    r = torch.randn(2, 3, *size, generator=gen, dtype=dtype) \
        if with_residual else torch.zeros_like(s)
    s[0, 0].view(-1)[0] = -r[0, 0].view(-1)[0]  # the kink: ReLU'(0) = 0
    leaf, r_leaf = s.clone().requires_grad_(), r.clone().requires_grad_()
    moved = leaf * 1.0  # a non-leaf the op may overwrite
    x, pooled = relu_pool(moved, r_leaf if with_residual else None)
    assert x is moved  # in place
    ref_x = F.relu(leaf + r_leaf)
    torch.testing.assert_close(x, ref_x, rtol=0, atol=0)
    torch.testing.assert_close(pooled, ref_x.mean((2, 3)))
    seeds = [torch.randn_like(x), torch.randn_like(pooled)]
    inputs = (leaf, r_leaf) if with_residual else (leaf,)
    got = torch.autograd.grad((x, pooled), inputs, seeds)
    want = torch.autograd.grad((ref_x, ref_x.mean((2, 3))), inputs, seeds)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    if dtype == torch.float64:
        smooth = [torch.randn(2, 3, *size, generator=gen, dtype=dtype,
                              requires_grad=True)
                  for _ in range(1 + with_residual)]
        assert torch.autograd.gradcheck(
            lambda t, *res: relu_pool(t * 1.0, *res), smooth)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_relu_pool_passes_nan_on(dtype):
    """A NaN before the ReLU stays NaN (as F.relu keeps it), in an 8-value
    chunk and in a plane's values left over, and so does its plane's mean;
    the other planes are untouched by it."""
    s = torch.rand(1, 3, 3, 3, dtype=dtype)
    s[0, 0, 0, 1] = float('nan')
    s[0, 1, 2, 2] = float('nan')  # value 8: after the plane's one chunk
    with torch.no_grad():
        x, pooled = relu_pool(s.clone())
    assert x[0, 0, 0, 1].isnan() and x[0, 1, 2, 2].isnan()
    assert pooled[0, :2].isnan().all() and not pooled[0, 2].isnan()
    assert x.isnan().sum() == 2


@pytest.mark.parametrize('training', [True, False])
def test_relu_pool_then_branch_in_place_matches_reference(training):
    """The backbone's path: the block's residual branch s and shortcut r ->
    relu_pool -> branch written over x. Values and gradients w.r.t. s, r
    and every parameter equal the reference add -> ReLU -> mean -> branch;
    u_next's gradient may be absent."""
    x, u, w, z, gate, weight, norm, keep = make_case(torch.float64, b=3,
                                                     c=8, h=6, w=5, g=2)
    s = (x * 2).detach().requires_grad_()
    r = torch.randn_like(x).requires_grad_()
    leaves = [s, r, u.requires_grad_(), w.requires_grad_(),
              z.requires_grad_(), gate.requires_grad_(),
              weight.requires_grad_()]
    ref_norm = clone_norm(norm).train(training)
    norm.train(training)
    xr, pooled = relu_pool(s * 1.0, r)
    out, u_next = kcla_branch(xr, u, w * pooled.mean(1, keepdim=True), z,
                              gate, weight, norm, keep, EPS,
                              out_in_place=True)
    ref_x = F.relu(s + r)
    ref_pooled = ref_x.mean((2, 3))
    ref = reference_branch(ref_x, u, w * ref_pooled.mean(1, keepdim=True), z,
                           gate, weight, ref_norm, keep)
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(u_next, ref[1])
    seed = torch.randn_like(out)
    params = leaves + [norm.weight, norm.bias]
    ref_params = leaves + [ref_norm.weight, ref_norm.bias]
    got = torch.autograd.grad(out, params, seed)  # u_next: no gradient
    want = torch.autograd.grad(ref[0], ref_params, seed)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('x_used_twice', [False, True])
def test_gradient_handoffs_match_reference(x_used_twice):
    """Two layers as the backbone chains them (relu_pool -> branch, the
    state passed by tape): the branch hands its gradient of x to relu_pool
    and the second layer its gradient of u to the first, which overwrite
    them in place; values and gradients equal the reference. When x also
    feeds another op, autograd sums a new gradient and nothing of the
    caller's is overwritten."""
    x, u, w, z, gate, weight, norm, keep = make_case(torch.float64, b=3,
                                                     c=8, h=6, w=5, g=2)
    s = (x * 2).detach().requires_grad_()
    r = torch.randn_like(x).requires_grad_()
    u = u.requires_grad_()
    w2 = (w.detach() * 0.5).requires_grad_()
    leaves = [s, r, u, w.requires_grad_(), w2, gate.requires_grad_(),
              weight.requires_grad_()]
    norm2, ref_norm, ref_norm2 = clone_norm(norm), clone_norm(norm), \
        clone_norm(norm)
    handed = []

    def hand(handoff):
        give = handoff.give
        handoff.give = lambda g: (handed.append(g), give(g))
        return handoff

    x_handoff = hand(GradHandoff())
    xr, _ = relu_pool(s * 1.0, r, x_handoff)
    extra = xr * 3.0 if x_used_twice else None
    tape = StateTape()
    hand(tape.grad_u)
    out1, u1 = kcla_branch(xr, u, w, z, gate, weight, norm, keep, EPS,
                           tape_out=tape, out_in_place=True,
                           x_handoff=x_handoff)
    out2, u2 = kcla_branch(out1 * 1.0, u1, w2, z + w2, gate, weight, norm2,
                           keep, EPS, tape_in=tape)
    release_invertible([tape])  # Z grew < 16x: the second layer inverts
    assert tape.kept is None
    ref_x = F.relu(s + r)
    ref1 = reference_branch(ref_x, u, w, z, gate, weight, ref_norm, keep)
    ref2 = reference_branch(ref1[0], ref1[1], w2, z + w2, gate, weight,
                            ref_norm2, keep)
    torch.testing.assert_close(out2, ref2[0])
    torch.testing.assert_close(u2, ref2[1])
    seeds = [torch.randn_like(out2), torch.randn_like(u2)]
    outs, ref_outs = [out2, u2], [ref2[0], ref2[1]]
    if x_used_twice:
        seeds.append(torch.randn_like(out2))
        outs.append(extra)
        ref_outs.append(ref_x * 3.0)
    got = torch.autograd.grad(outs, leaves, seeds)
    want = torch.autograd.grad(ref_outs, leaves, seeds)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # the second layer's grad_u (backward runs it first), the first's grad_x
    assert len(handed) == 2
    grad_s, grad_u = got[1], got[2]  # r's gradient is relu_pool's grad_s
    # the first layer wrote its grad_u over the second's ...
    assert grad_u.data_ptr() == handed[0].data_ptr()
    # ... and relu_pool grad_s over the branch's grad_x, unless x's
    # gradient was a sum autograd made
    assert (grad_s.data_ptr() == handed[1].data_ptr()) != x_used_twice


def test_backward_without_the_tapes_successor_names_the_way_out():
    """A layer whose successor inverts its state saves no U: a loss on its
    own output cannot reach it through the successor's backward, and its
    backward (C++) raises the tape's error (Python) naming invert_state."""
    x, u, w, z, gate, weight, norm, keep = make_case(torch.float64)
    x.requires_grad_()
    out, _ = kcla_branch(x, u, w, z, gate, weight, norm, keep, EPS,
                         tape_out=StateTape())
    with pytest.raises(RuntimeError, match='set invert_state=False'):
        out.sum().backward()


def test_baseline_and_avx2_kernels_agree():
    """The AVX2 + FMA copy of the CPU kernels (the default where the CPU has
    both) and the baseline copy (KCLA_CPU_ISA=base) give the same values
    and gradients to float32 round-off."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {osp.dirname(osp.abspath(__file__))!r})
        from test_kcla_branch import run_reference_case
        from kcla_mm.ops import get_ext
        torch.save((get_ext().cpu_isa(), run_reference_case()), sys.argv[1])
    """)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for isa in ('base', 'auto'):
            path = osp.join(tmp, f'{isa}.pt')
            env = dict(os.environ, KCLA_CPU_ISA=isa)
            proc = subprocess.run([sys.executable, '-c', script, path],
                                  env=env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            results[isa] = torch.load(path)
    assert results['base'][0] == 'base'
    assert results['auto'][0] in ('avx2', 'base')
    for a, b in zip(results['base'][1], results['auto'][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def run_reference_case():
    """Outputs and gradients of the fused branch on two fixed float32 cases:
    13x11 planes, and 7x7 ones (which the AVX2 copy runs in lane groups)."""
    results = []
    for h, w in ((13, 11), (7, 7)):
        x, u, wt, z, gate, weight, norm, keep = make_case(b=3, c=12, h=h,
                                                          w=w)
        norm.train()
        leaves = [t.requires_grad_() for t in (x, u, wt, z, gate, weight)]
        out = kcla_branch(x, u, wt, z, gate, weight, norm, keep, EPS)
        grads = torch.autograd.grad(out, leaves + [norm.weight, norm.bias],
                                    [torch.ones_like(out[0]),
                                     torch.ones_like(out[1])])
        results += [t.detach() for t in out] + list(grads)
    return results


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
