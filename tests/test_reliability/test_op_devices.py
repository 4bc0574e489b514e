"""The fused KCLA ops on devices and dtypes they do not support.

This torch is a CPU build: ``torch.empty(1, device='cuda')`` raises, so no
CUDA tensor can reach the extension here. The meta device stands in for
it: like CUDA on a CPU-only build of ``kcla_mm._ext``, it is a device the
extension has no kernels for. The dispatch is tested at both levels:

* Python: ``has_device_impl`` says no, so ``impl='auto'`` runs the PyTorch
  reference and ``impl='fused'`` raises naming the device;
* C++: with ``has_device_impl`` patched to say yes (an extension that
  claims the device), and for every raw entry called directly, the op
  entries refuse the tensors with a RuntimeError naming the argument or
  the device; they never crash (checked in a subprocess).

Mixed devices and wrong dtypes of ``kcla_state_update``'s arguments and the
raw branch entries' shape checks are in tests/test_ops; the fallback
switch of KCLALayer and ResNetKCLA in tests/test_models. Added here: the
same switch for KCLAFPN and KCLADecoderAttention, and for strided inputs.
"""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

import kcla_mm.ops.kcla_branch as kcla_branch_mod
import kcla_mm.ops.kcla_state as kcla_state_mod
from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers import KCLALayer
from kcla_mm.models.necks import KCLADecoderAttention
from kcla_mm.models.necks.kcla_fpn import KCLAFPN
from kcla_mm.ops import (ext_device_types, get_ext, has_device_impl,
                         kcla_state_update)
from kcla_mm.ops.kcla_branch import kcla_branch, kcla_branch_inference

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
NO_KERNEL = 'implementation for device'
needs_ext = pytest.mark.skipif(get_ext() is None,
                               reason='kcla_mm._ext is not built')


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """One intra-op thread: faster for these small tensors, and steady when
    the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state_inputs(device='cpu', dtype=torch.float32, b=2, c=8, h=5, w=7,
                 g=2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, c, h, w, generator=gen)
    u = torch.randn(b, c, h, w, generator=gen)
    wt = torch.rand(b, g, generator=gen) + 0.5
    z = wt + torch.rand(b, g, generator=gen) + 1
    return [t.to(device=device, dtype=dtype) for t in (x, u, wt, z)]


@pytest.mark.skipif(torch.cuda.is_available(), reason='a CUDA build')
def test_this_build_cannot_make_cuda_tensors_nor_has_cuda_kernels():
    with pytest.raises((AssertionError, RuntimeError),
                       match='not compiled with CUDA'):
        torch.empty(1, device='cuda')
    assert not has_device_impl('cuda')
    assert not has_device_impl('cuda', 'branch')
    assert 'cpu' in ext_device_types('state')


@needs_ext
def test_every_raw_entry_refuses_bad_tensors_without_crashing():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1')
    proc = subprocess.run(
        [sys.executable, osp.join(osp.dirname(__file__),
                                  'ext_bad_tensor_calls.py')],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, (
        f'crashed ({proc.returncode}) at {lines[-1] if lines else None}: '
        f'{proc.stderr[-2000:]}')
    results = [r for r in lines if r.get('state') != 'calling']
    assert len(results) == len(lines) // 2 > 100
    for r in results:
        entry, case = r['entry'], r['case']
        what = f'{entry} {case}: {r.get("message")}'
        if case == 'valid' or (case == 'all:half'
                               and entry.startswith('kcla_state')):
            assert r['error'] is None, what  # the state op takes float16
            continue
        assert r['error'] == 'RuntimeError', what
        assert r['message'].startswith(entry), what
        if case == 'all:meta':
            assert f'without an {NO_KERNEL} meta' in r['message'], what
        elif case.startswith('meta:'):
            assert 'on meta' in r['message'], what
        elif case.startswith('dtype:'):
            assert 'dtype' in r['message'] or 'must be uint8' in \
                r['message'], what
        else:  # all float16 (branch ops) or all int64
            assert 'must be float32 or float64' in r['message'] or \
                'must be floating point' in r['message'], what


def test_auto_runs_the_reference_on_a_device_without_kernels():
    x, u, w, z = state_inputs('meta')
    u_next, agg = kcla_state_update(x, w, z, u)  # impl='auto'
    assert u_next.device.type == agg.device.type == 'meta'
    assert u_next.shape == agg.shape == x.shape
    with pytest.raises(RuntimeError, match=f"no {NO_KERNEL} 'meta'"):
        kcla_state_update(x, w, z, u, impl='fused')


@pytest.mark.parametrize('mode', ['train', 'eval'])
def test_backbone_on_a_device_without_kernels(mode):
    """'auto' gives shape inference on meta; 'fused' names the device."""
    x = torch.rand(1, 3, 33, 65)
    model = ResNetKCLA(18, base_channels=8, head_dim=8).train(mode == 'train')
    with torch.no_grad():
        expected = [o.shape for o in model(x)]
    model = model.to('meta')
    with torch.no_grad():
        assert [o.shape for o in model(x.to('meta'))] == expected
    fused = ResNetKCLA(18, base_channels=8, head_dim=8, kcla_impl='fused')
    fused = fused.to('meta').train(mode == 'train')
    with pytest.raises(RuntimeError, match=f"no {NO_KERNEL} 'meta'"):
        fused(x.to('meta'))


@pytest.fixture
def ext_claims_meta(monkeypatch):
    """Make the Python dispatch believe the extension has meta kernels, so
    meta tensors reach the C++ op entries (as CUDA tensors would with a
    wrong device list)."""
    def claims(device_type, group='state'):
        return device_type in ('cpu', 'meta')

    monkeypatch.setattr(kcla_state_mod, 'has_device_impl', claims)
    monkeypatch.setattr(kcla_branch_mod, 'has_device_impl', claims)


@needs_ext
@pytest.mark.parametrize('mode', ['train', 'eval-no-grad'])
def test_op_entries_refuse_a_device_the_extension_claims(ext_claims_meta,
                                                        mode):
    x, u, w, z = state_inputs('meta')
    with pytest.raises(RuntimeError, match=f'{NO_KERNEL} meta'):
        kcla_state_update(x, w, z, u)
    layer = KCLALayer(8, head_dim=4).to('meta').train(mode == 'train')
    assert kcla_branch_mod.branch_supported(x, layer.norm)
    with torch.set_grad_enabled(mode == 'train'):
        with pytest.raises(RuntimeError, match=f'kcla_(branch|heads)_.*'
                           f'{NO_KERNEL} meta'):
            layer(x)
    # the switch still runs everything in PyTorch
    layer.impl = 'torch'
    out, state = layer(x)
    assert out.shape == x.shape and state.u.device.type == 'meta'


def branch_case(dtype=torch.float32):
    x, u, w, z = state_inputs(dtype=dtype)
    gate = torch.rand_like(w)
    weight = torch.rand(8, 1, 3, 3, dtype=dtype)
    norm = torch.nn.BatchNorm2d(8).to(dtype)
    keep = torch.ones(2, dtype=dtype)
    return x, u, w, z, gate, weight, norm, keep


@needs_ext
@pytest.mark.parametrize('arg', ['x', 'u', 'w', 'z', 'gate', 'weight'])
def test_branch_wrappers_name_a_tensor_on_another_device(arg):
    x, u, w, z, gate, weight, norm, keep = branch_case()
    args = dict(x=x, u=u, w=w, z=z, gate=gate, weight=weight)
    args[arg] = args[arg].to('meta')
    # x names the other arguments' device; the others are named themselves
    named = 'w' if arg == 'x' else arg
    for fn in (kcla_branch, kcla_branch_inference):
        extra = (keep, ) if fn is kcla_branch else ()
        with pytest.raises(RuntimeError, match=f'argument `{named}` is on '):
            fn(*args.values(), norm.eval(), *extra)


@needs_ext
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16,
                                   torch.int64])
def test_branch_wrappers_refuse_other_dtypes(dtype):
    x, u, w, z, gate, weight, norm, keep = branch_case()
    x, u = x.to(dtype), u.to(dtype)
    with pytest.raises(RuntimeError, match='`x` must be float32 or float64'):
        kcla_branch(x, u, w, z, gate, weight, norm.train(), keep)
    with pytest.raises(RuntimeError, match='`x` must be float32 or float64'):
        kcla_branch_inference(x, u, w, z, gate, weight, norm.eval())


def test_state_update_refuses_integer_features():
    x, u, w, z = state_inputs()
    for impl in ('auto', 'fused', 'torch'):
        with pytest.raises(TypeError, match='`x` must be floating point, '
                           'got torch.int64'):
            kcla_state_update(x.long(), w.long(), z.long(), u.long(),
                              impl=impl)


# --------------------------------------------------------------------------
# the fallback switch: impl='torch' equals the fused path
# --------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize('layout', ['channels_last', 'transposed', 'sliced'])
def test_state_update_torch_path_takes_strided_inputs(layout):
    x, u, w, z = state_inputs(dtype=torch.float64)
    if layout == 'channels_last':
        xs, us = (t.contiguous(memory_format=torch.channels_last)
                  for t in (x, u))
    elif layout == 'transposed':
        xs, us = (t.transpose(2, 3).contiguous().transpose(2, 3)
                  for t in (x, u))
    else:
        xs, us = (torch.cat([t, t], 3)[..., 3:3 + t.shape[3]]
                  for t in (torch.roll(x, 3, 3), torch.roll(u, 3, 3)))
    assert not xs.is_contiguous()
    results = []
    for impl, (xi, ui) in (('fused', (x, u)), ('torch', (xs, us))):
        xi, ui, wi, zi = (t.detach().requires_grad_()
                          for t in (xi, ui, w, z))
        outs = kcla_state_update(xi, wi, zi, ui, impl=impl)
        grads = torch.autograd.grad(
            outs, (xi, ui, wi, zi),
            [torch.ones_like(outs[0]), torch.cos(outs[1].detach())])
        results.append(list(outs) + list(grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def run_both(build, inputs_fn, forward):
    """Outputs and gradients of the fused and torch builds, float64, train
    mode, same parameters and drop-path draws."""
    torch.manual_seed(0)
    fused, plain = build('fused'), build('torch')
    plain.load_state_dict(fused.state_dict())
    results = []
    for module in (fused, plain):
        module.double().train()
        inputs = [t.double().requires_grad_() for t in inputs_fn()]
        torch.manual_seed(1)
        outs = forward(module, inputs)
        loss = sum((o * torch.cos(o.detach())).sum() for o in outs)
        loss.backward()
        results.append([o.detach() for o in outs] + [t.grad for t in inputs]
                       + [p.grad for p in module.parameters()])
    return results


@needs_ext
def test_fpn_fallback_switch_equals_fused():
    in_channels = [8, 16, 32]

    def inputs():
        gen = torch.Generator().manual_seed(2)
        return [torch.randn(2, c, 15 // 2**i + 1, 21 // 2**i + 1,
                            generator=gen)
                for i, c in enumerate(in_channels)]

    fused, plain = run_both(
        lambda impl: KCLAFPN(in_channels, 16, num_outs=4, head_dim=8,
                             kcla_drop_path=0.1, kcla_impl=impl),
        inputs, lambda neck, x: neck(x))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@needs_ext
def test_decoder_attention_fallback_switch_equals_fused():
    def inputs():
        gen = torch.Generator().manual_seed(3)
        return [torch.randn(2, 32, 5, 7, generator=gen),
                torch.randn(2, 16, 9, 13, generator=gen),
                torch.randn(2, 16, 17, 25, generator=gen)]

    def forward(decoder, feats):
        outs, state = [], None
        for i, feat in enumerate(feats):
            out, state = decoder(feat, i, state)
            outs.append(out)
        return outs

    fused, plain = run_both(
        lambda impl: KCLADecoderAttention([32, 16, 16], head_dim=8,
                                          drop_path=0.1, impl=impl),
        inputs, forward)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
