"""Compatibility shims, all in one place.

torch >= 2.6 loads checkpoints with ``weights_only=True`` by default, but a
checkpoint written by mmengine 0.10.7's runner holds the message hub's
:class:`~mmengine.logging.HistoryBuffer` objects and numpy arrays/scalars,
so ``runner.resume()`` fails with an ``UnpicklingError``. The fix declares
exactly those types as safe globals; nothing else is unpickled.
"""
from typing import List

import numpy as np
import torch


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
