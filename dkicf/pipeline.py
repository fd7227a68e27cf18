"""From a Zarr dataset to a model and labels on a cluster, never holding X or P whole.

Planning (how much memory one task and the whole factor need, whether X and
P stay in worker memory) is separated from execution, so ``dkicf info`` can
show the same estimates that ``dkicf fit`` acts on.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import numpy as np

from . import io
from ._plan import FitPlan, _worker_resources, describe, plan_fit, plan_for_cluster  # noqa: F401
from ._saved import read_model

logger = logging.getLogger(__name__)

__all__ = ["FitPlan", "plan_fit", "fit_store", "predict_store", "describe"]


def _storage_args(plan: FitPlan, target: str, checkpoint, every, resume, options,
                  asked: str = "auto") -> dict:
    """Where the factorization keeps P: worker memory, the output group, or the checkpoint.

    With a checkpoint, P is where the plan puts it (the commits copy its new
    columns, or the checkpoint holds it), except that a resumed fit keeps
    the choice its checkpoint recorded unless ``asked`` (the caller's
    ``p_storage``) names one.
    """
    if checkpoint is not None:
        where = "auto" if resume and asked == "auto" else plan.p_storage
        return {"checkpoint": checkpoint, "checkpoint_every": every, "resume": resume,
                "storage_options": options, "p_storage": where}
    if plan.p_storage != "zarr":
        return {}
    return {"p_store": io._join(target, "P"), "storage_options": options}


def _kmeans_checkpoint_args(checkpoint, resume, options) -> dict:
    """The k-means stage checkpoints next to the factorization, in its ``kmeans`` subgroup."""
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
    save_p: bool = True,
) -> dict:
    """Fit :class:`~dkicf.KernelKMeans` on a Zarr dataset and write the output group.

    ``client`` is the dask cluster's client; None runs the fit in this
    process on numpy, reading X whole: for data that fit in memory, without
    ``checkpoint`` or ``p_storage="zarr"``.

    With ``checkpoint`` (a Zarr group), the factorization commits its state
    every ``checkpoint_every`` iterations (P's new columns with it, or P
    itself when the plan keeps P in Zarr), and k-means
    commits its own in the subgroup ``kmeans`` (at its default period, and
    after each run); ``resume=True`` continues a fit that stopped in either
    stage, refusing different data or parameters.  A task that keeps killing
    its workers ends the fit with :class:`~dkicf.errors.WorkerFailureError`,
    whose message names the stage, where in it (factorization iteration;
    k-means run and step, or pass) and the last commit to resume from.

    The output group holds the model (pivots, pivot rows of X, L, centres,
    trace errors, kernel and parameters, versions, input fingerprint) and the
    ``labels`` and ``P`` arrays chunked like X.  ``P`` (``8 * n * rank``
    bytes: the training points' features, what ``transform`` gives for
    them) is left out with ``save_p=False``; predicting needs only the model.

    The fit claims ``out`` and ``checkpoint`` first (:func:`dkicf.io.claimed`):
    a second fit on either is refused (:class:`dkicf.io.ClaimedError`) while
    this one runs; the claim of a fit that was killed is taken over with
    ``resume=True`` or ``overwrite=True``.

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
    t_start = time.perf_counter()
    store, out = io.absolute_location(store), io.absolute_location(out)
    checkpoint = io.absolute_location(checkpoint)
    io.check_not_input(out, {"the dataset": store, "the checkpoint": checkpoint})
    # One run at a time writes the output and the checkpoint; the claim of a
    # run that was killed is taken over by one that resumes or overwrites.
    with (_write_errors(store, out, checkpoint, params, save_p, storage_options),
          io.claimed({"the output": out, "the checkpoint": checkpoint},
                     take_over=resume or overwrite)):
        return _fit_claimed(
            store, out, params, t_start, client=client, overwrite=overwrite,
            p_storage=p_storage, persist=persist, storage_options=storage_options,
            progress=progress, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
            resume=resume, save_p=save_p,
        )


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError with an errno behind ``exc`` (itself, or what it was raised from)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


def _free_bytes(path: str | None) -> int | None:
    """Free bytes on the filesystem of a local ``path`` (its nearest existing parent)."""
    import os
    import shutil

    local = io._local_path(path) if path else None
    if local is None:
        return None
    while not os.path.exists(local) and local != local.parent:
        local = local.parent
    try:
        return shutil.disk_usage(local).free
    except OSError:
        return None


@contextmanager
def _write_errors(store, out, checkpoint, params, save_p, storage_options):
    """A fit that cannot write (full disk, read-only, no permission) fails naming where and why.

    The error names the path, what was being written, roughly how much room
    the whole output (or checkpoint) takes and how much is free, and what
    is left: nothing at ``out`` (outputs are staged), and the checkpoint's
    last commit, which resumes once there is room.
    """
    import errno

    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only OSErrors with an errno are translated
        cause = _os_error(exc)
        if cause is None or cause.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                errno.EACCES, errno.EPERM):
            raise

        def bare(url) -> str:  # a location without its scheme, as filesystems name files
            return str(url).split("://", 1)[-1].lstrip("/")

        def within(path: str, location: str) -> bool:
            """``path`` is in ``location``, or is one of dkicf's files beside it."""
            inner, outer = bare(path), bare(location).rstrip("/")
            parent, _, name = outer.rpartition("/")
            return (inner == outer or inner.startswith(outer + "/")
                    or inner.startswith(f"{parent}/.{name}.dkicf-"))

        path = str(cause.filename or (checkpoint if checkpoint else out))
        in_checkpoint = bool(checkpoint) and within(path, checkpoint)
        if cause.filename and not (in_checkpoint or within(path, out)):
            raise  # not a write of this fit's (an input that cannot be read, say)
        location = checkpoint if in_checkpoint else out
        what = f"the checkpoint {checkpoint}" if in_checkpoint else f"the output {out}"
        try:
            node = store if io._probe(store, storage_options).kind == "array" \
                else io._join(store, "X")
            n = int(io._probe(node, storage_options).meta["shape"][0])
        except Exception:  # noqa: BLE001 - the estimate is only for the message
            n = None
        rank = params.get("rank", 100)
        if n is None or not isinstance(rank, int):
            need = "an unknown amount"
        elif in_checkpoint:  # P, the residual's two buffers, L and the pivot rows
            need = _size(8 * n * rank + 16 * n + 8 * rank * rank)
        else:  # P (unless save_p=False) and the labels
            need = _size((8 * n * rank if save_p else 0) + 4 * n)
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        kept = (f" The checkpoint {checkpoint} keeps its last commit: run again with "
                "resume=True (dkicf fit: --resume) once there is room."
                if checkpoint and full else "")
        if full:
            free = _free_bytes(path) if io._local_path(location) is not None else None
            room = "" if free is None else f", {_size(free)} free now"
            message = (
                f"no space left to write {path} ({cause.strerror or cause}): {what} takes "
                f"about {need} in all{room}. Free space there, or choose a location with "
                "more room. Nothing was published at the output."
            )
        else:
            message = (
                f"cannot write {path} ({cause.strerror or cause}): {what} must be on a "
                "writable filesystem where this user may create files. Choose another "
                "location. Nothing was published at the output."
            )
        raise io.DkicfIOError(message + kept) from exc


def _fit_claimed(store, out, params, t_start, *, client, overwrite, p_storage, persist,
                 storage_options, progress, checkpoint, checkpoint_every, resume,
                 save_p) -> dict:
    """:func:`fit_store` once its locations are absolute, checked and claimed."""
    # Here, not at the top: predicting imports this module, and needs no scikit-learn.
    from .estimator import KernelKMeans, _model_arrays_attrs, check_fit_params, fit_stages

    X, y, info = io.open_dataset(store, storage_options=storage_options)
    model = KernelKMeans(**params)
    check_fit_params(model, X.shape[0])
    if client is None and (checkpoint is not None or p_storage == "zarr"):
        raise ValueError(
            "a checkpoint, or P in Zarr, needs a dask cluster: pass client= (dkicf fit: "
            "--scheduler or --cluster)."
        )
    # The fit's one measurement of the workers, handed down to both stages.
    plan = plan_for_cluster(client, X.shape, X.chunks[0][0], X.dtype.itemsize, model.rank,
                            p_storage=p_storage, persist=persist, n_init=model.n_init,
                            init=model.init, algorithm=model.algorithm)
    if plan.rechunked:
        logger.warning("re-chunking X to %d rows per chunk so a task fits a worker",
                       plan.chunk_rows)
        X = X.rechunk({0: plan.chunk_rows, 1: -1})
        if y is not None:
            y = y.rechunk({0: plan.chunk_rows})
    with io.staged_group(out, overwrite=overwrite, storage_options=storage_options) as target:
        # The group is built where it will be published: P, when it is kept in
        # Zarr, is written by the workers straight into it.
        io.write_members(target, {}, {}, kind="fit-in-progress",
                         storage_options=storage_options)
        stages = fit_stages(
            model, X if client is not None else X.compute(scheduler="threads"),
            client=client, plan=plan, progress=progress,
            factor_options={"persist": plan.persist_x, **_storage_args(
                plan, target, checkpoint, checkpoint_every, resume, storage_options,
                p_storage)},
            kmeans_options=_kmeans_checkpoint_args(checkpoint, resume, storage_options),
        )
        icf, km = stages.factor, stages.clustering
        # Where P went (a resumed checkpoint keeps its own choice).
        p_where = icf.info.get("p_storage", plan.p_storage)
        t_icf, t_km = stages.factor_seconds, stages.kmeans_seconds
        labels, P = km.labels, icf.P
        if client is None:  # numpy, written and counted in X's row chunks
            import dask.array as da

            labels = da.from_array(labels, chunks=(X.chunks[0],))
            P = da.from_array(P, chunks=(X.chunks[0], -1))
        arrays, attrs = _model_arrays_attrs(model)
        attrs["input"] = _input_fingerprint(store, info, storage_options)
        attrs["plan"] = plan.attrs()
        t0 = time.perf_counter()
        io.write_dask(target, "labels", labels.astype(np.int32),
                      storage_options=storage_options)
        if not save_p:
            if p_where == "zarr" and checkpoint is None:  # written there by the fit
                io.remove_member(target, "P", storage_options=storage_options)
        elif p_where != "zarr" or checkpoint is not None:
            io.write_dask(target, "P", P, storage_options=storage_options)
        io.write_members(target, arrays, attrs, kind="model", storage_options=storage_options)
        t_write = time.perf_counter() - t0
    report = {
        "n_samples": int(X.shape[0]),
        "n_features": int(X.shape[1]),
        "rank": icf.rank,
        "stop_reason": icf.stop_reason,
        "trace_error": float(icf.trace_errors[-1]) if icf.rank else float(icf.initial_trace),
        "n_passes": icf.n_passes,
        "x_in_memory": plan.persist_x,
        "p_storage": p_where,
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
        table = _contingency(labels, y, model.n_clusters)
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
    model_path, store, out = (io.absolute_location(p) for p in (model_path, store, out))
    io.check_not_input(out, {"the model": model_path, "the dataset": store})
    with io.claimed({"the output": out}, take_over=overwrite):
        return _predict_claimed(model_path, store, out, client=client, overwrite=overwrite,
                                storage_options=storage_options)


def _predict_claimed(model_path, store, out, *, client, overwrite, storage_options) -> dict:
    """:func:`predict_store` once its locations are absolute, checked and claimed."""
    model = read_model(model_path, storage_options=storage_options)
    X, y, _ = io.open_dataset(store, storage_options=storage_options)
    if X.shape[1] != model.n_features_in:
        raise ValueError(
            f"{store} has {X.shape[1]} features but the model was fitted on "
            f"{model.n_features_in}; predict with data of the same features."
        )
    t0 = time.perf_counter()
    labels = model.feature_map().dask_labels(X).astype(np.int32)
    with io.staged_group(out, overwrite=overwrite, storage_options=storage_options) as target:
        attrs = {"model": str(model_path),
                 "input": _input_fingerprint(store, None, storage_options)}
        io.write_group(target, {}, attrs, kind="labels", overwrite=True,
                       storage_options=storage_options)
        io.write_dask(target, "labels", labels, storage_options=storage_options)
    report = {"n_samples": int(X.shape[0]), "predict_s": time.perf_counter() - t0, "out": out}
    if y is not None:
        stored = io.open_member(out, "labels", storage_options=storage_options)
        table = _contingency(stored.rechunk(y.chunks), y, model.cluster_centers.shape[0])
        report["accuracy"] = _accuracy_from_contingency(table)
    return report


def _input_fingerprint(store: str, info, storage_options) -> dict:
    node = store if io._probe(store, storage_options).kind == "array" else io._join(store, "X")
    return io.fingerprint(node, storage_options=storage_options)
