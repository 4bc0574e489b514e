"""What ``torch.load(weights_only=True)`` may read of an mmengine checkpoint.

torch >= 2.6 unpickles with ``weights_only=True`` by default: a pickle may
only name, call and build allow-listed globals. A checkpoint written by
mmengine 0.10.7's runner also holds the message hub's ``HistoryBuffer``
objects and numpy arrays, scalars and dtypes, which torch refuses, so
``runner.resume()`` fails. :func:`allow_mmengine_checkpoints` allows exactly
what such a checkpoint needs, only inside its ``with`` block:

- numpy's ``_reconstruct``, ``scalar``, ``ndarray``, ``dtype`` and the
  numeric dtype classes (they build arrays and scalars from bytes);
- ``HistoryBuffer``, as a stand-in that checks the pickled state before it
  becomes a HistoryBuffer: mmengine's ``__setstate__`` merges the pickled
  statistics functions into a dict that every HistoryBuffer of the process
  shares, so an unchecked file could replace ``mean`` for all of them;
- ``builtins.getattr``, as :func:`history_buffer_statistic`: pickle
  protocol 2 writes ``HistoryBuffer.mean`` as ``getattr(HistoryBuffer,
  'mean')``. The real ``getattr`` would let a pickle walk from any allowed
  object to any module (``getattr(getattr, '__self__')`` is ``builtins``)
  and rewrite its globals with SETITEM, e.g. switch off ``weights_only``
  for the rest of the process.

Nothing is allowed outside the block, and ``import kcla_mm`` allows nothing.
torch's allow-list is process-wide, so while a block runs the entries hold
for other threads' loads too; each entry reads no further than above.
"""
import pickle
from contextlib import contextmanager
from typing import Iterator, List

import numpy as np
from mmengine.logging import HistoryBuffer

from .compat import weights_only_allowlist

# HistoryBuffer's own statistics (its _set_default_statistics); a function a
# user registers with HistoryBuffer.register_statistics is pickled by name
# and refused as any other global
HISTORY_BUFFER_STATISTICS = ('min', 'max', 'current', 'mean')
_HISTORY_BUFFER_STATE = {
    'max_length': int,
    '_log_history': np.ndarray,
    '_count_history': np.ndarray,
    'statistics_methods': dict,
}


class CheckedHistoryBuffer(HistoryBuffer):
    """What the unpickler builds for a pickled ``HistoryBuffer``.

    Its ``__setstate__`` accepts only the state mmengine pickles (the
    attribute names and types of :data:`_HISTORY_BUFFER_STATE`, numeric
    histories, statistics among :data:`HISTORY_BUFFER_STATISTICS` mapped to
    HistoryBuffer's own functions), then turns the object into a plain
    ``HistoryBuffer`` (same layout: the subclass adds nothing), so what a
    checkpoint loads and saves again is mmengine's class.
    """

    def __setstate__(self, state: dict) -> None:
        check_history_buffer_state(state)
        self.__class__ = HistoryBuffer
        HistoryBuffer.__setstate__(self, state)


def check_history_buffer_state(state: object) -> None:
    """Raise ``pickle.UnpicklingError`` unless ``state`` is what mmengine
    0.10.7's ``HistoryBuffer.__getstate__`` returns."""
    if not isinstance(state, dict):
        _refuse(f'a HistoryBuffer state must be a dict, got '
                f'{type(state).__name__}')
    for name, value in state.items():
        expected = _HISTORY_BUFFER_STATE.get(name)
        if expected is None:
            _refuse(f'unknown HistoryBuffer attribute {name!r} (allowed: '
                    f'{", ".join(_HISTORY_BUFFER_STATE)})')
        if type(value) is not expected:
            _refuse(f'HistoryBuffer attribute {name!r} must be '
                    f'{expected.__name__}, got {type(value).__name__}')
        if expected is np.ndarray and value.dtype.kind not in 'biuf':
            _refuse(f'HistoryBuffer attribute {name!r} must hold numbers, '
                    f'got dtype {value.dtype}')
    for name, method in state.get('statistics_methods', {}).items():
        if name not in HISTORY_BUFFER_STATISTICS or \
                method is not getattr(HistoryBuffer, name):
            _refuse(f'HistoryBuffer statistic {name!r} must be '
                    f'HistoryBuffer\'s own (one of '
                    f'{", ".join(HISTORY_BUFFER_STATISTICS)})')


def history_buffer_statistic(owner: object, name: object) -> object:
    """``getattr`` as an mmengine checkpoint uses it, and no further.

    Returns ``HistoryBuffer.<name>`` for the statistics of
    :data:`HISTORY_BUFFER_STATISTICS`; raises ``pickle.UnpicklingError``
    for any other object or name.
    """
    if owner is not CheckedHistoryBuffer or \
            name not in HISTORY_BUFFER_STATISTICS:
        _refuse(f'getattr(<{type(owner).__name__}>, {name!r}): a checkpoint '
                f'may only read HistoryBuffer\'s statistics '
                f'({", ".join(HISTORY_BUFFER_STATISTICS)})')
    return getattr(HistoryBuffer, name)


def mmengine_checkpoint_globals() -> List[object]:
    """The allow-list entries of :func:`allow_mmengine_checkpoints`: objects
    and ``(object, 'module.name')`` pairs, as torch's ``safe_globals``
    takes them."""
    try:  # numpy >= 2
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtype_classes = {
        type(np.dtype(t))
        for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                  np.float16, np.float32, np.float64)
    }
    history_buffer = f'{HistoryBuffer.__module__}.{HistoryBuffer.__name__}'
    return [
        _reconstruct, scalar, np.ndarray, np.dtype, *dtype_classes,
        (CheckedHistoryBuffer, history_buffer),
        (history_buffer_statistic, 'builtins.getattr'),
    ]


@contextmanager
def allow_mmengine_checkpoints() -> Iterator[None]:
    """Let ``torch.load(weights_only=True)`` read mmengine runner
    checkpoints inside the block (see the module docstring for exactly
    what); outside it torch's allow-list is as it was.

    Example:
        >>> with allow_mmengine_checkpoints():
        ...     checkpoint = torch.load('work_dirs/x/iter_100.pth')
    """
    with weights_only_allowlist(mmengine_checkpoint_globals()):
        yield


def _refuse(message: str) -> None:
    raise pickle.UnpicklingError(f'kcla_mm refused the checkpoint: {message}')
