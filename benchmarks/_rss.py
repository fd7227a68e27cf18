"""Peak resident memory of dask workers, measured from a given moment.

Run on the workers with ``client.run``: the functions are sent by reference,
so the workers must import this module too.  Worker processes started by a
LocalCluster are spawned with this process's ``sys.path``: put this folder on
it before the cluster starts (a script run from here has it already).
"""

from __future__ import annotations

import threading
import time

import psutil

_RSS_PEAK = {"value": 0, "thread": None}


def start_rss_sampler(interval: float = 0.02) -> bool:
    """Sample this process's resident memory in a thread; run on workers with ``client.run``.

    Unlike ``ru_maxrss`` this ignores the start-up of the process: it measures
    the peak from now on.  Read it with :func:`rss_sampler_peak`.
    """
    if _RSS_PEAK["thread"] is not None:
        _RSS_PEAK["value"] = 0
        return True
    proc = psutil.Process()

    def sample():
        while True:
            _RSS_PEAK["value"] = max(_RSS_PEAK["value"], proc.memory_info().rss)
            time.sleep(interval)

    thread = threading.Thread(target=sample, name="dkicf-rss", daemon=True)
    _RSS_PEAK["thread"] = thread
    thread.start()
    return True


def rss_sampler_peak() -> int:
    """Largest resident memory (bytes) seen since :func:`start_rss_sampler`."""
    return max(_RSS_PEAK["value"], psutil.Process().memory_info().rss)
