"""The CUDA kernels of the fused KCLA branch equal the CPU kernels.

Every raw ``kcla_mm._ext`` branch entry runs once on CPU and once on CUDA
with the same inputs (copied per device, aliased arguments staying aliased)
and NaN-filled outputs: float32/float64 results agree to round-off, and the
float16/bfloat16 CUDA results agree with the float32 CPU results on the same
(rounded) inputs. Bit masks are bit-identical except where the value they
threshold lies within round-off of 0. The autograd wrappers
(:func:`kcla_branch`, :func:`relu_pool`, with state tapes) are compared the
same way, values and gradients. Needs a GPU and an extension built with CUDA.

Each test loops over its cases (shapes x precisions x variants) rather than
being parametrized, so a run collects one item per entry / wrapper; a
failing case names itself (``case_named``) in the assertion message.
"""
import contextlib
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kcla_mm.ops import get_ext, has_device_impl
from kcla_mm.ops.kcla_branch import (StateTape, kcla_branch, relu_pool,
                                     release_invertible)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU'),
    pytest.mark.skipif(
        not (torch.cuda.is_available() and has_device_impl('cuda', 'branch')),
        reason='kcla_mm._ext was built without the CUDA branch kernels'),
]

EPS = 1e-3

# (B, C, G, H, W): odd and tiny planes, B * C a multiple of nothing; 56 x 56
# puts the backward's float64 workspace in global memory, 128 x 128 also
# the float32 one (the rest fit in shared memory).
SHAPES = [
    (3, 10, 5, 1, 1),
    (2, 7, 7, 2, 9),
    (3, 10, 5, 7, 7),
    (1, 3, 1, 13, 5),
    (2, 5, 5, 56, 56),
    (1, 3, 3, 128, 128),
]

# (CPU dtype, CUDA dtype): the low-precision CUDA kernels are compared with
# the float32 CPU kernels on the same rounded inputs.
PRECISIONS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
]

# (rtol, atol) of per-element results, by CUDA dtype; per-plane sums of
# H * W terms get atol * H * W.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-10, 1e-10),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}

# Mask bits may differ where |scale * o + shift| is below this (round-off).
MASK_TOL = {
    torch.float32: 1e-5,
    torch.float64: 1e-12,
    torch.float16: 5e-2,
    torch.bfloat16: 1e-1,
}


def shape_id(shape):
    b, c, g, h, w = shape
    return f'B{b}C{c}G{g}-{h}x{w}'


def precision_id(pair):
    cpu, cuda = pair
    name = str(cuda).replace('torch.', '')
    return name if cpu == cuda else f'{name}-vs-cpu-float32'


def inputs(shape, seed=0):
    """Float64 (and uint8 mask) CPU inputs of every branch entry."""
    b, c, g, h, w = shape
    gen = torch.Generator().manual_seed(seed)

    def rand(*size, lo=-1.0, hi=1.0):
        return torch.rand(*size, generator=gen,
                          dtype=torch.float64) * (hi - lo) + lo

    heads_w = rand(b, g, lo=0.5, hi=3.0)
    return dict(
        x=rand(b, c, h, w),
        u=rand(b, c, h, w),
        w=heads_w,
        z=heads_w + rand(b, g, lo=0.5, hi=4.0),
        gate=rand(b, g, lo=0.1, hi=0.9),
        weight=rand(c, 1, 3, 3),
        scale=rand(c, lo=0.5, hi=1.5),
        shift=rand(c, lo=-0.3, hi=0.3),
        var=rand(c, lo=0.5, hi=2.0),
        keep=torch.tensor([(1.25, 0.0, 0.8)[i % 3] for i in range(b)],
                          dtype=torch.float64),
        mean=rand(c, lo=-0.2, hi=0.2),
        alpha=rand(c, lo=-0.1, hi=0.1),
        beta=rand(c, lo=-0.1, hi=0.1),
        grad_out=rand(b, c, h, w),
        grad_u_next=rand(b, c, h, w),
        out=rand(b, c, h, w, lo=-1.0, hi=2.0),
        u_next=rand(b, c, h, w, lo=-3.0, hi=3.0),
        grad_pooled=rand(b, c),
        random_mask=torch.randint(0, 256, (b, c, (h * w + 7) // 8),
                                  generator=gen, dtype=torch.uint8),
    )


def nan_like(t):
    return torch.full_like(t, float('nan'))


def nan(*size):
    return torch.full(size, float('nan'), dtype=torch.float64)


def new_mask(shape):
    """An output mask filled with a pattern the kernels must overwrite."""
    b, c, g, h, w = shape
    return torch.full((b, c, (h * w + 7) // 8), 0xA5, dtype=torch.uint8)


def on_devices(args, dtype, cuda_dtype):
    """(cpu, cuda) copies of keyword arguments. Floating tensors are rounded
    to cuda_dtype, then copied to CUDA, and to CPU as dtype; other tensors
    are copied as they are. An argument passed as the same tensor object
    twice (aliasing) is one tensor in each copy."""
    cpu, cuda, memo = {}, {}, {}
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            cpu[name] = cuda[name] = value
            continue
        if id(value) not in memo:
            if value.is_floating_point():
                low = value.to(cuda_dtype)
                memo[id(value)] = (low.to(dtype, copy=True),
                                   low.to('cuda', copy=True))
            else:
                memo[id(value)] = (value.clone(), value.to('cuda', copy=True))
        cpu[name], cuda[name] = memo[id(value)]
    return cpu, cuda


def run_both(name, args, dtype, cuda_dtype):
    """Calls the raw entry `name` on CPU and on CUDA; returns both argument
    dicts after the calls (CUDA tensors copied back to CPU), or None when the
    CUDA entry refuses a low-precision cuda_dtype (its entry in
    pytorch/kcla_branch.cpp accepts only float32/float64): the caller skips
    that case (the parametrized version of this file called pytest.skip
    here)."""
    ext = get_ext()
    cpu, cuda = on_devices(args, dtype, cuda_dtype)
    getattr(ext, name)(**cpu)
    try:
        getattr(ext, name)(**cuda)
    except RuntimeError as e:
        if cuda_dtype != dtype and 'must be float32 or float64' in str(e):
            return None
        raise
    torch.cuda.synchronize()
    back = {}
    for k, v in cuda.items():
        back[k] = v.cpu() if isinstance(v, torch.Tensor) else v
    return cpu, back


@contextlib.contextmanager
def case_named(case):
    """Runs one case of a looped test: a failed check re-raises with the
    case id in front of its message, any other exception fails the test
    with the case id (the original exception chained)."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f'{case}: {e}') from e
    except Exception as e:  # pytest's skip/fail are BaseException: not here
        pytest.fail(f'{case}: {type(e).__name__}: {e}')


def cases(*axes):
    """(case id, values...) over the product of axes, each a list of
    (id, value) pairs; the id joins the value ids with '-'."""
    for combo in itertools.product(*axes):
        yield ('-'.join(i for i, _ in combo),) + tuple(v for _, v in combo)


def skip_if_all_refused(name, refused, total):
    """Skips the test when run_both refused every one of its cases (each
    would have been a skip in the parametrized version); when only some
    were refused the others ran and the test passes on them."""
    if refused and len(refused) == total:
        pytest.skip(f'{name} accepts only float32/float64 '
                    '(its entry in pytorch/kcla_branch.cpp)')


def assert_maps_close(got, want, cuda_dtype):
    rtol, atol = TOL[cuda_dtype]
    torch.testing.assert_close(got.to(want.dtype), want, rtol=rtol, atol=atol)


def assert_sums_close(got, want, cuda_dtype, hw):
    rtol, atol = TOL[cuda_dtype]
    torch.testing.assert_close(got.to(want.dtype), want, rtol=rtol,
                               atol=atol * max(hw, 1))


def unpack_bits(mask):
    """(B, C, bytes) uint8 -> (B, C, 8 * bytes) bool, position 8 j + k =
    bit k of byte j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((mask.unsqueeze(-1) >> shifts) & 1).flatten(-2).bool()


def assert_masks_match(got, want, y, tol):
    """got == want bit for bit, except at positions where the thresholded
    value y (B, C, H, W) is within tol of 0; the padding bits past H * W
    are 0 in both."""
    hw = y.shape[2] * y.shape[3]
    g, w = unpack_bits(got), unpack_bits(want)
    assert not g[..., hw:].any() and not w[..., hw:].any()
    far = y.flatten(2).abs() > tol
    diff = (g[..., :hw] != w[..., :hw]) & far
    assert not diff.any(), f'{int(diff.sum())} mask bits differ away from 0'
    # and the CPU mask is the ReLU's decision (sanity of the comparison)
    assert torch.equal(w[..., :hw] & far, (y.flatten(2) > 0) & far)


def reference_y(u_next, z, gate, weight, scale, shift):
    """scale * o + shift in float64, o = gate * DWConv3x3(u_next / (z +
    eps)): the value the forward masks threshold."""
    b, c = u_next.shape[:2]
    rep = c // z.shape[1]

    def per_plane(t):
        return t.double().repeat_interleave(rep, 1).view(b, c, 1, 1)

    agg = u_next.double() / (per_plane(z) + EPS)
    o = F.conv2d(agg, weight.double(), padding=1, groups=c) * per_plane(gate)
    return scale.double().view(1, c, 1, 1) * o + shift.double().view(
        1, c, 1, 1)


# ---------------------------------------------------------------- raw ops

def relu_pool_forward_args(shape, t, with_mask):
    """With a mask also with a residual (the block's shortcut)."""
    b, c = shape[:2]
    s = t['x'].clone()
    s.view(-1)[::5] = 0.0  # exact zeros: ReLU passes them, no mask bit
    residual = None
    if with_mask:
        residual = t['grad_out'].clone()
        residual.view(-1)[::5] = 0.0
    return dict(s=s, residual=residual,
                mask=new_mask(shape) if with_mask else None,
                pooled=nan(b, c))


def relu_pool_backward_args(shape, t):
    return dict(grad_x=t['grad_out'], grad_pooled=t['grad_pooled'],
                mask=t['random_mask'], grad_s=nan_like(t['x']))


def stats_args(shape, t, u_mode):
    b, c = shape[:2]
    u = None if u_mode == 'none' else t['u'].clone()
    u_next = u if u_mode == 'alias' else nan_like(t['x'])
    return dict(x=t['x'], u=u, w=t['w'], z=t['z'], gate=t['gate'],
                weight=t['weight'], u_next=u_next, stats=nan(b, c, 2),
                eps=EPS)


# u: pass u; alias_u: u_next is u; alias_out: out is x; keep/mask: pass one
FORWARD_VARIANTS = {
    'separate': dict(u=True, alias_u=False, alias_out=False, keep=True,
                     mask=True),
    'no_u': dict(u=False, alias_u=False, alias_out=False, keep=True,
                 mask=True),
    'in_place': dict(u=True, alias_u=True, alias_out=True, keep=True,
                     mask=True),
    'inference': dict(u=True, alias_u=True, alias_out=False, keep=False,
                      mask=False),
}


def forward_args(shape, t, variant):
    v = FORWARD_VARIANTS[variant]
    x = t['x'].clone()
    u = t['u'].clone() if v['u'] else None
    return dict(x=x, u=u, w=t['w'], z=t['z'], gate=t['gate'],
                weight=t['weight'], scale=t['scale'], shift=t['shift'],
                keep=t['keep'] if v['keep'] else None,
                u_next=u if v['alias_u'] else nan_like(x),
                out=x if v['alias_out'] else nan_like(x),
                mask=new_mask(shape) if v['mask'] else None, eps=EPS)


def apply_args(shape, t, alias_out):
    x = t['x'].clone()
    return dict(x=x, u_next=t['u_next'], z=t['z'], gate=t['gate'],
                weight=t['weight'], scale=t['scale'], shift=t['shift'],
                keep=t['keep'], out=x if alias_out else nan_like(x),
                mask=new_mask(shape), eps=EPS)


def bn_sums_args(shape, t):
    b, c = shape[:2]
    return dict(grad_out=t['grad_out'], u_next=t['u_next'], z=t['z'],
                gate=t['gate'], weight=t['weight'], keep=t['keep'],
                mask=t['random_mask'], mean=t['mean'], bn_sums=nan(b, c, 2),
                eps=EPS)


# grad_u_next / grad_u: pass one; u_prev: None, 'separate' or 'alias' (of
# u_next, as the state tape's in-place inversion)
BACKWARD_VARIANTS = {
    'full': dict(grad_u_next=True, grad_u=True, u_prev='separate'),
    'minimal': dict(grad_u_next=False, grad_u=False, u_prev=None),
    'invert_in_place': dict(grad_u_next=True, grad_u=True, u_prev='alias'),
}


def backward_args(shape, t, variant):
    b, c = shape[:2]
    v = BACKWARD_VARIANTS[variant]
    u_next = t['u_next'].clone()
    u_prev = {None: None, 'separate': nan_like(u_next),
              'alias': u_next}[v['u_prev']]
    return dict(
        grad_out=t['grad_out'],
        grad_u_next=t['grad_u_next'] if v['grad_u_next'] else None,
        out=t['out'], u_next=u_next, w=t['w'], z=t['z'], gate=t['gate'],
        weight=t['weight'], scale=t['scale'], shift=t['shift'],
        keep=t['keep'], mask=t['random_mask'], alpha=t['alpha'],
        beta=t['beta'], mean=t['mean'], grad_x=nan_like(u_next),
        grad_u=nan_like(u_next) if v['grad_u'] else None, u_prev=u_prev,
        bn_sums=nan(b, c, 2), head_sums=nan(b, c, 3),
        weight_sums=nan(b, c, 9), eps=EPS)


SHAPE_AXIS = [(shape_id(s), s) for s in SHAPES]
PRECISION_AXIS = [(precision_id(p), p) for p in PRECISIONS]


def test_relu_pool_forward():
    name = 'kcla_relu_pool_forward'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS,
                      [('mask_residual', True), ('no_mask', False)]))
    refused = []
    for case, shape, (dtype, cuda_dtype), with_mask in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, relu_pool_forward_args(shape, t, with_mask),
                            dtype, cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            # ReLU only selects values: exact in every dtype, and so is its
            # mask; s + residual is one rounding in either dtype
            if with_mask and cuda_dtype != dtype:
                assert_maps_close(cuda['s'], cpu['s'], cuda_dtype)
            else:
                assert torch.equal(cuda['s'].to(dtype), cpu['s'])
            if with_mask:
                assert torch.equal(cuda['mask'], cpu['mask'])
                hw = shape[3] * shape[4]
                assert not unpack_bits(cuda['mask'])[..., hw:].any()
            assert_maps_close(cuda['pooled'], cpu['pooled'], cuda_dtype)
    skip_if_all_refused(name, refused, len(todo))


def test_relu_pool_backward():
    name = 'kcla_relu_pool_backward'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS))
    refused = []
    for case, shape, (dtype, cuda_dtype) in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, relu_pool_backward_args(shape, t), dtype,
                            cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            assert_maps_close(cuda['grad_s'], cpu['grad_s'], cuda_dtype)
    skip_if_all_refused(name, refused, len(todo))


def test_branch_stats():
    name = 'kcla_branch_stats'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS,
                      [(m, m) for m in ('none', 'separate', 'alias')]))
    refused = []
    for case, shape, (dtype, cuda_dtype), u_mode in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, stats_args(shape, t, u_mode), dtype,
                            cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            assert_maps_close(cuda['u_next'], cpu['u_next'], cuda_dtype)
            if u_mode == 'alias':
                assert torch.equal(cuda['u'], cuda['u_next'])
            assert_sums_close(cuda['stats'], cpu['stats'], cuda_dtype,
                              shape[3] * shape[4])
    skip_if_all_refused(name, refused, len(todo))


def test_branch_forward():
    name = 'kcla_branch_forward'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS,
                      [(v, v) for v in FORWARD_VARIANTS]))
    refused = []
    for case, shape, (dtype, cuda_dtype), variant in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, forward_args(shape, t, variant), dtype,
                            cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            assert_maps_close(cuda['u_next'], cpu['u_next'], cuda_dtype)
            assert_maps_close(cuda['out'], cpu['out'], cuda_dtype)
            if FORWARD_VARIANTS[variant]['mask']:
                y = reference_y(cpu['u_next'], cpu['z'], cpu['gate'],
                                cpu['weight'], cpu['scale'], cpu['shift'])
                assert_masks_match(cuda['mask'], cpu['mask'], y,
                                   MASK_TOL[cuda_dtype])
    skip_if_all_refused(name, refused, len(todo))


def test_branch_apply():
    name = 'kcla_branch_apply'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS,
                      [('separate', False), ('out_is_x', True)]))
    refused = []
    for case, shape, (dtype, cuda_dtype), alias_out in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, apply_args(shape, t, alias_out), dtype,
                            cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            assert_maps_close(cuda['out'], cpu['out'], cuda_dtype)
            y = reference_y(cpu['u_next'], cpu['z'], cpu['gate'],
                            cpu['weight'], cpu['scale'], cpu['shift'])
            assert_masks_match(cuda['mask'], cpu['mask'], y,
                               MASK_TOL[cuda_dtype])
    skip_if_all_refused(name, refused, len(todo))


def test_branch_bn_sums():
    name = 'kcla_branch_bn_sums'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS))
    refused = []
    for case, shape, (dtype, cuda_dtype) in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, bn_sums_args(shape, t), dtype, cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            assert_sums_close(cuda['bn_sums'], cpu['bn_sums'], cuda_dtype,
                              shape[3] * shape[4])
    skip_if_all_refused(name, refused, len(todo))


def test_branch_backward():
    name = 'kcla_branch_backward'
    todo = list(cases(SHAPE_AXIS, PRECISION_AXIS,
                      [(v, v) for v in BACKWARD_VARIANTS]))
    refused = []
    for case, shape, (dtype, cuda_dtype), variant in todo:
        with case_named(case):
            t = inputs(shape)
            both = run_both(name, backward_args(shape, t, variant), dtype,
                            cuda_dtype)
            if both is None:
                # half dtype refused by the C++ entry: this case was a
                # pytest.skip (in run_both) before the loop
                refused.append(case)
                continue
            cpu, cuda = both
            hw = shape[3] * shape[4]
            assert_maps_close(cuda['grad_x'], cpu['grad_x'], cuda_dtype)
            for k in ('grad_u', 'u_prev'):
                if cpu[k] is not None:
                    assert_maps_close(cuda[k], cpu[k], cuda_dtype)
            # u_next is an input, overwritten only through u_prev when
            # aliased
            assert_maps_close(cuda['u_next'], cpu['u_next'], cuda_dtype)
            for k in ('bn_sums', 'head_sums', 'weight_sums'):
                assert_sums_close(cuda[k], cpu[k], cuda_dtype, hw)
    skip_if_all_refused(name, refused, len(todo))


def test_empty_batch_or_plane():
    """Empty maps: nothing to do, or (H * W = 0) per-plane outputs as the
    CPU writes them (a mean of nothing is NaN, sums are 0)."""
    for shape in [(0, 4, 2, 5, 5), (2, 4, 2, 0, 3)]:
        with case_named(shape_id(shape)):
            t = inputs(shape)
            calls = [
                ('kcla_relu_pool_forward',
                 relu_pool_forward_args(shape, t, True)),
                ('kcla_relu_pool_backward', relu_pool_backward_args(shape, t)),
                ('kcla_branch_stats', stats_args(shape, t, 'separate')),
                ('kcla_branch_forward', forward_args(shape, t, 'separate')),
                ('kcla_branch_apply', apply_args(shape, t, False)),
                ('kcla_branch_bn_sums', bn_sums_args(shape, t)),
                ('kcla_branch_backward', backward_args(shape, t, 'full')),
            ]
            for name, args in calls:
                # float32 on both sides: run_both never refuses it
                cpu, cuda = run_both(name, args, torch.float32,
                                     torch.float32)
                for k, want in cpu.items():
                    if not isinstance(want, torch.Tensor):
                        continue
                    if want.is_floating_point():
                        torch.testing.assert_close(cuda[k], want,
                                                   equal_nan=True,
                                                   msg=f'{name}: {k}')
                    else:
                        assert torch.equal(cuda[k], want), f'{name}: {k}'


# ------------------------------------------------------- autograd wrappers

AUTOGRAD_SHAPES = [
    (3, 10, 5, 1, 1),
    (2, 7, 7, 2, 9),
    (3, 10, 5, 7, 7),
    (1, 3, 1, 13, 5),
    (2, 4, 2, 56, 56),
]
AUTOGRAD_SHAPE_AXIS = [(shape_id(s), s) for s in AUTOGRAD_SHAPES]
FLOAT_DTYPE_AXIS = [('float32', torch.float32), ('float64', torch.float64)]
TRAINING_AXIS = [('train', True), ('eval', False)]


def make_norm(shape, t, dtype):
    c = shape[1]
    norm = nn.BatchNorm2d(c).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(t['scale'])
        norm.bias.copy_(t['shift'])
        norm.running_mean.copy_(t['mean'])
        norm.running_var.copy_(t['var'])
    return norm


def leaves_on(device, t, names, dtype):
    return {k: t[k].to(device=device, dtype=dtype,
                       copy=True).requires_grad_() for k in names}


def seeds_for(tensors, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, generator=gen, dtype=torch.float64)
            for x in tensors]


def assert_all_close(got, want, dtype, what):
    """Values: per element; gradients (often sums over a batch and planes):
    relative to the largest entry of the reference."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.detach().cpu().to(b.dtype), b.detach()
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8,
                                       msg=f'{what}[{i}]')
        else:
            scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale,
                                       msg=f'{what}[{i}]')


def branch_on(device, shape, t, dtype, training, with_u):
    ins = leaves_on(device, t, ('x', 'u', 'w', 'z', 'gate', 'weight'),
                    dtype)
    if not with_u:
        ins['u'] = None
    norm = make_norm(shape, t, dtype).to(device).train(training)
    out, u_next = kcla_branch(ins['x'], ins['u'], ins['w'], ins['z'],
                              ins['gate'], ins['weight'], norm,
                              t['keep'].to(device=device, dtype=dtype), EPS)
    params = [v for v in ins.values() if v is not None]
    params += [norm.weight, norm.bias]
    seeds = [s.to(device=device, dtype=dtype)
             for s in seeds_for((out, u_next), 1)]
    grads = torch.autograd.grad((out, u_next), params, seeds)
    return ([out, u_next], list(grads),
            [norm.running_mean, norm.running_var])


def check_branch_cases_cuda_match_cpu():
    """kcla_branch on CUDA against the CPU over every autograd case:
    values, gradients, running statistics."""
    for case, shape, dtype, training, with_u in cases(
            AUTOGRAD_SHAPE_AXIS, FLOAT_DTYPE_AXIS, TRAINING_AXIS,
            [('u', True), ('no_u', False)]):
        with case_named(case):
            t = inputs(shape)
            want = branch_on('cpu', shape, t, dtype, training, with_u)
            got = branch_on('cuda', shape, t, dtype, training, with_u)
            for what, a, b in zip(('values', 'grads', 'running stats'), got,
                                  want):
                assert_all_close(a, b, dtype, what)


def test_kcla_branch_autograd_cuda_matches_cpu():
    check_branch_cases_cuda_match_cpu()


def test_one_call_training_kernels_cuda_match_cpu(monkeypatch):
    """The one-call training branch on CUDA (its kernels belong to the
    extension's 'layer' group, which the models take on a device only
    whole: called here directly) equals the CPU's: values, gradients,
    running statistics."""
    import kcla_mm.ops.kcla_branch as kcla_branch_mod
    monkeypatch.setattr(kcla_branch_mod, 'layer_supported',
                        lambda x, impl='auto': True)
    ext, one_call = get_ext(), []
    apply = ext.kcla_branch_autograd

    def spy(*args):
        one_call.append(args[13])
        return apply(*args)

    monkeypatch.setattr(ext, 'kcla_branch_autograd', spy)
    check_branch_cases_cuda_match_cpu()
    assert one_call and all(one_call)


def relu_pool_on(device, t, dtype):
    s_leaf, = leaves_on(device, t, ('x',), dtype).values()
    x, pooled = relu_pool(s_leaf.clone())  # overwrites its argument
    seeds = [s.to(device=device, dtype=dtype)
             for s in seeds_for((x, pooled), 2)]
    grad, = torch.autograd.grad((x, pooled), [s_leaf], seeds)
    return [x, pooled], [grad]


def test_relu_pool_autograd_cuda_matches_cpu():
    for case, shape, dtype in cases(AUTOGRAD_SHAPE_AXIS, FLOAT_DTYPE_AXIS):
        with case_named(case):
            t = inputs(shape)
            want = relu_pool_on('cpu', t, dtype)
            got = relu_pool_on('cuda', t, dtype)
            for what, a, b in zip(('values', 'grads'), got, want):
                assert_all_close(a, b, dtype, what)


def block_on(device, shape, t, dtype, training):
    """A block's shortcut add, final ReLU and GAP (relu_pool), then the
    branch writing its output over the ReLU's (out_in_place)."""
    ins = leaves_on(device, t, ('x', 'grad_out', 'u', 'w', 'z', 'gate',
                                'weight'), dtype)
    norm = make_norm(shape, t, dtype).to(device).train(training)
    x, pooled = relu_pool(ins['x'].clone(), ins['grad_out'])
    out, u_next = kcla_branch(x, ins['u'], ins['w'], ins['z'], ins['gate'],
                              ins['weight'], norm,
                              t['keep'].to(device=device, dtype=dtype), EPS,
                              out_in_place=True)
    params = list(ins.values()) + [norm.weight, norm.bias]
    seeds = [s.to(device=device, dtype=dtype)
             for s in seeds_for((out, u_next, pooled), 3)]
    grads = torch.autograd.grad((out, u_next, pooled), params, seeds)
    return [out, u_next, pooled], list(grads)


def test_relu_pool_then_branch_in_place_cuda_matches_cpu():
    for case, shape, dtype, training in cases(
            AUTOGRAD_SHAPE_AXIS, FLOAT_DTYPE_AXIS, TRAINING_AXIS):
        with case_named(case):
            t = inputs(shape)
            want = block_on('cpu', shape, t, dtype, training)
            got = block_on('cuda', shape, t, dtype, training)
            for what, a, b in zip(('values', 'grads'), got, want):
                assert_all_close(a, b, dtype, what)


def chain_on(device, shape, dtype, training):
    """Three layers sharing one state through tapes, released as the
    backbone does: where the growth check allows, the middle layer's
    backward inverts the running sum in place (u_prev aliases u_next), the
    last one into a new buffer; the flags are returned with the values."""
    layers = [inputs(shape, seed=10 + i) for i in range(3)]
    tapes = [StateTape(), StateTape()]
    u0 = leaves_on(device, layers[0], ('u',), dtype)['u']
    u, outs, params = u0, [], [u0]
    for i, t in enumerate(layers):
        ins = leaves_on(device, t, ('x', 'w', 'z', 'gate', 'weight'), dtype)
        norm = make_norm(shape, t, dtype).to(device).train(training)
        out, u = kcla_branch(ins['x'], u, ins['w'], ins['z'], ins['gate'],
                             ins['weight'], norm,
                             t['keep'].to(device=device, dtype=dtype), EPS,
                             tape_in=tapes[i - 1] if i > 0 else None,
                             tape_out=tapes[i] if i < 2 else None)
        outs.append(out)
        params += list(ins.values()) + [norm.weight, norm.bias]
    flags = torch.stack([t.keep_flag for t in tapes]).to(torch.float64)
    release_invertible(tapes)
    outs.append(u)
    seeds = [s.to(device=device, dtype=dtype) for s in seeds_for(outs, 4)]
    grads = torch.autograd.grad(outs, params, seeds)
    return outs + [flags], list(grads)


def test_state_tape_chain_cuda_matches_cpu():
    for case, shape, dtype, training in cases(
            AUTOGRAD_SHAPE_AXIS, FLOAT_DTYPE_AXIS, TRAINING_AXIS):
        with case_named(case):
            want = chain_on('cpu', shape, dtype, training)
            got = chain_on('cuda', shape, dtype, training)
            for what, a, b in zip(('values', 'grads'), got, want):
                assert_all_close(a, b, dtype, what)
