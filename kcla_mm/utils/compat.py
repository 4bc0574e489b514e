"""Compatibility shims, all in one place.

1. torch's allow-list for ``weights_only`` loading takes ``(object,
   'module.name')`` entries from torch 2.6 on, the release that also made
   ``weights_only=True`` the default: :func:`weights_only_allowlist`.
2. mmengine 0.10.7's ``pytorch`` launcher calls ``torch.cuda.set_device``
   unconditionally, so ``torchrun ... --launcher pytorch`` fails on a machine
   without a GPU. On such machines the launcher is made to skip it and to
   use gloo (NCCL needs GPUs); with a GPU nothing changes.
3. torch APIs that KCLA's dispatch reads and that older torch (down to 2.1,
   mmcv 2.1.0's prebuilt wheels) lacks: :func:`is_exporting`,
   :func:`autocast_enabled`, :func:`has_global_module_hooks`.
"""
import contextlib
import warnings
from typing import ContextManager, List

import torch
from torch.nn.modules import module as nn_module

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split('.')[:2])


def weights_only_allowlist(entries: List[object]) -> ContextManager:
    """torch's ``safe_globals`` context for the ``entries`` not allowed yet
    (on leaving it, torch removes what it added, so an entry the caller had
    allowed before stays allowed). Before torch 2.6, a no-op: those loads
    default to ``weights_only=False``, and an explicit ``weights_only=True``
    load refuses the entries' types with torch's error."""
    if TORCH_VERSION < (2, 6):
        return contextlib.nullcontext()
    allowed = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals(
        [entry for entry in entries if entry not in allowed])


def enable_cpu_distributed() -> None:
    """Let mmengine's ``pytorch`` launcher start on machines without a GPU.

    Idempotent; a no-op without mmengine. DDP on CPU also needs
    ``model_wrapper_cfg.device_ids=None`` (``tools/dist_train.sh`` sets it).
    """
    try:
        from mmengine.dist import utils as dist_utils
    except ImportError:
        return
    original = dist_utils._init_dist_pytorch
    if getattr(original, 'kcla_cpu_shim', False):
        return

    def init_dist_pytorch(backend: str = 'nccl',
                          init_backend: str = 'torch',
                          **kwargs) -> None:
        if torch.cuda.is_available() or init_backend != 'torch' \
                or not _only_cpu(dist_utils):
            return original(backend, init_backend, **kwargs)
        if backend == 'nccl':
            warnings.warn('kcla_mm: no GPU on this machine; distributed '
                          'training uses the gloo backend instead of nccl')
            backend = 'gloo'
        torch.distributed.init_process_group(backend=backend, **kwargs)

    init_dist_pytorch.kcla_cpu_shim = True
    dist_utils._init_dist_pytorch = init_dist_pytorch


def _only_cpu(dist_utils) -> bool:
    """No CUDA, MLU, NPU or MUSA device (mmengine's launcher's branches)."""
    return not any(
        getattr(dist_utils, name, lambda: False)()
        for name in ('is_mlu_available', 'is_npu_available',
                     'is_musa_available'))


def is_exporting() -> bool:
    """Whether torch.export is tracing the running code (torch >= 2.7;
    earlier torch has no such query: False)."""
    query = getattr(torch.compiler, 'is_exporting', None)
    return query is not None and query()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False for devices without
    autocast (e.g. 'meta'). torch < 2.4 has per-device queries for the CPU
    and CUDA only."""
    if hasattr(torch.amp, 'is_autocast_available'):
        return torch.amp.is_autocast_available(device_type) and \
            torch.is_autocast_enabled(device_type)
    if device_type == 'cpu':
        return torch.is_autocast_cpu_enabled()
    return device_type == 'cuda' and torch.is_autocast_enabled()


def has_global_module_hooks() -> bool:
    """Whether global forward or backward hooks are registered for every
    ``nn.Module`` (``_has_any_global_hook`` from torch 2.8 on; earlier, the
    dicts it reads)."""
    query = getattr(nn_module, '_has_any_global_hook', None)
    if query is not None:
        return bool(query())
    return bool(nn_module._global_backward_pre_hooks
                or nn_module._global_backward_hooks
                or nn_module._global_forward_pre_hooks
                or nn_module._global_forward_hooks)
