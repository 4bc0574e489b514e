"""Compatibility shims, all in one place.

1. torch >= 2.6 loads checkpoints with ``weights_only=True`` by default, but
   a checkpoint written by mmengine 0.10.7's runner holds the message hub's
   :class:`~mmengine.logging.HistoryBuffer` objects and numpy arrays/scalars,
   so ``runner.resume()`` fails with an ``UnpicklingError``. The fix declares
   exactly those types as safe globals; nothing else is unpickled.
2. mmengine 0.10.7's ``pytorch`` launcher calls ``torch.cuda.set_device``
   unconditionally, so ``torchrun ... --launcher pytorch`` fails on a machine
   without a GPU. On such machines the launcher is made to skip it and to
   use gloo (NCCL needs GPUs); with a GPU nothing changes.
3. torch APIs that KCLA's dispatch reads and that older torch (down to 2.1,
   mmcv 2.1.0's prebuilt wheels) lacks: :func:`is_exporting`,
   :func:`autocast_enabled`, :func:`has_global_module_hooks`.
"""
import warnings
from typing import List

import numpy as np
import torch
from torch.nn.modules import module as nn_module


def _numpy_safe_globals() -> List[object]:
    """numpy callables and classes an mmengine checkpoint pickles."""
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtype_classes = {
        type(np.dtype(t))
        for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                  np.float16, np.float32, np.float64)
    }
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtype_classes]


def register_checkpoint_safe_globals() -> None:
    """Allow ``torch.load(weights_only=True)`` to read mmengine checkpoints.

    Idempotent; a no-op on torch < 2.4 (no ``add_safe_globals``) or without
    mmengine.
    """
    add_safe_globals = getattr(torch.serialization, 'add_safe_globals', None)
    if add_safe_globals is None:
        return
    safe = _numpy_safe_globals()
    try:
        from mmengine.logging import HistoryBuffer
    except ImportError:
        pass
    else:
        # HistoryBuffer pickles its statistics methods as
        # getattr(buffer, 'mean'); the unpickler still refuses to *call*
        # anything outside the allow-list, so getattr only reads attributes.
        safe += [HistoryBuffer, getattr]
    add_safe_globals(safe)


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
