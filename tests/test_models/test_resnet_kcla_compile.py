"""ResNetKCLA under torch.compile computes what it computes eagerly.

mmengine's runner compiles the model when a config sets ``compile=True``.
Dynamo cannot trace the extension's calls and breaks the graph around
them; inductor compiles the rest (the blocks, the torch glue), and after a
few recompilations it makes the stages' spatial sizes dynamic, where
torch 2.13's inductor failed on the blocks' backward while they took their
shortcut before their residual branch (resnet_blocks.block_shortcut).
"""
import pytest
import torch
import torch._inductor.config as inductor_config

from kcla_mm.models import ResNetKCLA

from .test_resnet_kcla_impls import train_step


@pytest.mark.slow
def test_compiled_resnet50_kcla_matches_eager(tmp_path, monkeypatch):
    # compiled from scratch, not from another run's cache
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, compiled = (ResNetKCLA(50, base_channels=16, head_dim=16,
                                  norm_eval=False).double()
                       for _ in range(2))
    compiled.load_state_dict(eager.state_dict())
    forward = torch.compile(compiled)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    # inductor draws its own random numbers unless told to use eager's
    with inductor_config.patch(fallback_random=True):
        ours = train_step(compiled, x, forward)
        with torch.no_grad():
            ours_eval = forward.eval()(x)
    ref = train_step(eager, x)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    with torch.no_grad():  # the one-call inference ops
        for a, b in zip(ours_eval, eager.eval()(x)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    torch._dynamo.reset()
