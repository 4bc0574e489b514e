"""kcla_mm.utils.compat's torch queries, on this torch and with the APIs
that torch before 2.8 lacks taken away (the fallbacks torch 2.1 runs)."""
import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from kcla_mm.utils.compat import (autocast_enabled, has_global_module_hooks,
                                  is_exporting)


@pytest.fixture(params=['this torch', 'without the new APIs'])
def old_torch(request, monkeypatch):
    if request.param == 'without the new APIs':  # raising=False: old torch
        for owner, name in ((torch.compiler, 'is_exporting'),
                            (torch.amp, 'is_autocast_available'),
                            (nn_module, '_has_any_global_hook')):
            monkeypatch.delattr(owner, name, raising=False)
    return request.param


def test_global_module_hooks(old_torch):
    assert not has_global_module_hooks()
    for register in (nn_module.register_module_forward_hook,
                     nn_module.register_module_forward_pre_hook,
                     nn_module.register_module_full_backward_hook):
        handle = register(lambda *args: None)
        try:
            assert has_global_module_hooks()
        finally:
            handle.remove()
        assert not has_global_module_hooks()


def test_autocast_enabled(old_torch):
    assert not autocast_enabled('cpu')
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert autocast_enabled('cpu')
        assert not autocast_enabled('cuda')
        assert not autocast_enabled('meta')
    assert not autocast_enabled('cpu')


def test_is_exporting_outside_export(old_torch):
    assert is_exporting() is False


@pytest.mark.skipif(not hasattr(torch.compiler, 'is_exporting'),
                    reason='torch < 2.7 has no export query')
def test_is_exporting_inside_export():
    seen = []

    class Probe(nn.Module):

        def forward(self, x):
            seen.append(is_exporting())
            return x + 1

    torch.export.export(Probe(), (torch.ones(2), ))
    assert seen and all(seen)
