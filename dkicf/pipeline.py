"""From a Zarr dataset to a model and labels on a cluster, never holding X or P whole.

Planning (how much memory one task and the whole factor need, whether X and
P stay in worker memory) is separated from execution, so ``dkicf info`` can
show the same estimates that ``dkicf fit`` acts on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from ._backends import held_bytes, usable_memory_fraction

logger = logging.getLogger(__name__)

__all__ = ["FitPlan", "plan_fit", "fit_store", "predict_store", "describe"]

# Fraction of a worker's memory limit that one task may use, and of the
# cluster's memory that P (and X, when held) may use.
_TASK_FRACTION = 0.5
_HOLD_FRACTION = 0.6


@dataclass
class FitPlan:
    """Memory estimates of a fit and the decisions taken from them.

    All sizes are bytes.  ``task_bytes`` is one chunk task of the
    factorization: the X chunk (as stored and widened to float64), its rows of
    P, the kernel column block and a few per-row vectors.
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

    def lines(self) -> list[str]:
        def gb(b):
            return "unknown" if b is None else f"{b / 2**30:.3f} GiB"

        return [
            f"estimated memory of a fit at rank {self.rank}:",
            f"  X: {gb(self.x_bytes)}, P: {gb(self.p_bytes)} ({self.n_chunks} chunks "
            f"of {self.chunk_rows} rows)",
            f"  one task: {gb(self.task_bytes)}"
            + (f" (worker limit {gb(self.worker_memory)})" if self.worker_memory else ""),
            f"  X held in worker memory: {self.persist_x}; P kept in: {self.p_storage}"
            if self.worker_memory else
            "  X held in worker memory, P in memory or Zarr: decided by fit from the "
            "workers' memory (not known here)",
        ]


def _task_bytes(rows: int, d: int, itemsize: int, s: int, block: int = 1) -> int:
    return int(rows * (d * itemsize + 8 * d + 8 * s + 8 * (4 + 2 * block)) + 8 * s * (s + d))


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
) -> FitPlan:
    """Estimate the memory of a fit and decide chunking, X residency and P storage.

    Raises
    ------
    MemoryError
        When even a small chunk cannot fit a worker; the message says what to change.
    """
    n, d = shape
    s = min(rank, n)
    x_bytes = n * d * itemsize
    p_bytes = 8 * n * s
    task = _task_bytes(chunk_rows, d, itemsize, s)
    rechunked = False
    cluster_memory = worker_memory * n_workers if worker_memory else None
    # Never above the fraction at which the fit itself refuses to start (see
    # check_worker_memory): dask's spill and pause thresholds, as configured.
    usable = usable_memory_fraction()
    hold_fraction = min(_HOLD_FRACTION, usable)
    if worker_memory:
        budget = min(_TASK_FRACTION, usable) * worker_memory / max(threads_per_worker, 1)
        if task > budget:
            per_row = _task_bytes(1, d, itemsize, s) - 8 * s * (s + d)
            rows = int((budget - 8 * s * (s + d)) // max(per_row, 1))
            if rows < 256:
                raise MemoryError(
                    f"one task of the factorization needs about {task / 2**20:.0f} MiB "
                    f"({chunk_rows} rows x {d} features at rank {s}) and even 256 rows "
                    f"need more than {budget / 2**20:.0f} MiB per worker thread; give the "
                    f"workers more memory (--memory-limit), fewer threads (--threads), "
                    f"or lower the rank (--rank)."
                )
            chunk_rows, rechunked = rows, True
            task = _task_bytes(chunk_rows, d, itemsize, s)
    hold = None if cluster_memory is None else hold_fraction * cluster_memory
    if persist == "auto":
        persist_x = hold is not None and held_bytes(n, d, itemsize, s, True) < hold
    else:
        persist_x = persist == "yes"
    fits = hold is None or held_bytes(n, d, itemsize, s, False) < hold
    if p_storage == "auto":
        p_storage = "memory" if fits else "zarr"
    elif p_storage == "memory" and not fits:
        raise MemoryError(
            f"P ({n} x {s} float64, {held_bytes(n, d, itemsize, s, False) / 2**30:.2f} GiB with "
            f"its vectors) does not fit below {hold_fraction:.0%} of the "
            f"cluster's {cluster_memory / 2**30:.2f} GiB, where dask starts spilling to disk: "
            "keep it in Zarr (p_storage='zarr', --p-storage zarr or auto), or add workers "
            "or memory."
        )
    return FitPlan(
        n_samples=n, n_features=d, rank=s, chunk_rows=int(chunk_rows),
        n_chunks=math.ceil(n / chunk_rows), x_bytes=x_bytes, p_bytes=p_bytes, task_bytes=task,
        worker_memory=worker_memory, cluster_memory=cluster_memory,
        threads_per_worker=threads_per_worker, persist_x=persist_x, p_storage=p_storage,
        rechunked=rechunked,
    )


def _worker_resources(client) -> tuple[int | None, int, int]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    if not workers:
        raise RuntimeError(
            "the dask cluster has no workers; start some or wait for them before fitting."
        )
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    threads = max(w.get("nthreads", 1) for w in workers.values())
    limit = min(limits) if all(limits) else None
    return limit, len(workers), threads


def _storage_args(plan: FitPlan, target: str, checkpoint, every, resume, options) -> dict:
    """Where the factorization keeps P: worker memory, the output group, or the checkpoint."""
    from . import io

    if checkpoint is not None:
        return {"checkpoint": checkpoint, "checkpoint_every": every, "resume": resume,
                "storage_options": options}
    if plan.p_storage != "zarr":
        return {}
    return {"p_store": io._join(target, "P"), "storage_options": options}


def _kmeans_checkpoint_args(checkpoint, resume, options) -> dict:
    """The k-means stage checkpoints next to the factorization, in its ``kmeans`` subgroup."""
    from . import io

    if checkpoint is None:
        return {}
    return {"checkpoint": io._join(str(checkpoint), "kmeans"), "resume": resume,
            "storage_options": options}


def _contingency(labels, y, n_clusters: int):
    """k x c counts of (label, class) pairs, reduced chunk by chunk."""
    import dask.array as da

    n_classes = int(y.max().compute()) + 1
    pairs = labels.astype(np.int64) * n_classes + y.astype(np.int64)
    counts = da.bincount(pairs, minlength=n_clusters * n_classes).compute()
    return np.asarray(counts).reshape(n_clusters, n_classes)


def _accuracy_from_contingency(table: np.ndarray) -> float:
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(-table)
    return float(table[rows, cols].sum() / table.sum())


def fit_store(
    store: str,
    out: str,
    params: dict,
    *,
    client,
    overwrite: bool = False,
    p_storage: str = "auto",
    persist: str = "auto",
    storage_options: dict | None = None,
    progress=None,
    checkpoint: str | None = None,
    checkpoint_every: int = 25,
    resume: bool = False,
) -> dict:
    """Fit :class:`~dkicf.KernelKMeans` on a Zarr dataset and write the output group.

    With ``checkpoint`` (a Zarr group), the factorization commits its state
    every ``checkpoint_every`` iterations and holds P there, and k-means
    commits its own in the subgroup ``kmeans`` (at its default period, and
    after each run); ``resume=True`` continues a fit that stopped in either
    stage, refusing different data or parameters.  A task that keeps killing
    its workers ends the fit with :class:`~dkicf.errors.WorkerFailureError`,
    whose message names the stage, where in it (factorization iteration;
    k-means run and step, or pass) and the last commit to resume from.

    The output group holds the model (pivots, pivot rows of X, L, centres,
    trace errors, kernel and parameters, versions, input fingerprint) and the
    ``labels`` and ``P`` arrays chunked like X.

    Relative local paths (``store``, ``out``, ``checkpoint``) are taken in this
    process's working directory and made absolute before anything is sent to
    the workers, which may run elsewhere (:func:`dkicf.io.absolute_location`).
    A chunk of X that a worker cannot find fails the fit
    (:class:`dkicf.io.MissingChunkError`) instead of being read as zeros.

    Returns
    -------
    dict
        Figures of the run (timings, rank, inertia, accuracy when the dataset
        has labels); ``out`` is the absolute location written.
    """
    from . import io
    from .estimator import KernelKMeans, _model_arrays_attrs
    from .icf import incomplete_cholesky
    from .kmeans import kmeans

    t_start = time.perf_counter()
    store, out = io.absolute_location(store), io.absolute_location(out)
    checkpoint = io.absolute_location(checkpoint)
    io.check_not_input(out, {"the dataset": store, "the checkpoint": checkpoint})
    X, y, info = io.open_dataset(store, storage_options=storage_options)
    model = KernelKMeans(**params)
    model._check_params(X.shape[0])
    worker_memory, n_workers, threads = _worker_resources(client)
    plan = plan_fit(
        X.shape, X.chunks[0][0], X.dtype.itemsize, model.rank,
        worker_memory=worker_memory, n_workers=n_workers, threads_per_worker=threads,
        p_storage=p_storage, persist=persist,
    )
    if plan.rechunked:
        logger.warning("re-chunking X to %d rows per chunk so a task fits a worker",
                       plan.chunk_rows)
        X = X.rechunk({0: plan.chunk_rows, 1: -1})
        if y is not None:
            y = y.rechunk({0: plan.chunk_rows})
    icf_seed, km_seed = model._seeds()
    with io.staged_group(out, overwrite=overwrite, storage_options=storage_options) as target:
        # The group is built where it will be published: P, when it is kept in
        # Zarr, is written by the workers straight into it.
        io.write_members(target, {}, {"format": "dkicf-fit-in-progress"},
                         storage_options=storage_options)
        t0 = time.perf_counter()
        icf = incomplete_cholesky(
            X, kernel=model.kernel, gamma=model.gamma, degree=model.degree, coef0=model.coef0,
            max_rank=model.rank, tol=model.tol, pivoting=model.pivoting, client=client,
            persist=plan.persist_x,
            random_state=icf_seed, progress=progress,
            **_storage_args(plan, target, checkpoint, checkpoint_every, resume,
                            storage_options),
        )
        t_icf = time.perf_counter() - t0
        t0 = time.perf_counter()
        km = kmeans(
            icf.P, model.n_clusters, algorithm=model.algorithm, batch_size=model.batch_size,
            n_init=model.n_init, max_iter=model.max_iter, tol=model.kmeans_tol,
            random_state=km_seed, client=client, progress=progress,
            # A P kept in Zarr is larger than the cluster's memory: read, not held.
            persist=plan.p_storage != "zarr",
            **_kmeans_checkpoint_args(checkpoint, resume, storage_options),
        )
        t_km = time.perf_counter() - t0
        model.n_features_in_ = X.shape[1]
        model._set_fitted(icf, km.cluster_centers, km.inertia, km.n_iter)
        arrays, attrs = _model_arrays_attrs(model)
        attrs["input"] = _input_fingerprint(store, info, storage_options)
        attrs["plan"] = asdict(plan)
        t0 = time.perf_counter()
        io.write_dask(target, "labels", km.labels.astype(np.int32),
                      storage_options=storage_options)
        if plan.p_storage != "zarr" or checkpoint is not None:
            io.write_dask(target, "P", icf.P, storage_options=storage_options)
        io.write_members(target, arrays, attrs, storage_options=storage_options)
        t_write = time.perf_counter() - t0
    report = {
        "n_samples": int(X.shape[0]),
        "n_features": int(X.shape[1]),
        "rank": icf.rank,
        "stop_reason": icf.stop_reason,
        "trace_error": float(icf.trace_errors[-1]) if icf.rank else float(icf.initial_trace),
        "n_passes": icf.n_passes,
        "x_in_memory": plan.persist_x,
        "p_storage": plan.p_storage,
        "gamma": getattr(icf.kernel, "gamma", None),
        "inertia": km.inertia,
        "icf_s": t_icf,
        "icf_ms_per_iteration": 1000 * t_icf / max(icf.rank, 1),
        "kmeans_s": t_km,
        "write_s": t_write,
        "total_s": time.perf_counter() - t_start,
        "out": out,
    }
    if icf.info.get("resumed_from") is not None:
        report["resumed_from_rank"] = icf.info["resumed_from"]
    if km.info.get("resumed_from") is not None:
        report["kmeans_resumed_from"] = km.info["resumed_from"]
    if y is not None:
        table = _contingency(km.labels, y, model.n_clusters)
        report["accuracy"] = _accuracy_from_contingency(table)
    return report


def predict_store(
    model_path: str,
    store: str,
    out: str,
    *,
    client,
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> dict:
    """Assign the points of a Zarr dataset with a saved model; write ``labels`` to ``out``.

    Relative local paths are taken in this process's working directory, as in
    :func:`fit_store`.
    """
    from . import io
    from .estimator import load

    model_path, store, out = (io.absolute_location(p) for p in (model_path, store, out))
    io.check_not_input(out, {"the model": model_path, "the dataset": store})
    model = load(model_path, storage_options=storage_options)
    X, y, _ = io.open_dataset(store, storage_options=storage_options)
    if X.shape[1] != model.n_features_in_:
        raise ValueError(
            f"{store} has {X.shape[1]} features but the model was fitted on "
            f"{model.n_features_in_}; predict with data of the same features."
        )
    t0 = time.perf_counter()
    labels = model.predict(X).astype(np.int32)
    with io.staged_group(out, overwrite=overwrite, storage_options=storage_options) as target:
        attrs = {"format": "dkicf-labels", "model": str(model_path),
                 "input": _input_fingerprint(store, None, storage_options)}
        io.write_group(target, {}, attrs, overwrite=True, storage_options=storage_options)
        io.write_dask(target, "labels", labels, storage_options=storage_options)
    report = {"n_samples": int(X.shape[0]), "predict_s": time.perf_counter() - t0, "out": out}
    if y is not None:
        stored = io.open_member(out, "labels", storage_options=storage_options)
        table = _contingency(stored.rechunk(y.chunks), y, model.n_clusters)
        report["accuracy"] = _accuracy_from_contingency(table)
    return report


def _input_fingerprint(store: str, info, storage_options) -> dict:
    from . import io

    node = store if io._probe(store, storage_options).kind == "array" else io._join(store, "X")
    return io.fingerprint(node, storage_options=storage_options)


def describe(path: str, *, rank: int = 100, storage_options: dict | None = None) -> list[str]:
    """Lines describing a dataset (shape, chunks, sizes, fit estimate) or a model."""
    from . import io

    kind, meta = io.inspect(path, storage_options=storage_options)
    lines = [f"{path}: {kind}"]
    for key, value in meta.items():
        lines.append(f"  {key}: {value}")
    if kind == "dataset":
        n, d = meta["shape"]
        plan = plan_fit((n, d), meta["chunks"][0], np.dtype(meta["dtype"]).itemsize, rank)
        lines += plan.lines()
    return lines
