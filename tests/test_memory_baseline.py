"""Memory accounting with the workers' own memory, and fits that fail instead of hanging.

A dask worker process uses about 150 MiB before it holds any data; a fit
planned as if that memory were free filled its workers past their limit,
and the restarted workers then left tasks waiting for ever.
"""

import contextlib
import math
import os
import re
import signal
import threading
import time

import dask.array as da
import numpy as np
import pytest

from dkicf import _backends, _chunk, _memory, _services, incomplete_cholesky
from dkicf._cluster import all_workers
from dkicf.errors import WorkerFailureError
from dkicf.pipeline import plan_fit

MiB = 2**20


class FakeClient:
    """What the accounting asks of a client, with the unmanaged memory the workers reported."""

    def __init__(self, n_workers, limit, own=None, threads=1):
        self.workers = {}
        for k in range(n_workers):
            w = {"memory_limit": limit, "nthreads": threads}
            if own is not None:
                w["metrics"] = {"memory": own, "managed_bytes": 0}
            self.workers[f"tcp://w{k}"] = w

    def scheduler_info(self, n_workers=-1):
        return {"workers": self.workers}


@pytest.fixture(scope="module")
def own_cluster():
    """Two worker processes under nannies, for tests that kill or pause them."""
    from dkicf import local_cluster

    client = local_cluster(2, 1, memory_limit="1GiB")
    yield client
    cluster = client.cluster
    client.close()
    # Workers the tests killed may still be restarting: distributed's close can then
    # look up a worker that is already gone (KeyError in _watch_worker_status).
    with contextlib.suppress(KeyError):
        cluster.close()


def test_the_workers_own_memory_is_measured_on_them(client):
    import psutil

    measured = _memory.worker_baseline(client)

    def unmanaged(dask_worker):
        return psutil.Process().memory_info().rss - dask_worker.state.nbytes

    reference = max(client.run(unmanaged).values())
    # The interpreter, dask, numpy, zarr and dkicf: far from nothing.
    assert 40 * MiB < measured < 2**30
    assert abs(measured - reference) < 32 * MiB, (measured, reference)
    # Without remote functions: the unmanaged memory the workers reported.
    assert _memory.worker_baseline(FakeClient(2, 2**30, own=123 * MiB)) == 123 * MiB
    assert _memory.worker_baseline(FakeClient(2, 2**30)) == 0


def test_the_workers_own_thresholds_apply_unless_set_here(client):
    import dask

    assert _memory.worker_memory_fraction(client) == 0.6  # the workers' defaults
    with dask.config.set({"distributed.worker.memory.target": False,
                          "distributed.worker.memory.spill": 0.85}):
        assert _memory.worker_memory_fraction(client) == 0.8  # set here: pause at 80%


def test_a_fit_that_cannot_fit_is_refused_by_the_plan_naming_the_limit_needed():
    """The reported case: a million rows at rank 100 on two workers of 300 or 200 MiB."""
    own = 142 * MiB
    kw = dict(n_workers=2, threads_per_worker=1, worker_baseline=own)
    with pytest.raises(MemoryError) as info:
        plan_fit((10**6, 2), 250_000, 8, 100, worker_memory=300 * MiB, **kw)
    message = str(info.value)
    assert "the workers have 300 MiB" in message and "142 MiB, measured" in message
    need = int(re.search(r"--memory-limit (\d+)MiB or more", message).group(1))
    assert f"at least about {need} MiB per worker" in message
    # The limit named is the least that the plan accepts, to the MiB.
    plan = plan_fit((10**6, 2), 250_000, 8, 100, worker_memory=need * MiB, **kw)
    assert plan.p_storage == "zarr" and plan.p_columns >= 1
    with pytest.raises(MemoryError, match="--memory-limit"):
        plan_fit((10**6, 2), 250_000, 8, 100, worker_memory=(need - 1) * MiB, **kw)
    with pytest.raises(MemoryError, match=r"use about 142 MiB each before holding any data.*"
                                          rf"--memory-limit {need}MiB or more"):
        plan_fit((10**6, 2), 250_000, 8, 100, worker_memory=200 * MiB, **kw)
    # Counted as free, the same memory would have been planned for.
    assert plan_fit((10**6, 2), 250_000, 8, 100, worker_memory=300 * MiB,
                    **{**kw, "worker_baseline": 0}).p_storage == "zarr"


def test_the_least_limit_counts_the_kmeans_state_when_it_binds():
    """At 4 million rows on two workers, k-means||'s state (2 x (5 runs x 12 + 8) bytes
    of each of a worker's rows) needs more than the factorization with P in Zarr."""
    own = 142 * MiB
    kw = dict(n_workers=2, threads_per_worker=1, worker_baseline=own)
    needs = {}
    for init in ("k-means||", "k-means++"):
        with pytest.raises(MemoryError) as info:
            plan_fit((4 * 10**6, 2), 250_000, 8, 100, worker_memory=300 * MiB, init=init, **kw)
        message = str(info.value)
        needs[init] = need = int(re.search(r"--memory-limit (\d+)MiB or more", message).group(1))
        plan = plan_fit((4 * 10**6, 2), 250_000, 8, 100, worker_memory=need * MiB, init=init,
                        **kw)
        assert plan.p_storage == "zarr"
        with pytest.raises(MemoryError, match="--memory-limit"):
            plan_fit((4 * 10**6, 2), 250_000, 8, 100, worker_memory=(need - 1) * MiB,
                     init=init, **kw)
        mib, per_row = {"k-means||": (259, 136), "k-means++": (15, 8)}[init]
        assert f"the k-means's state of those rows ({mib} MiB: {per_row} bytes a row" in message
        assert "its share of the mini-batch rows (39 MiB)" in message
    # The state of 2e6 rows and half of a mini-batch fetch (102,400 rows of P), one task's
    # chunk of 256 rows of P (twice, as read and decoded), its runs' labels and distances
    # (16 bytes each) and 32 bytes a row of buffers within 75% of what they leave, and the
    # worker's own memory, below 60% of the limit.
    held, task = 2 * 10**6 * 136 + 102_400 * 8 * 100 // 2, 256 * (2 * 8 * 100 + 5 * 16 + 32)
    assert needs["k-means||"] == math.ceil((held + task / 0.75 + own) / 0.6 / MiB)
    # With k-means++ the factorization's need binds (a column of P a Zarr chunk).
    workers = _memory._Workers([2**30] * 2, [1, 1], own, 0.6)
    least = _memory.least_limit(workers, 4 * 10**6, _memory.COLUMN_BLOCK)
    assert needs["k-means++"] == math.ceil(least / MiB) < needs["k-means||"]


@pytest.mark.parametrize("own", [0, 150 * MiB])
@pytest.mark.parametrize("init", ["k-means||", "k-means++"])
def test_the_plan_never_decides_what_the_fit_refuses(own, init):
    """Whatever the plan decides (P in memory or its Zarr width, X held, chunk rows),
    the fit's own checks accept, with the workers' own memory counted by both."""
    from dkicf._kmeans_tasks import _check_fits
    from dkicf._memory import COLUMN_BLOCK, kmeans_row_bytes

    planned = set()
    state = kmeans_row_bytes(5, init)
    for limit in (300 * MiB, 512 * MiB, 2**30, 4 * 2**30):
        for n in (20_000, 300_000, 1_000_000, 3_000_000):
            for d, itemsize, rank, workers in ((2, 8, 100, 2), (64, 4, 50, 3)):
                try:
                    plan = plan_fit((n, d), 100_000, itemsize, rank, worker_memory=limit,
                                    n_workers=workers, worker_baseline=own, init=init)
                except MemoryError:
                    planned.add("refused")
                    # Without the workers' own memory, only k-means||'s state of a
                    # worker's rows (136 bytes each) is refused.
                    assert own or -(-n // workers) * state > 0.5 * limit, (limit, n, rank)
                    continue
                planned.add(plan.p_storage)
                client = FakeClient(workers, limit, own=own)
                rows = plan.chunk_rows
                chunks = (rows,) * (n // rows) + ((n % rows,) if n % rows else ())
                dtype = np.float64 if itemsize == 8 else np.float32
                spec = None
                if plan.p_storage == "zarr":
                    cb = _memory.store_columns(client, n, plan.rank, COLUMN_BLOCK)
                    assert cb == plan.p_columns
                    spec = _chunk.StoreSpec("", "P", "t", cb)
                _memory.check_worker_memory(client, chunks, d, dtype, plan.rank, spec,
                                              plan.persist_x, hold_x=plan.persist_x)
                _check_fits(None, da.zeros((n, plan.rank), chunks=rows), [limit] * workers,
                            plan.p_storage == "memory", state)
    assert {"memory", "zarr"} <= planned
    assert ("refused" in planned) == bool(own or init == "k-means||")


def test_the_fit_counts_the_workers_own_memory():
    args = ((250_000,) * 4, 2, np.float64, 100, None, False)
    _memory.check_worker_memory(FakeClient(2, 2**30, own=0), *args)
    # Each chunk would fit a worker, not the rows of two.
    with pytest.raises(ValueError, match=r"P \(1000000 x 100 float64\).*own 0.29 GiB each.*"
                                         r"p_store="):
        _memory.check_worker_memory(FakeClient(2, 2**30, own=300 * MiB), *args)
    with pytest.raises(ValueError, match=r"use about 0.63 GiB each before holding any data"):
        _memory.check_worker_memory(FakeClient(2, 2**30, own=650 * MiB), *args)


def test_a_zarr_backed_update_stays_within_its_estimate(tmp_path):
    """The buffers a task allocates with P in Zarr (grown tail, new tail, flushed columns
    read back) stay below task_transient, as the process's resident memory shows."""
    import psutil

    from dkicf.checkpoint import _new_p_array
    from dkicf.kernels import make_kernel

    rows, cb, b, rank = 163_840, 10, 6, 48
    _new_p_array(str(tmp_path / "P.zarr"), None, rows, rank + b + cb, 8192, cb)
    spec = _chunk.StoreSpec(str(tmp_path / "P.zarr"), "", "memtest", cb)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 2))
    kernel = make_kernel("gaussian", gamma=4.0)
    state = _chunk.chunk_init(x, kernel, 0, rank + b, None, spec)
    proc = psutil.Process()
    peak = {"rss": 0, "on": True}

    def sample():
        while peak["on"]:
            peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    worst, stream_seen = 0, 0
    try:
        for i in range(0, rank, b):
            index = rng.choice(rows, b, replace=False)
            block = _chunk.PivotBlock(kernel, index, x[index], state.aux[index],
                                      rng.normal(size=(b, i)) * 1e-3, np.eye(b), i)
            time.sleep(0.01)
            held = proc.memory_info().rss
            peak["rss"] = held
            flushed = state.flushed
            state = _chunk.chunk_update(x, state, block)
            time.sleep(0.01)
            worst = max(worst, peak["rss"] - held)
            if flushed:
                stream_seen = max(stream_seen, peak["rss"] - held)
    finally:
        peak["on"] = False
        sampler.join()
    assert state.flushed > 0
    # The task's buffers, the second tail that held_bytes counts (the new state's,
    # while the old one is alive) and the block's columns (budgeted by task_budget).
    estimate = _memory.task_transient(
        rows, 2, 8, cb, _memory.stream_bytes(rows, rank + b, 8192)) + rows * 8 * (cb + b)
    assert worst <= estimate, (worst / MiB, estimate / MiB)
    # Reading the flushed columns back is most of it: the estimate is not vacuous.
    assert stream_seen > 0.5 * _chunk._STREAM_BYTES


def _replace_every_worker(client) -> None:
    """All workers gone at once, then as many new ones (new addresses), as when every
    worker of a cluster passes its memory limit and its nanny restarts it."""
    cluster = client.cluster
    count = len(all_workers(client))
    cluster.scale(0)
    while all_workers(client):
        time.sleep(0.05)
    time.sleep(0.5)
    cluster.scale(count)
    client.wait_for_workers(count)


@pytest.mark.timeout(180)
def test_every_worker_replaced_at_once_mid_fit_changes_nothing(own_cluster):
    """The chunks' first tasks prefer the workers they started on; with X streamed they
    depend on nothing, and recomputed while no worker runs, they used to wait for ever
    for those workers once others had joined."""
    client = own_cluster
    X = da.from_array(np.random.default_rng(5).normal(size=(600, 3)), chunks=150)
    kw = dict(gamma=0.5, max_rank=16, tol=0.0, pivoting="greedy", client=client,
              persist=False)
    ref = incomplete_cholesky(X, **kw)
    before = set(all_workers(client))
    replaced = []

    def replace(progress):
        if progress.rank == 6 and not replaced:
            _replace_every_worker(client)
            replaced.append(True)

    res = incomplete_cholesky(X, progress=replace, **kw)
    assert replaced and not before & set(all_workers(client))
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P.compute(), rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
def test_every_worker_killed_at_once_mid_fit_changes_nothing(own_cluster):
    """Both worker processes killed together: the nannies start new ones, the fit goes on."""
    client = own_cluster
    client.wait_for_workers(2)
    X = da.from_array(np.random.default_rng(6).normal(size=(600, 3)), chunks=150)
    kw = dict(gamma=0.5, max_rank=16, tol=0.0, pivoting="greedy", client=client,
              persist=False)
    ref = incomplete_cholesky(X, **kw)
    pids = sorted(client.run(os.getpid).values())
    killed = []

    def kill_all(progress):
        if progress.rank == 6 and not killed:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

    res = incomplete_cholesky(X, progress=kill_all, **kw)
    assert killed and not set(pids) & set(client.run(os.getpid).values())
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P.compute(), rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strict", [False, True])
def test_a_task_stranded_on_a_dead_preferred_worker_is_sent_elsewhere(own_cluster, strict):
    """The scheduler leaves a task that prefers a dead worker in ``no-worker`` once new
    workers have joined; the stall report sends the fit's ones to the running workers.
    So too a task restricted to it (the set-up where X is held there)."""
    client = own_cluster
    cluster = client.cluster
    gone = "tcp://127.0.0.1:1"  # a worker that is not there
    cluster.scale(0)
    while all_workers(client):
        time.sleep(0.1)
    token = "strandtest0000"
    fut = client.submit(int, 7, key=f"icf-init-{token}-0", workers=[gone],
                        allow_other_workers=not strict)
    cluster.scale(2)
    client.wait_for_workers(2)
    time.sleep(1.0)
    assert fut.status == "pending"  # stranded: the scheduler would wait for ever
    report = client.run_on_scheduler(_backends._stall_report, token=token)
    assert report["moved"] == 1 and report["paused"] == []
    assert fut.result(timeout=30) == 7


@pytest.mark.timeout(120)
def test_a_pass_held_by_paused_workers_fails_instead_of_waiting(own_cluster, monkeypatch):
    """Workers paused for good (memory that does not go down) hold the pass's tasks:
    the fit fails with WorkerFailureError naming them instead of waiting for ever."""
    from distributed.core import Status

    client = own_cluster
    client.wait_for_workers(2)
    monkeypatch.setattr(_services, "_STALL_SECONDS", 0.5)
    monkeypatch.setattr(_services, "_PAUSED_SECONDS", 3.0)
    X = da.from_array(np.random.default_rng(1).normal(size=(400, 2)), chunks=100)

    def pause(dask_worker):
        dask_worker.memory_manager.memory_pause_fraction = False  # no resuming by itself
        dask_worker.status = Status.paused

    def resume(dask_worker):
        dask_worker.memory_manager.memory_pause_fraction = 0.8
        dask_worker.status = Status.running

    armed = []

    def stop_workers(progress):
        if progress.rank == 3 and not armed:
            client.run(pause)
            armed.append(time.monotonic())

    try:
        with pytest.raises(WorkerFailureError, match=r"factorization stalled at iteration \d+: "
                                                     r".*paused.*--memory-limit") as info:
            incomplete_cholesky(X, gamma=0.5, max_rank=10, tol=0.0, pivoting="greedy",
                                client=client, progress=stop_workers)
    finally:
        client.run(resume)
    assert info.value.stage == "factorization"
    assert time.monotonic() - armed[0] < 30


def _worker_pids(cluster) -> list[int]:
    """The worker processes of ``cluster`` now (its nannies start new ones after a kill);
    not those of the other clusters of this test process."""
    pids = []
    for nanny in list(cluster.workers.values()):
        process = getattr(nanny, "process", None)
        pid = getattr(process, "pid", None)
        if pid:
            pids.append(pid)
    return pids


@pytest.mark.timeout(180)
def test_workers_dying_again_and_again_fail_the_fit_instead_of_hanging(monkeypatch):
    """Workers that keep dying, whichever task they run (as workers over their memory
    limit do), until their nannies give up: the fit ends with WorkerFailureError instead
    of waiting for ever."""
    from dkicf import local_cluster

    monkeypatch.setattr(_services, "_STALL_SECONDS", 0.5)
    monkeypatch.setattr(_services, "_NO_WORKERS_SECONDS", 5.0)
    client = local_cluster(2, 1, memory_limit="1GiB")
    X = da.from_array(np.random.default_rng(2).normal(size=(400, 2)), chunks=100)
    stop = threading.Event()
    started = []

    def kill_all():
        for pid in _worker_pids(client.cluster):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def kill_again_and_again():
        while not stop.wait(0.3):
            kill_all()

    def start_killing(progress):
        if progress.rank == 3 and not started:
            started.append(time.monotonic())
            kill_all()
            threading.Thread(target=kill_again_and_again, daemon=True).start()

    try:
        with pytest.raises(WorkerFailureError, match=r"factorization failed at iteration \d+: "
                                                     r"a task killed every worker") as info:
            incomplete_cholesky(X, gamma=0.5, max_rank=60, tol=0.0, pivoting="greedy",
                                client=client, persist=False, progress=start_killing)
    finally:
        stop.set()
        cluster = client.cluster
        client.close()
        cluster.close()
    assert info.value.stage == "factorization"
    assert time.monotonic() - started[0] < 90


def test_one_measurement_holds_what_the_checks_use_and_each_call_measures_anew():
    class Counting(FakeClient):
        runs = 0

        def run(self, func):
            Counting.runs += 1
            return {w: {"own": 100 * MiB * Counting.runs, "fraction": 0.6}
                    for w in self.workers}

    client = Counting(2, 2**30, threads=3)
    measured = _memory.measure_workers(client)
    assert Counting.runs == 1  # one probe gives the workers' own memory and threshold
    assert (measured.baseline, measured.fraction, measured.limits) == (100 * MiB, 0.6,
                                                                      [2**30, 2**30])
    assert measured.nthreads == {"tcp://w0": 3, "tcp://w1": 3} and measured.total_threads == 6
    # The checks read the measurement they are handed, and ask the client nothing.
    _memory.check_worker_memory(None, (1000,) * 4, 2, np.float64, 10, None, True,
                                workers=measured)
    assert _memory.store_columns(None, 4000, 50, 32, workers=measured) == 32
    assert Counting.runs == 1
    assert _memory.worker_baseline(client) == 200 * MiB  # outside a fit: measured anew
    unlimited = _memory.measure_workers(FakeClient(2, 0))
    assert not unlimited.limited and unlimited.count == 2


def test_a_fit_measures_its_workers_once_and_a_plan_handed_down_not_at_all(client, monkeypatch):
    from dkicf import KernelKMeans
    from dkicf._plan import plan_for_cluster

    calls = []
    measure = _memory.measure_workers

    def counting(c):
        calls.append(c)
        return measure(c)

    for module in (_memory, _backends):
        monkeypatch.setattr(module, "measure_workers", counting)
    from dkicf import _plan, icf

    for module in (_plan, icf):
        monkeypatch.setattr(module, "measure_workers", counting)
    X = da.from_array(np.random.default_rng(0).normal(size=(600, 3)), chunks=200)
    KernelKMeans(3, rank=20, gamma=0.5, random_state=0).fit(X)
    assert len(calls) == 1  # the estimator's plan, for both stages
    calls.clear()
    plan = plan_for_cluster(client, X.shape, 200, 8, 20, decide=False)
    assert len(calls) == 1 and plan.workers.count == 2
    with pytest.raises(AttributeError):
        plan.rank = 5  # frozen: computed once per fit
    incomplete_cholesky(X, gamma=0.5, max_rank=20, client=client, plan=plan)
    assert len(calls) == 1  # the plan's measurement, not a new one
    incomplete_cholesky(X, gamma=0.5, max_rank=20, client=client)
    assert len(calls) == 2  # without a plan: measured once at the start
