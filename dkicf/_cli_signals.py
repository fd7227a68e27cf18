"""Ctrl-C and SIGTERM for the command line: raised at once, and again at the next pass.

Python prints and drops an exception raised while it runs a finalizer (an
object's ``__del__``, such as a dask future releasing its key): a Ctrl-C
that lands there is lost, and the fit would run to its end.  The handlers
remember the signal; the command's progress callback, called after every
pass and step, raises it again (:func:`raise_pending`).
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch system's walltime, ``kill``): unwinds like Ctrl-C, cleaning up."""


_pending: type[KeyboardInterrupt] | None = None


def _on_signal(signum, frame):
    global _pending
    _pending = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    raise _pending()


@contextlib.contextmanager
def handled():
    """Within the block (in the main thread): SIGINT and SIGTERM raise, and are remembered."""
    global _pending
    _pending = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_pending() -> None:
    """Raise again a Ctrl-C or SIGTERM received in the block of :func:`handled`."""
    if _pending is not None:
        raise _pending()
