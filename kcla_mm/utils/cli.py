"""Running kcla_mm's command-line tools."""
import contextlib
import signal
import threading
from typing import Iterator


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does,
    so the clean-up of a half-done write runs before the tool exits; after
    it the previous handler is back. Outside the main thread (where Python
    runs signal handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
