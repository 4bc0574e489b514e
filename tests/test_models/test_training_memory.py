"""What a ResNetKCLA training step keeps for backward, and that the parts
recomputed in backward (cross-stage adapters not folded into one matmul)
update BN once."""
import pytest
import torch
from mmdet.models.backbones import ResNet

from kcla_mm.models import ResNetKCLA
from kcla_mm.models.layers.kcla import KCLAStateAdapter


def saved_bytes(model, x):
    """Bytes of the distinct non-parameter storages autograd saves in one
    training forward (as tools/analysis/benchmark_kcla.py counts them)."""
    params = {t.untyped_storage().data_ptr()
              for t in list(model.parameters()) + list(model.buffers())}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


def test_kcla_activation_memory_is_within_the_target():
    """The memory target: the maps ResNet-50-KCLA saves for backward are at
    most 1.30x the plain ResNet-50's (a count of bytes, on a smaller input
    than the benchmark's)."""
    torch.manual_seed(0)
    x = torch.rand(2, 3, 128, 128)
    plain = ResNet(50, norm_eval=False)
    kcla = ResNetKCLA(50, norm_eval=False)
    plain.train()  # mmdet's train() returns None
    kcla.train()
    ratio = saved_bytes(kcla, x) / saved_bytes(plain, x)
    assert 1.0 < ratio <= 1.30, ratio


@pytest.mark.parametrize('fold_adapters', [True, False])
def test_recomputed_adapters_update_running_stats_once(fold_adapters,
                                                       monkeypatch):
    """A training forward + backward leaves the same BN running statistics
    as a training forward without autograd (where nothing is recomputed),
    for every BN of the backbone, adapters included: folded into one matmul
    or (forced) the generic way, recomputed in backward."""
    if not fold_adapters:
        monkeypatch.setattr(KCLAStateAdapter, 'folds', lambda self: False)
    torch.manual_seed(0)
    model = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False,
                       kcla_drop_path=0.0).train()
    other = ResNetKCLA(50, base_channels=16, head_dim=16, norm_eval=False,
                       kcla_drop_path=0.0).train()
    other.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 64, 64)
    sum(o.mean() for o in model(x)).backward()
    with torch.no_grad():
        other(x)
    adapters = [n for n, _ in model.named_modules() if n.endswith('adapter')]
    assert len(adapters) == 3
    buffers = dict(other.named_buffers())
    for name, buf in model.named_buffers():
        if 'num_batches_tracked' in name:
            assert buf.item() == 1, name
        else:
            torch.testing.assert_close(buf, buffers[name], rtol=1e-5,
                                       atol=1e-6, msg=name)
