"""Ctrl-C and SIGTERM for the command line: raised at once, and again at the next pass.

Python prints and drops an exception raised while it runs a finalizer (an
object's ``__del__``, such as a dask future releasing its key): a Ctrl-C
that lands there would be lost, and the fit would run to its end.  The
handlers remember the signal, do not raise it inside a ``__del__``, and
keep Python from printing one that a finalizer dropped; the command's
progress callback, called after every pass and step, raises it again
(:func:`raise_pending`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch system's walltime, ``kill``): unwinds like Ctrl-C, cleaning up."""


_pending: type[KeyboardInterrupt] | None = None


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside an object's ``__del__``."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_signal(signum, frame):
    global _pending
    _pending = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    if _in_finalizer(frame):
        # Raised there it would be printed and dropped, and it would cut short what
        # the finalizer does (a dask future releasing its key, which then left the
        # scheduler asserting on the cancellation): raised at the next pass instead.
        return
    raise _pending()


def _quiet_interrupts(previous):
    """A ``sys.unraisablehook`` that drops the remembered Ctrl-C or SIGTERM (raised again
    at the next pass) and hands everything else to ``previous``."""

    def hook(unraisable):
        if _pending is not None and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def handled():
    """Within the block (in the main thread): SIGINT and SIGTERM raise, and are remembered."""
    global _pending
    _pending = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_interrupts(hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_pending() -> None:
    """Raise again a Ctrl-C or SIGTERM received in the block of :func:`handled`."""
    if _pending is not None:
        raise _pending()
