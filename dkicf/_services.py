"""Cluster services shared by the engine and the k-means.

What a distributed stage needs besides its algorithm: chunks read lazily
inside tasks, BLAS threads limited per task, chunk digests (the data's
fingerprint), summaries sent as dask events and their inbox on the driver,
the placement of row chunks on workers, and the scheduler-side checks that
unstick or diagnose a pass that waits.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import mmap
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np
from threadpoolctl import ThreadpoolController

from ._cluster import get_client

_CONTROLLER: ThreadpoolController | None = None


@runtime_checkable
class ChunkBackend(Protocol):
    """What every backend of dkicf is: row chunks of one matrix, in this process or
    on a cluster, read by chunk tasks (numpy arrays here, dask futures there).

    The factorization's :class:`~dkicf._backends.FactorBackend` (chunks of X and
    their states) and the k-means' :class:`~dkicf._kmeans_tasks.KMeansBackend`
    (chunks of P) extend it with their own passes; both have a numpy and a
    dask implementation.
    """

    n: int

    def rows(self, index) -> Any:
        """The rows at the global indices ``index`` (and what the backend keeps with them)."""

    def close(self) -> None:
        """Release the threads, futures and subscriptions of the fit."""


_LIMIT_LOCK = threading.Lock()
_SHARED_LIMIT: dict = {"holders": 0, "limits": None, "limiter": None}


class _BlasLimit:
    """One holder of the process's shared BLAS thread limit (see :func:`threadpool_limits`).

    A context manager, or held until :meth:`restore_original_limits`.
    """

    def __init__(self, limits: int):
        global _CONTROLLER
        self._own, self._held = None, False
        with _LIMIT_LOCK:
            if _CONTROLLER is None:
                _CONTROLLER = ThreadpoolController()
            shared = _SHARED_LIMIT
            if shared["holders"] and shared["limits"] != limits:
                # Another limit is held: this one is set on its own, as threadpoolctl does.
                self._own = _CONTROLLER.limit(limits=limits, user_api="blas")
                return
            if not shared["holders"]:
                shared["limiter"] = _CONTROLLER.limit(limits=limits, user_api="blas")
                shared["limits"] = limits
            shared["holders"] += 1
        self._held = True

    def restore_original_limits(self) -> None:
        """Let go of the limit; the last holder restores the threads the process had."""
        if self._own is not None:
            own, self._own = self._own, None
            own.restore_original_limits()
            return
        with _LIMIT_LOCK:
            if not self._held:
                return
            self._held = False
            shared = _SHARED_LIMIT
            shared["holders"] -= 1
            if not shared["holders"]:
                shared["limiter"].restore_original_limits()
                shared["limiter"] = shared["limits"] = None

    def __enter__(self) -> _BlasLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.restore_original_limits()


def threadpool_limits(limits: int = 1) -> _BlasLimit:
    """Limit BLAS threads inside a task; the library scan is done once per process.

    Tasks that overlap in one process (the threads of an in-process dask
    worker, the numpy backends' pools) share one limit: the first to enter
    sets it, the last to leave restores the process's threads.  With a
    limit of their own, one task's exit would give BLAS back its threads
    while another task still computes, and some BLAS products round
    differently with more threads: a fit would not repeat bit for bit.
    """
    return _BlasLimit(limits)


class LazyChunk:
    """A row chunk of X that is read from its source (e.g. Zarr) only inside a task.

    Streaming passes hand tasks this small object instead of a future holding
    the chunk, so no chunk stays in memory longer than the task that reads it.
    It carries only the tasks that produce its chunk (a few reads of the
    source), not the graph of the whole array: every pass ships one per
    task, and the scheduler keeps them while the task's result is in memory.
    """

    __slots__ = ("graph", "key")

    def __init__(self, graph: dict, key):
        self.graph = graph
        self.key = key

    @classmethod
    def row_chunks(cls, X) -> list:
        """One :class:`LazyChunk` per row chunk of the dask array ``X`` (one column chunk)."""
        from dask.core import flatten
        from dask.optimization import cull

        graph = dict(X.__dask_graph__())
        return [cls(cull(graph, [key])[0], key) for key in flatten(X.__dask_keys__())]

    def read(self) -> np.ndarray:
        from dask.local import get_sync

        return np.asarray(get_sync(self.graph, self.key))

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype, copy=False)


def materialize(x):
    """The chunk as a numpy array (reading it if it is a :class:`LazyChunk`)."""
    return x.read() if isinstance(x, LazyChunk) else x


def report_summary(report: tuple, summary: dict) -> None:
    """Send a chunk's summary to the driver as an event of this dask worker.

    The event travels with the worker's task-finished message, so the driver
    learns the summary one scheduler round trip earlier than by running a
    task to fetch it.  Arrays go as their bytes (with shape and dtype), bit
    for bit.
    """
    from distributed import get_worker

    topic, step, chunk = report
    msg = {"step": int(step), "chunk": int(chunk)}
    for key, value in summary.items():
        if isinstance(value, np.ndarray):
            value = {"shape": list(value.shape), "dtype": value.dtype.str,
                     "bytes": value.tobytes()}
        msg[key] = value
    get_worker().log_event(topic, msg)


def summary_from_event(msg: dict) -> dict:
    """The summary dict of :func:`chunk_stats` from a :func:`report_summary` event."""
    out = {}
    for key, value in msg.items():
        if key in ("step", "chunk"):
            continue
        if isinstance(value, dict) and "shape" in value:
            value = np.frombuffer(value["bytes"], dtype=value["dtype"]).reshape(value["shape"])
            value = value.copy()  # writeable, and free of the message's buffer
        group, _, name = key.partition(".")
        if name and group in ("block_stats", "top_rows"):
            out.setdefault(group, {})[name] = value
        else:
            out[key] = value
    return out


def chunk_digest(x: np.ndarray) -> str:
    """Hex digest of a chunk of X's bytes (with its dtype and shape): the data's fingerprint."""
    x = np.ascontiguousarray(x)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{x.dtype.str}{x.shape}".encode())
    h.update(memoryview(x).cast("B"))
    return h.hexdigest()


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
        # Bytes of arrays in the reports received since the scheduler last forgot them.
        self._kept = 0
        try:
            client.subscribe_topic(topic, self._receive)
            self._subscribed = True
        except Exception:  # pragma: no cover - a client without events: summary tasks
            pass

    def _receive(self, event) -> None:
        _, msg = event
        self._kept += sum(len(v["bytes"]) for v in msg.values()
                          if isinstance(v, dict) and "bytes" in v)
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
                    return [summary_from_event(msg) for msg in msgs]
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

    def trim(self, limit: int) -> None:
        """Have the scheduler forget the topic's stored reports once they hold over ``limit``
        bytes of arrays (best effort).

        The scheduler keeps a topic's last events (1,000 by default) for as
        long as it runs.  Reports that carry rows of P would otherwise hold
        up to that many passes' worth of them; the driver has every report
        it collected, and a report still in flight reaches it regardless.
        """
        if not self._subscribed or self._kept <= limit:
            return
        self._kept = 0
        with contextlib.suppress(Exception):  # a scheduler refusing remote functions
            self.client.run_on_scheduler(_forget_events, topic=self.topic)

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
    """On the scheduler: forget the worker restrictions (preferred or strict) of these
    tasks (those that exist)."""
    dropped = 0
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and ts.worker_restrictions:
            ts.worker_restrictions = None
            ts.loose_restrictions = False
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
        # Preferences, and restrictions to workers that are all gone (set where X
        # was held: the replacements hold nothing, and have new addresses).
        stuck = [ts for ts in mine if ts.loose_restrictions or (
            ts.worker_restrictions and not ts.worker_restrictions & set(s.workers))]
        for ts in stuck:
            ts.worker_restrictions = None
            ts.loose_restrictions = False
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


def _forget_events(topic: str, dask_scheduler=None) -> int:
    """On the scheduler: empty an event topic's stored events, keeping its subscribers."""
    topics = getattr(getattr(dask_scheduler, "_broker", None), "_topics", None)
    found = None if topics is None else topics.get(topic)
    if found is None:
        return 0
    count = len(found.events)
    found.truncate()
    return count


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


def _placement(chunks, nthreads: dict) -> list[str | None]:
    """A home worker for each row chunk: consecutive runs, rows in proportion to threads.

    ``nthreads``: the threads of each worker by address, as the fit's plan
    measured them."""
    workers = sorted((addr, int(t or 1)) for addr, t in nthreads.items())
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


def persist_rows(X, client=None):
    """Hold a dask array's row chunks in worker memory, consecutive chunks together.

    Like :meth:`distributed.Client.persist`, but each worker holds one run
    of consecutive row chunks, its rows in proportion to its threads.  A
    factorization of an X held this way runs one task per worker thread and
    pass, and moves no byte of X between workers; an X persisted by dask
    alone is often held interleaved (chunk 0 on worker A, 1 on B, 2 on A,
    ...), and each run of chunks then costs a task of its own every pass.

    Parameters
    ----------
    X : dask.array.Array of shape (n_samples, n_features)
        The rows; its column chunks are merged into one.
    client : distributed.Client, optional
        Defaults to the current client.

    Returns
    -------
    dask.array.Array
        The same rows, computed and held on the workers.  The call returns
        once every chunk is in memory.  Where the chunks were placed is not
        binding afterwards: a chunk lost with its worker is recomputed
        wherever dask chooses.

    Examples
    --------
    >>> from dkicf import incomplete_cholesky, local_cluster, persist_rows
    >>> import dask.array as da
    >>> client = local_cluster(2, 1)  # doctest: +SKIP
    >>> X = persist_rows(da.random.random((100_000, 8), chunks=(12_500, 8)))  # doctest: +SKIP
    >>> res = incomplete_cholesky(X, gamma=0.5, max_rank=50)  # doctest: +SKIP
    """
    import dask.array as da
    from distributed import wait

    if not isinstance(X, da.Array):
        raise TypeError(
            f"persist_rows takes a dask array, not {type(X).__name__}; wrap an array in "
            "memory with dask.array.from_array(X, chunks=(rows, -1))."
        )
    if X.ndim != 2:
        raise ValueError(f"persist_rows takes a 2-D array of rows; this one is {X.ndim}-D.")
    client = get_client(client)
    if X.numblocks[1] != 1:
        X = X.rechunk({1: -1})
    homes = _placement(X.chunks[0], client.nthreads())
    blocks = list(X.to_delayed().ravel())
    futures = [None] * len(blocks)
    for home in dict.fromkeys(homes):
        mine = [j for j, h in enumerate(homes) if h == home]
        where = {} if home is None else {"workers": [home], "allow_other_workers": False}
        for j, f in zip(mine, client.compute([blocks[j] for j in mine], **where)):
            futures[j] = f
    wait(futures)
    for f in futures:
        if f.status == "error":
            f.result()  # raises the chunk's error
    with contextlib.suppress(Exception):  # best effort, as after a fit's first tasks
        client.run_on_scheduler(_drop_preferences, keys=[f.key for f in futures])
    rebuild, args = X.__dask_postpersist__()
    return rebuild({f.key: f for f in futures}, *args)


def chunk_futures(P, client) -> list | None:
    """The futures that hold P's row chunks, where its graph only renames them (a
    factorization's P: each chunk an alias of a future on the workers); else None.

    Computing such a chunk would run the renaming as a task, whose result (the
    same array) a worker keeps under a new key and counts again in its memory.
    """
    from distributed import Future

    graph = dict(P.__dask_graph__())
    found = []
    for key in (k[0] if isinstance(k, list) else k for k in P.__dask_keys__()):
        value = graph.get(key)
        for _ in range(len(graph)):  # a chain of renamings, at most one per key
            if isinstance(value, Future):
                break
            # An alias (dask's task spec) names its target; a plain reference is the key.
            try:
                value = graph[getattr(value, "target", value)]
            except (KeyError, TypeError):  # a task or data, not a renaming
                break
        if not isinstance(value, Future) or value.client is not client:
            return None
        found.append(value)
    return found


def _identity(x):
    return x


def _own_copy(*parts) -> np.ndarray:
    """The row chunks ``parts`` as one new C-ordered array."""
    if len(parts) == 1:
        return np.array(parts[0], order="C", copy=True)
    return np.concatenate(parts, axis=0)


# Buffers at least this large are mapped and faulted in with one system call.
_MAPPED_BYTES = 4 << 20
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def mapped_empty(shape: tuple[int, int], order: str = "C", populate: bool = True) -> np.ndarray:
    """An uninitialised float64 array; a large one is an anonymous memory map whose pages
    are all faulted in with one system call (``MADV_POPULATE_WRITE``).

    Touched for the first time by the code that fills it, a large fresh
    array takes one trap per page, which on a virtual machine costs several
    times the filling itself: 123 MB of mini-batch rows put in place took
    0.34 s in a fresh array and 0.03 + 0.06 s in a populated one.
    ``populate=False`` leaves the first touch to the caller (who may spread
    it over threads).  The page size is the system's: no huge pages are
    asked for (see :func:`dkicf._chunk.empty_columns`).
    """
    nbytes = 8 * math.prod(shape)
    if nbytes < _MAPPED_BYTES:
        return np.empty(shape, dtype=np.float64, order=order)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        try:
            buf.madvise(_POPULATE_WRITE)
        except (OSError, ValueError):  # kernel < 5.14
            pass
    return np.frombuffer(buf, dtype=np.float64).reshape(shape, order=order)


_SCRATCH = threading.local()


def scratch(slot, shape: tuple[int, ...], dtype=np.float64) -> np.ndarray:
    """A C-ordered scratch array of this thread, reused across calls.

    Chunk kernels need temporaries of a block's size (about a megabyte) many
    times per pass.  Fresh arrays of that size are memory maps in a dask
    worker, whose nanny sets a small malloc trim threshold: every block would
    fault in new pages, which made the workers' passes up to twice as slow as
    the same work in one process.  Each thread keeps its own buffers (a few
    MB) for the life of the process; a caller is done with a slot's array
    before it asks for that slot again.
    """
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    dtype = np.dtype(dtype)
    need = math.prod(shape)  # not np.prod: a few microseconds a call, thousands a pass
    buf = bufs.get((slot, dtype))
    if buf is None or buf.shape[0] < need:
        buf = bufs[slot, dtype] = np.empty(need, dtype=dtype)
    return buf[:need].reshape(shape)


def _aligned(x):
    """``x`` itself where BLAS reads it at full speed (contiguous, 16-byte aligned), else
    a C-ordered copy in memory this process allocated.

    A chunk unpickled from a transfer can sit at any offset of its message's
    buffer: a matrix product reads such a chunk at about half speed.
    """
    if isinstance(x, np.ndarray) and (x.flags.c_contiguous or x.flags.f_contiguous) and (
            x.ctypes.data % 16 == 0):
        return x
    return np.array(x, order="C", copy=True)


def _holders(client, X, nthreads: dict | None = None) -> list[str] | None:
    """The worker holding each row chunk of ``X``, if all are in worker memory (else None).

    A chunk held by several workers (a replica, as a computation that
    gathered the chunks leaves) is assigned to one of them: its home in the
    consecutive placement (:func:`_placement` over ``nthreads``, by default
    the client's) if that is one of them, else the worker of the chunk
    before it, else the one with the fewest rows so far.  Taking always the
    first would pile every replicated chunk on one worker.
    """
    from dask.core import flatten

    keys = list(flatten(X.__dask_keys__()))
    try:
        found = client.run_on_scheduler(_who_holds, keys=keys)
    except Exception:  # best effort: the chunks are then placed as if not held
        return None
    if not found or not all(found):
        return None
    rows = [int(c) for c in X.chunks[0]] if len(keys) == len(X.chunks[0]) else [1] * len(keys)
    ideal = None
    if any(len(h) > 1 for h in found):
        ideal = _placement(rows, client.nthreads() if nthreads is None else nthreads)
    load: dict[str, int] = {}
    out: list[str] = []
    for j, held in enumerate(found):
        if len(held) == 1:
            pick = held[0]
        elif ideal[j] in held:
            pick = ideal[j]
        elif out and out[-1] in held:
            pick = out[-1]
        else:
            pick = min(held, key=lambda w: (load.get(w, 0), w))
        load[pick] = load.get(pick, 0) + rows[j]
        out.append(pick)
    return out


def _who_holds(keys: list, dask_scheduler=None) -> list:
    """On the scheduler: the workers holding each key in memory, sorted (empty where none
    does)."""
    out = []
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        # who_has is None, not empty, for a task no worker holds.
        out.append(sorted(ws.address for ws in ts.who_has or ()) if ts is not None else [])
    return out
