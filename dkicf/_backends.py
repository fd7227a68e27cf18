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

import functools
import logging
import math

import numpy as np

from . import _chunk
from .kernels import Kernel

logger = logging.getLogger(__name__)


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
        self.step = 0
        self.n_threads = n_threads or _cpu_count()
        self._pool = None
        self._limiter = None
        if self.n_threads > 1 and self.n > _chunk.ROW_BLOCK:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="dkicf")
            self._limiter = _chunk.threadpool_limits(1)
        # One pivot per pass: large tasks (little scheduling per pass).  A
        # block per pass: long passes, smaller tasks that stay in cache.
        self.bounds = _even_bounds(self.n, self._BLOCK_ROWS, self.n_threads)
        self.fine_bounds = _even_bounds(self.n, _chunk.ROW_BLOCK, self.n_threads)
        # One range per thread for the candidate statistics: each returns its
        # own candidates, which the driver merges.
        self.thread_bounds = _even_bounds(self.n, -(-self.n // self.n_threads), self.n_threads)
        if restore is None:
            # The O(n) set-up (checks, kernel diagonal, first touch of P's
            # memory) on the pool's threads: serial, it took as long as
            # several passes on many cores.
            self.state = _chunk.chunk_init(self.X, kernel, 0, capacity, checked=checked,
                                           run=self._run_ranges)
        else:
            spec, point = restore
            self.step = int(point["iteration"])
            self.state = _chunk.chunk_restore(
                self.X, None, spec, kernel, 0, capacity, None, point, stored=False
            )

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

    def summary(self, m: int = 1, first: bool = False) -> dict:
        return _chunk.chunk_stats(self.state, m, self.X, rows=True)

    def rows(self, index: np.ndarray):
        return _chunk.chunk_rows(self.X, self.state, index)

    def apply(
        self, block: _chunk.PivotBlock, history=None, m: int = 1, stash: int = 0, prefetch=None
    ) -> dict:
        """Apply the block to the one chunk; ``prefetch`` is for :class:`DaskBackend` only
        (here :meth:`map_chunks` is a plain call)."""
        st = self.state
        args = (self.X, st.P, st.e, st.aux, block)
        bounds = self.bounds if block.index.shape[0] == 1 else self.fine_bounds
        if self._pool is None:
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
        from .pivoting import chunk_block_stats

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
    ):
        import uuid

        import dask

        from ._cluster import get_client

        self.client = get_client(client)
        if X.numblocks[1] != 1:
            X = X.rechunk({1: -1})
        self.n, self.d = X.shape
        self.input_chunks = tuple(int(c) for c in X.chunks[0])
        check_worker_memory(
            self.client, self.input_chunks, self.d, X.dtype, capacity, store, persist,
            hold_x=persist,
        )
        # Consecutive row chunks are grouped into one task each, about one per
        # worker thread (as memory allows): the per-pass cost of the scheduler
        # grows with the number of tasks, not with their size.
        # X held in worker memory (persisted) stays where it is: chunks are
        # grouped only with neighbours on the same worker, and each group's
        # tasks run there, so no byte of X or P moves between workers.
        holders = _holders(self.client, X) if persist else None
        sizes = work_chunks(self.client, self.input_chunks, self.d, X.dtype, capacity, store,
                            persist, holders)
        input_starts = np.concatenate([[0], np.cumsum(self.input_chunks)]).astype(np.int64)
        held_chunks = None
        if holders is not None:
            ends = np.searchsorted(input_starts, np.cumsum(sizes))
            groups = list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist()))
            held_chunks = (list(X.to_delayed().ravel()), groups)
            self._home = [holders[a] for a, _ in groups]
        else:
            self._home = None
        if len(sizes) < len(self.input_chunks):
            X = X.rechunk({0: sizes})
        self.chunks = tuple(int(c) for c in X.chunks[0])
        # What a task may spend on a block's kernel columns (see BlockSizer):
        # a share of what the workers' own memory and the held states leave.
        workers = _Workers.of(self.client)
        if workers is None:
            self.task_bytes = float("inf")
        else:
            held = held_bytes(
                max(workers.rows(self.n), max(self.chunks)), self.d, X.dtype.itemsize,
                capacity, persist, None if store is None else store.columns,
            )
            self.task_bytes = task_budget(
                workers.limits, [workers.threads], self.n, store,
                baseline=workers.baseline, held=held,
            )
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
        self.rebase_every = rebase_every
        self._last_rebase = 0
        self._x_blocks = list(X.to_delayed().ravel())
        # One small graph per row chunk, for the per-pass reads.
        self._x_lazy = _chunk.LazyChunk.row_chunks(X)
        self.persist = persist
        self._x_step = None
        self._x_futs = None
        # Where each chunk's state starts: where its rows of X are held, or
        # else consecutive chunks on the same worker, rows shared in
        # proportion to the workers' threads.  Later tasks follow the
        # states, so the passes stay balanced.
        if self._home is None:
            self._home = _placement(self.client, self.chunks)
        self._n_workers = len(_worker_resources(self.client)[0])
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
        """Worker restriction (a preference) for chunk ``j``'s first task."""
        home = self._home[j] if self._home else None
        return {"workers": [home], "allow_other_workers": True} if home else {}

    def _x(self, j):
        if self.persist:
            return self._x_futs[j]
        # Streaming: the task reads its chunk itself, so no chunk outlives the
        # task that uses it and every pass reads X afresh.
        return self._x_lazy[j]

    def summary(self, m: int = 1, first: bool = False) -> dict:
        futs = self._map(
            "stats", _chunk.chunk_stats, self.states, m, self._xs(), True,
            each=(True, False, True, False),
        )
        return _merge_summaries(self._gather(futs), m)

    def _wait(self, futures) -> None:
        """Wait until ``futures`` are done (finished or failed).

        Every :data:`_STALL_SECONDS` that they are not, tasks of this fit
        stranded in the scheduler's ``no-worker`` state are sent to the
        running workers, and the fit fails rather than wait for ever (see
        :meth:`_on_stall`).
        """
        import asyncio

        from distributed import wait

        while True:
            try:
                with self.client.as_current():
                    wait(futures, timeout=_STALL_SECONDS)
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

        Called every :data:`_STALL_SECONDS` of waiting (see :func:`_stall_report`).
        The fit fails with :class:`~dkicf.errors.WorkerFailureError` when,
        without the pass completing, workers died :func:`_deaths_allowed`
        times, or no worker was left for :data:`_NO_WORKERS_SECONDS`, or a
        worker that dask paused (memory over its pause threshold, which does
        not go down) held the pass's tasks for :data:`_PAUSED_SECONDS`.
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
        elif now - self._no_workers_since > _NO_WORKERS_SECONDS:
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
        elif now - self._paused_since > _PAUSED_SECONDS:
            from .errors import WorkerFailureError

            key, address, memory, limit = report["paused"][0]
            share = f"{memory / limit:.0%} of its memory limit of {_gib(limit)}" if limit else (
                f"{_gib(memory)} of memory")
            raise WorkerFailureError(
                f"factorization stalled at iteration {self.step}: the task {key} it waits "
                f"for has been held for {now - self._paused_since:.0f} s by worker "
                f"{address}, which dask paused at {share} (its pause threshold) and whose "
                "memory does not go down, so that no task runs there. The worker process "
                f"itself uses about {_gib(worker_baseline(self.client))} of it. Give the "
                "workers more memory (dkicf fit: --memory-limit), or add workers.",
                "factorization", self.step,
            )

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
        if ahead is not None:
            found = self._rows_from(ahead, index)
            if found is not None:
                return found
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

    def _rows_from(self, ahead: list, index: np.ndarray):
        """The rows at ``index`` from the chunks' largest residuals fetched with the last
        pass (:func:`~dkicf._chunk.chunk_top_rows`), or None if one is missing there."""
        parts = self._gather(ahead)
        where = np.concatenate([p[0] for p in parts])
        order = np.argsort(where, kind="stable")
        pos = np.searchsorted(where[order], index)
        pos = np.minimum(pos, where.shape[0] - 1)
        if where.shape[0] == 0 or not np.array_equal(where[order][pos], index):
            return None
        take = order[pos]
        xr = np.concatenate([p[1] for p in parts])[take]
        aux = None if parts[0][2] is None else np.concatenate([p[2] for p in parts])[take]
        pr = np.concatenate([p[3] for p in parts])[take]
        er = np.concatenate([p[4] for p in parts])[take]
        return xr, aux, pr, er

    def apply(
        self, block: _chunk.PivotBlock, history: _chunk.History, m: int = 1, stash: int = 0,
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
        # One message to the scheduler for all chunks, so that they start together.
        self.states = self._map(
            "update", _chunk.chunk_update, self._xs(), self.states, arg,
            [None if inbox is None else (inbox.topic, self.step, j)
             for j in range(len(self.states))],
            [_stash_share(stash, c, self.n) for c in self.chunks],
            None if inbox is None else prefetch,
            each=(True, True, False, True, True, False),
        )
        self._rows_ahead = None
        if self.persist and prefetch is not None and prefetch[2].limit:
            # The rows of X and P that the next candidates come from, fetched
            # now with the pass: the driver gathers them, saving the round
            # trip of tasks sent once it has chosen (X is read, not re-read).
            self._rows_ahead = self._map(
                "top-rows", _chunk.chunk_top_rows, self._xs(), self.states, prefetch[2].limit,
                each=(True, True, False),
            )
        parts = None if inbox is None else inbox.collect(self.step, self.states)
        self._settle()
        if parts is None:
            summary = self.summary(m)
        else:
            stats = [p.pop("block_stats", None) for p in parts]
            if prefetch is not None and all(st is not None for st in stats):
                self._prefetched = (prefetch, stats)
            summary = _merge_summaries(parts, m)
        if self.step - self._last_rebase >= self.rebase_every:
            self._rebase(history)
        return summary

    def _prefetch_request(self, lo: int, hi: int, request) -> tuple | None:
        """What the update tasks send of the next candidate request (None: nothing).

        For the largest residuals, each chunk sends about twice its share
        of them (:func:`_top_share`): the sum over the chunks stays small
        however many there are, and the driver asks again in full only
        when a chunk held more of them than it sent (see
        :func:`~dkicf.pivoting.gather_candidates`).
        """
        from dataclasses import replace

        count = len(self.states)
        if request.rule == "top" and request.count:
            share = _top_share(request.count + 1, max(self.chunks), self.n)
            request = replace(request, limit=share)
            entries = share * count
        else:
            entries = (request.count + 1) * count
        return None if entries > _PREFETCH_ENTRIES else (lo, hi, request)

    def _rebase(self, history: _chunk.History) -> None:
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
        from .pivoting import chunk_block_stats, same_request

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
            root, path = self.store.root, self.store.p_path
            P = da.from_zarr(
                root, component=path or None, chunks=(self.input_chunks, self.capacity),
                **self.store.zarr_kwargs(),
            )[:, :rank]
        else:
            P = self._as_input_chunks(self._memory_P(rank))
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
        import dask.array as da

        return da.concatenate(
            [
                da.from_delayed(
                    self.client.submit(_chunk.chunk_P, st, rank, key=f"icf-P-{self.token}-{j}"),
                    shape=(c, rank), dtype=np.float64,
                )
                for j, (st, c) in enumerate(zip(self.states, self.chunks))
            ],
            axis=0,
        )

    def close(self):
        self._x_step = None
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


class _EventInbox:
    """Chunk summaries that update tasks send as dask events (see ``report_summary``).

    One scheduler round trip shorter than fetching each summary with a task.
    The futures stay the source of truth: a task that fails raises here, a
    task re-run after a worker died reports again (the same values), and if
    a report has not arrived when its task is finished the caller falls back
    to summary tasks.
    """

    def __init__(self, client, topic: str):
        import threading

        self.client = client
        self.topic = topic
        # Called while a collect waits for unfinished tasks (DaskBackend._on_stall).
        self.on_stall = None
        self._got: dict[tuple[int, int], dict] = {}
        self._cond = threading.Condition()
        self._subscribed = False
        try:
            client.subscribe_topic(topic, self._receive)
            self._subscribed = True
        except Exception:  # pragma: no cover - a client without events: summary tasks
            pass

    def _receive(self, event) -> None:
        _, msg = event
        with self._cond:
            self._got[(int(msg["step"]), int(msg["chunk"]))] = msg
            self._cond.notify_all()

    def collect(self, step: int, futures: list, grace: float = 1.0) -> list[dict] | None:
        """The summaries of ``step`` in chunk order, or None to fetch them with tasks.

        :attr:`on_stall` (if set) is called every :data:`_STALL_SECONDS` that
        some of ``futures`` are not finished (see :meth:`DaskBackend._on_stall`).
        """
        import time

        on_stall = self.on_stall

        if not self._subscribed:
            return None
        wanted = [(step, j) for j in range(len(futures))]
        done_since = None
        stall_at = time.monotonic() + _STALL_SECONDS
        while True:
            with self._cond:
                if all(k in self._got for k in wanted):
                    msgs = [self._got.pop(k) for k in wanted]
                    # Reports of earlier steps (duplicates from re-runs) are stale.
                    for k in [k for k in self._got if k[0] <= step]:
                        del self._got[k]
                    return [_chunk.summary_from_event(msg) for msg in msgs]
                self._cond.wait(timeout=0.2)
            # Outside the lock: the client's event loop, which delivers the
            # reports, is the one that resolves these futures.
            bad = [f for f in futures if f.status in ("error", "cancelled")]
            if bad:
                bad[0].result()  # raises the task's error
            if all(f.status == "finished" for f in futures):
                done_since = done_since or time.monotonic()
                if time.monotonic() - done_since > grace:
                    return None
            else:
                done_since = None
                if on_stall is not None and time.monotonic() > stall_at:
                    on_stall()
                    stall_at = time.monotonic() + _STALL_SECONDS

    def close(self) -> None:
        """Unsubscribe, and drop the topic's events from the scheduler's log.

        The scheduler keeps the last events of every topic (1,000 by
        default) for as long as it runs; a fit's summaries are of no use
        once it has ended, and a long-lived scheduler would otherwise hold
        them for every fit.
        """
        if self._subscribed:
            try:
                self.client.unsubscribe_topic(self.topic)
                if self.client.status == "running":  # not after the cluster went away
                    self.client.run_on_scheduler(_drop_topic, topic=self.topic)
            except Exception:  # pragma: no cover - client closed, or no remote functions
                pass
            self._subscribed = False


# Seconds of waiting for a pass's tasks between looks for stranded ones.
_STALL_SECONDS = 5.0
# Seconds a pass may wait on workers that dask paused before the fit fails.
_PAUSED_SECONDS = 60.0
# Seconds a pass may wait with no worker at all in the cluster (all died, none
# came back) before the fit fails.
_NO_WORKERS_SECONDS = 300.0


def _deaths_allowed(n_workers: int) -> int:
    """Worker deaths that a pass may see without completing before the fit fails.

    As many as would fail one task with dask's ``allowed-failures`` on every
    worker: a pass whose tasks keep killing their workers, each time a
    different task (as workers over their memory limit do), fails like a
    single task that does.
    """
    import dask

    allowed = int(dask.config.get("distributed.scheduler.allowed-failures", 3))
    return (allowed + 1) * max(1, n_workers)


@functools.cache
def _kept_dying_class() -> type:
    """A ``distributed.KilledWorker`` whose message is its own (made once, on first use)."""
    from distributed import KilledWorker

    class WorkersKeptDying(KilledWorker):
        """Workers kept dying while a pass waited, whichever tasks they ran."""

        def __str__(self) -> str:
            return str(self.args[0])

    return WorkersKeptDying


def _workers_kept_dying(message: str) -> Exception:
    """A ``distributed.KilledWorker`` with ``message``: the factorization turns it into
    its :class:`~dkicf.errors.WorkerFailureError` (stage, iteration, checkpoint)."""
    return _kept_dying_class()(message, None, 0)


def _drop_preferences(keys: list, dask_scheduler=None) -> int:
    """On the scheduler: forget the preferred workers of these tasks (those that exist)."""
    dropped = 0
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and ts.loose_restrictions and ts.worker_restrictions:
            ts.worker_restrictions = None
            dropped += 1
    return dropped


def _stall_report(token: str, dask_scheduler=None) -> dict:
    """On the scheduler: unstick this fit's stranded tasks; report what a waiting pass faces.

    A task that only prefers a worker (``allow_other_workers=True``) and
    becomes runnable while no worker is running waits in ``no-worker``; the
    scheduler reconsiders such tasks when a worker joins, but only for that
    worker's address, so a task preferring a worker that died waits for
    ever once the replacements (new addresses) have joined.  Their
    preference is dropped and they are scheduled like any other task
    (``moved``: how many).  ``paused``: ``(key, worker, process memory,
    memory limit)`` for the fit's tasks that wait on a paused worker, or
    for none running at all.  ``deaths``: how many workers the scheduler
    has lost unexpectedly (killed, restarted), ``last_death`` the last;
    ``workers``: the workers' addresses.
    """
    import time

    from distributed.core import Status

    s = dask_scheduler
    mine = [ts for ts in list(s.unrunnable) if token in str(ts.key)]
    moved = 0
    if s.running:
        stuck = [ts for ts in mine if ts.loose_restrictions]
        for ts in stuck:
            ts.worker_restrictions = None
        if stuck:
            s.transitions({ts.key: "processing" for ts in stuck},
                          stimulus_id=f"dkicf-unstrand-{time.time()}")
        moved = len(stuck)
    paused = []
    for ws in s.workers.values():
        if ws.status != Status.paused:
            continue
        waiting = [ts for ts in ws.processing if token in str(ts.key)]
        if waiting or (mine and not s.running):
            key = (waiting or mine)[0].key
            paused.append((str(key), ws.address, int(ws.memory.process),
                           int(ws.memory_limit or 0)))
    deaths, last = 0, None
    try:
        events = s.get_events("all")
    except Exception:  # pragma: no cover - a scheduler without an event log
        events = ()
    for _, msg in events:
        if (isinstance(msg, dict) and msg.get("action") == "remove-worker"
                and not msg.get("expected", False)):
            deaths, last = deaths + 1, msg.get("worker")
    return {"moved": moved, "paused": paused, "deaths": deaths, "last_death": last,
            "workers": list(s.workers)}


async def _drop_topic(topic: str, dask_scheduler=None, wait: float = 2.0) -> bool:
    """On the scheduler: forget an event topic and its stored events (best effort).

    The client's unsubscription travels on its stream, not with this call,
    and may come second: the scheduler would then create the topic again,
    empty, to unsubscribe from it.  So the topic is dropped once it has no
    subscriber left, or after ``wait`` seconds.
    """
    import asyncio
    import time

    broker = getattr(dask_scheduler, "_broker", None)
    topics = getattr(broker, "_topics", None)
    if topics is None or topic not in topics:
        return False
    deadline = time.monotonic() + wait
    while topics.get(topic) is not None and topics[topic].subscribers:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    found = topics.pop(topic, None)
    if found is not None:
        found.truncate()
    return found is not None


def _top_share(count: int, rows: int, n: int) -> int:
    """Largest residuals a chunk of ``rows`` of ``n`` sends of the ``count`` largest overall:
    twice its share, and at least 64 more."""
    return int(min(count, math.ceil(2 * count * rows / max(n, 1)) + 64))


def _stash_share(count: int, rows: int, n: int) -> int:
    """Candidate rows a chunk of ``rows`` of ``n`` keeps for a request of ``count``.

    Four times its share of the rows, and at least 64: a chunk that holds
    more of the candidates than it kept is read again (same rows, same bits).
    """
    if count <= 0:
        return 0
    return int(min(count, math.ceil(4 * count * rows / max(n, 1)) + 64))


def _placement(client, chunks) -> list[str | None]:
    """A home worker for each row chunk: consecutive runs, rows in proportion to threads."""
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # distributed < 2025: all workers by default
        info = client.scheduler_info()
    workers = sorted(
        (addr, int(w.get("nthreads") or 1)) for addr, w in info.get("workers", {}).items()
    )
    if len(workers) < 2:
        return [None] * len(chunks)
    total = float(sum(chunks)) or 1.0
    threads = float(sum(t for _, t in workers))
    bounds = np.cumsum([t / threads for _, t in workers]) * total
    homes = []
    start = 0
    for c in chunks:
        middle = start + c / 2.0
        w = min(int(np.searchsorted(bounds, middle, side="right")), len(workers) - 1)
        homes.append(workers[w][0])
        start += c
    return homes


def _identity(x):
    return x


def _own_copy(*parts) -> np.ndarray:
    """The row chunks ``parts`` as one new C-ordered array."""
    if len(parts) == 1:
        return np.array(parts[0], order="C", copy=True)
    return np.concatenate(parts, axis=0)


def _holders(client, X) -> list[str] | None:
    """The worker holding each row chunk of ``X``, if all are in worker memory (else None)."""
    from dask.core import flatten

    keys = list(flatten(X.__dask_keys__()))
    try:
        found = client.run_on_scheduler(_who_holds, keys=keys)
    except Exception:  # best effort: the chunks are then placed as if not held
        return None
    return found if found and all(found) else None


def _who_holds(keys: list, dask_scheduler=None) -> list:
    """On the scheduler: one worker holding each key in memory (None where none does)."""
    out = []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        # who_has is None, not empty, for a task no worker holds.
        holders = sorted(ws.address for ws in ts.who_has or ()) if ts is not None else []
        out.append(holders[0] if holders else None)
    return out


def _worker_resources(client) -> tuple[list[int], list[int]]:
    """Memory limits (0: none) and thread counts of the cluster's workers."""
    info = _scheduler_info(client)
    workers = list(info.get("workers", {}).values())
    return ([int(w.get("memory_limit") or 0) for w in workers],
            [int(w.get("nthreads") or 1) for w in workers])


def _scheduler_info(client) -> dict:
    try:
        return client.scheduler_info(n_workers=-1)  # every worker, not only the first few
    except TypeError:  # distributed < 2025: all workers by default
        return client.scheduler_info()


# ------------------------------------------------------------------ memory accounting
#
# What a worker must fit below the fraction ``f`` of its memory limit ``L``
# at which dask spills or pauses (worker_memory_fraction):
#
# * its own memory ``B`` before any data of the fit: the interpreter, dask,
#   numpy, zarr and dkicf themselves (about 150 MiB), measured on the workers
#   by worker_baseline();
# * the chunk states it holds between passes (held_bytes, for the rows of the
#   worker: rows are placed in proportion to the workers' threads);
# * the buffers of the tasks it runs at once, one per thread
#   (task_transient): X as read and in float64, a residual and a product, and
#   with P in Zarr the tail grown by a block and the flushed columns streamed
#   from Zarr.
#
# The tasks may use at most _TASK_SHARE of what the held states leave of the
# room ``f * L - B`` (memory_fits); the rest is for the kernel values of a
# pivot block (task_budget) and slack.

# Fraction of the cluster's memory that the states of a Zarr-backed P may hold
# between passes (four vectors and one tail per row): an upper bound on its
# Zarr chunk width besides what the workers' room allows (zarr_width).
_STORE_HOLD_FRACTION = 0.5
# Share of a worker's free room (room less held states) that the tasks running
# at once may use for their buffers.
_TASK_SHARE = 0.75
# Share of that free room, per thread, for the buffers of one group of chunks
# (work_chunks).
_GROUP_SHARE = 0.5
# Fraction of a thread's share of the free room that the kernel values of one
# pivot block may take (task_budget, BlockSizer).
_GROUP_MEMORY_FRACTION = 0.25
# Float64 vectors of n rows that a Zarr-backed state holds besides its tail of
# P (residual diagonal, its spare buffer, kernel row terms, a squared-norm buffer).
_STATE_VECTORS = 4
# Rows of a Zarr chunk of P at most (checkpoint.p_rows_for): a streamed tile
# of flushed columns holds whole Zarr chunks of rows.
_P_ROWS = 8192
# Seconds during which one measurement of the workers is reused: the plan and
# the checks of one fit then see the same figures.
_BASELINE_TTL = 60.0
_BASELINES: dict = {}
# Modules whose import a fit's tasks pay on a worker (part of its own memory).
_TASK_MODULES = ("dkicf._chunk", "dkicf.pivoting", "dkicf.io", "dkicf.kmeans", "zarr")
_THRESHOLDS = ("target", "spill", "pause", "terminate")


def _smallest_threshold(values) -> float:
    """The smallest of dask's memory thresholds that are set (1.0 if none is)."""
    return min((float(v) for v in values if v is not None and v is not False), default=1.0)


def _probe(dask_worker=None) -> dict:
    """On a worker: its own memory and memory thresholds, after importing what tasks import.

    Run with ``client.run``.  ``own``: resident memory less dask's data, that
    is the worker process itself (interpreter, libraries, allocator and BLAS
    buffers) and anything it holds outside dask's accounting.
    ``fraction``: the smallest of the worker's target, spill and pause
    fractions and of the terminate fraction in its configuration.
    """
    import importlib

    import dask
    import psutil

    for name in _TASK_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - a worker without an optional module
            pass
    rss = psutil.Process().memory_info().rss
    managed = getattr(getattr(dask_worker, "state", None), "nbytes", 0)
    manager = getattr(dask_worker, "memory_manager", None)
    values = [dask.config.get(f"distributed.worker.memory.{name}", None) for name in _THRESHOLDS]
    if manager is not None:
        values[:3] = [getattr(manager, f"memory_{name}_fraction", values[k])
                      for k, name in enumerate(_THRESHOLDS[:3])]
    return {"own": int(max(rss - (managed if isinstance(managed, int) else 0), 0)),
            "fraction": _smallest_threshold(values)}


def _reported_baseline(info: dict) -> int:
    """The largest unmanaged memory (process less managed data) the workers last reported."""
    found = []
    for w in info.get("workers", {}).values():
        metrics = w.get("metrics") or {}
        if "memory" in metrics:
            found.append(int(metrics["memory"]) - int(metrics.get("managed_bytes") or 0))
    return max([max(v, 0) for v in found], default=0)


def _measure(client) -> dict:
    """``{"own": bytes or None, "fraction": float or None, "info": scheduler info}``.

    Measured on the workers with :func:`_probe`, and reused for
    :data:`_BASELINE_TTL` seconds while the workers stay the same.
    """
    import time

    info = _scheduler_info(client)
    workers = tuple(sorted(info.get("workers", {})))
    run = getattr(client, "run", None)
    if run is None or not workers:
        return {"own": None, "fraction": None, "info": info}
    now = time.monotonic()
    for key in [k for k, (t, _) in _BASELINES.items() if now - t > _BASELINE_TTL]:
        del _BASELINES[key]
    key = (id(client), workers)
    if key not in _BASELINES:
        try:
            found = run(_probe)
        except Exception:  # a worker that left meanwhile, or remote functions refused
            found = {}
        probes = [v for v in found.values() if isinstance(v, dict)]
        _BASELINES[key] = (now, {
            "own": max((int(v["own"]) for v in probes), default=None),
            "fraction": min((float(v["fraction"]) for v in probes), default=None),
        })
    return {**_BASELINES[key][1], "info": info}


def worker_baseline(client) -> int:
    """Bytes of memory that the largest worker process uses before holding any of a fit's data.

    Measured on every worker (``client.run``) after importing the modules
    that the fit's tasks import: resident memory less the data dask manages
    there.  A dask worker with numpy, zarr and dkicf loaded uses about
    150 MiB this way.  Falls back to the unmanaged memory that the workers
    last reported to the scheduler, then to 0.  One measurement is reused
    for :data:`_BASELINE_TTL` seconds while the workers stay the same, so
    that a fit's plan and its checks agree.

    Parameters
    ----------
    client : distributed.Client
        The cluster's client (anything with ``scheduler_info``; ``run`` if it has one).

    Returns
    -------
    int
        Bytes, the largest over the workers.
    """
    found = _measure(client)
    return found["own"] if found["own"] is not None else _reported_baseline(found["info"])


def worker_memory_fraction(client) -> float:
    """Fraction of the workers' memory limit that a fit may fill on this cluster.

    :func:`usable_memory_fraction` when this process's dask configuration
    sets the workers' memory thresholds otherwise than distributed's
    defaults (an explicit choice); else the smallest threshold that the
    workers themselves use, measured with :func:`worker_baseline` (they may
    have been configured otherwise than this process); else
    :func:`usable_memory_fraction`.

    Parameters
    ----------
    client : distributed.Client

    Returns
    -------
    float
    """
    driver = usable_memory_fraction()
    if _configured_here():
        return driver
    measured = _measure(client)["fraction"]
    return driver if measured is None else measured


def _configured_here() -> bool:
    """Whether this process sets a worker memory threshold otherwise than distributed's default."""
    import dask

    for name in _THRESHOLDS:
        key = f"distributed.worker.memory.{name}"
        default = None
        for defaults in dask.config.defaults:
            node = defaults
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                default = node
        if default is not None and dask.config.get(key, None) != default:
            return True
    return False


class _Workers:
    """The figures of a cluster's workers that the memory accounting uses.

    ``limit`` is the smallest worker's memory limit, ``threads`` the most
    threads of a worker, ``share`` the largest fraction of the cluster's
    threads on one worker (its fraction of the rows), ``baseline`` the
    largest worker's own memory and ``fraction`` the share of a limit that
    a fit may fill (:func:`worker_memory_fraction`).
    """

    def __init__(self, limits, threads, baseline: int, fraction: float | None = None):
        self.limits = [int(v) for v in limits]
        self.limit = min(self.limits)
        self.count = len(self.limits)
        self.threads = max(1, max(threads))
        self.share = self.threads / max(sum(threads), 1)
        self.baseline = int(baseline)
        self.fraction = usable_memory_fraction() if fraction is None else fraction

    @classmethod
    def of(cls, client) -> _Workers | None:
        """The cluster's figures, or None when a worker has no memory limit."""
        limits, threads = _worker_resources(client)
        if not limits or not all(v > 0 for v in limits):
            return None
        return cls(limits, threads, worker_baseline(client), worker_memory_fraction(client))

    @property
    def room(self) -> float:
        """Bytes of a worker's memory that the fit may fill: ``fraction * limit - baseline``."""
        return self.fraction * self.limit - self.baseline

    def rows(self, n: int) -> int:
        """Rows of ``n`` that the busiest worker holds (rows follow threads)."""
        return min(int(n), math.ceil(n * self.share))

    def threshold(self) -> tuple[str, str]:
        """``("60% of", ", at which dask ...")``: how messages name the usable fraction."""
        if self.fraction >= 1:
            return "all of", ""
        return (f"{self.fraction:.0%} of",
                ", at which dask starts spilling to disk or pausing the worker")


def usable_memory_fraction() -> float:
    """Fraction of a worker's memory limit that a fit may fill.

    The smallest of dask's worker memory thresholds that are set (``target``
    and ``spill``, at which a worker spills data to disk, ``pause`` and
    ``terminate``; 0.6 by default), as configured in the driver's process
    (the workers of a cluster started elsewhere may be configured otherwise).
    Consecutive states of a chunk share their buffers, so spilling one frees
    nothing: it only pickles P to disk, seconds per pass, and a worker that
    passes ``pause`` stops running tasks.  The workers' own memory
    (:func:`worker_baseline`) counts against it too.  For a cluster, see
    :func:`worker_memory_fraction`: the thresholds the workers use when this
    process does not set them.
    """
    import dask

    try:  # dask reads distributed's defaults when it is imported
        import distributed  # noqa: F401
    except ImportError:  # pragma: no cover - distributed is a dependency
        pass
    return _smallest_threshold(
        dask.config.get(f"distributed.worker.memory.{name}", None) for name in _THRESHOLDS)


def held_bytes(n: int, d: int, itemsize: int, capacity: int, persist: bool,
               columns: int | None = None) -> int:
    """Bytes that the chunk states of ``n`` rows hold in worker memory between passes.

    With P in memory (``columns=None``): its ``capacity`` columns and three
    vectors.  With P in Zarr: :data:`_STATE_VECTORS` vectors and two tails of
    ``columns`` columns (after a flush, the state before it keeps the old
    tail until the next pass).  With ``persist``, X as stored too.
    """
    x = n * d * itemsize if persist else 0
    if columns is None:
        return n * (8 * capacity + 8 * 3) + x
    return n * 8 * (_STATE_VECTORS + 2 * columns) + x


def stream_bytes(rows: int, capacity: int, p_rows: int = _P_ROWS) -> int:
    """Bytes of flushed columns of P that a task of ``rows`` rows reads from Zarr at once.

    Tiles of about ``_chunk._STREAM_BYTES``, but never less than one Zarr
    chunk of ``p_rows`` rows by every flushed column (fewer than ``capacity``),
    nor more than the task's rows.
    """
    tile = max(_chunk._STREAM_BYTES, 8 * p_rows * capacity)
    return int(min(8 * rows * capacity, tile))


def task_transient(rows: int, d: int, itemsize: int, columns: int | None = None,
                   stream: int = 0) -> int:
    """Bytes that one task of a pass over ``rows`` rows allocates besides the held states.

    X as read and in float64, a residual vector and a product; with P in
    Zarr (``columns`` per Zarr chunk) also the tail grown by a pivot block
    before its full columns are flushed, and ``stream`` bytes of flushed
    columns read from Zarr (:func:`stream_bytes`).  The kernel values of a
    block are budgeted apart (:func:`task_budget`).
    """
    per_row = d * (itemsize + 8) + 8 * 2
    if columns is None:
        return rows * per_row
    return rows * (per_row + 8 * columns) + int(stream)


def pass_transient(rows: int, d: int, itemsize: int, capacity: int, columns: int | None,
                   p_rows: int | None) -> int:
    """:func:`task_transient` of one task of a pass over ``rows`` rows, with P in
    Zarr (``columns`` per Zarr chunk) the flushed columns it streams included."""
    stream = 0 if columns is None else stream_bytes(rows, capacity, p_rows)
    return task_transient(rows, d, itemsize, columns, stream)


def memory_fits(room: float, held: float, threads: int, transient: float) -> bool:
    """Whether states holding ``held`` bytes and ``threads`` tasks of ``transient`` bytes
    fit a worker's ``room`` (``fraction * limit - baseline``): the tasks within
    :data:`_TASK_SHARE` of what the states leave."""
    free = room - held
    return free > 0 and threads * transient <= _TASK_SHARE * free


def largest_rows(fits, hi: int) -> int:
    """The largest ``r`` in ``[1, hi]`` with ``fits(r)`` (monotone: fewer rows fit
    better), or 0 if none does."""
    lo, hi = 0, int(hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def store_width(room: float, rows: int, threads: int, cap: int,
                p_rows: int = _P_ROWS) -> int:
    """Columns per Zarr chunk of P that a worker holding ``rows`` rows can afford (0: none).

    The largest ``cb <= cap`` for which the held states (:func:`held_bytes`)
    and one task per thread over all the worker's rows (their tails grown and
    the flushed columns streamed, X left out) fit ``room``
    (:func:`memory_fits`).
    """
    per_task = max(1, math.ceil(rows / max(threads, 1)))

    def fits(cb: int) -> bool:
        transient = pass_transient(per_task, 0, 8, cap, cb, p_rows)  # X left out: d = 0
        return memory_fits(room, held_bytes(rows, 0, 8, cap, False, cb), threads, transient)

    return largest_rows(fits, cap)


def zarr_width(workers: _Workers, n: int, cap: int) -> int:
    """Columns per Zarr chunk of P for ``n`` rows on these workers (0: none fits).

    :func:`store_width` for the busiest worker's rows, and at most what
    keeps the tails and vectors of all rows within
    :data:`_STORE_HOLD_FRACTION` of the cluster's memory.
    """
    cb = store_width(workers.room, workers.rows(n), workers.threads, cap)
    hold = _STORE_HOLD_FRACTION * workers.limit * workers.count
    return max(0, min(cb, int((hold - 8 * _STATE_VECTORS * n) // (8 * max(n, 1)))))


def least_limit(workers: _Workers, n: int, cap: int) -> float:
    """Smallest memory limit per worker at which P in Zarr fits ``n`` rows (a column a chunk)."""
    rows = workers.rows(n)
    per_task = max(1, math.ceil(rows / workers.threads))
    held = held_bytes(rows, 0, 8, cap, False, 1)
    transient = pass_transient(per_task, 0, 8, cap, 1, _P_ROWS)  # X left out: d = 0
    room = held + workers.threads * transient / _TASK_SHARE
    hold = 8 * (_STATE_VECTORS + 1) * n / (_STORE_HOLD_FRACTION * workers.count)
    return max((room + workers.baseline) / workers.fraction, hold)


def store_columns(client, n: int, capacity: int, largest: int) -> int:
    """Columns per Zarr chunk of P when P lives in Zarr: as many as memory allows.

    Between passes every chunk keeps fewer than this many columns of P in
    memory (its tail, twice after a flush), besides a few vectors of its
    rows, and a task grows its tail by a pivot block and streams the
    flushed columns.  The width is the largest, up to ``largest``, for
    which all that fits what the workers' own memory leaves below dask's
    spill threshold (:func:`zarr_width`).  Without memory limits it is
    ``largest``.

    Raises
    ------
    ValueError
        When even one column per chunk does not fit: the message says how
        much memory a worker needs at least.
    """
    cap = max(1, min(largest, capacity))
    workers = _Workers.of(client)
    if workers is None:
        return cap
    rows = workers.rows(n)
    cb = zarr_width(workers, n, cap)
    if cb < 1:
        need = least_limit(workers, n, cap)
        threshold, where = workers.threshold()
        raise ValueError(
            f"{n} rows need about {_gib(need)} of memory per worker even with P in Zarr "
            f"({rows} rows on the busiest of {workers.count} workers: the residual diagonal "
            f"and a column of P per row, the flushed columns streamed, and "
            f"{_gib(workers.baseline)} for the worker process itself), so that they stay "
            f"below {threshold} the smallest worker's memory limit of "
            f"{_gib(workers.limit)}{where}. Add workers or give them more memory "
            f"(at least {_gib(need)} each)."
        )
    return min(cb, cap)


def task_budget(limits, threads, n: int, store, *, baseline: int = 0,
                held: float | None = None) -> float:
    """Bytes the kernel values of one task's pivot block may take.

    :data:`_GROUP_MEMORY_FRACTION` of a thread's share of what the smallest
    worker has free: :func:`usable_memory_fraction` of its limit, less its
    own memory ``baseline`` and ``held``, the states it holds between passes
    (by default, with ``store``, its rows' vectors and tails of P, see
    :func:`held_bytes`).  Infinite without memory limits.
    """
    known = [lim for lim in limits if lim > 0]
    if not known:
        return float("inf")
    workers = _Workers(known, list(threads) or [1], baseline)
    if held is None:
        held = 0.0 if store is None else held_bytes(
            workers.rows(n), 0, 8, store.columns, False, store.columns)
    free = max(workers.room - held, 0.0)
    return _GROUP_MEMORY_FRACTION * free / workers.threads


def _p_rows(chunks) -> int:
    """Rows per Zarr chunk of P for these row chunks (see checkpoint.p_rows_for)."""
    from .checkpoint import p_rows_for

    return p_rows_for(tuple(int(c) for c in chunks)) or int(max(chunks))


def work_chunks(client, chunks, d: int, dtype, capacity: int, store,
                hold_x: bool = False, homes: list | None = None) -> tuple[int, ...]:
    """Row counts of the tasks of one pass: consecutive chunks of X grouped.

    About one group per worker thread, each allocating at most
    :data:`_GROUP_SHARE` of a thread's share of what the smallest worker
    has free once its own memory and the states it holds (P's columns or
    tails, vectors, X with ``hold_x``) are counted (see
    :func:`task_transient`), never splitting a chunk.  With P in Zarr the
    groups stay aligned with its Zarr chunks, whose rows divide every chunk
    of X.  ``homes`` (the worker holding each chunk, for X in worker
    memory): only neighbours on the same worker are grouped, each run of
    them into about its worker's threads times its share of that worker's
    rows.
    """
    chunks = tuple(int(c) for c in chunks)
    limits, threads = _worker_resources(client)
    n_threads = max(1, sum(threads))
    m = len(chunks)
    if homes is None and m <= n_threads:
        return chunks
    itemsize = np.dtype(dtype).itemsize
    columns = None if store is None else store.columns
    starts = np.concatenate([[0], np.cumsum(chunks)])
    n = int(starts[-1])
    workers = _Workers.of(client)
    transient = None
    if workers is not None:
        held = held_bytes(max(workers.rows(n), max(chunks)), d, itemsize, capacity,
                          hold_x, columns)
        budget = _GROUP_SHARE * max(workers.room - held, 0.0) / workers.threads
        p_rows = _p_rows(chunks) if store is not None else _P_ROWS

        def transient(rows):
            return pass_transient(rows, d, itemsize, capacity, columns, p_rows)

    def cut(part: tuple[int, ...], least: int) -> tuple[int, ...]:
        """``part`` in at least ``least`` groups of nearly equal rows that fit the budget."""
        k = len(part)
        edges = np.concatenate([[0], np.cumsum(part)])
        rows = int(edges[-1])
        for g in range(min(least, k), k + 1):
            # Cut at the chunk boundaries nearest to equal shares of rows.
            t = np.arange(1, g) * rows / g
            up = np.clip(np.searchsorted(edges, t), 1, k)
            near = np.where(t - edges[up - 1] < edges[up] - t, up - 1, up)
            cuts = np.unique(np.concatenate([[0], near, [k]]))
            sizes = np.diff(edges[cuts])
            sizes = sizes[sizes > 0]
            if len(sizes) >= k or transient is None or transient(int(sizes.max())) <= budget:
                return tuple(int(v) for v in sizes)
        return part

    if homes is None:
        return cut(chunks, n_threads)
    info = _scheduler_info(client).get("workers", {})
    held: dict = {}
    for c, h in zip(chunks, homes):
        held[h] = held.get(h, 0) + c
    out: list[int] = []
    j = 0
    while j < m:
        k = j
        while k < m and homes[k] == homes[j]:
            k += 1
        run = chunks[j:k]
        own = int((info.get(homes[j]) or {}).get("nthreads") or 1)
        share = max(1, round(own * sum(run) / max(held[homes[j]], 1)))
        out += cut(run, share)
        j = k
    return tuple(out)


def check_worker_memory(client, chunks, d: int, dtype, capacity: int, store, persist: bool,
                        *, hold_x: bool | None = None):
    """Refuse, before any work, a fit whose data cannot fit in the workers' memory.

    A worker holds its own memory (:func:`worker_baseline`), the chunk
    states of its rows between passes (:func:`held_bytes`: P's columns, or
    with ``store`` only tails of them, vectors, and X if held) and the
    buffers of one task per thread (:func:`task_transient`); all of it must
    fit below the :func:`worker_memory_fraction` of the smallest worker's
    limit (:func:`memory_fits`).  The message says what to change: smaller
    row chunks, P in Zarr, or more memory.  ``hold_x`` says whether X is
    held in worker memory (default: ``persist`` with P in memory; a
    Zarr-backed fit's caller says so itself).
    """
    workers = _Workers.of(client)
    if workers is None:
        return
    itemsize = np.dtype(dtype).itemsize
    hold_x = (persist and store is None) if hold_x is None else hold_x
    columns = None if store is None else store.columns
    rows = max(chunks)
    n = int(sum(chunks))
    share = workers.rows(n)
    p_rows = _p_rows(chunks) if store is not None else _P_ROWS

    def transient(r: int) -> int:
        return pass_transient(r, d, itemsize, capacity, columns, p_rows)

    def held(r: int) -> int:
        return held_bytes(max(share, r), d, itemsize, capacity, hold_x, columns)

    room, T = workers.room, workers.threads
    if memory_fits(room, held(rows), T, transient(rows)):
        return
    threshold, where = workers.threshold()
    own = _gib(workers.baseline)
    if room <= 0:
        raise ValueError(
            f"the dask workers use about {own} each before holding any data (the worker "
            f"process and the libraries a fit imports), more than {threshold} the smallest "
            f"worker's memory limit of {_gib(workers.limit)}{where}. Give the workers more "
            "memory."
        )

    def alone(r: int) -> bool:  # a worker holding this chunk's state only
        state = held_bytes(r, d, itemsize, capacity, hold_x, columns)
        return memory_fits(room, state, T, transient(r))

    if not alone(rows) or memory_fits(room, held(1), T, transient(1)):
        # The chunk itself is too large: name it and say how small to make it.
        j = int(np.argmax(chunks))
        fit = largest_rows(lambda r: memory_fits(room, held(r), T, transient(r)), rows)
        fit = fit or largest_rows(alone, rows)
        need = workers.baseline + held_bytes(rows, d, itemsize, capacity, hold_x, columns) + (
            T * transient(rows))
        raise ValueError(
            f"row chunk {j} of X ({rows} rows) needs about {_gib(need)} on its worker "
            f"(X rows in float64, {capacity if store is None else columns} columns of P "
            f"per row, and {own} for the worker process itself), more than {threshold} the "
            f"smallest worker's memory limit of {_gib(workers.limit)}{where}. Use "
            f"X.rechunk({{0: {max(1, fit // 2)}}}) or larger workers."
        )
    total = workers.count * (workers.baseline + held(1) + T * transient(1))
    if store is None:
        raise ValueError(
            f"P ({n} x {capacity} float64) and the data held in worker memory need about "
            f"{_gib(total)} with the worker processes' own {own} each, more than {threshold} "
            f"the cluster's {_gib(sum(workers.limits))}{where}. Pass p_store='path-or-url.zarr' "
            "to keep P in Zarr (and persist=False to re-read X), or add workers or memory."
        )
    raise ValueError(
        f"{n} rows need about {_gib(total)} of worker memory in all even with P in Zarr "
        f"({columns} columns a chunk, the residual diagonal, the flushed columns streamed"
        f"{', X held' if hold_x else ''} and the worker processes' own {own} each), more "
        f"than {threshold} the cluster's {_gib(sum(workers.limits))}{where}. "
        + ("Pass persist=False to re-read X, or add " if hold_x else "Add ")
        + "workers or give them more memory."
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


_INLINE_BLOCK_BYTES = 1 << 20
# Candidate statistics an update pass may send as events, over all chunks
# (residuals and row indices; each entry is a Python number in the
# scheduler's event log until the fit ends).  Larger requests are mapped.
_PREFETCH_ENTRIES = 1 << 16


def _block_nbytes(block: _chunk.PivotBlock) -> int:
    return block.rows.nbytes + block.U.nbytes + block.L.nbytes + 64


