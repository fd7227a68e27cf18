"""Preloaded by the worker processes of the LocalClusters that dkicf starts.

Ctrl-C in a terminal reaches every process of the foreground group: the
driver, and the local worker processes it spawned.  The driver stops the fit
and closes the cluster (which ends its workers); workers that took the
signal themselves would only print tracebacks of their interrupted event
loops on the way.  So they ignore it.

The modules a fit's tasks import are imported in a background thread as
the worker starts, so that a first fit does not wait for them.

A task that fails with one of dkicf's own errors (NaN in X, a missing chunk)
is reported by the driver in one line; the worker's "Compute Failed" dump of
the same error is dropped, and so is the traceback of a result that could not
be sent to a worker whose connection closed (the cluster closing).
"""

from __future__ import annotations

import logging
import signal
import threading


def _own_error_names() -> set[str]:
    """Class names of the errors that dkicf raises in tasks and reports itself."""
    # Worker-side imports, at the first log record: the preload itself stays light.
    from . import io  # noqa: F401 - defines the errors of reading stores
    from ._chunk import NonFiniteError
    from .errors import DkicfError

    names, todo = set(), [DkicfError, NonFiniteError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


class _OwnErrorsFilter(logging.Filter):
    """Drops distributed's "Compute Failed" record of a task that raised a dkicf error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed") or len(record.args or ()) < 4:
            return True
        text = str(record.args[3])
        return text.split("(", 1)[0] not in _own_error_names()


class _PeerGoneFilter(logging.Filter):
    """Drops distributed's "failed during get data" record: sending a task's result to
    another worker failed because that worker's connection closed.

    It comes when the driver closes the cluster (after Ctrl-C, for one) while
    a worker still sends data to one that is closing; a worker that asked
    and still needs the data asks again, and logs its own failure if that
    fails too.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed during get data")


def _import_task_modules() -> None:
    """Import what a fit's tasks import (zarr, dkicf's chunk and k-means tasks)."""
    from ._memory import import_task_modules

    import_task_modules()


def dask_setup(worker) -> None:
    """Make this worker process ignore SIGINT (the driver ends it); quiet dkicf's errors
    and sends to closed peers; import the fit's task modules in the background.

    The imports take a few tenths of a second of CPU per worker process.
    Done while the cluster starts and the data load, a first fit does not
    wait for them in its set-up (many workers on few cores would import
    one after another there).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = logging.getLogger("distributed.worker")
    log.addFilter(_OwnErrorsFilter())
    log.addFilter(_PeerGoneFilter())
    threading.Thread(target=_import_task_modules, name="dkicf-imports", daemon=True).start()
