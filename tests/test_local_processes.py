"""Local clusters whose scheduler and nannies run in processes of their own (dkicf._local)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from dkicf._cluster import all_workers
from dkicf._config import process_settings
from dkicf._local import _SHARED_PROCESS_MAX, separate_processes


def test_auto_separates_beyond_a_few_workers_and_bad_values_are_refused():
    assert separate_processes("auto", _SHARED_PROCESS_MAX) is False
    assert separate_processes("auto", _SHARED_PROCESS_MAX + 1) is True
    assert separate_processes("AUTO", 16) is True
    assert separate_processes(True, 1) is True and separate_processes(False, 64) is False
    with pytest.raises(ValueError, match="separate_processes must be True, False or 'auto'"):
        separate_processes("yes", 2)


def _assert_started_with_dkicf_s_settings(client) -> None:
    """The cluster's workers run without the profiler; workers and scheduler tick each second."""
    import dask

    assert set(client.run(dask.config.get, "distributed.worker.profile.enabled").values()) \
        == {False}
    assert set(client.run(lambda dask_worker: dask_worker._tick_interval).values()) == {1}
    assert client.run_on_scheduler(lambda dask_scheduler: dask_scheduler._tick_interval) == 1


def test_the_local_processes_start_without_the_profiler_and_with_slow_ticks(client):
    """The session's cluster (scheduler and nannies in this process): its workers, nannies
    and scheduler took dkicf's settings when they started; this process's are as they were."""
    import dask

    _assert_started_with_dkicf_s_settings(client)
    assert {n._tick_interval for n in client.cluster.workers.values()} == {1}
    assert dask.config.get("distributed.worker.profile.enabled") is True
    assert dask.config.get("distributed.admin.tick.interval") == "20ms"


def test_process_settings_follow_dkicf_s_two_settings_and_refuse_bad_values():
    import dask

    assert process_settings() == {"distributed.worker.profile.enabled": False,
                                  "distributed.admin.tick.interval": "1s"}
    with dask.config.set({"dkicf.cluster.worker-profiler": None,
                          "dkicf.cluster.tick-interval": "250ms"}):
        assert process_settings() == {"distributed.admin.tick.interval": "0.25s"}
    with dask.config.set({"dkicf.cluster.worker-profiler": True,
                          "dkicf.cluster.tick-interval": None}):
        assert process_settings() == {"distributed.worker.profile.enabled": True}
    with dask.config.set({"dkicf.cluster.worker-profiler": "off"}), pytest.raises(
            ValueError, match="worker-profiler must be true, false or null, got 'off'"):
        process_settings()
    for bad in ("soon", 0, "-1s"):
        with dask.config.set({"dkicf.cluster.tick-interval": bad}), pytest.raises(
                ValueError, match="tick-interval must be a positive duration such as 1s"):
            process_settings()


def _listening(proc: psutil.Process) -> list:
    try:
        return [c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == "LISTEN"]
    except psutil.Error:
        return []


def test_scheduler_and_nannies_leave_the_driver_and_stay_on_loopback():
    import dask
    import dask.array as da

    import dkicf

    with dask.config.set({"dkicf.fit.rank": 37}):
        client = dkicf.local_cluster(2, 1, "1GiB", separate_processes=True)
    cluster = client.cluster
    try:
        me = os.getpid()
        assert len(all_workers(client)) == 2
        scheduler_pid = client.run_on_scheduler(os.getpid)
        nanny_pids = set(client.run(os.getppid).values())
        assert scheduler_pid != me and me not in nanny_pids and len(nanny_pids) == 2
        # The driver's dask settings went with them; Ctrl-C in the terminal does not.
        get = lambda: dask.config.get("dkicf.fit.rank")  # noqa: E731
        assert client.run_on_scheduler(get) == 37
        assert set(client.run(get).values()) == {37}
        assert client.run_on_scheduler(dask.config.get, "distributed.scheduler.http.routes") \
            == ["distributed.http.health"]
        # On top of them, dkicf.cluster.worker-profiler and tick-interval: no stack
        # sampling, and event-loop health checks every second, in every process.
        _assert_started_with_dkicf_s_settings(client)
        worker_pids = set(client.run(os.getpid).values())
        children = [psutil.Process(p) for p in {scheduler_pid, *nanny_pids, *worker_pids}]
        assert {os.getsid(p.pid) for p in children}.isdisjoint({os.getsid(0)})
        addresses = [ip for p in children for ip in _listening(p)]
        assert addresses and set(addresses) == {"127.0.0.1"}
        # A fit on it gives the numpy backend's pivots.
        X = np.random.default_rng(0).normal(size=(3000, 4))
        res = dkicf.incomplete_cholesky(da.from_array(X, chunks=1000), gamma=0.3, max_rank=12,
                                        client=client)
        ref = dkicf.incomplete_cholesky(X, gamma=0.3, max_rank=12)
        np.testing.assert_array_equal(res.pivots, ref.pivots)
    finally:
        client.close()
        cluster.close()
    deadline = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children):
        assert time.monotonic() < deadline, "processes outlived cluster.close()"
        time.sleep(0.1)


_DRIVER = """
import json, sys, time
import psutil
import dkicf
if __name__ == "__main__":
    client = dkicf.local_cluster(2, 1, "1GiB", separate_processes=True)
    print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]), flush=True)
    time.sleep(600)
"""


def test_the_processes_end_themselves_when_the_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) >= 5  # the scheduler, 2 nannies and their 2 workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    alive = pids
    while alive:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert time.monotonic() < deadline, f"orphans still running: {alive}"
        time.sleep(0.2)


_CANCELLED_LOGS = """
import asyncio, logging, types
import distributed  # noqa: F401  (configures its loggers, as in a scheduler process)
from dkicf import _orphan_guard

_orphan_guard.dask_setup(types.SimpleNamespace(periodic_callbacks={}))
for exc in (asyncio.CancelledError(), ValueError("a real failure")):
    try:
        raise exc
    except BaseException as e:
        logging.getLogger("distributed.scheduler").exception(e)
"""


def test_scheduler_processes_drop_the_tracebacks_of_cancelled_handlers():
    """After Ctrl-C the driver closes the cluster; a graph update still in flight is
    cancelled, and distributed logged that CancelledError's traceback under the one-line
    "interrupted".  Other errors still print."""
    proc = subprocess.run([sys.executable, "-c", _CANCELLED_LOGS], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CancelledError" not in proc.stderr
    assert "ValueError: a real failure" in proc.stderr


def test_a_process_is_killed_before_its_children_when_the_cluster_closes(monkeypatch):
    """A nanny killed after its children could, closing its worker's queues in between,
    start a second multiprocessing resource tracker (its own gone with the children), whose
    KeyError tracebacks then follow the driver's one-line "interrupted"."""
    import asyncio

    from dkicf import _local

    order = []

    class Proc:
        pid, returncode = 4242, None

        def kill(self):
            order.append("process")

        async def wait(self):
            return -9

    monkeypatch.setattr(_local, "descendants", lambda pid: order.append(f"listed {pid}") or
                        ["worker", "tracker"])
    monkeypatch.setattr(_local, "kill_all", lambda procs: order.append(list(procs)))
    spec = _local._SpecProcess({"cls": "distributed.Nanny", "opts": {}})
    spec.process = Proc()
    asyncio.run(spec.close())
    assert order == ["listed 4242", "process", ["worker", "tracker"]]
    assert spec.process is None
