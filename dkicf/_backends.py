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

import math

import numpy as np

from . import _chunk
from .kernels import Kernel


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
        if restore is None:
            self.state = _chunk.chunk_init(self.X, kernel, 0, capacity, checked=checked)
        else:
            spec, point = restore
            self.step = int(point["iteration"])
            self.state = _chunk.chunk_restore(
                self.X, None, spec, kernel, 0, capacity, None, point, stored=False
            )
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
        """``[func(X, state, 0, *args)]``: the whole dataset is one chunk."""
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
    (:func:`work_chunks`), placed evenly over the workers.  The chunk states
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
            self.client, self.input_chunks, self.d, X.dtype, capacity, store, persist
        )
        # Consecutive row chunks are grouped into one task each, about one per
        # worker thread (as memory allows): the per-pass cost of the scheduler
        # grows with the number of tasks, not with their size.
        sizes = work_chunks(self.client, self.input_chunks, self.d, X.dtype, capacity, store)
        input_starts = np.concatenate([[0], np.cumsum(self.input_chunks)]).astype(np.int64)
        if len(sizes) < len(self.input_chunks):
            X = X.rechunk({0: sizes})
        self.chunks = tuple(int(c) for c in X.chunks[0])
        # What a task may spend on a block's kernel columns (see BlockSizer).
        self.task_bytes = task_budget(*_worker_resources(self.client), self.n, store)
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
        # Where each chunk's state starts: consecutive chunks on the same
        # worker, rows shared in proportion to the workers' threads.  Later
        # tasks follow the states, so the passes stay balanced.
        self._home = _placement(self.client, self.chunks)
        if persist:
            # Each chunk copied once into memory the worker allocated itself:
            # chunks unpickled from a transfer can sit in buffers that BLAS
            # reads at half speed, and every pass reads them.
            raw = self.client.compute(self._x_blocks)
            self._x_futs = [
                self.client.submit(
                    _own_copy, r, key=f"icf-x-{self.token}-{j}", **self._where(j)
                )
                for j, r in enumerate(raw)
            ]
            del raw
        self.step = 0
        self._events = _EventInbox(self.client, f"dkicf-icf-{self.token}")
        if restore is None:
            self.states = [
                self.client.submit(
                    _chunk.chunk_init, self._x(j), kernel, int(off), capacity,
                    self._labels[j], store, key=f"icf-init-{self.token}-{j}", **self._where(j),
                )
                for j, off in enumerate(self.offsets[:-1])
            ]
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
        return _merge_summaries(self.client.gather(futs), m)

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
        js, local = self._locate(index)
        groups: dict[int, list[int]] = {}
        for pos, j in enumerate(js):
            groups.setdefault(int(j), []).append(pos)
        futs = [
            self.client.submit(
                _chunk.chunk_rows, self._x(j), self.states[j], local[pos],
                key=f"icf-rows-{self.token}-{self.step}-{j}",
            )
            for j, pos in groups.items()
        ]
        parts = self.client.gather(futs)
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
        if prefetch is not None and (prefetch[2].count + 1) * len(self.states) > _PREFETCH_ENTRIES:
            prefetch = None
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
        parts = None if inbox is None else inbox.collect(self.step, self.states)
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
        from distributed import wait

        wait(new)
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
        return out

    def rebase_from(self, spec: _chunk.StoreSpec, point: dict) -> None:
        """Cut the lineage at a committed checkpoint: states become leaf tasks reading Zarr.

        As in :meth:`_rebase`, a worker that still holds a state reuses it;
        a lost state is read back from the checkpoint instead of replayed.
        """
        from distributed import wait

        new = self._restore_tasks(spec, point, previous=self.states)
        wait(new)
        self.states = new
        self._last_rebase = self.step

    def _each_chunk(self, name: str, func, *args) -> None:
        futs = self._map(name, func, self.states, *args, each=(True,) + (False,) * len(args))
        self.client.gather(futs)

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
        return self.client.gather(futs)

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
        self._events.close()

    def abort(self) -> None:
        """After a failure: cancel the fit's futures at once.

        The scheduler then forgets them, and the failed tasks under them,
        before the caller submits anything else.  Left to garbage collection
        they would live as long as the exception that carries this backend,
        and a retry made inside the ``except`` block (``resume=True``) would
        meet the failed keys of X's chunks again.
        """
        futures = [f for f in list(self.states or []) + list(self._x_futs or [])
                   if f is not None]
        self.states, self._x_futs = [], None
        try:
            self.client.cancel(futures)
        except Exception:  # pragma: no cover - the cluster itself is gone
            pass


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
        """The summaries of ``step`` in chunk order, or None to fetch them with tasks."""
        import time

        if not self._subscribed:
            return None
        wanted = [(step, j) for j in range(len(futures))]
        done_since = None
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


def _drop_topic(topic: str, dask_scheduler=None) -> bool:
    """On the scheduler: forget an event topic and its stored events (best effort)."""
    broker = getattr(dask_scheduler, "_broker", None)
    topics = getattr(broker, "_topics", None)
    if topics is None or topic not in topics:
        return False
    topics.pop(topic).truncate()
    return True


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


def _own_copy(x) -> np.ndarray:
    return np.array(x, order="C", copy=True)


def _worker_resources(client) -> tuple[list[int], list[int]]:
    """Memory limits (0: none) and thread counts of the cluster's workers."""
    try:
        info = client.scheduler_info(n_workers=-1)  # every worker, not only the first few
    except TypeError:  # distributed < 2025: all workers by default
        info = client.scheduler_info()
    workers = list(info.get("workers", {}).values())
    return ([int(w.get("memory_limit") or 0) for w in workers],
            [int(w.get("nthreads") or 1) for w in workers])


# Fraction of the cluster's memory that the states of a Zarr-backed P may hold
# between passes (residual diagonal, its spare buffer, kernel row terms, tail).
_STORE_HOLD_FRACTION = 0.5
# Float64 vectors of n rows that a state holds besides its tail of P.
_STATE_VECTORS = 4


def store_columns(client, n: int, capacity: int, largest: int) -> int:
    """Columns per Zarr chunk of P when P lives in Zarr: as many as memory allows.

    Between passes every chunk keeps fewer than this many columns of P in
    memory (its tail), besides a few vectors of its rows.  The width is the
    largest, up to ``largest``, whose tails over all ``n`` rows fit in
    :data:`_STORE_HOLD_FRACTION` of the cluster's memory, rows spread evenly
    over the workers.  Without memory limits it is ``largest``.
    """
    limits, _ = _worker_resources(client)
    cap = max(1, min(largest, capacity))
    if not limits or not all(limits):
        return cap
    budget = _STORE_HOLD_FRACTION * min(limits) * len(limits)
    fixed = 8 * _STATE_VECTORS * n
    cb = int((budget - fixed) // (8 * n))
    if cb < 1:
        need = (fixed + 8 * n) / _STORE_HOLD_FRACTION
        raise ValueError(
            f"{n} rows need about {_gib(need)} of worker memory in all even with P in Zarr "
            f"(the residual diagonal and a column of P per row), more than the cluster's "
            f"{_gib(min(limits) * len(limits))}. Add workers or give them more memory."
        )
    return min(cb, cap)


# Fraction of a worker thread's share of memory that one grouped task may hold.
_GROUP_MEMORY_FRACTION = 0.25


def task_budget(limits, threads, n: int, store) -> float:
    """Bytes one task of a pass may hold: a quarter of a thread's share of memory.

    The share is of the smallest worker's limit, less, with P in Zarr, what
    every worker holds between passes (its rows' tails of P and vectors, see
    :func:`store_columns`).  Infinite without memory limits.
    """
    known = [lim for lim in limits if lim > 0]
    if not known:
        return float("inf")
    free = min(known)
    if store is not None:
        held = 8 * (_STATE_VECTORS + store.columns) * n / max(len(limits), 1)
        free = max(free - held, 0.25 * free)
    return _GROUP_MEMORY_FRACTION * free / max(threads)


def work_chunks(client, chunks, d: int, dtype, capacity: int, store) -> tuple[int, ...]:
    """Row counts of the tasks of one pass: consecutive chunks of X grouped.

    About one group per worker thread, each holding at most a quarter of a
    thread's share of the smallest worker's memory (X in float64 and as
    stored, P's columns in memory, a few vectors), never splitting a chunk.
    With P in Zarr, the share is of the memory that the states held between
    passes leave free.
    With P in Zarr the groups stay aligned with its Zarr chunks, whose rows
    divide every chunk of X.
    """
    chunks = tuple(int(c) for c in chunks)
    limits, threads = _worker_resources(client)
    n_threads = max(1, sum(threads))
    m = len(chunks)
    if m <= n_threads:
        return chunks
    width = capacity if store is None else store.columns
    per_row = 8 * d + np.dtype(dtype).itemsize * d + 8 * width + 8 * 6
    starts = np.concatenate([[0], np.cumsum(chunks)])
    n = starts[-1]
    budget = task_budget(limits, threads, n, store)
    for g in range(n_threads, m + 1):
        # Cut at the chunk boundaries nearest to equal shares of rows.
        t = np.arange(1, g) * n / g
        up = np.clip(np.searchsorted(starts, t), 1, m)
        near = np.where(t - starts[up - 1] < starts[up] - t, up - 1, up)
        cuts = np.unique(np.concatenate([[0], near, [m]]))
        sizes = np.diff(starts[cuts])
        sizes = sizes[sizes > 0]
        if sizes.max() * per_row <= budget or len(sizes) >= m:
            return tuple(int(v) for v in sizes)
    return chunks


def usable_memory_fraction() -> float:
    """Fraction of a worker's memory limit that chunk states may fill.

    The smallest of dask's worker memory thresholds that are set (``target``
    and ``spill``, at which a worker spills data to disk, ``pause`` and
    ``terminate``; 0.6 by default), as configured in the driver's process
    (the workers of a cluster started elsewhere may be configured otherwise).
    Consecutive states of a chunk share their buffers, so spilling one frees
    nothing: it only pickles P to disk, seconds per pass, and a worker that
    passes ``pause`` stops running tasks.
    """
    import dask

    fractions = []
    for name in ("target", "spill", "pause", "terminate"):
        value = dask.config.get(f"distributed.worker.memory.{name}", None)
        if value is not None and value is not False:
            fractions.append(float(value))
    return min(fractions, default=1.0)


def held_bytes(n: int, d: int, itemsize: int, capacity: int, persist: bool) -> int:
    """Bytes that the chunk states of ``n`` rows (P in memory at ``capacity``
    columns and their vectors) and, with ``persist``, X hold in worker memory."""
    return n * (8 * capacity + 8 * 3) + (n * d * itemsize if persist else 0)


def check_worker_memory(client, chunks, d: int, dtype, capacity: int, store, persist: bool):
    """Refuse, before any work, a row chunk that cannot fit in a worker's memory.

    A task holds the chunk of X (as given and in float64), the chunk's state
    (its rows of P, or only a one-block tail with ``store``), a few vectors,
    and with ``store`` the group of flushed columns it streams; all of it
    must fit below the :func:`usable_memory_fraction` of the smallest
    worker's limit.  A P that cannot fit in that fraction of the whole
    cluster's memory is refused too, with the suggestion to keep it in Zarr.
    """
    limits, _ = _worker_resources(client)
    limits = [m for m in limits if m > 0]
    if not limits:
        return
    fraction = usable_memory_fraction()
    threshold = f"{fraction:.0%} of" if fraction < 1 else "all of"
    rows = max(chunks)
    width = capacity if store is None else store.columns
    per_row = 8 * d + np.dtype(dtype).itemsize * d + 8 * width + 8 * 6
    need = rows * per_row + (_chunk._STREAM_BYTES if store is not None else 0)
    smallest = min(limits)
    where = (", at which dask starts spilling to disk or pausing the worker"
             if fraction < 1 else "")
    if need > fraction * smallest:
        j = int(np.argmax(chunks))
        fit = max(1, int(0.5 * (fraction * smallest - (need - rows * per_row)) // per_row))
        raise ValueError(
            f"row chunk {j} of X ({rows} rows) needs about {_gib(need)} in one task "
            f"(X rows in float64 plus {width} columns of P), more than {threshold} the "
            f"smallest worker's memory limit of {_gib(smallest)}{where}. Use "
            f"X.rechunk({{0: {fit}}}) or larger workers."
        )
    n = int(sum(chunks))
    if store is None:
        total = held_bytes(n, d, np.dtype(dtype).itemsize, capacity, persist)
        if total > fraction * sum(limits):
            raise ValueError(
                f"P ({n} x {capacity} float64) and the data held in worker memory need about "
                f"{_gib(total)}, more than {threshold} the cluster's {_gib(sum(limits))}{where}. "
                "Pass p_store='path-or-url.zarr' to keep P in Zarr (and persist=False to "
                "re-read X), or add workers or memory."
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


