"""Training memory: a KCLA layer's state recovered by inverting the sum."""
import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers import KCLALayer
from kcla_mm.ops import kcla_branch as branch_ops
from kcla_mm.ops.kcla_branch import StateTape, kcla_branch


def chain(n, channels=16, invert=True, key_std=None, dtype=torch.float64,
          drop_path=0.0):
    torch.manual_seed(0)
    layers = [
        KCLALayer(channels, head_dim=8, drop_path=drop_path) for _ in range(n)
    ]
    for i, layer in enumerate(layers):
        layer.init_weights()
        layer.invert_state = invert and i + 1 < n
        if key_std is not None:
            torch.nn.init.normal_(layer.k_conv.weight, std=key_std)
    return [layer.to(dtype).train() for layer in layers]


def run(layers, xs, seed=1, backwards=1):
    """Forward (releasing the invertible states, as ResNetKCLA does) +
    ``backwards`` backward passes (each with other output gradients; all
    but the last retain the graph); returns outputs, input grads, parameter
    grads and the bytes of the distinct storages autograd saved or the
    state tapes keep."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    inputs = [x.clone().requires_grad_() for x in xs]
    torch.manual_seed(seed)
    state, outs, tapes = None, [], []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer, x in zip(layers, inputs):
            out, state = layer(x, state)
            outs.append(out)
            if state.tape is not None:
                tapes.append(state.tape)
    branch_ops.release_invertible(tapes)
    for tape in tapes:
        if tape.kept is not None:
            pack(tape.kept)
    gen = torch.Generator().manual_seed(2)
    for k in range(backwards):
        sum((o * torch.randn(o.shape, generator=gen,
                             dtype=torch.float64).to(o.dtype)).sum()
            for o in outs).backward(retain_graph=k + 1 < backwards)
    grads = [x.grad for x in inputs] + [
        p.grad for layer in layers for p in layer.parameters()]
    return [o.detach() for o in outs] + grads, sum(storages.values())


def inputs(n, dtype=torch.float64, shape=(2, 16, 9, 7)):
    torch.manual_seed(3)
    return [torch.rand(shape, dtype=dtype) * 2 for _ in range(n)]


def torch_and_fused(xs, bn_train=True, backwards=1, **chain_kwargs):
    """:func:`run`'s outputs and grads of a chain on the PyTorch path and of
    the same chain fused, inverting its states."""
    results = []
    for impl, invert in (('torch', False), ('fused', True)):
        layers = chain(len(xs), invert=invert, **chain_kwargs)
        for layer in layers:
            layer.impl = impl
            layer.norm.train(bn_train)
        results.append(run(layers, xs, backwards=backwards)[0])
    return results


@pytest.mark.parametrize('bn_train', [True, False])
def test_inverted_chain_matches_torch_path_float64(bn_train):
    results = torch_and_fused(inputs(6), bn_train, drop_path=0.2)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_inversion_drops_one_state_map_per_interior_layer():
    n = 6
    xs = inputs(n, torch.float32)
    # zero keys: every layer weighs 1, Z grows 1..6 (< the growth limit)
    saved = {}
    for invert in (False, True):
        layers = chain(n, invert=invert, key_std=0.0, dtype=torch.float32)
        saved[invert] = run(layers, xs)[1]
    one_map = xs[0].numel() * 4
    assert saved[False] - saved[True] == (n - 1) * one_map


def float32_error(invert, key_std=1.5, n=6):
    """Max relative error of float32 outputs/grads against float64, and the
    saved bytes."""
    xs = inputs(n, torch.float32)
    ref, _ = run(chain(n, invert=False, key_std=key_std),
                 [x.double() for x in xs])
    got, saved = run(
        chain(n, invert=invert, key_std=key_std, dtype=torch.float32), xs)
    error = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(got, ref))
    return error, saved


def test_fast_growing_weights_keep_float32_accuracy(monkeypatch):
    """Keys with std 1.5 make Z grow fast: inverting every step loses
    float32 accuracy (cancellation), so the layers where Z grew more than
    MAX_INVERSION_GROWTH save their incoming state instead."""
    plain_error, plain_saved = float32_error(invert=False)
    error, saved = float32_error(invert=True)
    monkeypatch.setattr(branch_ops, 'MAX_INVERSION_GROWTH', float('inf'))
    unlimited_error, unlimited_saved = float32_error(invert=True)
    assert plain_error < 1e-4 and error < 2 * plain_error, (plain_error,
                                                            error)
    assert unlimited_error > 5 * error, (unlimited_error, error)
    assert unlimited_saved < saved < plain_saved


def test_second_backward_with_retain_graph(monkeypatch):
    """A second backward reads the states the first one left: a state that
    a layer kept (Z grew past MAX_INVERSION_GROWTH) and handed back to its
    predecessor, which inverts its own state in place, must stay intact
    (it was inverted in place: the second backward's gradients were wrong,
    ResNet-50-KCLA's by up to 3.3e3 times their largest value)."""
    kept = []
    release = branch_ops.release_invertible

    def spy(tapes):
        release(tapes)
        kept.extend(tape.kept is not None for tape in tapes)

    monkeypatch.setattr(branch_ops, 'release_invertible', spy)
    results = torch_and_fused(inputs(6), backwards=2, key_std=1.5)
    # the interior layers' states: some kept, some inverted
    assert True in kept and False in kept, kept
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('backwards', [1, 2])
def test_successor_off_the_fused_path_keeps_the_state(backwards):
    """A layer on PyTorch ops (impl='torch' here; hooks on its submodules
    send it there too) keeps the state its predecessor did not save; the
    layers around it invert theirs (it raised before)."""
    xs = inputs(5)
    reference = chain(5, invert=False)
    mixed = chain(5)
    for layer in reference:
        layer.impl = 'torch'
    mixed[2].impl = 'torch'
    assert all(layer.invert_state for layer in mixed[:4])
    for a, b in zip(run(mixed, xs, backwards=backwards)[0],
                    run(reference, xs, backwards=backwards)[0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('norm_eval', [True, False])
def test_backbone_inverts_interior_layers_only(norm_eval):
    model = ResNetKCLA(101, base_channels=8, head_dim=8, norm_eval=norm_eval)
    stage3 = [layer.invert_state for layer in model.layer3_attn]
    # block 11 re-initialises the state: block 10 must keep its own
    assert stage3[10] is False and stage3[22] is False
    assert all(stage3[:10]) and all(stage3[11:22])
    assert not any(layer.invert_state for layer in ResNetKCLA(
        18, with_cp=True).layer1_attn)
    torch.manual_seed(0)
    fused = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=norm_eval)
    plain = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=norm_eval,
                       kcla_impl='torch')
    plain.load_state_dict(fused.state_dict())
    results = []
    for model in (fused, plain):
        model.double().train()
        torch.manual_seed(1)
        outs = model(torch.rand(2, 3, 64, 64, dtype=torch.float64))
        sum((o * o).mean() for o in outs).backward()
        results.append([p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('factor', [15.9, 16.1])
def test_growth_check_runs_on_the_device(factor):
    """The branch keeps its incoming state on the tape with a device flag:
    whether Z grew more than 16x over the tape's floor for any head of any
    sample; the next floor is Z where it did, else the old floor."""
    torch.manual_seed(0)
    x = torch.rand(2, 8, 5, 4, requires_grad=True)
    u = torch.rand(2, 8, 5, 4)
    floor = torch.rand(2, 2) + 0.5
    z = floor.clone()
    z[1, 0] *= factor
    tape_in, tape_out = StateTape(), StateTape()
    tape_in.z_floor = floor
    kcla_branch(x, u, torch.rand(2, 2) + 0.1, z, torch.rand(2, 2),
                torch.randn(8, 1, 3, 3), nn.BatchNorm2d(8), torch.ones(2),
                tape_in=tape_in, tape_out=tape_out)
    grew = factor > 16
    assert tape_in.keep_flag.dtype == torch.bool
    assert bool(tape_in.keep_flag) == grew
    assert torch.equal(tape_out.z_floor, z if grew else floor)
    assert torch.equal(tape_in.kept, u)


def test_release_drops_only_the_states_backward_can_invert():
    tapes = [StateTape() for _ in range(4)]
    for tape, grew in zip(tapes, (False, True, False)):
        tape.keep(torch.ones(3), torch.tensor(grew))
    tapes[3].keep(torch.ones(3))  # kept for good: no flag to read
    branch_ops.release_invertible(tapes)
    assert [t.kept is not None for t in tapes] == [False, True, False, True]
    assert all(t.keep_flag is None for t in tapes)


def test_dropping_the_outputs_frees_the_kept_states():
    """A forward whose outputs are dropped without backward (an exception,
    a skipped step) frees the states its tapes keep: no reference cycle
    between the tapes and the graph holds them."""
    layers = chain(3, dtype=torch.float32)
    state, outs, kept = None, [], []
    for layer, x in zip(layers, inputs(3, torch.float32)):
        out, new_state = layer(x.requires_grad_(), state)
        if state is not None:
            kept.append(StorageWeakRef(state.tape.kept.untyped_storage()))
        state = new_state
        outs.append(out)
    assert len(kept) == 2 and not any(ref.expired() for ref in kept)
    del outs, state, new_state, out
    assert all(ref.expired() for ref in kept)
