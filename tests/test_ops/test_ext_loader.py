"""The extension loader's error path and the pure-PyTorch fallback."""
import warnings

import pytest
import torch

from kcla_mm.ops import ext_loader, kcla_state_update


@pytest.fixture
def missing_extension(monkeypatch):
    """Make kcla_mm believe its extension is not built."""
    monkeypatch.setattr(ext_loader, 'EXT_NAME', 'kcla_mm._ext_not_built')
    ext_loader.get_ext.cache_clear()
    yield
    ext_loader.get_ext.cache_clear()


def test_load_ext_missing_module_says_how_to_build():
    with pytest.raises(ImportError, match='kcla_mm._ext_not_built could not '
                       'be imported.*pip install --no-build-isolation -e'):
        ext_loader.load_ext('kcla_mm._ext_not_built')


def test_load_ext_missing_function_is_reported():
    with pytest.raises(ImportError, match=r"lacks \['no_such_op'\]"):
        ext_loader.load_ext('kcla_mm._ext', funcs=('no_such_op', ))


def test_fallback_warns_once_and_still_computes(missing_extension):
    x = torch.randn(2, 4, 3, 3)
    w = torch.rand(2, 2) + 1
    z = w + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        outs = [kcla_state_update(x, w, z) for _ in range(3)]
    messages = [str(c.message) for c in caught
                if issubclass(c.category, RuntimeWarning)]
    assert len(messages) == 1
    assert 'Falling back to the pure-PyTorch KCLA ops' in messages[0]
    expected = x * w.repeat_interleave(2, 1).view(2, 4, 1, 1)
    for u_next, agg in outs:
        assert u_next.grad_fn is None or 'KCLAState' not in \
            u_next.grad_fn.name()
        torch.testing.assert_close(u_next, expected)
        torch.testing.assert_close(
            agg, expected / (z.repeat_interleave(2, 1).view(2, 4, 1, 1) +
                             1e-3))
    assert ext_loader.ext_device_types() == ()
    with pytest.raises(RuntimeError, match="no implementation for device "
                       "'cpu'"):
        kcla_state_update(x, w, z, impl='fused')
