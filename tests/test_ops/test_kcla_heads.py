"""The heads op (kcla_heads) against the same equations in torch ops, on
the CPU and a GPU."""
import pytest
import torch

from kcla_mm.ops import get_ext, has_device_impl
from kcla_mm.ops.kcla_heads import as_operand, kcla_heads
from .test_kcla_branch import reference_heads


def make_heads_case(dtype=torch.float64, b=3, c=12, g=3, k=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pooled = torch.rand(b, c, generator=gen, dtype=dtype) * 2
    z = torch.rand(b, g, generator=gen, dtype=dtype) + 1
    q_kernel, k_kernel = (torch.randn(1, 1, k, generator=gen, dtype=dtype)
                          for _ in range(2))
    norm_d = torch.rand(g, generator=gen, dtype=dtype) + 0.7
    gate_weight = torch.randn(g, g, generator=gen, dtype=dtype)
    return pooled, z, q_kernel, k_kernel, norm_d, gate_weight


# every CUDA build has the heads' kernels (and the branch group's)
CUDA = pytest.param('cuda', marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and has_device_impl('cuda', 'branch')),
    reason='needs a GPU and kcla_mm._ext built with CUDA'))


@pytest.mark.parametrize('device', ['cpu', CUDA])
@pytest.mark.parametrize('with_z', [True, False])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_heads_match_reference_values_and_gradients(dtype, with_z, device):
    pooled, z, qk, kk, norm_d, gate_w = (
        t.to(device) for t in make_heads_case(dtype, b=5, c=40, g=4))
    z = z if with_z else None
    leaves = [t.requires_grad_() for t in (pooled, qk, kk, gate_w)] + \
        ([z.requires_grad_()] if with_z else [])
    got = kcla_heads(pooled, z, qk, kk, norm_d, gate_w, 1e-6, 10.0)
    want = reference_heads(pooled, qk.view(-1), kk.view(-1), norm_d, gate_w,
                           z)
    # float32: the op sums in double, the reference in float32
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    seeds = [torch.randn_like(t) for t in got]
    for a, b in zip(torch.autograd.grad(got, leaves, seeds),
                    torch.autograd.grad(want, leaves, seeds)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize('device', ['cpu', CUDA])
def test_heads_gradcheck_float64_and_clamps(device):
    """gradcheck on a smooth case, then the two clamps: a head whose
    |K| / norm_d is past the exp clamp passes w no gradient, and a zero
    key (|K| = 0 < key_eps) gives finite gradients equal to torch's."""
    pooled, z, qk, kk, norm_d, gate_w = (
        t.to(device) for t in make_heads_case(b=2, c=8, g=2, k=3))
    inputs = [t.requires_grad_() for t in (pooled, z, qk, kk, gate_w)]
    assert torch.autograd.gradcheck(
        lambda p, zz, q, k, gw: kcla_heads(p, zz, q, k, norm_d, gw, 1e-6,
                                           10.0), inputs)
    big = pooled.detach().clone()
    big[0] *= 1e3  # |K| / norm_d > 10 in every head of sample 0
    big[1, :4] = 0  # head 0 of sample 1: zero key
    leaves = [big.requires_grad_(), qk, kk, gate_w]
    got = kcla_heads(big, z, qk, kk, norm_d, gate_w, 1e-6, 10.0)
    want = reference_heads(big, qk.view(-1), kk.view(-1), norm_d, gate_w, z)
    seeds = [torch.randn_like(t) for t in got]
    for a, b in zip(torch.autograd.grad(got, leaves, seeds),
                    torch.autograd.grad(want, leaves, seeds)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def test_raw_heads_ops_name_bad_arguments():
    ext = get_ext()
    pooled, z, qk, kk, norm_d, gate_w = make_heads_case(torch.float32)
    w, z_next, gate = (torch.empty(3, 3) for _ in range(3))
    with pytest.raises(RuntimeError, match='kcla_heads_forward: argument '
                       '`pooled` must be \\(B, C\\)'):
        ext.kcla_heads_forward(pooled[..., None], z, qk.view(-1), kk.view(-1),
                               norm_d, gate_w, w, z_next, gate, 1e-6, 10.0)
    with pytest.raises(RuntimeError, match='argument `w` must be \\(B, G\\) '
                       'with B = 3 and G dividing C = 12'):
        ext.kcla_heads_forward(pooled, z, qk.view(-1), kk.view(-1), norm_d,
                               gate_w, torch.empty(3, 5), z_next, gate, 1e-6,
                               10.0)
    with pytest.raises(RuntimeError, match='argument `q_kernel` must hold '
                       'an odd number of elements'):
        ext.kcla_heads_forward(pooled, z, qk.view(-1)[:4], kk.view(-1)[:4],
                               norm_d, gate_w, w, z_next, gate, 1e-6, 10.0)
    # any shape of k elements (Conv1d's (1, 1, k)) gives the 1-D result
    outs = [torch.empty(3, 3) for _ in range(3)]
    ext.kcla_heads_forward(pooled, z, qk.view(-1), kk.view(-1), norm_d,
                           gate_w, *outs, 1e-6, 10.0)
    ext.kcla_heads_forward(pooled, z, qk.view(1, 1, -1), kk.view(1, 1, -1),
                           norm_d.view(1, -1, 1, 1, 1), gate_w, w, z_next,
                           gate, 1e-6, 10.0)
    for got, want in zip((w, z_next, gate), outs):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match='kcla_heads_backward: argument '
                       '`grad_pooled` must have the shape of `pooled`'):
        ext.kcla_heads_backward(pooled, qk.view(-1), kk.view(-1), norm_d,
                                gate_w, w, gate, w, gate, torch.empty(3, 4),
                                torch.empty(5), torch.empty(5),
                                torch.empty(3, 3), 1e-6, 10.0)
    with pytest.raises(RuntimeError, match='argument `gate` has dtype '
                       'Double but `pooled` has dtype Float'):
        ext.kcla_heads_forward(pooled, z, qk.view(-1), kk.view(-1), norm_d,
                               gate_w, w, z_next, gate.double(), 1e-6, 10.0)


def test_as_operand_passes_ready_tensors_through_and_casts_the_rest():
    """The tensor itself where it is already contiguous in the dtype; else a
    contiguous copy in it, through which gradients flow back."""
    ready = torch.rand(4, 3)
    assert as_operand(ready, torch.float32) is ready
    strided = torch.rand(3, 4, dtype=torch.float64, requires_grad=True).t()
    for dtype in (torch.float32, torch.float64):
        out = as_operand(strided, dtype)
        assert out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, strided.detach().to(dtype))
    grad, = torch.autograd.grad(as_operand(strided, torch.float32).sum() * 2,
                                strided)
    assert grad.dtype == torch.float64
    assert torch.equal(grad, torch.full((4, 3), 2.0, dtype=torch.float64))
