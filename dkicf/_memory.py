"""Memory accounting of a fit: what the workers hold, what each task needs, and the checks.

The figures that size a fit (how many columns of P a Zarr chunk holds, how
many rows a task reads at once, whether P and X fit the workers) are
computed here, below the engine and the k-means, from the workers' memory
limits and threads and from their own measured memory.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ._cluster import all_workers

logger = logging.getLogger(__name__)

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



def _worker_resources(client) -> tuple[list[int], list[int]]:
    """Memory limits (0: none) and thread counts of the cluster's workers."""
    workers = list(all_workers(client).values())
    return ([int(w.get("memory_limit") or 0) for w in workers],
            [int(w.get("nthreads") or 1) for w in workers])


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
# Bytes of flushed P columns a task reads from Zarr at once.
_STREAM_BYTES = 32 << 20


# Modules whose import a fit's tasks pay on a worker (part of its own memory).
_TASK_MODULES = ("dkicf._chunk", "dkicf._candidates", "dkicf.io", "dkicf._kmeans_tasks",
                 "dkicf._mapping", "zarr")


def import_task_modules() -> None:
    """Import what a fit's tasks import on a worker (those that are installed)."""
    import importlib

    for name in _TASK_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - a worker without an optional module
            pass


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
    import dask
    import psutil

    import_task_modules()
    rss = psutil.Process().memory_info().rss
    managed = getattr(getattr(dask_worker, "state", None), "nbytes", 0)
    manager = getattr(dask_worker, "memory_manager", None)
    values = [dask.config.get(f"distributed.worker.memory.{name}", None) for name in _THRESHOLDS]
    if manager is not None:
        values[:3] = [getattr(manager, f"memory_{name}_fraction", values[k])
                      for k, name in enumerate(_THRESHOLDS[:3])]
    return {"own": int(max(rss - (managed if isinstance(managed, int) else 0), 0)),
            "fraction": _smallest_threshold(values)}


def _reported_baseline(workers: dict) -> int:
    """The largest unmanaged memory (process less managed data) the workers last reported."""
    found = []
    for w in workers.values():
        metrics = w.get("metrics") or {}
        if "memory" in metrics:
            found.append(int(metrics["memory"]) - int(metrics.get("managed_bytes") or 0))
    return max([max(v, 0) for v in found], default=0)


def _measure(client, workers: dict | None = None) -> dict:
    """``{"own": bytes or None, "fraction": float or None, "workers": their scheduler info}``,
    probed on the workers with :func:`_probe`."""
    workers = all_workers(client) if workers is None else workers
    run = getattr(client, "run", None)
    if run is None or not workers:
        return {"own": None, "fraction": None, "workers": workers}
    try:
        found = run(_probe)
    except Exception:  # a worker that left meanwhile, or remote functions refused
        found = {}
    probes = [v for v in found.values() if isinstance(v, dict)]
    return {"own": max((int(v["own"]) for v in probes), default=None),
            "fraction": min((float(v["fraction"]) for v in probes), default=None),
            "workers": workers}


def _baseline_of(found: dict) -> int:
    return found["own"] if found["own"] is not None else _reported_baseline(found["workers"])


def _fraction_of(found: dict) -> float:
    if _configured_here() or found["fraction"] is None:
        return usable_memory_fraction()
    return found["fraction"]


def worker_baseline(client) -> int:
    """Bytes of memory that the largest worker process uses before holding any of a fit's data.

    Measured on every worker (``client.run``) after importing the modules
    that the fit's tasks import: resident memory less the data dask manages
    there.  A dask worker with numpy, zarr and dkicf loaded uses about
    150 MiB this way.  Falls back to the unmanaged memory that the workers
    last reported to the scheduler, then to 0.  A fit measures it once, in
    its plan (:func:`measure_workers`).

    Parameters
    ----------
    client : distributed.Client
        The cluster's client (anything with ``scheduler_info``; ``run`` if it has one).

    Returns
    -------
    int
        Bytes, the largest over the workers.
    """
    return _baseline_of(_measure(client))


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
    if _configured_here():
        return usable_memory_fraction()
    return _fraction_of(_measure(client))


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
    """One measurement of a cluster's workers: what the memory accounting uses.

    ``limits`` and ``nthreads`` (by address) are every worker's memory limit
    (0: none) and threads.  ``limit`` is the smallest limit, ``threads`` the
    most threads of a worker, ``share`` the largest fraction of the cluster's
    threads on one worker (its fraction of the rows), ``baseline`` the
    largest worker's own memory and ``fraction`` the share of a limit that a
    fit may fill (:func:`worker_memory_fraction`).  A fit takes it once, in
    its plan (:func:`measure_workers`), and its checks read it from there.
    """

    def __init__(self, limits, threads, baseline: int, fraction: float | None = None,
                 nthreads: dict | None = None):
        self.limits = [int(v) for v in limits]
        self.limit = min(self.limits, default=0)
        self.count = len(self.limits)
        self.threads = max(1, max(threads, default=1))
        self.total_threads = max(1, sum(threads))
        self.share = self.threads / self.total_threads
        self.baseline = int(baseline)
        self.fraction = usable_memory_fraction() if fraction is None else fraction
        self.nthreads = dict(nthreads or {})

    @property
    def limited(self) -> bool:
        """Whether every worker has a memory limit (else nothing is decided from memory)."""
        return bool(self.limits) and all(v > 0 for v in self.limits)

    @classmethod
    def of(cls, client) -> _Workers | None:
        """The cluster's figures, or None when a worker has no memory limit."""
        workers = measure_workers(client)
        return workers if workers.limited else None

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


def measure_workers(client) -> _Workers:
    """Measure the cluster's workers once: limits, threads and, with limits, their own memory.

    One request to the scheduler and, when every worker has a memory limit,
    one probe of the workers (:func:`worker_baseline`,
    :func:`worker_memory_fraction`).  A fit does this once, for its plan
    (:class:`dkicf._plan.FitPlan`), and hands the result down.
    """
    found = all_workers(client)
    threads = [int(w.get("nthreads") or 1) for w in found.values()]
    workers = _Workers([int(w.get("memory_limit") or 0) for w in found.values()], threads, 0,
                       nthreads=dict(zip(found, threads)))
    if workers.limited:
        measured = _measure(client, found)
        workers.baseline, workers.fraction = _baseline_of(measured), _fraction_of(measured)
    return workers


def _limited(client, workers: _Workers | None) -> _Workers | None:
    """The fit's measurement (``workers``), else a new one of ``client``; None without limits."""
    if workers is None:
        return _Workers.of(client)
    return workers if workers.limited else None


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


# k-means: bytes per row of one task's buffers besides its chunk of P and the
# labels and distances of its runs (kmeans_task_bytes): a block's distances, the
# labels pass's output.
KMEANS_TASK_BYTES = 32


# Mini-batch prefetch: rows of as many future steps as fit in this budget.  The
# default run (max_iter 100, batches of 1024) fetches once up to s = 163, so that
# on dask all its rows come while k-means|| runs (a run ending early leaves part of
# its fetch unused; a second fetch would have cost a wait on the workers).
KMEANS_FETCH_ROWS = 102400
KMEANS_FETCH_BYTES = 128 << 20


def kmeans_fetch_rows(s: int, rows: int = KMEANS_FETCH_ROWS,
                      nbytes: int = KMEANS_FETCH_BYTES) -> int:
    """Rows of P (``s`` columns) that one mini-batch fetch brings at most: ``rows``, and
    no more than ``nbytes`` of them."""
    return min(rows, nbytes // (8 * max(1, int(s))))


def kmeans_fetch_bytes(s: int, n: int | None = None) -> int:
    """Bytes of P's rows (``s`` columns, ``n`` rows) that one mini-batch fetch brings at most.

    The workers hold them, each its chunks' share, until the driver has
    gathered them; the fetches run one at a time.  A row drawn twice comes
    from its worker once.
    """
    rows = kmeans_fetch_rows(s)
    return 8 * max(1, int(s)) * (rows if n is None else min(rows, int(n)))


def kmeans_row_bytes(n_init: int = 5, init="k-means||") -> int:
    """Bytes per row that the k-means holds on the workers at its peak, besides P.

    With k-means|| (the default ``init``) each chunk keeps, between its
    passes, every run's squared distance to its nearest candidate (float64)
    and that candidate's number (int32), and the rows' squared norms
    (float64): 68 bytes for five runs.  The driver lets a round's old
    states go once the round is done, so at its end every chunk holds two:
    136 bytes (measured: 155-158 bytes a row above P at rank 20 with a
    mini-batch fetch of 16 among them).  Otherwise what stays is the last
    pass's labels (int64).
    """
    if isinstance(init, str) and init == "k-means||":
        return 2 * (int(n_init) * (8 + 4) + 8)
    return 8


def kmeans_task_bytes(n_init: int = 5) -> int:
    """Bytes per row of its chunk that one k-means task allocates, besides P.

    A Lloyd pass's label (int64) and squared distance (float64) of every
    run, and :data:`KMEANS_TASK_BYTES` of buffers.
    """
    return 16 * int(n_init) + KMEANS_TASK_BYTES


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

    Tiles of about ``_STREAM_BYTES``, but never less than one Zarr
    chunk of ``p_rows`` rows by every flushed column (fewer than ``capacity``),
    nor more than the task's rows.
    """
    tile = max(_STREAM_BYTES, 8 * p_rows * capacity)
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


def store_columns(client, n: int, capacity: int, largest: int, *,
                  workers: _Workers | None = None) -> int:
    """Columns per Zarr chunk of P when P lives in Zarr: as many as memory allows.

    Between passes every chunk keeps fewer than this many columns of P in
    memory (its tail, twice after a flush), besides a few vectors of its
    rows, and a task grows its tail by a pivot block and streams the
    flushed columns.  The width is the largest, up to ``largest``, for
    which all that fits what the workers' own memory leaves below dask's
    spill threshold (:func:`zarr_width`).  Without memory limits it is
    ``largest``.  ``workers``: the fit's measurement (default: measure ``client``).

    Raises
    ------
    ValueError
        When even one column per chunk does not fit: the message says how
        much memory a worker needs at least.
    """
    cap = max(1, min(largest, capacity))
    workers = _limited(client, workers)
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
    return p_rows_for(tuple(int(c) for c in chunks)) or int(max(chunks))


def work_chunks(client, chunks, d: int, dtype, capacity: int, store,
                hold_x: bool = False, homes: list | None = None,
                workers: _Workers | None = None) -> tuple[int, ...]:
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
    rows.  ``workers``: the fit's measurement (default: measure ``client``).
    """
    chunks = tuple(int(c) for c in chunks)
    measured = measure_workers(client) if workers is None else workers
    n_threads = measured.total_threads
    m = len(chunks)
    if homes is None and m <= n_threads:
        return chunks
    itemsize = np.dtype(dtype).itemsize
    columns = None if store is None else store.columns
    starts = np.concatenate([[0], np.cumsum(chunks)])
    n = int(starts[-1])
    workers = measured if measured.limited else None
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
        own = int(measured.nthreads.get(homes[j]) or 1)
        share = max(1, round(own * sum(run) / max(held[homes[j]], 1)))
        out += cut(run, share)
        j = k
    return tuple(out)


def check_worker_memory(client, chunks, d: int, dtype, capacity: int, store, persist: bool,
                        *, hold_x: bool | None = None, workers: _Workers | None = None):
    """Refuse, before any work, a fit whose data cannot fit in the workers' memory.

    A worker holds its own memory (:func:`worker_baseline`), the chunk
    states of its rows between passes (:func:`held_bytes`: P's columns, or
    with ``store`` only tails of them, vectors, and X if held) and the
    buffers of one task per thread (:func:`task_transient`); all of it must
    fit below the :func:`worker_memory_fraction` of the smallest worker's
    limit (:func:`memory_fits`).  The message says what to change: smaller
    row chunks, P in Zarr, or more memory.  ``hold_x`` says whether X is
    held in worker memory (default: ``persist`` with P in memory; a
    Zarr-backed fit's caller says so itself).  ``workers``: the fit's
    measurement (default: measure ``client``).
    """
    workers = _limited(client, workers)
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


# Columns of P per Zarr chunk: the unit in which tasks flush P.
COLUMN_BLOCK = 32


_ROWS_LOW, _ROWS_HIGH = 4096, 8192


def p_rows_for(chunks: tuple[int, ...]) -> int:
    """Rows per Zarr chunk of P for X's row chunks (0 if they need rechunking).

    The result divides every row chunk but the last, so each task writes
    whole Zarr chunks: the largest such divisor in ``[4096, 8192]``, or the
    common chunk size itself when it is smaller or has no divisor there.
    Irregular chunks whose common divisor is small (< 1024 and smaller than
    the chunks) give 0.
    """
    inner = [int(c) for c in chunks[:-1]] or [int(chunks[0])]
    g = math.gcd(*inner)
    if g <= _ROWS_HIGH:
        return g if (g >= 1024 or g >= max(inner)) else 0
    for r in range(_ROWS_HIGH, _ROWS_LOW - 1, -1):
        if g % r == 0:
            return r
    return g
