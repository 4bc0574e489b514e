"""KCLALayer against a deliberately naive implementation of docs/method.md."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kcla_mm.models.layers import kcla
from kcla_mm.models.layers import (KCLALayer, KCLAState, LayerAttention,
                                   eca_kernel_size, softmax_layer_attention)
from .naive_kcla import EPS, naive_kcla, randomise


def make_chain(impl):
    layers = [
        KCLALayer(16, head_dim=8, impl=impl),
        KCLALayer(16, head_dim=8, impl=impl),
        KCLALayer(32, head_dim=8, state_in_channels=16, state_stride=2,
                  impl=impl),
        KCLALayer(32, head_dim=8, impl=impl),
        KCLALayer(32, head_dim=8, state_in_channels=32, impl=impl),
        KCLALayer(32, head_dim=8, impl=impl),
    ]
    return [randomise(layer, i).eval() for i, layer in enumerate(layers)]


@pytest.mark.parametrize('impl', ['torch', 'fused'])
def test_kcla_layer_equals_naive_spec(impl):
    torch.manual_seed(0)
    layers = make_chain(impl)
    xs = [torch.randn(2, 16, 8, 6) for _ in range(2)] + \
        [torch.randn(2, 32, 4, 3) for _ in range(4)]
    state = None
    outs = []
    with torch.no_grad():
        for layer, x in zip(layers, xs):
            out, state = layer(x, state)
            outs.append(out)
        expected = naive_kcla(layers, xs)
    for t, (a, b) in enumerate(zip(outs, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                   msg=f'layer {t}')


def random_bn(channels, seed, dtype=torch.float32):
    """An eval-mode BatchNorm2d with random affine and running statistics."""
    gen = torch.Generator().manual_seed(seed)
    bn = torch.nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=gen)
        bn.bias.uniform_(-0.3, 0.3, generator=gen)
        bn.running_mean.uniform_(-0.3, 0.3, generator=gen)
        bn.running_var.uniform_(0.5, 2.0, generator=gen)
    return bn.to(dtype).eval()


@pytest.mark.parametrize('fold_adapters', [True, False])
@pytest.mark.parametrize('grad', [False, True])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('impl', ['torch', 'fused'])
def test_block_tail_inputs_equal_naive_spec(impl, dtype, grad, fold_adapters,
                                            monkeypatch):
    """The backbone's call: the block's branch before its last norm, the
    shortcut and that norm (relu_input, shortcut, tail_norm), in eval mode,
    against the naive implementation on X = ReLU(norm(s) + r). Without grad
    the fused layer runs as one kcla_layer_inference call; the adapters run
    folded into one matmul (their BN is a plain BatchNorm2d) or, forced, the
    generic way (conv, BN, GAP in turn)."""
    if not fold_adapters:
        monkeypatch.setattr(kcla.KCLAStateAdapter, 'folds', lambda self: False)
    torch.manual_seed(0)
    layers = [layer.to(dtype) for layer in make_chain(impl)]
    shapes = [(2, 16, 8, 6)] * 2 + [(2, 32, 4, 3)] * 4
    ss = [torch.randn(shape, dtype=dtype) for shape in shapes]
    rs = [torch.randn(shape, dtype=dtype) for shape in shapes]
    norms = [random_bn(shape[1], i, dtype) for i, shape in enumerate(shapes)]
    state = None
    outs = []
    with torch.set_grad_enabled(grad):
        for i, layer in enumerate(layers):
            folds = impl == 'fused' and not grad
            assert layer.folds_tail_norm(ss[i], norms[i]) == folds
            if layer.adapter is not None:
                assert layer.adapter.folds() == fold_adapters
            s = ss[i].clone()
            out, state = layer(s, state, relu_input=True, shortcut=rs[i],
                               tail_norm=norms[i])
            if folds:
                assert out is s  # written over the block's output
            outs.append(out.detach())
    with torch.no_grad():
        xs = [F.relu(n(s) + r) for s, r, n in zip(ss, rs, norms)]
        expected = naive_kcla(layers, xs)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    for t, (a, b) in enumerate(zip(outs, expected)):
        torch.testing.assert_close(a, b, msg=f'layer {t}', **tol)


@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('c_in,stride', [(16, 2), (32, 1)])
def test_folded_adapter_matches_generic_values_grads_running_stats(
        c_in, stride, training, monkeypatch):
    """KCLAStateAdapter.folded_state (one matmul; with c_in = C and stride
    1 there is no conv) against the generic composition (U / Z, conv, BN,
    GAP, key, weights) in float64: U', Z', their gradients w.r.t. the
    incoming state and every parameter, and BN's running statistics."""
    torch.manual_seed(0)
    layer = randomise(KCLALayer(32, head_dim=8, state_in_channels=c_in,
                                state_stride=stride), 3).double()
    layer.train(training)
    generic = copy.deepcopy(layer)
    u = (torch.rand(3, c_in, 8, 6, dtype=torch.float64) * 3).requires_grad_()
    z = (torch.rand(3, c_in // 8, dtype=torch.float64) + 1).requires_grad_()
    size = (8 // stride, 6 // stride)
    seeds = [torch.randn(3, 32, *size, dtype=torch.float64),
             torch.randn(3, 4, dtype=torch.float64)]
    results = []
    for model, fold in ((layer, True), (generic, False)):
        with monkeypatch.context() as m:
            if not fold:
                m.setattr(kcla.KCLAStateAdapter, 'folds', lambda self: False)
            assert model.adapter.folds() == fold
            outs = model._adapted_state(KCLAState(u, z), size)
        params = list(model.adapter.parameters())
        grads = torch.autograd.grad(outs, [u, z] + params, seeds)
        results.append(list(outs) + list(grads) +
                       list(model.adapter.buffers()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_adapter_runs_as_one_op_only_in_no_grad_eval(monkeypatch):
    """kcla_adapter_inference runs the folded adapter (eval BN, no grad,
    impl other than 'torch'); its U', Z' equal the torch path's."""
    calls, real_op = [], kcla.kcla_adapter_inference

    def counted(*args, **kwargs):
        calls.append(True)
        return real_op(*args, **kwargs)

    monkeypatch.setattr(kcla, 'kcla_adapter_inference', counted)
    state = KCLAState(torch.rand(2, 16, 8, 6) * 3, torch.rand(2, 2) + 1)
    results = {}
    for impl in ('fused', 'torch'):
        layer = randomise(KCLALayer(32, head_dim=8, state_in_channels=16,
                                    state_stride=2, impl=impl), 0).eval()
        calls.clear()
        with torch.no_grad():
            results[impl] = layer._adapted_state(state, (4, 3))
        assert len(calls) == (impl == 'fused')
        calls.clear()
        layer._adapted_state(state, (4, 3))  # grad enabled
        with torch.no_grad():
            layer.train()._adapted_state(state, (4, 3))  # batch statistics
        assert not calls
    for a, b in zip(results['fused'], results['torch']):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('relu_input', [False, True])
def test_drop_path_applies_in_no_grad_training_mode_with_frozen_bn(
        relu_input):
    """Training mode with frozen (eval) BNs under no_grad, as norm_eval
    gives: the fused path still drops paths, with the torch path's masks."""
    outs = []
    for impl in ('fused', 'torch'):
        torch.manual_seed(0)
        layer = randomise(KCLALayer(16, head_dim=8, drop_path=0.5,
                                    impl=impl), 0).train()
        layer.norm.eval()
        s, r = torch.randn(8, 16, 4, 4), torch.randn(8, 16, 4, 4)
        assert not layer.folds_tail_norm(s)
        with torch.no_grad():
            torch.manual_seed(1)
            out, _ = layer(s.clone(), None, relu_input=relu_input,
                           shortcut=r if relu_input else None)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    x = F.relu(s + r) if relu_input else s
    dropped = (outs[1] == x).flatten(1).all(1)
    assert 0 < dropped.sum() < 8  # some samples dropped, some kept


def test_tail_norm_folds_only_in_no_grad_eval():
    layer = KCLALayer(16, head_dim=8).eval()
    x = torch.rand(2, 16, 4, 4)
    bn = random_bn(16, 0)
    with torch.no_grad():
        assert layer.folds_tail_norm(x, bn) and layer.folds_tail_norm(x)
        assert not layer.folds_tail_norm(x, bn.train())  # batch statistics
        bn.eval()
        assert not layer.train().folds_tail_norm(x, bn)
        layer.eval()
        assert not layer.folds_tail_norm(x, torch.nn.GroupNorm(2, 16))
    assert not layer.folds_tail_norm(x, bn)  # grad enabled
    # otherwise the layer applies the norm itself: same result as folded
    s, r = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    with torch.no_grad():
        folded, _ = layer(s.clone(), None, relu_input=True, shortcut=r,
                          tail_norm=bn)
    applied, _ = layer(s.clone(), None, relu_input=True, shortcut=r,
                       tail_norm=bn)
    torch.testing.assert_close(folded, applied.detach(), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match='tail_norm is the block'):
        layer(s, None, tail_norm=bn)


def test_fused_and_torch_paths_agree_with_gradients():
    torch.manual_seed(0)
    xs = [torch.randn(2, 16, 8, 6) for _ in range(2)] + \
        [torch.randn(2, 32, 4, 3) for _ in range(4)]
    results = {}
    for impl in ('torch', 'fused'):
        layers = make_chain(impl)
        for layer in layers:
            layer.train()
        inputs = [x.clone().requires_grad_() for x in xs]
        torch.manual_seed(1)  # same drop-path masks
        state = None
        total = 0
        for layer, x in zip(layers, inputs):
            out, state = layer(x, state)
            total = total + (out * torch.cos(out)).sum()
        total.backward()
        results[impl] = [out] + [x.grad for x in inputs] + [
            p.grad for layer in layers for p in layer.parameters()]
    # float32 round-off: the fused heads sum in double, torch in float32
    # (the backbone test compares both paths in float64 to 1e-9)
    for a, b in zip(results['torch'], results['fused']):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_eca_kernel_sizes_match_spec():
    assert [eca_kernel_size(c) for c in (64, 128, 256, 512, 1024, 2048)] == \
        [3, 5, 5, 5, 5, 7]


def test_temperatures_and_norm_d_buffer():
    layer = KCLALayer(256, head_dim=64)
    s = 1 / layer.norm_d
    torch.testing.assert_close(
        s, torch.tensor([0.700, 0.888, 1.126, 1.429]), atol=1e-3, rtol=0)
    assert 'norm_d' not in layer.state_dict()


def test_collinear_keys_single_head_equal_softmax_layer_attention():
    """The approximation claim: KCLA is exact when keys are collinear."""
    torch.manual_seed(0)
    c, t = 16, 6
    layers = [KCLALayer(c, head_dim=c).eval() for _ in range(t)]
    shared_k = torch.randn(1, 1, eca_kernel_size(c))
    for layer in layers:
        layer.k_conv.weight.data.copy_(shared_k)
    base = torch.randn(2, c, 5, 5)
    base = base / layer.k_conv(base.mean((2, 3)).unsqueeze(1)).norm(
        dim=-1, keepdim=True).view(2, 1, 1, 1)  # |K_0| = 1
    xs = []
    for i in range(t):
        noise = torch.randn(2, c, 5, 5)
        noise = noise - noise.mean((2, 3), keepdim=True)  # GAP(noise) = 0
        xs.append((0.5 + 1.5 * i) * base + noise)
    state = None
    with torch.no_grad():
        for layer, x in zip(layers, xs):
            _, state = layer(x, state)
        keys = torch.stack([
            layers[0].k_conv(x.mean((2, 3)).unsqueeze(1)).view(2, 1, c)
            for x in xs
        ], 1)  # (B, T, G=1, d)
    direction = keys[:, 0] / keys[:, 0].norm(dim=-1, keepdim=True)
    cos = F.cosine_similarity(keys, direction.unsqueeze(1), dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))
    assert (keys.norm(dim=-1) * 0.7).max() < 10  # below the clamp
    expected = softmax_layer_attention(direction, keys, torch.stack(xs, 1),
                                       scale=0.7)
    torch.testing.assert_close(
        state.aggregate(eps=EPS), expected, rtol=2e-3, atol=1e-5)
    # and not trivially: the weights are far from uniform
    uniform = torch.stack(xs, 1).mean(1)
    assert (expected - uniform).abs().max() > 0.1


def test_state_memory_constant_in_depth_la_cache_grows():
    sizes = {}
    for depth in (4, 40):
        kcla = [KCLALayer(64, head_dim=16).eval() for _ in range(depth)]
        la = [
            LayerAttention(64, head_dim=16, reset_cache=(i == 0)).eval()
            for i in range(depth)
        ]
        x = torch.randn(1, 64, 8, 8)
        state, cache = None, None
        with torch.no_grad():
            for layer in kcla:
                _, state = layer(x, state)
            for layer in la:
                _, cache = layer(x, cache)
        assert isinstance(state, KCLAState)
        sizes[depth] = (state.u.numel() + state.z.numel(),
                        sum(t.numel() for t in cache.keys + cache.values))
    assert sizes[4][0] == sizes[40][0] == 64 * 8 * 8 + 4
    assert sizes[40][1] == 10 * sizes[4][1]


def test_softmax_layer_attention_matches_loop():
    torch.manual_seed(0)
    b, t, g, d, h, w = 2, 3, 2, 4, 3, 3
    q = torch.randn(b, g, d)
    k = torch.randn(b, t, g, d)
    v = torch.randn(b, t, g * d, h, w)
    out = softmax_layer_attention(q, k, v, scale=0.5)
    for bi in range(b):
        for gi in range(g):
            logits = torch.tensor(
                [0.5 * float(q[bi, gi] @ k[bi, s, gi]) for s in range(t)])
            a = torch.softmax(logits, 0)
            ref = sum(a[s] * v[bi, s, gi * d:(gi + 1) * d] for s in range(t))
            torch.testing.assert_close(out[bi, gi * d:(gi + 1) * d], ref)


def test_zero_input_gives_finite_output_and_grads():
    layer = KCLALayer(32, head_dim=16).train()
    x = torch.zeros(2, 32, 4, 4, requires_grad=True)
    out, state = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters()
               if p.grad is not None)


@pytest.mark.parametrize('impl', ['torch', 'fused'])
@pytest.mark.parametrize('half_input', [False, True],
                         ids=['float32-input', 'autocast-dtype-input'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16],
                         ids=['float16', 'bfloat16'])
def test_autocast_keeps_state_float32_and_finite_at_clamp(
        dtype, half_input, impl, monkeypatch):
    """23 layers (a ResNet-101 stage 3 without its re-anchoring at block 11,
    which would reset Z) whose key norms all hit the clamp (e^10 each: Z
    reaches 23 e^10).

    Inputs in float32 take the fused branch kernels where ``impl`` allows;
    inputs in the autocast dtype (what a block under autocast produces) take
    the torch branch, with the fused or torch state update."""
    log_weights = []  # |K_g| * s_g of every call, before the clamp
    exact = kcla.layer_weights

    def recording(key, norm_d):
        log_weights.append((key.norm(dim=-1) / norm_d).detach())
        return exact(key, norm_d)

    monkeypatch.setattr(kcla, 'layer_weights', recording)
    torch.manual_seed(0)
    layers = [KCLALayer(64, head_dim=16, impl=impl) for _ in range(23)]
    for layer in layers:  # positive taps: large features give large keys
        layer.k_conv.weight.data.uniform_(0.3, 1.0)
    x = 20 + 5 * torch.randn(2, 64, 6, 6)
    x = x.to(dtype if half_input else torch.float32).requires_grad_()
    fused = layers[0]._use_fused_branch(x)
    assert fused == (impl == 'fused' and not half_input)
    state = None
    with torch.autocast('cpu', dtype=dtype):
        out = x
        for layer in layers:
            out, state = layer(out, state)
    if not fused:  # the torch heads (the fused path has them in one op)
        assert len(log_weights) == 23  # one per layer (no adapter here)
        assert all((lw >= kcla.MAX_LOG_WEIGHT).all() for lw in log_weights)
    assert out.dtype == x.dtype
    assert state.u.dtype == torch.float32 and state.z.dtype == torch.float32
    # Z = 23 e^10 ~ 5.1e5, beyond float16's largest value (65504)
    torch.testing.assert_close(
        state.z, torch.full_like(state.z, 23 * math.exp(kcla.MAX_LOG_WEIGHT)))
    assert torch.isfinite(out).all() and torch.isfinite(state.u).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    grads = [p.grad for layer in layers for p in layer.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(channels=96, head_dim=64), ValueError,
     'head_dim=64 must divide the channels \\(96\\)'),
    (dict(channels=64, head_dim=0), ValueError, 'head_dim must be a positive'),
    (dict(channels=64, drop_path=1.5), ValueError,
     'drop_path must be a float in \\[0, 1\\)'),
    (dict(channels=64, impl='gpu'), ValueError, 'impl must be one of'),
    (dict(channels=64, temperature_range=(2.0, 1.0)), ValueError,
     'temperature_range must be'),
])
def test_bad_layer_config_is_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        KCLALayer(**kwargs)


def test_bad_layer_input_is_named():
    layer = KCLALayer(64, head_dim=32)
    with pytest.raises(ValueError, match='must be 4-D'):
        layer(torch.randn(2, 64, 4))
    with pytest.raises(ValueError, match='input has 32 channels, the layer '
                       'was built for channels=64'):
        layer(torch.randn(2, 32, 4, 4))
    with pytest.raises(TypeError, match='must be floating point'):
        layer(torch.ones(2, 64, 4, 4, dtype=torch.long))
    _, state = KCLALayer(32, head_dim=16)(torch.randn(2, 32, 4, 4))
    with pytest.raises(ValueError, match='needs state_in_channels'):
        layer(torch.randn(2, 64, 2, 2), state)
    adapting = KCLALayer(64, head_dim=32, state_in_channels=32)
    with pytest.raises(ValueError, match='adapts an incoming state'):
        adapting(torch.randn(2, 64, 4, 4))
    with pytest.raises(ValueError, match='check the stage stride'):
        adapting(torch.randn(2, 64, 2, 2), state)
