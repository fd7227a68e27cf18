"""The k-means' options, records and parameter checks (light: the CLI's parser reads them)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ._validation import check_positive_int

if TYPE_CHECKING:
    import dask.array as da

__all__ = ["ALGORITHMS", "INITS", "KMeansProgress", "KMeansResult"]


ALGORITHMS = ("minibatch-lloyd", "minibatch", "lloyd")


INITS = ("k-means++", "k-means||")


@dataclass
class KMeansProgress:
    """What a progress callback receives after each step or iteration.

    Attributes
    ----------
    restart : int
        Index of the current run, from 0 to ``n_init - 1``.
    n_init : int
        Number of runs.
    step : int
        Mini-batch steps or Lloyd iterations of this run so far.
    max_iter : int
        The step (iteration) count at which the run stops at the latest.
    inertia : float
        Estimate of the sum of squared distances over all rows.  Lloyd: the
        exact inertia of the pass, with respect to the centres before the
        update.  Mini-batch: ``n_samples`` times the exponentially weighted
        mean squared distance of the batches (the raw first batch at step 1).
    center_shift : float
        Sum of the squared movements of the centres in this step.
    elapsed : float
        Seconds since :func:`kmeans` started.
    phase : {"minibatch", "lloyd"}
        The phase of the run: mini-batch steps, or Lloyd iterations (a pass
        over P each, shared by all the runs still iterating, so their
        reports come in turn).  ``step`` counts the steps of this phase.
    done : bool
        Whether this step or iteration was the run's last.
    """

    restart: int
    n_init: int
    step: int
    max_iter: int
    inertia: float
    center_shift: float
    elapsed: float
    phase: str = "minibatch"
    done: bool = False


@dataclass
class KMeansResult:
    """The outcome of :func:`kmeans`.

    Attributes
    ----------
    cluster_centers : ndarray of shape (n_clusters, n_features)
        The centres of the kept run, float64.
    labels : ndarray or dask array of shape (n_samples,)
        Index of the nearest centre of every row, int64: a numpy array for a
        numpy P, a dask array chunked like P's rows for a dask P (its chunks
        live on the workers).
    inertia : float
        Sum of the squared distances of the rows to their nearest centre,
        from a full pass over P.
    n_iter : int
        Mini-batch steps plus Lloyd iterations of the kept run.
    n_steps_total : int
        Steps (iterations) of all runs together.
    inertias : list of float
        Full-pass inertia of each run, in run order.
    stop_reason : {"converged", "tol", "no_improvement", "max_iter"}
        Why the kept run's last phase stopped: no label changed in a Lloyd
        pass (the centres stayed put), the tolerance was reached (see
        ``tol`` of :func:`kmeans`), the smoothed batch inertia stopped
        improving (mini-batch only), or the step cap.
    info : dict
        With ``checkpoint=``: its location (``"checkpoint"``), where the fit
        continued from (``"resumed_from"``: ``{"restart": r, "step": s}``,
        run ``r`` at its mini-batch step ``s``, or with ``r == n_init`` the
        runs' shared Lloyd passes after ``s`` iterations; None for a new
        fit) and whether the checkpoint already held the
        finished fit (``"already_finished"``).  Empty otherwise.
    """

    cluster_centers: np.ndarray
    labels: np.ndarray | da.Array
    inertia: float
    n_iter: int
    n_steps_total: int
    inertias: list[float]
    stop_reason: str = "max_iter"
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Config:
    n_clusters: int
    algorithm: str
    init: np.ndarray | str
    batch_size: int
    n_init: int
    max_iter: int
    tol: float
    max_no_improvement: int | None
    init_size: int


def _check_centers(centers, n_clusters: int | None, n_features: int, name: str) -> np.ndarray:
    c = np.asarray(centers)
    if c.ndim != 2 or (n_clusters is not None and c.shape[0] != n_clusters) or (
        c.shape[1] != n_features
    ):
        want = f"({n_clusters}, {n_features})" if n_clusters else f"(n_clusters, {n_features})"
        raise ValueError(f"{name} has shape {c.shape}; it should be {want}.")
    if c.shape[0] == 0:
        raise ValueError(f"{name} is empty: it needs at least one centre.")
    if c.dtype.kind not in "biuf" or not np.isfinite(c).all():
        raise ValueError(f"{name} must hold finite real numbers.")
    return np.array(c, dtype=np.float64)


def _check_config(
    n, s, n_clusters, algorithm, init, batch_size, n_init, max_iter, tol,
    max_no_improvement, init_size, progress,
) -> _Config:
    k = check_positive_int(n_clusters, "n_clusters")
    if k > n:
        raise ValueError(f"n_samples={n} should be >= n_clusters={k}.")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        valid = ", ".join(repr(a) for a in ALGORITHMS)
        raise ValueError(f"algorithm={algorithm!r} is not supported; choose one of {valid}.")
    batch_size = check_positive_int(batch_size, "batch_size")
    n_init = check_positive_int(n_init, "n_init")
    max_iter = check_positive_int(max_iter, "max_iter")
    if (
        isinstance(tol, bool)
        or not isinstance(tol, numbers.Real)
        or not (math.isfinite(tol) and tol >= 0)
    ):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}.")
    if max_no_improvement is not None:
        max_no_improvement = check_positive_int(max_no_improvement, "max_no_improvement")
    if init_size is None:
        init_size = max(3 * batch_size, 10 * k)
    else:
        init_size = check_positive_int(init_size, "init_size")
        if init_size < k:
            raise ValueError(f"init_size={init_size} should be >= n_clusters={k}.")
    if isinstance(init, str):
        if init not in INITS:
            valid = ", ".join(repr(a) for a in INITS)
            raise ValueError(
                f"init={init!r} is not supported; choose one of {valid} or pass an array of "
                "centres."
            )
        centers = init
    else:
        centers = _check_centers(init, k, s, "init")
        # Every run would start from the same centres: one run is all there is.
        n_init = 1
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable or None, got {type(progress).__name__}.")
    return _Config(
        n_clusters=k,
        algorithm=algorithm,
        init=centers,
        batch_size=min(batch_size, n),
        n_init=n_init,
        max_iter=max_iter,
        tol=float(tol),
        max_no_improvement=max_no_improvement,
        init_size=min(init_size, n),
    )
