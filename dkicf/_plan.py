"""One plan per fit: the memory estimates of a dataset on a cluster and the decisions taken.

:func:`plan_fit` is pure arithmetic on the dataset's shape and the workers'
resources (measured once per fit by the caller), so ``dkicf info`` shows the
same estimates that ``dkicf fit`` acts on.  The per-task accounting it uses
is in :mod:`dkicf._memory`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from . import _memory, io
from ._cluster import all_workers
from ._memory import (
    _TASK_SHARE,
    _Workers,
    held_bytes,
    kmeans_fetch_bytes,
    kmeans_row_bytes,
    kmeans_task_bytes,
    largest_rows,
    least_limit,
    measure_workers,
    memory_fits,
    p_rows_for,
    pass_transient,
    usable_memory_fraction,
    zarr_width,
)

__all__ = ["FitPlan", "plan_fit", "plan_for_cluster"]


# Fraction of a worker's memory limit that one task may use, and of the
# cluster's memory that P (and X, when held) may use.
_TASK_FRACTION = 0.5
_HOLD_FRACTION = 0.6


@dataclass(frozen=True)
class FitPlan:
    """Memory estimates of a fit and the decisions taken from them.

    All sizes are bytes.  ``task_bytes`` is one chunk task of the
    factorization: the X chunk (as stored and widened to float64), its rows of
    P (their tails, with P in Zarr), a few per-row vectors and, with P in
    Zarr, the flushed columns it streams.  ``worker_baseline`` is the memory
    a worker uses before holding any of the fit's data (None: not measured)
    and ``p_columns`` the columns of P per Zarr chunk (with P in Zarr).
    ``kmeans_bytes`` is what the k-means holds on the workers besides P at
    its peak: its state of every row (:func:`dkicf._memory.kmeans_row_bytes`)
    and the rows of one mini-batch fetch.
    ``workers`` is the one measurement of the cluster's workers
    (:func:`dkicf._memory.measure_workers`, None for no cluster) that the
    fit's engine and k-means check against: a fit computes its plan once
    and hands it down (``plan=``), so the workers are asked once.
    """

    n_samples: int
    n_features: int
    rank: int
    chunk_rows: int
    n_chunks: int
    x_bytes: int
    p_bytes: int
    task_bytes: int
    worker_memory: int | None
    cluster_memory: int | None
    threads_per_worker: int
    persist_x: bool
    p_storage: str
    rechunked: bool = False
    worker_baseline: int | None = None
    p_columns: int | None = None
    kmeans_bytes: int = 0
    workers: _Workers | None = field(default=None, repr=False, compare=False)

    def attrs(self) -> dict:
        """The plan as JSON-able attributes (the measurement left out)."""
        out = asdict(self)
        out.pop("workers", None)
        return out

    def lines(self) -> list[str]:
        def gb(b):
            return "unknown" if b is None else f"{b / 2**30:.3f} GiB"

        own = ("" if self.worker_baseline is None
               else f", of which the worker process itself uses {gb(self.worker_baseline)}")
        return [
            f"estimated memory of a fit at rank {self.rank}:",
            f"  X: {gb(self.x_bytes)}, P: {gb(self.p_bytes)} ({self.n_chunks} chunks "
            f"of {self.chunk_rows} rows)",
            f"  k-means besides P: {gb(self.kmeans_bytes)} (its state of every row and, but "
            "for Lloyd alone, one mini-batch fetch)",
            f"  one task: {gb(self.task_bytes)}"
            + (f" (worker limit {gb(self.worker_memory)}{own})" if self.worker_memory else ""),
            f"  X held in worker memory: {self.persist_x}; P kept in: {self.p_storage}"
            + (f" ({self.p_columns} columns per Zarr chunk)" if self.p_columns else "")
            if self.worker_memory else
            "  X held in worker memory, P in memory or Zarr: decided by fit from the "
            "workers' memory (not known here)",
        ]


def _task_bytes(rows: int, d: int, itemsize: int, s: int, block: int = 1) -> int:
    return int(rows * (d * itemsize + 8 * d + 8 * s + 8 * (4 + 2 * block)) + 8 * s * (s + d))


# Fewest rows per chunk that a plan rechunks X to.
_MIN_ROWS = 256


# Rows of a Zarr chunk of P when X is rechunked for P in Zarr.
_ZARR_ROWS = 8192


# k-means: how many copies of a chunk of P a task reading it from Zarr holds
# (as read and decoded).
_KMEANS_P_COPIES = 2


def plan_fit(
    shape: tuple[int, int],
    chunk_rows: int,
    itemsize: int,
    rank: int,
    *,
    worker_memory: int | None = None,
    n_workers: int = 1,
    threads_per_worker: int = 1,
    p_storage: str = "auto",
    persist: str = "auto",
    worker_baseline: int | None = None,
    memory_fraction: float | None = None,
    workers: _Workers | None = None,
    n_init: int = 5,
    init="k-means||",
    algorithm: str = "minibatch-lloyd",
) -> FitPlan:
    """Estimate the memory of a fit and decide chunking, X residency and P storage.

    The decisions are those under which the fit itself starts
    (:func:`dkicf._memory.check_worker_memory`) and its k-means stage
    fits too: per worker, its own memory, the chunk states of its rows held
    between passes and one task's buffers per thread stay below the usable
    fraction of its limit.  P stays in worker memory if that fits, else goes
    to Zarr with as many columns per Zarr chunk as fit; X is held if it fits
    too, and rechunked to smaller row chunks if its chunks do not fit.

    Parameters
    ----------
    shape, chunk_rows, itemsize : the dataset's shape, rows per chunk and bytes per value.
    rank : int
        The factorization's largest rank.
    worker_memory : int, optional
        The smallest worker's memory limit (None: unknown, nothing decided from memory).
    n_workers, threads_per_worker : int
        The cluster's workers and the most threads of one.
    p_storage : {"auto", "memory", "zarr"}
    persist : {"auto", "yes", "no"}
        Whether X is held in worker memory.
    worker_baseline : int, optional
        Bytes a worker uses before holding any of the fit's data, as measured
        (:func:`dkicf._memory.worker_baseline`).  None: not measured; the
        plan then counts none and leaves the refusal of a fit that cannot fit
        even with P in Zarr to the fit itself (before its first pass).
    memory_fraction : float, optional
        Fraction of a worker's limit that the fit may fill, as the workers
        use it (:func:`dkicf._memory.worker_memory_fraction`); default
        :func:`~dkicf._memory.usable_memory_fraction`.
    workers : optional
        The measurement these figures come from (:func:`plan_for_cluster`),
        kept in the plan for the fit's checks.
    n_init, init, algorithm : optional
        The k-means's runs, initialisation and algorithm, as in
        :func:`dkicf.kmeans.kmeans`: with k-means|| each run keeps a distance
        and a label per row on the workers
        (:func:`dkicf._memory.kmeans_row_bytes`); the mini-batch steps fetch
        rows of P (:func:`dkicf._memory.kmeans_fetch_bytes`).

    Raises
    ------
    MemoryError
        When even small chunks with P in Zarr cannot fit the workers, or P
        forced into memory cannot; the message says what to change.
    """
    n, d = shape
    s = min(rank, n)
    x_bytes = n * d * itemsize
    p_bytes = 8 * n * s
    chunk_rows = int(max(1, min(chunk_rows, n))) if n else int(chunk_rows)
    cluster_memory = worker_memory * n_workers if worker_memory else None
    usable = usable_memory_fraction() if memory_fraction is None else memory_fraction
    hold_fraction = min(_HOLD_FRACTION, usable)
    kmeans = _KMeansCost.of(n, s, n_init, init, algorithm)
    base = dict(n_samples=n, n_features=d, rank=s, x_bytes=x_bytes, p_bytes=p_bytes,
                worker_memory=worker_memory, cluster_memory=cluster_memory,
                threads_per_worker=threads_per_worker, worker_baseline=worker_baseline,
                workers=workers, kmeans_bytes=n * kmeans.state + kmeans.fetch)
    if not worker_memory:
        return FitPlan(
            chunk_rows=chunk_rows, n_chunks=math.ceil(n / chunk_rows),
            task_bytes=_task_bytes(chunk_rows, d, itemsize, s), persist_x=persist == "yes",
            p_storage="memory" if p_storage == "auto" else p_storage, **base,
        )
    workers = _Workers([worker_memory] * max(n_workers, 1),
                       [max(threads_per_worker, 1)] * max(n_workers, 1),
                       worker_baseline or 0, usable)
    return _plan_on_workers(workers, n, d, itemsize, s, chunk_rows, p_storage, persist,
                            hold_fraction, base, kmeans)


_NO_WORKERS = "the dask cluster has no workers; start some or wait for them before fitting."


def plan_for_cluster(client, shape: tuple[int, int], chunk_rows: int, itemsize: int,
                     rank: int, *, p_storage: str = "auto", persist: str = "auto",
                     decide: bool = True, n_init: int = 5, init="k-means||",
                     algorithm: str = "minibatch-lloyd") -> FitPlan:
    """:func:`plan_fit` on a cluster's workers, measured once here (None: no cluster).

    The plan keeps the measurement (``FitPlan.workers``); the fit hands the
    plan to :func:`dkicf.incomplete_cholesky` and :func:`dkicf.kmeans`, whose
    checks read it instead of asking the workers again.  ``decide=False``:
    the caller's ``p_storage`` and ``persist`` stand as given, and the
    engine's checks refuse what does not fit (the estimator's fits).
    """
    if client is None:
        return plan_fit(shape, chunk_rows, itemsize, rank, p_storage=p_storage,
                        persist=persist, n_init=n_init, init=init, algorithm=algorithm)
    workers = measure_workers(client)
    if not workers.count:
        raise RuntimeError(_NO_WORKERS)
    limited = workers.limited and decide
    return plan_fit(
        shape, chunk_rows, itemsize, rank,
        worker_memory=workers.limit if limited else None, n_workers=workers.count,
        threads_per_worker=workers.threads, p_storage=p_storage, persist=persist,
        # What the workers use themselves, and the share of their limit dask
        # lets a fit fill, as measured on them.
        worker_baseline=workers.baseline if limited else None,
        memory_fraction=workers.fraction if limited else None, workers=workers,
        n_init=n_init, init=init, algorithm=algorithm,
    )


def _plan_on_workers(workers, n, d, itemsize, s, chunk_rows, p_storage, persist,
                     hold_fraction, base, kmeans) -> FitPlan:
    """:func:`plan_fit` once the workers' memory is known (``kmeans``: what the
    k-means adds, see :func:`_kmeans_memory`)."""
    worker_memory, worker_baseline = base["worker_memory"], base["worker_baseline"]
    threads_per_worker, cluster_memory = base["threads_per_worker"], base["cluster_memory"]
    usable = workers.fraction
    rechunked = False
    room, threads, rows_w = workers.room, workers.threads, workers.rows(n)
    enough = min(_MIN_ROWS, chunk_rows)
    fetched = _fetch_share(workers, n, kmeans.fetch)

    def fits(rows: int, hold_x: bool, columns: int | None, p_rows: int | None = None) -> bool:
        """Whether chunks of ``rows`` rows fit the factorization and then k-means."""
        held = held_bytes(max(rows_w, rows), d, itemsize, s, hold_x, columns)
        zarr_rows = None if columns is None else min(
            rows, _p_rows(rows) if p_rows is None else p_rows)
        transient = pass_transient(rows, d, itemsize, s, columns, zarr_rows)
        if not memory_fits(room, held, threads, transient):
            return False
        return kmeans_fits(rows, columns)

    def kmeans_fits(rows: int, columns: int | None) -> bool:
        """Whether the k-means fits after it (:func:`_kmeans_memory`)."""
        held, transient = _kmeans_memory(rows_w, rows, s, columns, kmeans, fetched)
        return memory_fits(room, held, threads, transient)

    def least_need(cap: int) -> float:
        """Smallest limit per worker at which P in Zarr fits both stages."""
        return _least_need(workers, n, s, cap, enough, kmeans)

    def most_rows(hold_x: bool, columns: int | None) -> int:
        """Rows per chunk that fit, at most chunk_rows (0: not even a few)."""
        if fits(chunk_rows, hold_x, columns):
            return chunk_rows
        rows = largest_rows(lambda r: fits(r, hold_x, columns, _ZARR_ROWS), chunk_rows)
        if columns is not None and rows > _ZARR_ROWS:
            rows -= rows % _ZARR_ROWS  # whole Zarr chunks of P (see checkpoint.p_rows_for)
        return rows if rows >= enough else 0

    if room <= 0 and worker_baseline is not None:
        need = least_need(max(1, min(_column_block(), s)))
        raise MemoryError(_own_memory_message(workers, n, s, need))
    p_fits = most_rows(False, None) > 0
    if p_storage == "auto":
        p_storage = "memory" if p_fits else "zarr"
    elif p_storage == "memory" and not p_fits:
        raise MemoryError(
            f"P ({n} x {s} float64, {held_bytes(n, d, itemsize, s, False) / 2**30:.2f} GiB with "
            f"its vectors) does not fit below {hold_fraction:.0%} of the "
            f"cluster's {cluster_memory / 2**30:.2f} GiB, where dask starts spilling to disk, "
            f"with what the workers use themselves ({_mib(workers.baseline)} each), the "
            f"k-means's state of every row ({kmeans.state} bytes a row) and the buffers of "
            "their tasks: keep it in Zarr (p_storage='zarr', --p-storage zarr or auto), or "
            "add workers or memory."
        )
    columns = None
    if p_storage == "zarr":
        cap = max(1, min(_column_block(), s))
        columns = zarr_width(workers, n, cap)
        if columns < 1 and worker_baseline is None:
            # Not measured: the fit refuses it before its first pass (store_columns).
            return _plan_by_task(chunk_rows, d, itemsize, s, threads_per_worker, worker_memory,
                                 usable, persist, base)
        if columns < 1 or not kmeans_fits(enough, columns):
            raise MemoryError(_least_memory_message(workers, n, s, least_need(cap), kmeans))
    if persist == "auto":
        persist_x = most_rows(True, columns) > 0
    else:
        persist_x = persist == "yes"
    rows = most_rows(persist_x, columns)
    if rows < 1:
        raise MemoryError(
            f"one task of the factorization over {chunk_rows} rows x {d} features at rank {s} "
            f"does not fit a worker's memory limit of {_mib(worker_memory)} with "
            f"{threads_per_worker} thread(s), even over {enough} rows: below "
            f"{usable:.0%} of it, the worker process itself uses {_mib(workers.baseline)} and "
            f"the states of its rows {_mib(held_bytes(rows_w, d, itemsize, s, persist_x, columns))}"
            f"{' (X held: try --persist no)' if persist_x else ''}; give the workers more "
            "memory (--memory-limit), fewer threads (--threads), or lower the rank (--rank)."
        )
    if rows < chunk_rows:
        chunk_rows, rechunked = rows, True
    task = held_bytes(chunk_rows, d, itemsize, s, persist_x, columns) + pass_transient(
        chunk_rows, d, itemsize, s, columns, None if columns is None else _p_rows(chunk_rows))
    return FitPlan(
        chunk_rows=chunk_rows, n_chunks=math.ceil(n / chunk_rows), task_bytes=int(task),
        persist_x=persist_x, p_storage=p_storage, rechunked=rechunked, p_columns=columns,
        **base,
    )


def _column_block() -> int:
    """Columns per Zarr chunk of P at most (read at each call: tests shrink it)."""
    return _memory.COLUMN_BLOCK


def _p_rows(rows: int) -> int:
    """Rows per Zarr chunk of P for row chunks of ``rows`` (checkpoint.p_rows_for)."""
    return p_rows_for((rows, rows)) or rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def _own_memory_message(workers, n: int, s: int, need: float) -> str:
    need = math.ceil(need / 2**20)
    return (
        f"the dask workers use about {_mib(workers.baseline)} each before holding any data "
        f"(the worker process and the libraries a fit imports), more than "
        f"{workers.fraction:.0%} of their memory limit of {_mib(workers.limit)}, where dask "
        f"starts spilling to disk: a fit of {n} rows at rank {s} needs a limit of at least "
        f"about {need} MiB per worker. Give the workers more memory (--memory-limit "
        f"{need}MiB or more; --memory per job on slurm and pbs)."
    )


def _least_need(workers, n: int, s: int, cap: int, rows: int, kmeans: _KMeansCost) -> float:
    """Smallest memory limit per worker at which P in Zarr fits ``n`` rows in both stages.

    The factorization's at a column a Zarr chunk (:func:`least_limit`), and
    the k-means's (:func:`_kmeans_memory`): the state of the busiest
    worker's rows and its share of a mini-batch fetch, with one task per
    thread over a chunk of ``rows`` rows of P.
    """
    held, transient = _kmeans_memory(workers.rows(n), rows, s, 1, kmeans,
                                     _fetch_share(workers, n, kmeans.fetch))
    room = held + workers.threads * transient / _TASK_SHARE
    return max(least_limit(workers, n, cap), (room + workers.baseline) / workers.fraction)


class _KMeansCost(NamedTuple):
    """What the k-means adds to the workers' memory: ``state`` bytes a row held, ``task``
    bytes a row of a task's chunk, and the bytes of one mini-batch ``fetch`` (all the
    workers' shares)."""

    state: int
    task: int
    fetch: int

    @classmethod
    def of(cls, n: int, s: int, n_init: int, init, algorithm: str) -> _KMeansCost:
        """The costs of a k-means of ``n_init`` runs on an ``n x s`` P (no fetch for Lloyd
        alone)."""
        fetch = 0 if algorithm == "lloyd" else kmeans_fetch_bytes(s, n)
        return cls(kmeans_row_bytes(n_init, init), kmeans_task_bytes(n_init), fetch)


def _kmeans_memory(rows_w: int, rows: int, s: int, columns: int | None,
                   kmeans: _KMeansCost, fetched: int) -> tuple[int, int]:
    """Bytes that the k-means holds on a worker of ``rows_w`` rows, and that one of its
    tasks over a chunk of ``rows`` rows allocates.

    ``kmeans``: the bytes a row held and of a task (:class:`_KMeansCost`).
    Held: the k-means's state of every row, the worker's share of a
    mini-batch fetch (``fetched``) and, with P in memory (``columns=None``),
    P itself and the factorization's residual diagonal (8 bytes a row): P's
    chunks are the factorization's buffers, or views of them, which the
    k-means keeps as they are.  A task: its runs' labels and distances and
    its buffers, and with P in Zarr the chunk of P it reads
    (:data:`_KMEANS_P_COPIES` copies, as read and decoded).
    """
    state, per_task = kmeans.state, kmeans.task
    if columns is not None:
        return rows_w * state + fetched, rows * (8 * s * _KMEANS_P_COPIES + per_task)
    return max(rows_w, rows) * (8 * s + 8 + state) + fetched, rows * per_task


def _fetch_share(workers, n: int, fetch: int) -> int:
    """The busiest worker's share of a mini-batch fetch of ``fetch`` bytes (rows drawn
    uniformly)."""
    return math.ceil(fetch * workers.rows(n) / max(n, 1))


def _least_memory_message(workers, n: int, s: int, need: float, kmeans: _KMeansCost) -> str:
    need = math.ceil(need / 2**20)
    rows, kmeans_bytes = workers.rows(n), kmeans.state
    fetched = _fetch_share(workers, n, kmeans.fetch)
    # k-means|| keeps a distance and a label per run and row.
    hint = "; fewer with a smaller --n-init or --init k-means++" if kmeans_bytes > 8 else ""
    return (
        f"a fit of {n} rows at rank {s} needs a memory limit of at least about {need} MiB "
        f"per worker, even with P in Zarr, and the workers have {_mib(workers.limit)}. "
        f"Below {workers.fraction:.0%} of a worker's limit (where dask starts spilling to "
        f"disk) must fit the worker process itself ({_mib(workers.baseline)}, measured), "
        f"the residuals of its {rows} rows with a column of P each, the k-means's state "
        f"of those rows ({_mib(rows * kmeans_bytes)}: {kmeans_bytes} bytes a row{hint}) "
        f"and its share of the mini-batch rows ({_mib(fetched)}), "
        f"and the buffers of its {workers.threads} task(s) at once. Give the workers more "
        f"memory (--memory-limit {need}MiB or more; --memory per job on slurm and pbs) or "
        "add workers (--workers)."
    )


def _plan_by_task(chunk_rows, d, itemsize, s, threads, worker_memory, usable, persist,
                  base) -> FitPlan:
    """P in Zarr, sized per task only (the workers' own memory not measured)."""
    task = _task_bytes(chunk_rows, d, itemsize, s)
    rechunked = False
    budget = min(_TASK_FRACTION, usable) * worker_memory / max(threads, 1)
    if task > budget:
        per_row = _task_bytes(1, d, itemsize, s) - 8 * s * (s + d)
        rows = int((budget - 8 * s * (s + d)) // max(per_row, 1))
        if rows < _MIN_ROWS:
            raise MemoryError(
                f"one task of the factorization needs about {task / 2**20:.0f} MiB "
                f"({chunk_rows} rows x {d} features at rank {s}) and even {_MIN_ROWS} rows "
                f"need more than {budget / 2**20:.0f} MiB per worker thread; give the "
                f"workers more memory (--memory-limit), fewer threads (--threads), "
                f"or lower the rank (--rank)."
            )
        chunk_rows, rechunked = rows, True
        task = _task_bytes(chunk_rows, d, itemsize, s)
    return FitPlan(
        chunk_rows=chunk_rows, n_chunks=math.ceil(base["n_samples"] / chunk_rows),
        task_bytes=task, persist_x=persist == "yes", p_storage="zarr", rechunked=rechunked,
        **base,
    )


def _worker_resources(client) -> tuple[int | None, int, int]:
    workers = all_workers(client)
    if not workers:
        raise RuntimeError(_NO_WORKERS)
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    threads = max(w.get("nthreads", 1) for w in workers.values())
    limit = min(limits) if all(limits) else None
    return limit, len(workers), threads


def describe(path: str, *, rank: int = 100, n_init: int = 5, init="k-means||",
             algorithm: str = "minibatch-lloyd",
             storage_options: dict | None = None) -> list[str]:
    """Lines describing a dataset (shape, chunks, sizes, fit estimate at ``rank`` with
    the k-means's ``n_init``, ``init`` and ``algorithm``) or a model."""
    kind, meta = io.inspect(path, storage_options=storage_options)
    lines = [f"{path}: {kind}"]
    for key, value in meta.items():
        lines.append(f"  {key}: {value}")
    if kind == "dataset":
        n, d = meta["shape"]
        plan = plan_fit((n, d), meta["chunks"][0], np.dtype(meta["dtype"]).itemsize, rank,
                        n_init=n_init, init=init, algorithm=algorithm)
        lines += plan.lines()
    return lines
