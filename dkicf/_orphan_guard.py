"""Preloaded by the scheduler and nanny processes of a local cluster (see :mod:`dkicf._local`).

Those processes run in a session of their own, so that Ctrl-C reaches only
the driver, which closes them.  A driver that dies without closing them
(SIGKILL, a crash) would leave them running for ever: this preload checks
every second whether the process that started this one is still its parent,
and if not, ends this process and its children (a nanny's worker).

It also keeps the tracebacks of handlers cancelled as the server closes out
of the terminal: when the driver closes the cluster after Ctrl-C, a graph
update still in flight is cancelled, and distributed logs that
``CancelledError`` with its traceback as an error, under the driver's
one-line "interrupted".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

_CHECK_MS = 1000


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def descendants(pid: int) -> list:
    """The descendants of process ``pid`` (``psutil.Process`` objects; none if it is gone)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_all(processes: list) -> None:
    """Kill ``processes`` (from :func:`descendants`; what is gone already is skipped)."""
    import psutil

    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def kill_children(pid: int) -> None:
    """Kill every descendant of process ``pid`` (what is gone already is skipped)."""
    kill_all(descendants(pid))


def _not_cancelled(record: logging.LogRecord) -> bool:
    """False for a record of a cancelled task (``asyncio.CancelledError``)."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, asyncio.CancelledError)


def dask_setup(server) -> None:
    """Start the check on ``server``'s event loop (scheduler or nanny), and drop the
    logs of cancelled handlers."""
    from tornado.ioloop import PeriodicCallback

    # distributed logs a handler's exception under the handler's module (its
    # log_errors): the filter goes on the handlers that print them.
    for handler in logging.getLogger("distributed").handlers + logging.getLogger().handlers:
        if _not_cancelled not in handler.filters:
            handler.addFilter(_not_cancelled)

    parent = os.getppid()

    def check() -> None:
        if _orphaned(parent):
            kill_children(os.getpid())
            os._exit(0)

    server.periodic_callbacks["dkicf-orphan-guard"] = PeriodicCallback(check, _CHECK_MS)
