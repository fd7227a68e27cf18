"""Child processes of the tests that end with the test run, even when it is killed.

:func:`tied_popen` starts a command as the leader of its own process group
(so that everything it starts, such as a dask worker's own worker process or
the processes a job script launches, is in that group) and, beside it, a
guardian: a small process that ends the whole group (SIGTERM, then SIGKILL)
as soon as the test process is gone.  The guardian learns of that from its
parent-death signal (``prctl(PR_SET_PDEATHSIG)`` on Linux) and, elsewhere,
from the end of a pipe that only the test process holds open.  It exits by
itself once the group is empty.  Fixture finalisers still stop the processes
first in a normal run; the guardian covers a run that is killed (SIGKILL, an
out-of-memory kill, a CI timeout), where no finaliser runs.

Run as a script, this module is the guardian: ``python _tied.py PGID``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

_GRACE_S = 5.0


def _die_with_parent(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent ends (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _guard(pgid: int, parent: int) -> None:
    def parent_gone(*_):
        _end_group(pgid)
        os._exit(0)

    signal.signal(signal.SIGTERM, parent_gone)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        parent_gone()
    while _group_alive(pgid):
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the parent is gone
            parent_gone()


def tied_popen(args, **kwargs) -> subprocess.Popen:
    """:class:`subprocess.Popen` of ``args`` in a new session, ended with the test run.

    Takes Popen's keyword arguments (``start_new_session`` is always True:
    the child leads a process group of its own, and ``proc.pid`` is that
    group's id).  The guardian is attached to the returned object as
    ``proc.guardian``.
    """
    kwargs["start_new_session"] = True
    proc = subprocess.Popen(args, **kwargs)
    proc.guardian = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(proc.pid), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc


if __name__ == "__main__":
    _guard(int(sys.argv[1]), int(sys.argv[2]))
