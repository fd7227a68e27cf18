"""K-means on the rows of the factor P, in memory or on a dask cluster.

Kernel k-means on an incomplete Cholesky factorization ``K ~ P P^T`` is plain
k-means on the rows of P.  This module clusters those rows: in this process
for a numpy P, and on a ``distributed`` cluster for a dask P chunked by rows.

Three algorithms share one layout:

* ``"minibatch"`` (Sculley 2010, as scikit-learn's ``MiniBatchKMeans``): the
  driver draws the batches' global row indices from its own generator, fetches
  only those rows (the rows of many future steps in one request, since the
  indices do not depend on the centres) and updates the centres itself;
* ``"lloyd"``: one pass over P per iteration; each row chunk returns its
  per-centre sums and counts, its inertia and its few farthest points, and the
  driver reduces them in chunk order;
* ``"minibatch-lloyd"`` (the default): mini-batch steps bring the centres close
  cheaply, then Lloyd passes take them to Lloyd's fixed point.

Centres start from k-means++ on a seeded sample of rows, or from k-means||
(Bahmani et al. 2012): a few passes that oversample candidates from all of P.

Row chunks never leave the workers: the driver receives sampled rows and
per-chunk summaries of size ``O(k s)``, and labels stay a dask array chunked
like P.  Every random choice is made on the driver and addresses rows by
global index, so the result does not depend on the number of workers or on
the chunking.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._kmeans_config import (
    ALGORITHMS,
    INITS,
    KMeansProgress,
    KMeansResult,
    _check_centers,
    _check_config,
)
from ._kmeans_runs import (
    _CHECKPOINT_EVERY,
    _fit,
    _full_pass,
    _open_checkpoint,
    _Position,
    _seed_fingerprint,
    _worker_failure,
)
from ._kmeans_tasks import _backend
from ._memory import kmeans_row_bytes
from ._services import threadpool_limits
from ._validation import check_array_2d, check_positive_int
from .errors import worker_failure, worker_failure_types

if TYPE_CHECKING:
    pass

__all__ = ["ALGORITHMS", "INITS", "KMeansProgress", "KMeansResult", "assign", "kmeans"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- public API


def kmeans(
    P,
    n_clusters: int,
    *,
    algorithm: str = "minibatch-lloyd",
    init: str | np.ndarray = "k-means||",
    batch_size: int = 1024, n_init: int = 5, max_iter: int = 100, tol: float = 1e-4,
    max_no_improvement: int | None = 10, init_size: int | None = None,
    random_state: int | np.random.Generator | None = None, client=None,
    progress: Callable[[KMeansProgress], None] | None = None,
    checkpoint: str | None = None, checkpoint_every: int | None = None,
    resume: bool = False, overwrite: bool = False, storage_options: dict | None = None,
    persist: bool = True, plan=None,
) -> KMeansResult:
    """K-means on the rows of P, in memory or on a dask cluster.

    Each run starts from k-means|| or k-means++, then runs mini-batch steps
    and/or Lloyd iterations (distributed passes that return per-centre sums
    and counts; no row of P moves).  The run of lowest inertia is kept.  The
    result depends on ``random_state`` only, not on the workers or the
    chunking (up to rounding in Lloyd's sums).  ``docs/kmeans.md`` describes
    the options, their costs and the measurements behind the defaults.

    Parameters
    ----------
    P : ndarray or dask array of shape (n_samples, n_features)
        The rows to cluster; a dask array chunked by rows stays on the
        workers (the driver receives sampled rows and per-chunk summaries).
    n_clusters : int
        Number of clusters, at most the number of distinct rows of P.
    algorithm : {"minibatch-lloyd", "minibatch", "lloyd"}, default="minibatch-lloyd"
        Mini-batch steps (Sculley 2010) then Lloyd to its fixed point; the
        steps alone (cheapest, short of the optimum); or Lloyd alone.
    init : {"k-means||", "k-means++"} or ndarray of shape (n_clusters, n_features), \
default="k-means||"
        ``"k-means||"`` (Bahmani et al. 2012; 4 passes over P shared by all
        runs, then weighted k-means++ on the candidates: it finds small
        clusters a sample misses), ``"k-means++"`` on the init sample, or
        the initial centres (a single run).
    batch_size : int, default=1024
        Rows per mini-batch step.
    n_init : int, default=5
        Number of runs, each from its own initialisation.
    max_iter : int, default=100
        Largest number of mini-batch *steps* (not epochs as in scikit-learn)
        and of Lloyd *iterations* (passes over P) per run and phase.
    tol : float, default=1e-4
        Mini-batch and ``"lloyd"``: stop when the centres move (squared) by
        ``<= tol`` times the features' mean variance; the Lloyd phase of
        ``"minibatch-lloyd"``: when an iteration lowers the inertia by ``<=
        tol`` times itself.  Lloyd always stops when no label changes.
    max_no_improvement : int or None, default=10
        Mini-batch: stop when the averaged batch inertia has not improved for
        this many steps (None: never).
    init_size : int, optional
        Rows sampled for k-means++ and for the variance that scales ``tol``
        (default ``max(3 * batch_size, 10 * n_clusters)``).
    random_state : int, numpy Generator or None
        Seed of every random choice, all drawn on the driver.
    client : distributed.Client or str, optional
        Cluster for a dask P (default: the current client).
    progress : callable, optional
        Called with a :class:`KMeansProgress` after each step or iteration.
    checkpoint, checkpoint_every, resume, overwrite, storage_options
        Commit to the Zarr group ``checkpoint`` (fsspec ``storage_options``)
        every ``checkpoint_every`` steps (100 mini-batch, 5 Lloyd) and after each
        run; ``resume=True`` continues it to the uninterrupted result;
        ``overwrite=True`` replaces a dkicf checkpoint.  See ``docs/checkpoints.md``.
    persist : bool, default=True
        Dask P only: hold P's chunks in worker memory (refused before any
        task if they do not fit), or (``False``) read each chunk from P's
        source in every task, for a P larger than the cluster's memory.
    plan : FitPlan, optional
        The fit's plan, whose measurement of the workers the checks use.

    Returns
    -------
    KMeansResult

    Raises
    ------
    ValueError
        An invalid parameter (named with its value), or NaN or infinity in P.
    dkicf.errors.CheckpointMismatchError, FileExistsError, dkicf.errors.WorkerFailureError
        Another fit's checkpoint; a location holding something else; a task
        that killed every worker that ran it (``resume=True`` continues).

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kmeans import kmeans
    >>> rng = np.random.default_rng(0)
    >>> P = np.concatenate([rng.normal(c, 0.1, size=(100, 2)) for c in (0.0, 5.0)])
    >>> res = kmeans(P, 2, random_state=0)
    >>> np.bincount(res.labels).tolist()
    [100, 100]
    """
    P = check_array_2d(P, "P")
    n, s = P.shape
    cfg = _check_config(
        n, s, n_clusters, algorithm, init, batch_size, n_init, max_iter, tol,
        max_no_improvement, init_size, progress,
    )
    checkpoint_every = _check_run_args(checkpoint, checkpoint_every, resume, overwrite, persist)
    seeds = np.random.default_rng(random_state).integers(np.iinfo(np.int64).max, size=cfg.n_init)
    limits = None if plan is None or plan.workers is None else plan.workers.limits
    backend = _backend(P, client, persist, limits, kmeans_row_bytes(cfg.n_init, cfg.init))
    pos, ckpt = _Position(cfg.n_init), None
    try:
        if checkpoint is not None:
            ckpt = _open_checkpoint(
                backend, P, cfg, _seed_fingerprint(random_state, seeds), checkpoint,
                checkpoint_every, resume, overwrite, storage_options,
            )
        with threadpool_limits(1):  # the driver's small products: see icf._run_loop
            return _fit(backend, cfg, seeds, progress, ckpt, pos)
    except worker_failure_types() as exc:
        raise _failure(exc, pos, ckpt, checkpoint) from exc
    finally:
        backend.close()


def _failure(exc: BaseException, pos: _Position, ckpt, checkpoint):
    """dkicf's error for a task that killed its workers, the failed fit let go."""
    err = _worker_failure(exc, pos, ckpt, checkpoint)
    # The error must not keep the failed fit's futures alive (its traceback
    # keeps its lines, not its frames' variables, nor the best run's labels):
    # their erred tasks, P's chunks among them when they were lost with the
    # dying workers, are released, and a resume in this process computes them
    # again instead of failing on their errors.
    traceback.clear_frames(exc.__traceback__)
    return err


def _check_run_args(checkpoint, checkpoint_every, resume, overwrite, persist) -> dict:
    """Check the checkpoint and persistence arguments; the commit interval of each phase."""
    for name, flag in (("resume", resume), ("overwrite", overwrite), ("persist", persist)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}.")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=, the location to resume from.")
    if checkpoint_every is None:
        return dict(_CHECKPOINT_EVERY)
    every = check_positive_int(checkpoint_every, "checkpoint_every")
    return {"minibatch": every, "lloyd": every}


def assign(P, centers, *, client=None) -> tuple[Any, float]:
    """Nearest centre of every row of P and the inertia: one full pass.

    Parameters
    ----------
    P : ndarray or dask array of shape (n_samples, n_features)
        As in :func:`kmeans`.
    centers : array-like of shape (n_clusters, n_features)
    client : distributed.Client or str, optional
        Cluster for a dask P (default: the current client).

    Returns
    -------
    labels : ndarray or dask array of shape (n_samples,)
        int64; a dask array chunked like P's rows for a dask P.
    inertia : float
        Sum of the squared distances of the rows to their nearest centre.

    Raises
    ------
    dkicf.errors.WorkerFailureError
        If a task of the pass killed every worker that ran it.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kmeans import assign
    >>> labels, inertia = assign(np.array([[0.0], [1.0], [10.0]]), np.array([[0.0], [10.0]]))
    >>> labels.tolist(), inertia
    ([0, 0, 1], 1.0)
    """
    P = check_array_2d(P, "P")
    centers = _check_centers(centers, None, P.shape[1], "centers")
    backend = _backend(P, client)
    try:
        labels, (inertia,), _ = _full_pass(backend, [centers])
    except worker_failure_types() as exc:
        raise worker_failure(
            exc, "labelling", 0, where="the pass that labels the rows",
            resume_hint="Nothing is saved by this pass: call it again once the cause is fixed.",
        ) from exc
    finally:
        backend.close()
    return labels, inertia
