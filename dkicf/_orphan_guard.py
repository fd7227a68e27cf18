"""Preloaded by the scheduler and nanny processes of a local cluster (see :mod:`dkicf._local`).

Those processes run in a session of their own, so that Ctrl-C reaches only
the driver, which closes them.  A driver that dies without closing them
(SIGKILL, a crash) would leave them running for ever: this preload checks
every second whether the process that started this one is still its parent,
and if not, ends this process and its children (a nanny's worker).
"""

from __future__ import annotations

import contextlib
import os

_CHECK_MS = 1000


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def kill_children(pid: int) -> None:
    """Kill every descendant of process ``pid`` (what is gone already is skipped)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def dask_setup(server) -> None:
    """Start the check on ``server``'s event loop (scheduler or nanny)."""
    from tornado.ioloop import PeriodicCallback

    parent = os.getppid()

    def check() -> None:
        if _orphaned(parent):
            kill_children(os.getpid())
            os._exit(0)

    server.periodic_callbacks["dkicf-orphan-guard"] = PeriodicCallback(check, _CHECK_MS)
