"""The fused state op equals the plain-PyTorch equations (docs/method.md §2,
steps 4-5)."""
import pytest
import torch

from kcla_mm.ops import get_ext, kcla_state_update

EPS = 1e-3


def naive_state_update(x, u, w, z, eps=EPS):
    """u + w * x and its normalisation, written per head with a loop."""
    b, c, h, wd = x.shape
    g = w.shape[1]
    d = c // g
    u_heads, agg_heads = [], []
    for head in range(g):
        sl = slice(head * d, (head + 1) * d)
        wh = w[:, head].view(b, 1, 1, 1)
        prev = 0 if u is None else u[:, sl]
        u_heads.append(prev + wh * x[:, sl])
        agg_heads.append(u_heads[-1] / (z[:, head].view(b, 1, 1, 1) + eps))
    return torch.cat(u_heads, 1), torch.cat(agg_heads, 1)


def make_inputs(dtype=torch.float32, b=2, c=12, h=5, w=7, g=3,
                with_u=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, h, w, generator=gen, dtype=torch.float64)
    u = torch.randn(b, c, h, w, generator=gen, dtype=torch.float64)
    wt = torch.rand(b, g, generator=gen, dtype=torch.float64) * 3 + 0.5
    z = wt + torch.rand(b, g, generator=gen, dtype=torch.float64) * 5
    out = [t.to(dtype).requires_grad_() for t in (x, u, wt, z)]
    if not with_u:
        out[1] = None
    return out


@pytest.mark.parametrize('with_u', [True, False])
def test_fused_forward_backward_match_naive_float32(with_u):
    x, u, w, z = make_inputs(with_u=with_u)
    fused = kcla_state_update(x, w, z, u, eps=EPS, impl='fused')
    naive = naive_state_update(x, u, w, z)
    for a, b in zip(fused, naive):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    gu, ga = torch.randn_like(x), torch.randn_like(x)
    inputs = [t for t in (x, u, w, z) if t is not None]
    grads_fused = torch.autograd.grad(fused, inputs, (gu, ga))
    grads_naive = torch.autograd.grad(naive, inputs, (gu, ga))
    for a, b in zip(grads_fused, grads_naive):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('with_u', [True, False])
def test_fused_gradcheck_float64(with_u):
    x, u, w, z = make_inputs(torch.float64, b=2, c=4, h=3, w=2, g=2,
                             with_u=with_u)
    if with_u:
        assert torch.autograd.gradcheck(
            lambda x, u, w, z: kcla_state_update(x, w, z, u, impl='fused'),
            (x, u, w, z))
    else:
        assert torch.autograd.gradcheck(
            lambda x, w, z: kcla_state_update(x, w, z, None, impl='fused'),
            (x, w, z))


@pytest.mark.parametrize('dtype,tol', [(torch.float16, 2e-3),
                                       (torch.bfloat16, 1.6e-2)])
def test_fused_half_precision_within_tolerance(dtype, tol):
    x, u, w, z = make_inputs(torch.float32)
    ref = naive_state_update(x.double(), u.double(), w.double(), z.double())
    out = kcla_state_update(x.to(dtype), w.to(dtype), z.to(dtype),
                            u.to(dtype), impl='fused')
    for a, b in zip(out, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_auto_uses_extension_and_torch_path_agrees():
    x, u, w, z = make_inputs()
    auto = kcla_state_update(x, w, z, u)
    torch_path = kcla_state_update(x, w, z, u, impl='torch')
    assert 'KCLAStateFunction' in auto[0].grad_fn.name()
    for a, b in zip(auto, torch_path):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_refused_where_only_torch_ops_can_run():
    """torch.jit.trace cannot record the fused kernels (a trace would keep
    empty outputs), nor do torch.func transforms reach them: impl='fused'
    raises there, impl='auto' traces the PyTorch ops."""
    x, u, w, z = (t.detach() for t in make_inputs())

    def fused(x):
        return kcla_state_update(x, w, z, u, impl='fused')

    with pytest.raises(RuntimeError, match="impl='fused'.*torch.jit"):
        torch.jit.trace(fused, (x, ), check_trace=False)
    with pytest.raises(RuntimeError, match="impl='fused'.*torch.func"):
        torch.func.vmap(fused)(x[None])
    traced = torch.jit.trace(
        lambda x: kcla_state_update(x, w, z, u, impl='auto'), (x, ),
        check_trace=False)
    x2 = torch.randn_like(x)
    for a, b in zip(traced(x2), naive_state_update(x2, u, w, z)):
        torch.testing.assert_close(a, b)


def test_non_contiguous_and_channels_last_inputs():
    x, u, w, z = make_inputs()
    x_cl = x.detach().to(memory_format=torch.channels_last)
    u_t = u.detach().transpose(2, 3).contiguous().transpose(2, 3)
    assert not x_cl.is_contiguous() and not u_t.is_contiguous()
    out = kcla_state_update(x_cl, w, z, u_t, impl='fused')
    ref = naive_state_update(x.detach(), u.detach(), w, z)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('arg', ['u', 'w', 'z'])
def test_mixed_devices_rejected_naming_argument(arg):
    x, u, w, z = (t.detach() if t is not None else None
                  for t in make_inputs())
    args = dict(x=x, u=u, w=w, z=z)
    args[arg] = args[arg].to('meta')
    with pytest.raises(ValueError, match=f'`{arg}` is on meta'):
        kcla_state_update(args['x'], args['w'], args['z'], args['u'])


@pytest.mark.parametrize('arg', ['u', 'w', 'z'])
def test_wrong_dtype_rejected_naming_argument(arg):
    x, u, w, z = (t.detach() for t in make_inputs())
    args = dict(x=x, u=u, w=w, z=z)
    args[arg] = args[arg].double()
    with pytest.raises(TypeError, match=f'`{arg}` has dtype torch.float64'):
        kcla_state_update(args['x'], args['w'], args['z'], args['u'])


@pytest.mark.parametrize('arg,shape,message', [
    ('x', (2, 12, 5), '`x` must be 4-D'),
    ('u', (2, 12, 5, 6), '`u` must have the shape of `x`'),
    ('w', (2, 5), '`w` must be \\(B, G\\)'),
    ('z', (2, 4), '`z` must have the shape of `w`'),
])
def test_mismatched_shapes_rejected_naming_argument(arg, shape, message):
    x, u, w, z = (t.detach() for t in make_inputs())
    args = dict(x=x, u=u, w=w, z=z)
    args[arg] = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        kcla_state_update(args['x'], args['w'], args['z'], args['u'])


def test_fused_on_device_without_implementation_is_clear():
    x, u, w, z = (t.detach().to('meta') for t in make_inputs())
    with pytest.raises(RuntimeError, match="no implementation for device "
                       "'meta'"):
        kcla_state_update(x, w, z, u, impl='fused')
    with pytest.raises(ValueError, match='`impl` must be one of'):
        kcla_state_update(x, w, z, u, impl='cuda')


def test_raw_extension_checks_arguments():
    """The C++ entry itself refuses bad tensors (no segfault)."""
    ext = get_ext()
    x, u, w, z = (t.detach() for t in make_inputs())
    out = [torch.empty_like(x), torch.empty_like(x)]
    with pytest.raises(RuntimeError, match='argument `z` has dtype Double'):
        ext.kcla_state_forward(x, u, w, z.double(), *out, EPS)
    with pytest.raises(RuntimeError, match='argument `u` must be contiguous'):
        ext.kcla_state_forward(x, u.transpose(2, 3), w, z, *out, EPS)
    with pytest.raises(RuntimeError, match='argument `w` must be \\(B, G\\)'):
        ext.kcla_state_forward(x, u, torch.ones(2, 5), torch.ones(2, 5),
                               *out, EPS)
    with pytest.raises(RuntimeError, match='argument `u` is on meta'):
        ext.kcla_state_forward(x, u.to('meta'), w, z, *out, EPS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16,
                                   torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    from kcla_mm.ops import has_device_impl
    if not has_device_impl('cuda'):
        pytest.skip('kcla_mm._ext was built without CUDA')
    x, u, w, z = make_inputs()
    cpu = kcla_state_update(*(t.detach().to(dtype) for t in (x, w, z, u)),
                            impl='fused')
    gpu = kcla_state_update(*(t.detach().to(dtype).cuda()
                              for t in (x, w, z, u)), impl='fused')
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(a, b.cpu(), rtol=tol, atol=tol)
