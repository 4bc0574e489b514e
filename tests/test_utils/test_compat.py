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


def test_import_kcla_mm_leaves_mmengines_launcher_alone():
    """A fresh interpreter: ``import kcla_mm`` keeps mmengine's ``pytorch``
    launcher; only an explicit ``enable_cpu_distributed()`` (which
    tools/train.py makes) replaces it, once however often it is called."""
    import subprocess
    import sys
    code = (
        'from mmengine.dist import utils\n'
        'original = utils._init_dist_pytorch\n'
        'import mmdet.models, mmseg.models, kcla_mm\n'
        'print(utils._init_dist_pytorch is original)\n'
        'from kcla_mm.utils import enable_cpu_distributed\n'
        'enable_cpu_distributed()\n'
        'shim = utils._init_dist_pytorch\n'
        'enable_cpu_distributed()\n'
        'print(shim is not original, utils._init_dist_pytorch is shim)\n')
    result = subprocess.run([sys.executable, '-c', code], check=True,
                            capture_output=True, text=True)
    assert result.stdout.splitlines()[-2:] == ['True', 'True True']
