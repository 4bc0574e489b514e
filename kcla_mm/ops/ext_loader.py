"""Loading of ``kcla_mm._ext``, the compiled KCLA kernels.

The extension is optional: without it every op runs its pure-PyTorch
reference, and :func:`get_ext` warns once (not once per call).
"""
import importlib
import warnings
from functools import lru_cache
from types import ModuleType
from typing import Iterable, Optional, Tuple

import torch
from torch.autograd import forward_ad

from kcla_mm.utils.compat import is_exporting

from .fused_backward import BATCHED_GRAD_ERROR, SECOND_ORDER_ERROR

EXT_NAME = 'kcla_mm._ext'
EXT_FUNCS = ('device_types', 'kcla_state_forward', 'kcla_state_backward',
             'kcla_relu_pool_forward', 'kcla_relu_pool_backward',
             'kcla_branch_stats', 'kcla_branch_forward', 'kcla_branch_apply',
             'kcla_branch_bn_sums', 'kcla_branch_backward',
             'kcla_layer_inference', 'kcla_heads_forward',
             'kcla_heads_backward', 'set_fused_backward_errors',
             'kcla_relu_pool_autograd', 'kcla_branch_autograd',
             'kcla_heads_autograd', 'kcla_state_autograd')


def load_ext(name: str = EXT_NAME,
             funcs: Iterable[str] = EXT_FUNCS) -> ModuleType:
    """Import the extension ``name`` and check it exports ``funcs``.

    Raises:
        ImportError: the module is missing or lacks one of ``funcs``; the
            message says how to build it.
    """
    try:
        ext = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f'{name} could not be imported ({e}). Build it with '
            '`pip install --no-build-isolation -e .` from the kcla_mm '
            'repository (with KCLA_WITH_OPS unset or 1), or run '
            '`bash tools/setup_env.sh`.') from e
    missing = [f for f in funcs if not hasattr(ext, f)]
    if missing:
        raise ImportError(f'{name} lacks {missing}: it is older than this '
                          'kcla_mm; rebuild it with `pip install '
                          '--no-build-isolation -e .`')
    return ext


@lru_cache(maxsize=None)
def get_ext() -> Optional[ModuleType]:
    """The loaded extension, or None (with one warning) if unavailable."""
    try:
        ext = load_ext(EXT_NAME)
    except ImportError as e:
        warnings.warn(f'{e} Falling back to the pure-PyTorch KCLA ops.',
                      RuntimeWarning, stacklevel=2)
        return None
    ext.set_fused_backward_errors(SECOND_ORDER_ERROR, BATCHED_GRAD_ERROR)
    return ext


def ext_device_types(group: str = 'state') -> Tuple[str, ...]:
    """Device types (``'cpu'``, ``'cuda'``) implementing an op group.

    Args:
        group (str): ``'state'`` (the state update), ``'branch'`` (the
            fused branch kernels) or ``'layer'`` (the whole layer in
            inference, the heads). Defaults to ``'state'``.
    """
    ext = get_ext()
    return _device_types(ext, group) if ext is not None else ()


@lru_cache(maxsize=None)
def _device_types(ext: ModuleType, group: str) -> Tuple[str, ...]:
    """``ext.device_types(group)``, asked once per loaded extension (the
    fused ops ask it on every call)."""
    return tuple(ext.device_types(group))


def torch_ops_only() -> bool:
    """Whether KCLA must run its PyTorch ops whatever ``impl`` says.

    True while torch.jit traces or torch.export exports the running code
    (FLOP counts and exported graphs then see the reference PyTorch ops;
    export's fake tensors have no data for the extension), inside a
    torch.func transform
    (vmap, grad, jacrev, ...: the extension's autograd Functions have no
    functorch rules) and while a forward-mode AD dual level is open (the
    kernels carry no tangents, also under no_grad).
    """
    return (torch.jit.is_tracing() or is_exporting()
            or torch._C._are_functorch_transforms_active()
            or forward_ad._current_level >= 0)


def has_device_impl(device_type: str, group: str = 'state') -> bool:
    """Whether the op group can run on tensors of ``device_type``."""
    return device_type in ext_device_types(group)
