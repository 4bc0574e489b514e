"""ResNetKCLA's fused path equals its PyTorch path, on the CPU and a GPU.

The same network (ResNet-50 layout at base width 16) runs once with the
extension's kernels and once with ``kcla_impl='torch'`` (plain PyTorch
ops), from the same weights and, in training, the same drop-path draws
(same seed, same device). Four paths: the CPU's (one-call kernels of the
extension's 'layer' group), the CPU taking the per-pass dispatch (that
group hidden: the branch one kernel per pass, the heads and adapters in
torch), and on a GPU (needs an extension built with CUDA) the 'layer'
group with ``kcla_impl='fused'`` and the per-pass route that
``kcla_impl='auto'`` keeps there until the 'layer' kernels have passed
on a GPU. This file imports no mmdet, so it also runs where mmcv has no
compiled ops (mmdet.models needs them).
"""
import collections

import pytest
import torch

import kcla_mm.ops.kcla_branch as kcla_branch_mod
from kcla_mm.models import ResNetKCLA
from kcla_mm.ops import get_ext, has_device_impl

CUDA_BRANCH = torch.cuda.is_available() and has_device_impl('cuda', 'branch')
CUDA = pytest.param('cuda', marks=pytest.mark.skipif(
    not (CUDA_BRANCH and has_device_impl('cuda', 'layer')),
    reason="needs a GPU and kcla_mm._ext built with the CUDA 'layer' "
    'kernels'))
CUDA_AUTO = pytest.param('cuda_auto', marks=pytest.mark.skipif(
    not CUDA_BRANCH,
    reason='needs a GPU and kcla_mm._ext built with the CUDA branch kernels'))
PATHS = ['cpu', 'cpu_gpu_dispatch', CUDA, CUDA_AUTO]

# the ops of the extension's 'layer' group that Python calls (the heads'
# kernels through their autograd op); the branch's one-call training
# kernels are called from C++, so per_kernel_branch below checks its
# one_call argument instead
LAYER_OPS = ('kcla_layer_inference', 'kcla_heads_autograd',
             'kcla_adapter_inference', 'kcla_adapter_autograd')
# the per-kernel ops each path must run instead (in training the autograd
# ops, which call their kernels in C++: the branch's with one_call False)
GPU_DISPATCH_OPS = {
    'inference': {'kcla_relu_pool_forward', 'kcla_branch_forward'},
    'training': {'kcla_relu_pool_autograd', 'kcla_branch_autograd'},
}
ONE_CALL_ARG = 13  # kcla_branch_autograd's one_call (pybind.cpp)

# Float32 round-off grows over the 16 blocks (each op agrees to 1e-5,
# tests/test_ops); on an H200 the stage outputs differed by up to 2.2e-5
INFERENCE_TOL = {'cpu': 1e-5, 'cuda': 1e-4}


def count_calls(names, monkeypatch) -> collections.Counter:
    """A counter of the extension's calls of ``names``, which still run."""
    ext, calls = get_ext(), collections.Counter()
    for name in names:
        def call(*args, name=name, fn=getattr(ext, name)):
            calls[name] += 1
            return fn(*args)
        monkeypatch.setattr(ext, name, call)
    return calls


def take_path(path, monkeypatch):
    """(device, kcla_impl, calls) of ``path``: for the per-pass paths
    ('cpu_gpu_dispatch': the 'layer' group hidden on the CPU; 'cuda_auto')
    a counter of the extension's calls (a call of a 'layer' op fails the
    test), else None."""
    if path in ('cpu', 'cuda'):
        return (path, 'fused'), None
    ext = get_ext()
    if path == 'cpu_gpu_dispatch':
        real = kcla_branch_mod.has_device_impl

        def without_layer_group(device_type, group='state'):
            return group != 'layer' and real(device_type, group)

        monkeypatch.setattr(kcla_branch_mod, 'has_device_impl',
                            without_layer_group)

    def refused(name):
        def call(*args):
            raise AssertionError(f"{name} ran, but the per-pass route has "
                                 "no 'layer' group")
        return call

    for name in LAYER_OPS:
        monkeypatch.setattr(ext, name, refused(name))
    calls = count_calls(set().union(*GPU_DISPATCH_OPS.values()), monkeypatch)
    branch = ext.kcla_branch_autograd

    def per_kernel_branch(*args):
        assert not args[ONE_CALL_ARG], \
            "the branch took the one-call kernels of the 'layer' group"
        return branch(*args)

    monkeypatch.setattr(ext, 'kcla_branch_autograd', per_kernel_branch)
    return ('cpu', 'fused') if path == 'cpu_gpu_dispatch' else \
        ('cuda', 'auto'), calls


def fused_and_torch(device, depth=50, impl='fused', **kwargs):
    """ResNet-``depth``-KCLA (base width 16, head_dim 16, training BNs,
    ``kwargs``) with ``kcla_impl=impl``, and the same weights with
    ``'torch'``, on ``device``."""
    torch.manual_seed(0)
    models = [ResNetKCLA(depth, base_channels=16, head_dim=16,
                         kcla_impl=kcla_impl, norm_eval=False, **kwargs)
              for kcla_impl in (impl, 'torch')]
    models[1].load_state_dict(models[0].state_dict())
    return [m.to(device) for m in models]


def train_step(model, x, forward=None):
    """Outputs, parameter gradients and buffers after one training step
    (``forward``: ``model`` compiled, say; default ``model`` itself)."""
    model.train()
    torch.manual_seed(1)  # the same drop-path draws for both paths
    outs = (model if forward is None else forward)(x)
    sum((o * o).mean() for o in outs).backward()
    return ([o.detach() for o in outs] + [p.grad for p in model.parameters()]
            + list(model.buffers()))


@pytest.mark.parametrize('path', PATHS)
def test_inference_matches_torch_path(path, monkeypatch):
    (device, impl), calls = take_path(path, monkeypatch)
    fused, ref = fused_and_torch(device, impl=impl)
    x = torch.rand(2, 3, 64, 64, device=device)
    tol = INFERENCE_TOL[device]
    with torch.no_grad():  # inference kernels (BN folded, state in place)
        for a, b in zip(fused.eval()(x), ref.eval()(x)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if calls is not None:
        assert set(calls) == GPU_DISPATCH_OPS['inference']


@pytest.mark.parametrize('path', PATHS)
def test_training_matches_torch_path_float64(path, monkeypatch):
    # training kernels, drop-path, BN batch statistics; in float64, since
    # train-mode BNs over stage 4's 8 values per channel amplify float32
    # round-off
    (device, impl), calls = take_path(path, monkeypatch)
    fused, ref = (m.double() for m in fused_and_torch(device, impl=impl))
    x = torch.rand(2, 3, 64, 64, device=device, dtype=torch.float64)
    for a, b in zip(train_step(fused, x), train_step(ref, x)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    if calls is not None:
        assert set(calls) == GPU_DISPATCH_OPS['training']


def test_sync_bn_reverted_by_mmengine_takes_fused_path(monkeypatch):
    """mmengine's runner turns SyncBN into _BatchNormXd when it trains or
    tests on one process (mmseg's configs use SyncBN); those layers run the
    fused kernels (they ran the PyTorch path) and equal the torch path."""
    from mmengine.model import revert_sync_batchnorm
    torch.manual_seed(0)
    fused = revert_sync_batchnorm(ResNetKCLA(
        50, base_channels=16, head_dim=16, norm_eval=False,
        norm_cfg=dict(type='SyncBN', requires_grad=True))).double()
    ref = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False,
                     kcla_impl='torch').double()
    ref.load_state_dict(fused.state_dict())
    calls = count_calls(
        ('kcla_branch_autograd', 'kcla_layer_inference'), monkeypatch)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    for a, b in zip(train_step(fused, x), train_step(ref, x)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    with torch.no_grad():
        for a, b in zip(fused.eval()(x), ref.eval()(x)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # one call per KCLA layer (16) in each
    assert calls == {'kcla_branch_autograd': 16, 'kcla_layer_inference': 16}


@pytest.mark.parametrize('impl', [
    pytest.param('fused', marks=CUDA.marks),
    pytest.param('auto', marks=CUDA_AUTO.marks)])
def test_training_step_replays_as_cuda_graph(impl):
    """A training step (forward and backward, static shapes) captured with
    torch.cuda.graph replays with the eager step's gradients: nothing in it
    reads a device value on the host (capture raises where something
    does), on the 'layer' group ('fused') and the per-pass route
    ('auto')."""
    torch.manual_seed(0)
    model = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False,
                       kcla_drop_path=0.0, kcla_impl=impl).cuda().train()
    x = torch.rand(2, 3, 64, 64, device='cuda')

    def step():
        model.zero_grad(set_to_none=True)
        sum((o * o).mean() for o in model(x)).backward()

    step()
    eager = [p.grad.clone() for p in model.parameters()]
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch's docs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sum((o * o).mean() for o in model(x)).backward()
    graph.replay()
    torch.cuda.synchronize()
    for p, grad in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad, grad, rtol=1e-3, atol=1e-4)
