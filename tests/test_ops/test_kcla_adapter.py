"""The adapter ops (kcla_adapter_inference, kcla_adapter) against
Algorithm 1 in plain torch ops: U / Z, the strided grouped 1x1 conv, the
BN (eval, or batch statistics updating the running ones), GAP, the ECA key
and z A'; kcla_adapter's gradients against autograd through those ops."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kcla_mm.ops import get_ext, has_device_impl
from kcla_mm.ops.kcla_adapter import kcla_adapter, kcla_adapter_inference


def reference_adapter(u, z, conv_weight, stride, bn, k_kernel, norm_d):
    """(z A', z) of Algorithm 1 with torch ops; no conv: ``conv_weight``
    None (same width, stride 1). ``bn`` in training mode uses batch
    statistics and updates its running ones."""
    b, c_in = u.shape[:2]
    g = norm_d.numel()
    a = u / z.repeat_interleave(c_in // z.shape[1], 1).view(b, c_in, 1, 1)
    if conv_weight is not None:
        a = F.conv2d(a, conv_weight, stride=stride, groups=g)
    if bn.training:  # nn.BatchNorm2d's count (F.batch_norm keeps none)
        bn.num_batches_tracked.add_(1)
    a = F.batch_norm(a, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                     bn.training, bn.momentum, bn.eps)
    k = k_kernel.numel()
    key = F.conv1d(a.mean((2, 3)).unsqueeze(1), k_kernel.view(1, 1, k),
                   padding=(k - 1) // 2).view(b, g, -1)
    z_out = torch.exp(torch.clamp(key.norm(dim=-1) / norm_d, max=10.0))
    u_out = a.view(b, g, -1, *a.shape[2:]) * z_out.view(b, g, 1, 1, 1)
    return u_out.view(a.shape), z_out


def make_adapter_case(c_in, g_in, c, g, stride, h, w, conv=True,
                      dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(3, c_in, h, w, generator=gen, dtype=dtype) + 0.5
    z = torch.rand(3, g_in, generator=gen, dtype=dtype) * 3 + 1
    weight = torch.randn(c, c_in // g, 1, 1, generator=gen,
                         dtype=dtype) if conv else None
    bn = torch.nn.BatchNorm2d(c).to(dtype).eval()
    with torch.no_grad():
        for t, lo, hi in ((bn.weight, 0.5, 1.5), (bn.bias, -0.3, 0.3),
                          (bn.running_mean, -0.3, 0.3),
                          (bn.running_var, 0.5, 2.0)):
            t.copy_(torch.rand(c, generator=gen, dtype=dtype) * (hi - lo) +
                    lo)
    k_kernel = torch.randn(1, 1, 5, generator=gen, dtype=dtype)
    norm_d = torch.rand(g, generator=gen, dtype=dtype) + 0.7
    return u, z, weight, stride, bn, k_kernel, norm_d


def op_weight(weight, c, g):
    """The op's (C, C' / G) weight: the conv's, or identity blocks."""
    if weight is None:
        return torch.eye(c // g, dtype=torch.float64).repeat(g, 1)
    return weight.view(c, -1)


# the CUDA launcher of the 'layer' group's inference adapter (not yet
# verified on a GPU: kcla_mm.ops.kcla_branch.UNVERIFIED_LAYER_DEVICES)
CUDA_LAYER = pytest.param('cuda', marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and has_device_impl('cuda', 'layer')),
    reason="needs a GPU and kcla_mm._ext's CUDA 'layer' kernels"))


@pytest.mark.parametrize('device', ['cpu', CUDA_LAYER])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize(
    'c_in,g_in,c,g,stride,h,w,conv',
    [(16, 2, 32, 4, 2, 8, 6, True),     # ResNet-like: width x2, stride 2
     (24, 6, 48, 3, 2, 7, 5, True),     # more incoming heads, odd sizes
     (16, 4, 32, 4, 3, 10, 7, True),    # stride 3, sizes not divisible
     (12, 3, 12, 3, 1, 5, 5, False)])   # same width and resolution
def test_adapter_matches_reference(c_in, g_in, c, g, stride, h, w, conv,
                                   dtype, device):
    u, z, weight, stride, bn, k_kernel, norm_d = make_adapter_case(
        c_in, g_in, c, g, stride, h, w, conv, dtype)
    u_ref, z_ref = reference_adapter(u, z, weight, stride, bn, k_kernel,
                                     norm_d)
    u_got, z_got = kcla_adapter_inference(
        u.to(device), z.to(device), op_weight(weight, c, g).to(device),
        stride, copy.deepcopy(bn).to(device), k_kernel.to(device),
        norm_d.to(device), 10.0)
    u_got, z_got = u_got.cpu(), z_got.cpu()
    assert u_got.shape == (3, c, -(-h // stride), -(-w // stride))
    # float32: rounding differs with the order of the folded products
    scale = u_ref.abs().max().item()
    tol = dict(rtol=1e-4, atol=1e-5 * scale) \
        if dtype == torch.float32 else {}
    torch.testing.assert_close(u_got, u_ref, **tol)
    torch.testing.assert_close(z_got, z_ref, **tol)


def test_adapter_weight_clamp_and_operand_casts():
    """A sample whose keys pass the exp clamp gets z = e^10 in every head;
    float32 parameters and a non-contiguous float64 state are cast as
    needed (the result is float64)."""
    u, z, weight, stride, bn, k_kernel, norm_d = make_adapter_case(
        16, 2, 32, 4, 2, 8, 6, dtype=torch.float32)
    u, z = u.double(), z.double()
    u[0] *= 1e4
    u_t = u.transpose(2, 3).contiguous().transpose(2, 3)  # not contiguous
    u_ref, z_ref = reference_adapter(u, z, weight.double(), stride,
                                     copy.deepcopy(bn).double(),
                                     k_kernel.double(), norm_d.double())
    assert torch.all(z_ref[0] == math.exp(10.0))
    u_got, z_got = kcla_adapter_inference(
        u_t, z, weight.view(32, -1), stride, bn, k_kernel, norm_d, 10.0)
    assert u_got.dtype == z_got.dtype == torch.float64
    torch.testing.assert_close(z_got, z_ref)
    torch.testing.assert_close(u_got, u_ref)


def test_raw_adapter_op_names_bad_arguments():
    ext = get_ext()
    u, z, weight, _, bn, k_kernel, norm_d = make_adapter_case(
        16, 2, 32, 4, 2, 8, 6, dtype=torch.float32)
    ones = torch.ones(32)

    def call(**change):
        args = dict(u=u, z=z, weight=weight.view(32, -1), stride=2,
                    bn_weight=ones, bn_bias=ones, bn_mean=ones, bn_var=ones,
                    k_kernel=k_kernel, norm_d=norm_d,
                    u_out=torch.empty(3, 32, 4, 3), z_out=torch.empty(3, 4),
                    bn_eps=1e-5, max_log_weight=10.0)
        args.update(change)
        ext.kcla_adapter_inference(**args)

    call()  # valid
    with pytest.raises(RuntimeError, match=r'`u_out` must be \(B, C, h, w\) '
                       r'= \(3, C, 4, 3\) \(u at stride 2\)'):
        call(u_out=torch.empty(3, 32, 8, 6))
    with pytest.raises(RuntimeError, match=r'`weight` must be \(C, C\' / G\) '
                       r'= \(32, 4\)'):
        call(weight=weight.view(32, -1)[:, :2].contiguous())
    with pytest.raises(RuntimeError, match='`k_kernel` must hold an odd'):
        call(k_kernel=torch.rand(4))
    with pytest.raises(RuntimeError, match='`norm_d` must hold G = 4'):
        call(norm_d=torch.rand(3))
    with pytest.raises(RuntimeError, match='`z` has dtype Double but `u` '
                       'has dtype Float'):
        call(z=z.double())
    with pytest.raises(RuntimeError, match='`u` must be contiguous'):
        call(u=u.transpose(2, 3))
    with pytest.raises(RuntimeError, match='`stride` must be >= 1'):
        call(stride=0)
    with pytest.raises(RuntimeError, match=r'heads of `z_out` must divide '
                       r"the incoming channels C' = 16"):
        call(z_out=torch.empty(3, 32), norm_d=torch.rand(32),
             weight=torch.rand(32, 0))
    with pytest.raises(RuntimeError, match=r'`bn_var` must be \(C,\) with '
                       'C = 32'):
        call(bn_var=torch.ones(16))
    with pytest.raises(RuntimeError, match='BN eps must be positive'):
        call(bn_eps=0.0)


def conv_module(weight, stride, g):
    """A grouped 1x1 Conv2d holding ``weight`` (None: no conv)."""
    if weight is None:
        return None
    conv = torch.nn.Conv2d(weight.shape[1] * g, weight.shape[0], 1, stride,
                           groups=g, bias=False)
    conv.to(weight.device, weight.dtype)
    conv.weight.data.copy_(weight)
    return conv


# every CUDA build has the adapter's training kernels
CUDA = pytest.param('cuda', marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and has_device_impl('cuda', 'branch')),
    reason='needs a GPU and kcla_mm._ext built with CUDA'))


@pytest.mark.parametrize('device', ['cpu', CUDA])
@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize(
    'c_in,g_in,c,g,stride,h,w,conv',
    [(16, 2, 32, 4, 2, 8, 6, True),
     (24, 6, 48, 3, 2, 7, 5, True),
     (16, 4, 32, 4, 3, 10, 7, True),
     (12, 3, 12, 3, 1, 5, 5, False)])
def test_adapter_autograd_matches_reference(c_in, g_in, c, g, stride, h, w,
                                            conv, training, device):
    """kcla_adapter's U', Z', the gradients of the state, Z and every
    parameter, and BN's running statistics and batch count (float64)."""
    u, z, weight, stride, bn, k_kernel, norm_d = (
        t.to(device) if hasattr(t, 'to') else t for t in make_adapter_case(
            c_in, g_in, c, g, stride, h, w, conv))
    bn.train(training)
    module = conv_module(weight, stride, g)
    results = []
    for fused in (True, False):
        norm, k = copy.deepcopy(bn), k_kernel.clone().requires_grad_()
        cv = copy.deepcopy(module)
        ui, zi = u.clone().requires_grad_(), z.clone().requires_grad_()
        if fused:
            outs = kcla_adapter(ui, zi, cv, stride, norm, k, norm_d, 10.0)
        else:
            outs = reference_adapter(ui, zi, None if cv is None else
                                     cv.weight, stride, norm, k, norm_d)
        params = [ui, zi, norm.weight, norm.bias, k] + (
            [] if cv is None else [cv.weight])
        torch.manual_seed(1)
        seeds = [torch.randn_like(o) for o in outs]
        grads = torch.autograd.grad(outs, params, seeds)
        results.append(list(outs) + list(grads) + list(norm.buffers()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('device', ['cpu', CUDA])
@pytest.mark.parametrize('training', [True, False])
def test_adapter_autograd_gradcheck(training, device):
    u, z, weight, stride, bn, k_kernel, norm_d = (
        t.to(device) if hasattr(t, 'to') else t
        for t in make_adapter_case(8, 2, 8, 2, 2, 5, 4))
    bn.train(training)

    def adapter(u, z, weight, bn_weight, bn_bias, k):
        # the modules' attributes that kcla_adapter reads, holding the inputs
        norm = SimpleNamespace(
            weight=bn_weight, bias=bn_bias, training=training, eps=bn.eps,
            momentum=0.0, track_running_stats=True,
            running_mean=bn.running_mean, running_var=bn.running_var,
            num_batches_tracked=torch.tensor(0))
        return kcla_adapter(u, z, SimpleNamespace(weight=weight), stride,
                            norm, k, norm_d, 10.0)

    inputs = [t.detach().clone().requires_grad_() for t in (
        u, z, weight, bn.weight, bn.bias, k_kernel)]
    assert torch.autograd.gradcheck(adapter, inputs)


def test_raw_adapter_autograd_op_names_bad_arguments():
    ext = get_ext()
    u, z, weight, _, bn, k_kernel, norm_d = make_adapter_case(
        16, 2, 32, 4, 2, 8, 6, dtype=torch.float32)
    ones = torch.ones(32)

    def call(**change):
        args = dict(u=u, z=z, weight=weight, bn_weight=ones, bn_bias=ones,
                    running_mean=ones, running_var=ones, k_kernel=k_kernel,
                    norm_d=norm_d, stride=2, batch_stats=True, momentum=0.1,
                    bn_eps=1e-5, max_log_weight=10.0)
        args.update(change)
        return ext.kcla_adapter_autograd(**args)

    assert call()[0].shape == (3, 32, 4, 3)  # valid
    with pytest.raises(RuntimeError, match=r"`weight` must be the grouped "
                       r"1x1 conv's \(C, C' / G, 1, 1\) with C' / G = 4"):
        call(weight=torch.rand(32, 2, 1, 1))
    with pytest.raises(RuntimeError, match='`z_in` has dtype Double but '
                       '`um` has dtype Float'):
        call(z=z.double())
    with pytest.raises(RuntimeError, match=r'`running_var` must be \[32\], '
                       r'got \[16\]'):
        call(running_var=torch.ones(16))
    with pytest.raises(RuntimeError, match='running statistics .* are '
                       'needed without batch statistics'):
        call(running_mean=None, running_var=None, batch_stats=False)
    with pytest.raises(RuntimeError, match='more than 1 value per channel'):
        call(u=u[:1, :, :1, :1].contiguous(), z=z[:1])
    with pytest.raises(RuntimeError, match='`k_kernel` must hold an odd'):
        call(k_kernel=torch.rand(4))
    with pytest.raises(RuntimeError, match='heads of `norm_d` must divide'):
        call(norm_d=torch.rand(3))
