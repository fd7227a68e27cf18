"""Ctrl-C and SIGTERM in the command line's handlers: raised at once, kept for the next pass
when they land in a finalizer, and never printed by Python as an ignored exception."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from dkicf import _cli_signals


def _wait_for_handler():
    # Python runs a signal's handler between bytecodes of the main thread.
    for _ in range(1000):
        time.sleep(0.001)


def test_a_signal_outside_a_finalizer_raises_at_once():
    with _cli_signals.handled():
        with pytest.raises(_cli_signals.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_handler()
        with pytest.raises(_cli_signals.Terminated):  # and again at the next pass
            _cli_signals.raise_pending()


def test_a_signal_inside_a_finalizer_waits_for_the_next_pass(monkeypatch):
    """Raised inside ``__del__`` (a dask future releasing its key) it would be printed and
    dropped, and would cut the release short: it is raised by the next pass instead."""
    seen, finished = [], []

    class Releasing:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_handler()
            finished.append(True)  # the finalizer ran to its end

    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with _cli_signals.handled():
        obj = Releasing()
        del obj
        assert finished == [True] and seen == []
        with pytest.raises(KeyboardInterrupt):
            _cli_signals.raise_pending()


def test_interrupts_a_finalizer_dropped_are_not_printed_and_the_hook_is_put_back(monkeypatch):
    seen = []

    class Dropping:
        def __init__(self, exc):
            self.exc = exc

        def __del__(self):
            raise self.exc

    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    before = sys.unraisablehook
    with _cli_signals.handled():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_handler()
        obj = Dropping(KeyboardInterrupt())  # e.g. raised in a weakref callback's frame
        del obj
        assert seen == []
        obj = Dropping(ValueError("a finalizer's own error"))
        del obj
        assert [type(u.exc_value) for u in seen] == [ValueError]  # still reported
    assert sys.unraisablehook is before
