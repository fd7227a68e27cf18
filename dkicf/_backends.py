"""Where the factorization's row chunks live: this process (numpy) or dask workers.

A backend holds the chunk states (rows of P, residual diagonal) and offers the
driver in :mod:`dkicf.icf` a few collective operations:

* ``summary(m)``: trace of the residual, its ``m`` largest entries and their
  rows of X and of P (a small dict, reduced over chunks);
* ``rows(index)``: rows of X and P at global indices;
* ``apply(block, history)``: add a pivot block to every chunk, return the new summary;
* ``map_chunks(func, *args)``: run ``func(x_chunk, state, offset, *args)`` on every
  chunk and return the small results in chunk order (for pivot rules);
* ``result_arrays(rank)``: P and the residual, as numpy or dask arrays;
* ``write_p(spec, start)``, ``write_e(spec, name)``, ``rebase_from(spec, point)``:
  the checkpoint's writes and the rebuilding of the states from a checkpoint
  (see :mod:`dkicf.checkpoint`).
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Protocol

import numpy as np

from . import _chunk, _services
from ._candidates import chunk_block_stats, match_rows, same_request, taken_rows, top_share
from ._cluster import get_client
from ._factor import History, PivotBlock
from ._memory import (
    _gib,
    _Workers,
    check_worker_memory,
    held_bytes,
    measure_workers,
    task_budget,
    work_chunks,
)
from ._services import (
    ChunkBackend,
    LazyChunk,
    _deaths_allowed,
    _drop_preferences,
    _EventInbox,
    _holders,
    _identity,
    _own_copy,
    _placement,
    _stall_report,
    _workers_kept_dying,
    threadpool_limits,
)
from .errors import WorkerFailureError
from .kernels import Kernel

logger = logging.getLogger(__name__)


class FactorBackend(ChunkBackend, Protocol):
    """What the factorization's driver loop (:mod:`dkicf.icf`) asks of a backend.

    Both :class:`NumpyBackend` and :class:`DaskBackend` implement it; the
    loop uses nothing else.  Attributes: ``n`` rows, ``chunks`` (row chunk
    sizes), ``step`` (passes applied), ``store`` (the Zarr spec of P, or
    None), ``task_bytes`` (bytes of kernel columns a task may hold, None:
    unbounded), ``pool`` and ``n_threads`` (threads idle between passes, that
    the driver may use).
    """

    n: int
    chunks: tuple[int, ...]
    step: int
    store: Any
    task_bytes: float | None
    pool: Any
    n_threads: int

    def summary(self, m: int = 1, first: bool = False, ahead=None) -> dict:
        """Trace of the residual diagonal, its ``m`` largest entries and their rows.

        ``ahead = (rank, request)``: what the next candidate request will be, which
        a backend may fetch with the summary (a dask round trip saved)."""

    def rows(self, index: np.ndarray) -> tuple:
        """Rows of X (float64), kernel aux values, rows of P and residuals at ``index``."""

    def apply(self, block, history, m: int = 1, stash: int = 0, prefetch=None) -> dict:
        """One pass: add the pivot block to every chunk; return the new summary."""

    def map_chunks(self, func, *args) -> list:
        """``func(x_chunk, state, offset, *args)`` on every chunk state (no pass over X)."""

    def result_arrays(self, rank: int) -> tuple:
        """P's first ``rank`` columns and the residual, as numpy or dask arrays."""

    def write_p(self, spec, start: int) -> None:
        """Write P's columns from ``start`` on to the Zarr spec (checkpoints)."""

    def write_e(self, spec, name: str) -> None:
        """Write the residual diagonal to the array ``name`` of the spec."""

    def rebase_from(self, spec, point: dict) -> None:
        """Rebuild the chunk states from a checkpoint's committed arrays."""

    def abort(self) -> None:
        """Cancel what is running after a failure."""

    def close(self) -> None:
        """Release the threads, futures and subscriptions of the fit."""


class NumpyBackend:
    """The whole dataset in this process, updated in cache-sized row blocks.

    Each pass runs the row blocks on a thread pool (one BLAS thread each), so
    the kernel column, the ``P u`` product, the exponential and the residual
    update of a block happen while it is in cache: one read of X and of P per
    iteration, the bandwidth floor of the method.
    """

    _BLOCK_ROWS = 4 * _chunk.ROW_BLOCK

    def __init__(
        self, X: np.ndarray, kernel: Kernel, capacity: int, n_threads: int | None = None,
        restore: tuple | None = None, checked: bool = False,
    ):
        self.X = _chunk.as_float(X)
        self.n, self.d = self.X.shape
        self.chunks = (self.n,)
        self.store = None
        self.task_bytes = None
        self.step = 0
        self.n_threads = n_threads or _cpu_count()
        self._pool = self._limiter = None
        if self.n_threads > 1 and self.n > _chunk.ROW_BLOCK:
            self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="dkicf")
            self._limiter = threadpool_limits(1)  # one BLAS thread per pool thread
        # One pivot per pass: large tasks (little scheduling per pass).  A
        # block per pass: long passes, smaller tasks that stay in cache.
        self.bounds = _even_bounds(self.n, self._BLOCK_ROWS, self.n_threads)
        self.fine_bounds = _even_bounds(self.n, _chunk.ROW_BLOCK, self.n_threads)
        # One range per thread for the candidate statistics: each returns its
        # own candidates, which the driver merges.
        self.thread_bounds = _even_bounds(self.n, -(-self.n // self.n_threads), self.n_threads)
        try:
            # The O(n) set-up (checks, kernel diagonal, first touch of P's memory)
            # on the pool's threads: serial, it took as long as several passes.
            if restore is None:
                self.state = _chunk.chunk_init(self.X, kernel, 0, capacity, checked=checked,
                                               run=self._run_ranges)
            else:
                spec, point = restore
                self.step = int(point["iteration"])
                self.state = _chunk.chunk_restore(self.X, None, spec, kernel, 0, capacity,
                                                  None, point, stored=False)
        except BaseException:
            self.close()  # the pool's threads and the process's BLAS threads as they were
            raise

    def _run_ranges(self, func, bounds=None) -> list:
        """``[func(lo, hi) for (lo, hi) in bounds]`` on the pool (default: the coarse bounds)."""
        bounds = self.bounds if bounds is None else bounds
        if self._pool is None:
            return [func(lo, hi) for lo, hi in bounds]
        futs = [self._pool.submit(func, lo, hi) for lo, hi in bounds]
        return [f.result() for f in futs]

    @property
    def pool(self):
        """The thread pool of the passes (None with one thread): idle between passes."""
        return self._pool

    def summary(self, m: int = 1, first: bool = False, ahead=None) -> dict:
        return _chunk.chunk_stats(self.state, m, self.X, rows=True)

    def rows(self, index: np.ndarray):
        return _chunk.chunk_rows(self.X, self.state, index)

    def apply(
        self, block: PivotBlock, history=None, m: int = 1, stash: int = 0, prefetch=None
    ) -> dict:
        """Apply the block to the one chunk; ``prefetch`` is for :class:`DaskBackend` only
        (here :meth:`map_chunks` is a plain call)."""
        st = self.state
        args = (self.X, st.P, st.e, st.aux, block)
        bounds = self.bounds if block.index.shape[0] == 1 else self.fine_bounds
        if self._pool is None:
            # No pool (few rows): BLAS's threads speed up a one-pivot pass but made
            # block passes 5-20x slower (a woken one waits for a core): those run one.
            with threadpool_limits(1) if block.index.shape[0] > 1 else nullcontext():
                found = [_chunk.update_rows(*args, lo, hi, stats=False) for lo, hi in bounds]
        else:
            futs = [self._pool.submit(_chunk.update_rows, *args, lo, hi, stats=False)
                    for lo, hi in bounds]
            found = [f.result() for f in futs]
        parts = _chunk.assemble_row_stats(st.e, found, st.sub_blocks())
        old = len(st.pivots)
        st.pivots = _chunk.finish_block(st.P, st.e, 0, block, st.pivots)
        _chunk.refresh_row_stats(parts, st.e, st.pivots[old:], st.sub_blocks())
        st.rank += block.index.shape[0]
        st.n_passes += 1
        self.step += 1
        if m == 1:
            return _chunk.chunk_stats(st, 1, self.X, rows=True, parts=parts)
        return self.summary(m)

    def write_p(self, spec: _chunk.StoreSpec, start: int) -> None:
        _chunk.chunk_write_p(self.state, spec, start)

    def write_e(self, spec: _chunk.StoreSpec, name: str) -> None:
        _chunk.chunk_write_e(self.state, spec, name)

    def rebase_from(self, spec: _chunk.StoreSpec, point: dict) -> None:
        """Nothing to do: this process's state has no lineage to cut."""

    def map_chunks(self, func, *args) -> list:
        """``[func(X, state, 0, *args)]``: the whole dataset is one chunk.

        :func:`~dkicf.pivoting.chunk_block_stats` (the block rules' candidate
        statistics, ``O(n)`` per pass) runs on the pool instead, one call per
        thread's range of rows: its results are those of as many chunks.
        """
        if func is chunk_block_stats and self._pool is not None:
            st = self.state
            return self._run_ranges(
                lambda lo, hi: func(None, _chunk.RowRange(st, lo, hi), lo, *args),
                self.thread_bounds,
            )
        return [func(self.X, self.state, 0, *args)]

    def result_arrays(self, rank: int):
        P = self.state.P[:, :rank]
        return P, self.state.e.copy()

    def abort(self) -> None:
        """Nothing to cancel: this process holds the whole state."""

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()
            self._limiter.restore_original_limits()
            self._pool = None


def _even_bounds(n: int, rows: int, n_threads: int, align: int = 256) -> list[tuple[int, int]]:
    """``(lo, hi)`` ranges of at most about ``rows`` rows covering ``0:n``, as many as a
    multiple of ``n_threads`` and of nearly equal size, so that the threads finish together.

    The boundaries are multiples of ``align`` rows, so every task starts on
    whole cache lines.  BLAS kernels may round a row differently depending on
    its place in a task: the factor can differ in its last bit between thread
    counts (never the pivots on data without near ties).
    """
    count = max(1, math.ceil(n / rows))
    count = math.ceil(count / n_threads) * n_threads
    inner = (np.linspace(0, n, count + 1)[1:-1] / align).round().astype(np.int64) * align
    edges = np.unique(np.concatenate([[0], inner[(inner > 0) & (inner < n)], [n]]))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _cpu_count() -> int:
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _merge_summaries(parts: list[dict], m: int) -> dict:
    """Global summary from the chunks': top ``m`` residuals, ties to the lowest index."""
    values = np.concatenate([p["values"] for p in parts])
    index = np.concatenate([p["index"] for p in parts])
    order = np.lexsort((index, -values))[:m]
    if all("trace_parts" in p for p in parts):
        # The sums of the same row blocks however the chunks were grouped:
        # one correctly rounded sum of them all is the same for any grouping.
        trace = math.fsum(v for p in parts for v in p["trace_parts"])
    else:
        trace = math.fsum(p["trace"] for p in parts)
    out = {
        "trace": trace,
        "values": values[order],
        "index": index[order],
        "n_passes": max(p["n_passes"] for p in parts),
    }
    if "max_sqnorm" in parts[0]:
        out["max_sqnorm"] = max(p.get("max_sqnorm", 0.0) for p in parts)
    if "x_rows" in parts[0]:
        out["x_rows"] = np.concatenate([p["x_rows"] for p in parts])[order]
        out["p_rows"] = np.concatenate([p["p_rows"] for p in parts])[order]
        if parts[0]["aux"] is not None:
            out["aux"] = np.concatenate([p["aux"] for p in parts])[order]
        else:
            out["aux"] = None
    return out


class DaskBackend:
    """Row chunks of a dask array, each a chain of futures on the workers.

    X chunks are either held in worker memory (``persist=True``) or re-read
    from their source (for example Zarr) by every pass.  Consecutive chunks
    of X are grouped into about one task per worker thread
    (:func:`work_chunks`), placed evenly over the workers; chunks of an X
    already in worker memory (persisted) are grouped only with neighbours
    on the same worker and their tasks run there, so that no byte of X or
    P moves between workers during the fit.  The chunk states
    (P rows and residuals) are futures: a worker that dies loses them, and the
    scheduler recomputes them from their lineage (X chunk, earlier state,
    pivot block), so no state lives only in scattered data.  One iteration is
    one scheduler round trip: the driver submits every chunk's update, and
    each update task sends its chunk's small summary (trace, largest residual
    and the rows of X and P there) back as a dask event; summary tasks are
    the fallback when an event does not come.
    """

    def __init__(
        self, X, kernel: Kernel, capacity: int, client, persist: bool, rebase_every: int = 25,
        salt="", store: _chunk.StoreSpec | None = None, restore: tuple | None = None,
        workers: _Workers | None = None,
    ):
        import uuid

        import dask

        self.client = get_client(client)
        # The fit's one measurement of the workers (its plan), else taken here.
        self.workers = measure_workers(self.client) if workers is None else workers
        if X.numblocks[1] != 1:
            X = X.rechunk({1: -1})
        self.n, self.d = X.shape
        self.input_chunks = tuple(int(c) for c in X.chunks[0])
        check_worker_memory(
            self.client, self.input_chunks, self.d, X.dtype, capacity, store, persist,
            hold_x=persist, workers=self.workers,
        )
        # Consecutive row chunks are grouped into one task each, about one per
        # worker thread (as memory allows): the per-pass cost of the scheduler
        # grows with the number of tasks, not with their size.
        # X held in worker memory (persisted) stays where it is: chunks are
        # grouped only with neighbours on the same worker, and each group's
        # tasks run there, so no byte of X or P moves between workers.
        holders = _holders(self.client, X, self.workers.nthreads) if persist else None
        if holders is not None:
            runs = 1 + sum(a != b for a, b in zip(holders[:-1], holders[1:]))
            if runs > len(set(holders)):
                logger.info(
                    "X's %d row chunks are held on %d workers in %d runs of consecutive "
                    "chunks: each pass runs at least one task per run. dkicf.persist_rows(X) "
                    "holds them in one run per worker.", len(holders), len(set(holders)), runs,
                )
        sizes = work_chunks(self.client, self.input_chunks, self.d, X.dtype, capacity, store,
                            persist, holders, self.workers)
        input_starts = np.concatenate([[0], np.cumsum(self.input_chunks)]).astype(np.int64)
        held_chunks = None
        if holders is not None:
            ends = np.searchsorted(input_starts, np.cumsum(sizes))
            groups = list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist()))
            held_chunks = (list(X.to_delayed().ravel()), groups)
            self._home = [holders[a] for a, _ in groups]
        else:
            self._home = None
        self._held = held_chunks is not None
        if len(sizes) < len(self.input_chunks):
            X = X.rechunk({0: sizes})
        self.chunks = tuple(int(c) for c in X.chunks[0])
        self.task_bytes = self._task_bytes(X.dtype.itemsize, capacity, persist, store)
        self.offsets = np.concatenate([[0], np.cumsum(self.chunks)]).astype(np.int64)
        first = np.searchsorted(input_starts, self.offsets[:-1])
        self._labels = [
            int(f) if self.chunks == self.input_chunks
            else (int(f), tuple(int(v) for v in input_starts[f:-1]))
            for f in first
        ]
        self.token = dask.base.tokenize(X, kernel, capacity, salt, uuid.uuid4().hex)[:16]
        self.kernel = kernel
        self.capacity = capacity
        self.store = store
        # The driver's panels run in the driver's own thread: the workers do the passes.
        self.pool, self.n_threads = None, 1
        self.rebase_every = rebase_every
        self._last_rebase = 0
        self._x_blocks = list(X.to_delayed().ravel())
        # One small graph per row chunk, for the per-pass reads.
        self._x_lazy = LazyChunk.row_chunks(X)
        self.persist = persist
        self._x_futs = None
        # Where each chunk's state starts: where its rows of X are held, or
        # else consecutive chunks on the same worker, rows shared in
        # proportion to the workers' threads.  Later tasks follow the
        # states, so the passes stay balanced.
        if self._home is None:
            self._home = _placement(self.chunks, self.workers.nthreads)
        self._n_workers = self.workers.count
        # Keys of tasks submitted with a preferred worker, whose preference is
        # dropped once they have run (see _settle), and the watch of waiting
        # passes (see _on_stall).
        self._preferred: list[str] = []
        self._deaths_at = self._paused_since = self._no_workers_since = None
        if persist:
            # Each chunk copied once into memory the worker allocated itself:
            # chunks unpickled from a transfer can sit in buffers that BLAS
            # reads at half speed, and every pass reads them.
            if held_chunks is None:
                raw = [[r] for r in self.client.compute(self._x_blocks)]
            else:  # the input chunks, grouped where they are held
                blocks, groups = held_chunks
                found = self.client.compute(blocks)
                raw = [found[a:b] for a, b in groups]
            self._x_futs = [
                self.client.submit(
                    _own_copy, *r, key=f"icf-x-{self.token}-{j}", **self._where(j)
                )
                for j, r in enumerate(raw)
            ]
            self._preferred += [f.key for f in self._x_futs]
            del raw
        self.step = 0
        self._events = _EventInbox(self.client, f"dkicf-icf-{self.token}")
        self._events.on_stall = self._on_stall
        if restore is None:
            self.states = [
                self.client.submit(
                    _chunk.chunk_init, self._x(j), kernel, int(off), capacity,
                    self._labels[j], store, key=f"icf-init-{self.token}-{j}", **self._where(j),
                )
                for j, off in enumerate(self.offsets[:-1])
            ]
            self._preferred += [f.key for f in self.states]
        else:
            # Iterations are counted from the checkpoint on (keys, rebases, error messages).
            self.step = self._last_rebase = int(restore[1]["iteration"])
            self.states = self._restore_tasks(*restore, previous=None)

    def _where(self, j: int) -> dict:
        """Worker restriction for chunk ``j``'s first tasks.

        Where X is held on the workers the restriction is strict: a loose one
        lets the scheduler's work stealing run the copy of X or the set-up
        elsewhere, moving the chunk.  Elsewhere it is a preference.  Either is
        dropped once the task has run (:meth:`_settle`), and a task whose
        worker died meanwhile is sent to the running ones
        (:func:`~dkicf._services._stall_report`).
        """
        home = self._home[j] if self._home else None
        if not home:
            return {}
        return {"workers": [home], "allow_other_workers": not self._held}

    def _x(self, j):
        if self.persist:
            return self._x_futs[j]
        # Streaming: the task reads its chunk itself, so no chunk outlives the
        # task that uses it and every pass reads X afresh.
        return self._x_lazy[j]

    def summary(self, m: int = 1, first: bool = False, ahead: tuple | None = None) -> dict:
        """The global summary; ``ahead = (rank, request)``: its tasks also send what the
        next :func:`~dkicf.pivoting.gather_candidates` at ``rank`` asks for, as an
        :meth:`apply` with ``prefetch`` does (X held on the workers only)."""
        prefetch = None
        if ahead is not None and self.persist:
            prefetch = self._prefetch_request(ahead[0], ahead[0], ahead[1])
        if prefetch is None:
            futs = self._map(
                "stats", _chunk.chunk_stats, self.states, m, self._xs(), True,
                each=(True, False, True, False),
            )
            return _merge_summaries(self._gather(futs), m)
        limit = prefetch[2].limit
        in_result = bool(limit) and self._report_bytes(limit, ahead[0]) <= _REPORT_ROW_BYTES
        futs = self._map("stats", _chunk.chunk_stats_ahead, self.states, m, self._xs(),
                         prefetch, in_result, each=(True, False, True, False, False))
        self._rows_ahead = self._top_rows_tasks(limit) if limit and not in_result else None
        parts = self._gather(futs)
        self._keep_ahead(parts, prefetch, in_result)
        return _merge_summaries(parts, m)

    def _top_rows_tasks(self, limit: int) -> list:
        """Tasks that hold each chunk's ``limit`` largest residuals' rows, for :meth:`rows`
        to gather (where they are too large to travel with a report)."""
        return self._map("top-rows", _chunk.chunk_top_rows, self._xs(), self.states, limit,
                         each=(True, True, False))

    def _keep_ahead(self, parts: list, prefetch, with_rows: bool) -> None:
        """Take what the tasks sent of the next request out of their ``parts``: the
        candidate statistics for :meth:`map_chunks`, and, ``with_rows``, the candidates'
        rows for :meth:`rows`."""
        stats = [p.pop("block_stats", None) for p in parts]
        if prefetch is not None and all(st is not None for st in stats):
            self._prefetched = (prefetch, stats)
        tops = [p.pop("top_rows", None) for p in parts]
        if with_rows and all(top is not None for top in tops):
            self._rows_ahead = [tuple(top.get(k) for k in _chunk._TOP_ROWS) for top in tops]

    def _wait(self, futures) -> None:
        """Wait until ``futures`` are done (finished or failed).

        Every :data:`_services._STALL_SECONDS` that they are not, tasks of this fit
        stranded in the scheduler's ``no-worker`` state are sent to the
        running workers, and the fit fails rather than wait for ever (see
        :meth:`_on_stall`).
        """
        import asyncio

        from distributed import wait

        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=_services._STALL_SECONDS)
                return
            except (TimeoutError, asyncio.TimeoutError):
                self._on_stall()

    def _gather(self, futures) -> list:
        """The results of ``futures`` (:meth:`_wait`, then gathered); settles preferences."""
        self._wait(futures)
        out = self.client.gather(futures)
        self._settle()
        return out

    def _on_stall(self) -> None:
        """While waiting for a pass: unstick stranded tasks, and fail rather than wait for ever.

        Called every :data:`_services._STALL_SECONDS` of waiting (see :func:`_stall_report`).
        The fit fails with :class:`~dkicf.errors.WorkerFailureError` when,
        without the pass completing, workers died :func:`_deaths_allowed`
        times, or no worker was left for :data:`_services._NO_WORKERS_SECONDS`, or a
        worker that dask paused (memory over its pause threshold, which does
        not go down) held the pass's tasks for :data:`_services._PAUSED_SECONDS`.
        """
        import time

        try:
            report = self.client.run_on_scheduler(_stall_report, token=self.token)
        except Exception:  # best effort: the scheduler is busy or gone
            return
        if report["moved"]:
            logger.warning(
                "%d task(s) of the factorization waited for workers that are gone; "
                "sent to the running workers", report["moved"],
            )
        now = time.monotonic()
        if report["workers"]:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        elif now - self._no_workers_since > _services._NO_WORKERS_SECONDS:
            raise _workers_kept_dying(
                f"the cluster has had no worker for {now - self._no_workers_since:.0f} s "
                f"while the pass waited; the last to die: {report['last_death']}"
            )
        deaths, first = report["deaths"], self._deaths_at
        if first is None or deaths < first:
            self._deaths_at = deaths
        elif deaths - first >= _deaths_allowed(max(self._n_workers, len(report["workers"]))):
            raise _workers_kept_dying(
                f"workers died or were restarted {deaths - first} times while the pass "
                f"waited, without it completing; the last: {report['last_death']}"
            )
        if not report["paused"]:
            self._paused_since = None
            return
        if self._paused_since is None:
            self._paused_since = now
        elif now - self._paused_since > _services._PAUSED_SECONDS:
            key, address, memory, limit = report["paused"][0]
            share = f"{memory / limit:.0%} of its memory limit of {_gib(limit)}" if limit else (
                f"{_gib(memory)} of memory")
            raise WorkerFailureError(
                f"factorization stalled at iteration {self.step}: the task {key} it waits "
                f"for has been held for {now - self._paused_since:.0f} s by worker "
                f"{address}, which dask paused at {share} (its pause threshold) and whose "
                "memory does not go down, so that no task runs there. The worker process "
                f"itself uses about {_gib(self.workers.baseline)} of it. Give the "
                "workers more memory (dkicf fit: --memory-limit), or add workers.",
                "factorization", self.step,
            )

    def _task_bytes(self, itemsize: int, capacity: int, persist: bool, store) -> float:
        """What a task may spend on a block's kernel columns (see BlockSizer): a
        share of what the workers' own memory and the held states leave."""
        workers = self.workers
        if not workers.limited:
            return float("inf")
        held = held_bytes(max(workers.rows(self.n), max(self.chunks)), self.d, itemsize,
                          capacity, persist, None if store is None else store.columns)
        return task_budget(workers.limits, [workers.threads], self.n, store,
                           baseline=workers.baseline, held=held)

    def _settle(self) -> None:
        """After a pass (or rebase) completed: drop the worker preferences of the tasks
        that have run, and start the watch of :meth:`_on_stall` again.

        A preference (``workers=[home], allow_other_workers=True``) only
        places a chunk's first task.  Left on the task, it would strand the
        task in the scheduler's ``no-worker`` state if it had to be
        recomputed while no worker runs (every worker restarted at once, as
        a nanny does to workers over their memory limit): the replacements
        have new addresses, and the scheduler does not reconsider a task
        preferring a gone worker when they join.
        """
        self._deaths_at = self._paused_since = self._no_workers_since = None
        if not self._preferred:
            return
        keys, self._preferred = self._preferred, []
        try:
            self.client.run_on_scheduler(_drop_preferences, keys=keys)
        except Exception:  # best effort; _stall_report covers what is left
            pass

    def _xs(self) -> list:
        return [self._x(j) for j in range(len(self.states))]

    def _map(self, name: str, func, *args, each) -> list:
        """One task per chunk, sent to the scheduler in one message.

        ``each[k]`` tells whether ``args[k]`` is a list with one entry per
        chunk (else the same value goes to every chunk).  Tasks are keyed
        ``icf-<name>-<token>-<step>-<chunk>``.
        """
        count = len(self.states)
        if len(each) != len(args):
            raise TypeError(f"_map: {len(args)} arguments but {len(each)} flags")
        columns = [a if per else [a] * count for a, per in zip(args, each)]
        return self.client.map(
            func, *columns, key=[f"icf-{name}-{self.token}-{self.step}-{j}" for j in range(count)],
            pure=False,
        )

    def _locate(self, index: np.ndarray):
        j = np.searchsorted(self.offsets, index, side="right") - 1
        return j, index - self.offsets[j]

    def rows(self, index: np.ndarray):
        index = np.asarray(index, dtype=np.int64)
        ahead, self._rows_ahead = getattr(self, "_rows_ahead", None), None
        parts = None
        if ahead is not None:
            parts = ahead if isinstance(ahead[0], tuple) else self._gather(ahead)
            found = self._rows_from(parts, index)
            if found is not None:
                return found
        have, take = match_rows(parts, index)
        # Only the rows the pass did not bring are fetched (a tie at the
        # largest residual puts most candidates in the lowest-indexed chunk).
        fetched = self._fetch_rows(index[~have])
        if take is None:
            return fetched
        out = []
        for got, held in zip(fetched, taken_rows(parts, take)):
            if got is not None:
                whole = np.empty((index.shape[0], *got.shape[1:]), dtype=got.dtype)
                whole[~have], whole[have] = got, held
                got = whole
            out.append(got)
        return tuple(out)

    def _fetch_rows(self, index: np.ndarray):
        """The rows at ``index`` of X and P (and aux, residuals), by tasks on their chunks."""
        js, local = self._locate(index)
        groups: dict[int, list[int]] = {}
        for pos, j in enumerate(js):
            groups.setdefault(int(j), []).append(pos)
        # One message to the scheduler for all chunks (a submit each cost
        # a scheduler round of its own: tens of ms a pass with 16 workers).
        futs = self.client.map(
            _chunk.chunk_rows, [self._x(j) for j in groups], [self.states[j] for j in groups],
            [local[pos] for pos in groups.values()],
            key=[f"icf-rows-{self.token}-{self.step}-{j}" for j in groups], pure=False,
        )
        parts = self._gather(futs)
        b = index.shape[0]
        xr = np.empty((b, self.d))
        pr = np.empty((b, parts[0][2].shape[1]))
        er = np.empty(b)
        aux = None if parts[0][1] is None else np.empty(b)
        for pos, (x_, a_, p_, e_) in zip(groups.values(), parts):
            xr[pos], pr[pos], er[pos] = x_, p_, e_
            if aux is not None:
                aux[pos] = a_
        return xr, aux, pr, er

    def _rows_from(self, parts: list, index: np.ndarray):
        """The rows at ``index`` from the chunks' largest residuals fetched with the last
        pass (:func:`~dkicf._chunk.chunk_top_rows`), or None if one is missing there."""
        have, take = match_rows(parts, index)
        if take is None or not have.all():
            return None
        return taken_rows(parts, take)

    def apply(
        self, block: PivotBlock, history: History, m: int = 1, stash: int = 0,
        prefetch: tuple | None = None,
    ) -> dict:
        """Send the block to every chunk and return the new global summary.

        ``stash``: streamed chunks keep the X rows of their ``stash + 1``
        largest residuals for the next :meth:`rows` (see ``chunk_update``).
        ``prefetch = (lo, hi, request)``: each update task also computes its
        :func:`~dkicf.pivoting.chunk_block_stats` for that request and sends
        it with its summary, so that the block loop's next
        ``map_chunks(chunk_block_stats, lo, hi, request)`` costs no round trip.
        """
        self._prefetched = None
        if prefetch is not None:
            prefetch = self._prefetch_request(*prefetch)
        arg = block
        if _block_nbytes(block) * len(self.states) > _INLINE_BLOCK_BYTES:
            # Large blocks become one task shared by every chunk: sent to the
            # cluster once per pass and recomputable from its spec.
            arg = self.client.submit(
                _identity, block, key=f"icf-block-{self.token}-{self.step + 1}"
            )
        self.step += 1
        inbox = self._events if m == 1 else None
        # The rows of X and P that the next candidates come from go with the
        # pass (X is read, not re-read), saving the round trip of tasks sent
        # once the driver has chosen: in the update's report while they are
        # small, else gathered from tasks that follow the update.
        ahead = self.persist and prefetch is not None and bool(prefetch[2].limit)
        in_report = ahead and inbox is not None and self._report_bytes(
            prefetch[2].limit, block.rank + block.index.shape[0]) <= _REPORT_ROW_BYTES
        # One message to the scheduler for all chunks, so that they start together.
        self.states = self._map(
            "update", _chunk.chunk_update, self._xs(), self.states, arg,
            [None if inbox is None else (inbox.topic, self.step, j)
             for j in range(len(self.states))],
            [_stash_share(stash, c, self.n) for c in self.chunks],
            None if inbox is None else prefetch, in_report,
            each=(True, True, False, True, True, False, False),
        )
        self._rows_ahead = (self._top_rows_tasks(prefetch[2].limit)
                            if ahead and not in_report else None)
        parts = None if inbox is None else inbox.collect(self.step, self.states)
        self._settle()
        if parts is None:
            summary = self.summary(m)
        else:
            self._keep_ahead(parts, prefetch, in_report)
            inbox.trim(_REPORT_BYTES_KEPT)
            summary = _merge_summaries(parts, m)
        if self.step - self._last_rebase >= self.rebase_every:
            self._rebase(history)
        return summary

    def _report_bytes(self, limit: int, rank: int) -> int:
        """Bytes of the candidates' rows that a pass's reports would carry, over all chunks."""
        rows = sum(min(limit, c) for c in self.chunks)
        return rows * (self.d + rank + 3) * 8

    def _prefetch_request(self, lo: int, hi: int, request) -> tuple | None:
        """What the update tasks send of the next candidate request (None: nothing).

        For the largest residuals, each chunk sends about twice its share
        of them (:func:`~dkicf._candidates.top_share`): the sum over the chunks stays small
        however many there are, and the driver asks again in full only
        when a chunk held more of them than it sent (see
        :func:`~dkicf.pivoting.gather_candidates`).
        """
        from dataclasses import replace

        count = len(self.states)
        if request.rule == "top" and request.count:
            share = top_share(request.count + 1, max(self.chunks), self.n)
            request = replace(request, limit=share)
            entries = share * count
        else:
            entries = (request.count + 1) * count
        return None if entries > _PREFETCH_ENTRIES else (lo, hi, request)

    def _rebase(self, history: History) -> None:
        """Cut the lineage: new state futures whose spec rebuilds from X and the history.

        Each rebase task runs where the chunk's state lives and reuses it; only
        if that worker has died does it replay the history.  After this, the
        scheduler forgets the previous iterations' tasks, so neither its memory
        nor a recovery's depth grows with the iteration count.
        """
        snapshot = self.client.submit(
            _identity, history.snapshot(), key=f"icf-history-{self.token}-{self.step}"
        )
        who_has = self.client.who_has(self.states)
        new = []
        for j, st in enumerate(self.states):
            workers = list(who_has.get(st.key, ()))
            # A state held nowhere (its worker just died) may run anywhere.
            where = {"workers": workers, "allow_other_workers": True} if workers else {}
            new.append(
                self.client.submit(
                    _chunk.chunk_rebase, self._x(j), st.key, snapshot,
                    int(self.offsets[j]), self.capacity, self._labels[j], self.store,
                    key=f"icf-rebase-{self.token}-{self.step}-{j}", **where,
                )
            )
            if where:
                self._preferred.append(new[-1].key)
        self._wait(new)
        self._settle()
        self.states = new
        self._last_rebase = self.step

    def _restore_tasks(self, spec: _chunk.StoreSpec, point: dict, previous) -> list:
        """Leaf tasks that rebuild every chunk's state from a committed checkpoint."""
        stored = self.store is not None
        tag = "restore" if previous is None else "reload"
        who_has = self.client.who_has(previous) if previous else {}
        out = []
        for j, off in enumerate(self.offsets[:-1]):
            key = None if previous is None else previous[j].key
            workers = list(who_has.get(key, ())) if key else []
            where = {"workers": workers, "allow_other_workers": True} if workers else self._where(j)
            out.append(
                self.client.submit(
                    _chunk.chunk_restore, self._x(j), key, spec, self.kernel, int(off),
                    self.capacity, self._labels[j], point, stored,
                    key=f"icf-{tag}-{self.token}-{self.step}-{j}", **where,
                )
            )
            if where:
                self._preferred.append(out[-1].key)
        return out

    def rebase_from(self, spec: _chunk.StoreSpec, point: dict) -> None:
        """Cut the lineage at a committed checkpoint: states become leaf tasks reading Zarr.

        As in :meth:`_rebase`, a worker that still holds a state reuses it;
        a lost state is read back from the checkpoint instead of replayed.
        """
        new = self._restore_tasks(spec, point, previous=self.states)
        self._wait(new)
        self._settle()
        self.states = new
        self._last_rebase = self.step

    def _each_chunk(self, name: str, func, *args) -> None:
        futs = self._map(name, func, self.states, *args, each=(True,) + (False,) * len(args))
        self._gather(futs)

    def write_p(self, spec: _chunk.StoreSpec, start: int) -> None:
        """Every chunk writes its columns ``start:rank`` of P (its tail, if Zarr-backed)."""
        self._each_chunk("write-p", _chunk.chunk_write_p, spec, start)

    def write_e(self, spec: _chunk.StoreSpec, name: str) -> None:
        """Every chunk writes its residual diagonal to the checkpoint array ``name``."""
        self._each_chunk(f"write-{name}", _chunk.chunk_write_e, spec, name)

    def map_chunks(self, func, *args) -> list:
        """``func(x_chunk, state, offset, *args)`` on every chunk, results in chunk order.

        Arguments are embedded in each task; keep them small.  The
        :func:`~dkicf.pivoting.chunk_block_stats` that the last :meth:`apply`
        prefetched are returned without a task.
        """
        done = getattr(self, "_prefetched", None)
        self._prefetched = None
        if done is not None and func is chunk_block_stats:
            (lo, hi, request), stats = done
            if (args[0], args[1]) == (lo, hi) and (
                args[2].count == 0 or same_request(args[2], request)
            ):
                return stats
        self._map_count = getattr(self, "_map_count", 0) + 1
        name = getattr(func, "__name__", "func")
        futs = self._map(
            f"{name}-{self._map_count}", func, self._xs(), self.states,
            [int(o) for o in self.offsets[:-1]], *args,
            each=(True, True, True) + (False,) * len(args),
        )
        return self._gather(futs)

    def result_arrays(self, rank: int):
        import dask.array as da

        if self.store is not None:
            self.write_p(self.store, rank)
            P = da.from_zarr(self.store.array(),
                             chunks=(self.input_chunks, self.capacity))[:, :rank]
        else:
            P = self._memory_P(rank)
        e = da.concatenate(
            [
                da.from_delayed(
                    self.client.submit(_chunk.chunk_residual, st, key=f"icf-e-{self.token}-{j}"),
                    shape=(c,), dtype=np.float64,
                )
                for j, (st, c) in enumerate(zip(self.states, self.chunks))
            ]
        )
        return P, self._as_input_chunks(e)

    def _as_input_chunks(self, arr):
        """``arr`` (rows in work chunks) row-chunked like the input X."""
        if self.chunks == self.input_chunks:
            return arr
        return arr.rechunk({0: self.input_chunks})

    def _memory_P(self, rank: int):
        """P held in the states' buffers, row-chunked like the input X.

        Each input chunk's rows are a view of its group's buffer, taken
        where the state lives: a rechunk would copy them (dask copies a
        slice of less than half a chunk), a second P in memory that a
        k-means then waits for.
        """
        import dask.array as da

        starts = np.concatenate([[0], np.cumsum(self.input_chunks)]).astype(np.int64)
        owner = np.searchsorted(self.offsets, starts[:-1], side="right") - 1
        pieces = [(int(j), int(a - self.offsets[j]), int(b - self.offsets[j]))
                  for j, a, b in zip(owner, starts[:-1], starts[1:])]
        futs = self.client.map(
            _chunk.chunk_P, [self.states[j] for j, _, _ in pieces], [rank] * len(pieces),
            [a for _, a, _ in pieces], [b for _, _, b in pieces],
            key=[f"icf-P-{self.token}-{k}" for k in range(len(pieces))], pure=False,
        )
        return da.concatenate(
            [da.from_delayed(f, shape=(b - a, rank), dtype=np.float64)
             for f, (_, a, b) in zip(futs, pieces)],
            axis=0,
        )

    def close(self):
        # The inbox's stall callback is a method of this backend: without it the
        # two would form a cycle, and the fit's futures (X's chunks) would outlive
        # the fit until the garbage collector ran.
        self._events.on_stall = None
        self._events.close()

    def abort(self) -> None:
        """After a failure: cancel the fit's futures at once.

        The scheduler then forgets them, and the failed tasks under them,
        before the caller submits anything else.  Left to garbage collection
        they would live as long as the exception that carries this backend,
        and a retry made inside the ``except`` block (``resume=True``) would
        meet the failed keys of X's chunks again.

        The states go first, in a call of their own: the scheduler then
        forgets the earlier states under them, which X's chunks feed too.
        Cancelled together, the scheduler would reach those unwanted
        earlier states from X's chunks and fail an assertion in its handler,
        which drops this client's connection (distributed logs it as an
        error, the client reconnects).
        """
        states = [f for f in list(self.states or []) if f is not None]
        xs = [f for f in list(self._x_futs or []) if f is not None]
        self.states, self._x_futs = [], None
        for futures in (states, xs):
            if not futures:
                continue
            try:
                self.client.cancel(futures)
            except Exception:  # pragma: no cover - the cluster itself is gone
                return


def _stash_share(count: int, rows: int, n: int) -> int:
    """Candidate rows a chunk of ``rows`` of ``n`` keeps for a request of ``count``.

    Four times its share of the rows, and at least 64: a chunk that holds
    more of the candidates than it kept is read again (same rows, same bits).
    """
    if count <= 0:
        return 0
    return int(min(count, math.ceil(4 * count * rows / max(n, 1)) + 64))


_INLINE_BLOCK_BYTES = 1 << 20
# Candidates' rows (X and P) a pass's update reports may carry, over all
# chunks; larger ones are fetched by tasks that follow the update.
_REPORT_ROW_BYTES = 16 << 20
# Bytes of reports the scheduler may keep in the fit's event topic before the
# driver, which has them, asks it to forget them (see _EventInbox.trim).
_REPORT_BYTES_KEPT = 64 << 20
# Candidate statistics an update pass may send as events, over all chunks
# (residuals and row indices; each entry is a Python number in the
# scheduler's event log until the fit ends).  Larger requests are mapped.
_PREFETCH_ENTRIES = 1 << 16


def _block_nbytes(block: PivotBlock) -> int:
    return block.rows.nbytes + block.U.nbytes + block.L.nbytes + 64


