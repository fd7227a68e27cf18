"""Preloaded by the worker processes of the LocalClusters that dkicf starts.

Ctrl-C in a terminal reaches every process of the foreground group: the
driver, and the local worker processes it spawned.  The driver stops the fit
and closes the cluster (which ends its workers); workers that took the
signal themselves would only print tracebacks of their interrupted event
loops on the way.  So they ignore it.
"""

from __future__ import annotations

import signal
import threading


def dask_setup(worker) -> None:
    """Make this worker process ignore SIGINT (the driver ends it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
