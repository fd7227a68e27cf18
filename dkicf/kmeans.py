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
    _open_checkpoint,
    _Position,
    _seed_fingerprint,
    _worker_failure,
)
from ._kmeans_tasks import _backend, _full_pass
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
    batch_size: int = 1024,
    n_init: int = 5,
    max_iter: int = 100,
    tol: float = 1e-4,
    max_no_improvement: int | None = 10,
    init_size: int | None = None,
    random_state: int | np.random.Generator | None = None,
    client=None,
    progress: Callable[[KMeansProgress], None] | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    storage_options: dict | None = None,
    persist: bool = True,
) -> KMeansResult:
    """K-means on the rows of P, in memory or on a dask cluster.

    Each run starts from k-means++ on a seeded sample of ``init_size`` rows
    (drawn by global row index; only those rows are fetched) or from
    k-means|| over all of P, then

    * ``algorithm="minibatch-lloyd"`` (the default): the mini-batch steps
      below, then full-batch Lloyd iterations from where they stopped, until
      no label changes or an iteration lowers the inertia by at most ``tol``
      times itself.  The mini-batch phase is cheap (it reads sampled rows
      only) and leaves few Lloyd passes to do; the Lloyd phase reaches
      Lloyd's fixed point, which mini-batch alone stops short of.
    * ``algorithm="minibatch"`` (Sculley 2010, as scikit-learn's
      ``MiniBatchKMeans``): each step draws ``batch_size`` row indices with
      replacement, fetches those rows, assigns them to the nearest centre and
      moves each centre ``j`` to ``(c_j v_j + S_j) / (v_j + n_j)``, where
      ``v_j`` counts the points it has received so far and ``n_j``, ``S_j``
      are the count and sum of its batch points.  The rows of several future
      steps are fetched in one request (about 64k rows).  A centre whose
      count stays below ``1e-3`` times the largest (or at zero) is re-seeded
      at a batch point drawn with probability proportional to the point's
      squared distance to its centre.
    * ``algorithm="lloyd"``: full-batch Lloyd, one pass over P per iteration,
      from the initial centres.

    In Lloyd iterations an empty cluster takes the point farthest from its
    centre (found from each chunk's few farthest points); a centre is never
    set to zero.  Each Lloyd iteration is one distributed pass: the chunks
    return per-centre sums and counts, no row of P moves.

    The run with the lowest inertia, measured by a full pass over P, is kept,
    together with that pass's labels.  The result depends on ``random_state``
    only: not on the number of workers nor on the chunking of P (up to
    rounding in Lloyd's sums).

    Parameters
    ----------
    P : ndarray or dask array of shape (n_samples, n_features)
        The rows to cluster.  A dask array is used chunked by rows (column
        blocks are merged first); its chunks are computed once into worker
        memory and never gathered: the driver only receives sampled rows and
        per-chunk summaries.
    n_clusters : int
        Number of clusters ``k``, at most the number of distinct rows of P
        (checked by a cheap pass that stops once ``k`` are found).
    algorithm : {"minibatch-lloyd", "minibatch", "lloyd"}, default="minibatch-lloyd"
        See above.  Cost per run: mini-batch reads ``max_iter * batch_size``
        sampled rows at most; each Lloyd iteration is a pass over P (one
        matrix product of ``n_samples * n_features * n_clusters``).
    init : {"k-means||", "k-means++"} or ndarray of shape (n_clusters, n_features), \
default="k-means||"
        Initial centres.  ``"k-means++"``: k-means++ with local trials on the
        init sample.  ``"k-means||"`` (Bahmani et al. 2012): 5 rounds, each
        one pass over P, draw about ``2 * n_clusters`` candidates per round
        from all rows with probability proportional to their squared distance
        to the candidates so far; the candidates, weighted by the rows
        nearest to them, are clustered on the driver by weighted k-means++.
        It finds small clusters that a sample of P misses, at the cost of
        6 passes over P, which all runs share (each run draws its own
        candidates; the passes update every run's distances at once).  With
        an array, there is a single run
        (``n_init`` is not used); the init sample is still drawn to scale
        ``tol``.
    batch_size : int, default=1024
        Rows per mini-batch step (at most ``n_samples``).  Also sets the
        default ``init_size``.
    n_init : int, default=5
        Number of runs, each from its own initialisation; the lowest inertia
        wins.  Five runs of the default find the optimum that scikit-learn's
        ``KMeans(n_init=10)`` finds on every case of the quality benchmark;
        three miss it on one case in 60.
    max_iter : int, default=100
        Largest number of mini-batch *steps* (batches, not epochs as in
        scikit-learn's ``MiniBatchKMeans``) and of Lloyd *iterations* (passes
        over P) per run; ``"minibatch-lloyd"`` caps each phase.
    tol : float, default=1e-4
        Mini-batch steps, and ``"lloyd"``: stop when the sum of the squared
        movements of the centres in a step is ``<= tol * v``, where ``v`` is
        the mean variance of the features on the init sample (as
        scikit-learn's ``KMeans``; relative, so rescaling P does not change
        the result).  Mini-batch ignores it at 0.  The Lloyd phase of
        ``"minibatch-lloyd"``: stop when an iteration lowers the inertia by
        at most ``tol`` times the inertia.  Every Lloyd iteration stops the
        run when no label changes (``tol=0``: only then).
    max_no_improvement : int or None, default=10
        Mini-batch only: stop when the exponentially weighted batch inertia
        has not improved for this many consecutive steps (None: never).
    init_size : int, optional
        Rows sampled for k-means++ and for the variance that scales ``tol``.
        Default ``max(3 * batch_size, 10 * n_clusters)``; at most
        ``n_samples``.
    random_state : int, numpy Generator or None
        Seed of every random choice (samples, batches, re-seeding), all drawn
        on the driver.
    client : distributed.Client or str, optional
        Cluster for a dask P (default: the current client).  Unused for numpy.
    progress : callable, optional
        Called with a :class:`KMeansProgress` after each step or iteration.
    checkpoint : str, optional
        Zarr group (local path or fsspec URL) where the fit commits its state
        every ``checkpoint_every`` steps of a run and after each run: the
        run, its step, centres and counts, the generators' states, the
        stopping counters, and the best run so far.  A driver that crashes
        resumes from it with ``resume=True`` and ends with exactly the
        centres, labels and inertia of an uninterrupted fit.  Creating it
        fingerprints P (one digest per row chunk, computed where the chunk is).
    checkpoint_every : int, optional
        Mini-batch steps or Lloyd iterations between commits within a run;
        default 100 steps and 5 iterations.
    resume : bool, default=False
        Continue the checkpoint at ``checkpoint`` (start it if there is none).
        A checkpoint that holds a finished fit gives its result with no step
        run, after one assignment pass for the labels.
    overwrite : bool, default=False
        Replace an existing dkicf k-means checkpoint (never anything that
        dkicf did not create).
    storage_options : dict, optional
        fsspec options (credentials, endpoint) of ``checkpoint``.
    persist : bool, default=True
        Dask P only: compute P's chunks once into worker memory (the
        fastest).  ``False`` reads each chunk from P's source (for example
        the Zarr array of a factorization run with ``p_store=``) in every task
        that needs it, so that a P larger than the cluster's memory is never
        held, at the cost of a read of P per pass and per batch of
        mini-batch steps fetched.  The result is the same.  ``True`` with a P
        larger than the memory of the cluster's workers raises ValueError
        before any task runs.

    Returns
    -------
    KMeansResult

    Raises
    ------
    ValueError
        For an invalid parameter (the message names it and its value) or a
        P holding NaN or infinity.
    dkicf.errors.CheckpointMismatchError
        When resuming a checkpoint written for other data or parameters; the
        message names each difference.
    FileExistsError
        When ``checkpoint`` holds something else than a dkicf k-means
        checkpoint, or one exists and neither ``resume`` nor ``overwrite`` is set.
    dkicf.errors.WorkerFailureError
        When a task killed every worker that ran it (the scheduler's
        ``allowed-failures``); the message names the run and the step or pass
        and, with ``checkpoint``, the last commit, which ``resume=True``
        continues.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kmeans import kmeans
    >>> rng = np.random.default_rng(0)
    >>> P = np.concatenate([rng.normal(c, 0.1, size=(100, 2)) for c in (0.0, 5.0)])
    >>> res = kmeans(P, 2, random_state=0)
    >>> res.cluster_centers.shape
    (2, 2)
    >>> np.bincount(res.labels).tolist()
    [100, 100]

    On a cluster, with P a dask array chunked by rows, the labels stay
    distributed:

    >>> import dask.array as da  # doctest: +SKIP
    >>> from dkicf import local_cluster  # doctest: +SKIP
    >>> client = local_cluster(2)  # doctest: +SKIP
    >>> res = kmeans(da.from_array(P, chunks=(50, 2)), 2, random_state=0)  # doctest: +SKIP
    >>> res.labels.chunks  # doctest: +SKIP
    ((50, 50, 50, 50),)
    """
    P = check_array_2d(P, "P")
    n, s = P.shape
    cfg = _check_config(
        n, s, n_clusters, algorithm, init, batch_size, n_init, max_iter, tol,
        max_no_improvement, init_size, progress,
    )
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}.")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=, the location to resume from.")
    if checkpoint_every is None:
        checkpoint_every = dict(_CHECKPOINT_EVERY)
    else:
        every = check_positive_int(checkpoint_every, "checkpoint_every")
        checkpoint_every = {"minibatch": every, "lloyd": every}
    if not isinstance(persist, bool):
        raise TypeError(f"persist must be True or False, got {persist!r}.")
    seeds = np.random.default_rng(random_state).integers(np.iinfo(np.int64).max,
                                                         size=cfg.n_init)
    backend = _backend(P, client, persist)
    pos, ckpt = _Position(cfg.n_init), None
    try:
        if checkpoint is not None:
            ckpt = _open_checkpoint(
                backend, P, cfg, _seed_fingerprint(random_state, seeds), checkpoint,
                checkpoint_every, resume, overwrite, storage_options,
            )
        return _fit(backend, cfg, seeds, progress, ckpt, pos)
    except worker_failure_types() as exc:
        err = _worker_failure(exc, pos, cfg.algorithm, ckpt, checkpoint)
        # The error must not keep the failed fit's futures alive (its
        # traceback keeps its lines, not its frames' variables, nor the best
        # run's labels): their erred tasks, P's chunks among them when they
        # were lost with the dying workers, are released, and a resume in this
        # session computes them again instead of failing on their errors.
        traceback.clear_frames(exc.__traceback__)
        ckpt = None
        raise err from exc
    finally:
        backend.close()


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
        labels, inertia, _ = _full_pass(backend, centers)
    except worker_failure_types() as exc:
        raise worker_failure(
            exc, "labelling", 0, where="the pass that labels the rows",
            resume_hint="Nothing is saved by this pass: call it again once the cause is fixed.",
        ) from exc
    finally:
        backend.close()
    return labels, inertia
