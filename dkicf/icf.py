"""Incomplete Cholesky factorization of a kernel matrix (the paper's Algorithm 1).

The factorization is a driver loop.  Each iteration

1. asks every row chunk for a small summary (trace of its residual diagonal,
   its largest residual and where);
2. picks the pivot ``t = argmax e`` over the whole dataset (ties go to the
   lowest global row index) and fetches only row ``t`` of X and of P;
3. sends every chunk the pivot, so that each chunk computes its piece of the
   kernel column ``K[:, t]``, the new column of P and the residual update.

With a numpy array the dataset is one chunk in this process; with a dask array
each row chunk is a dask task on the workers of a ``distributed`` cluster, P
stays in those workers' memory in chunks, and the driver only ever holds
``O(s^2 + s d)`` numbers.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular

from . import _chunk
from ._backends import DaskBackend, NumpyBackend
from ._validation import check_array_2d, is_dask_array
from .kernels import Kernel, make_kernel

__all__ = ["ICFResult", "ICFProgress", "incomplete_cholesky"]

logger = logging.getLogger(__name__)

_EPS = np.finfo(np.float64).eps


@dataclass
class ICFProgress:
    """What a progress callback receives after each pivot block.

    Attributes
    ----------
    rank : int
        Columns of P so far.
    max_rank : int
        The rank the factorization stops at, at the latest.
    trace_error : float
        ``tr(K - P P^T)`` now.
    initial_trace : float
        ``tr(K)``.
    elapsed : float
        Seconds since the factorization started.
    n_passes : int
        Passes over X so far.
    """

    rank: int
    max_rank: int
    trace_error: float
    initial_trace: float
    elapsed: float
    n_passes: int


@dataclass
class ICFResult:
    """The outcome of :func:`incomplete_cholesky`.

    Attributes
    ----------
    pivots : ndarray of shape (r,)
        Row indices of the selected points, in selection order.
    P : ndarray or dask array of shape (n, r)
        The factor, ``K ~ P P^T``.  A numpy array for numpy input, a dask array
        chunked by rows like X for dask input (its chunks live on the workers).
    trace_errors : ndarray of shape (r,)
        ``tr(K - P P^T)`` after each iteration; never increases.
    residual : ndarray or dask array of shape (n,)
        The residual diagonal ``diag(K - P P^T)``.
    L : ndarray of shape (r, r)
        ``P[pivots]``: lower triangular, the Cholesky factor of ``K[B, B]``.
    pivot_rows : ndarray of shape (r, d)
        ``X[pivots]`` in float64: all that :meth:`transform` needs of X.
    kernel : Kernel
    initial_trace : float
        ``tr(K)``.
    stop_reason : {"max_rank", "tol", "numerical_rank"}
        Why the loop stopped: the rank cap, the trace tolerance, or the
        residual vanishing (the numerical rank of K was reached).
    n_passes : int
        Passes over X, counting the one that computes the diagonal.
    elapsed : float
        Wall-clock seconds of the factorization.
    """

    pivots: np.ndarray
    P: Any
    trace_errors: np.ndarray
    residual: Any
    L: np.ndarray
    pivot_rows: np.ndarray
    kernel: Kernel
    initial_trace: float
    stop_reason: str
    n_passes: int
    elapsed: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """Number of columns of P."""
        return int(self.pivots.shape[0])

    def transform(self, X) -> np.ndarray:
        """Map points to the factor's feature space: ``p(x) = L^{-1} k(X_B, x)``.

        On a training point this reproduces its row of P.
        """
        return _transform_block(as_float_2d(X), self.kernel, self.pivot_rows, self.L)


def as_float_2d(X) -> np.ndarray:
    return np.ascontiguousarray(X, dtype=np.float64)


def _transform_block(x, kernel, pivot_rows, L, pivot_aux=None):
    if L.shape[0] == 0:
        return np.zeros((x.shape[0], 0))
    Kb = kernel.block(pivot_rows, x, pivot_aux, kernel.prepare(x))
    return solve_triangular(L, Kb, lower=True, check_finite=False).T


# --------------------------------------------------------------------------- driver


def _check_int(value, name, low=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}.")
    return int(value)


def incomplete_cholesky(
    X,
    *,
    kernel: str | Callable | Kernel = "gaussian",
    gamma: float | str | None = None,
    degree: int = 3,
    coef0: float = 1.0,
    max_rank: int = 100,
    tol: float = 1e-3,
    rank_tol: float | None = None,
    client=None,
    persist: bool = True,
    random_state: int | None = 0,
    progress: Callable[[ICFProgress], None] | None = None,
) -> ICFResult:
    """Incomplete Cholesky factorization ``K ~ P P^T`` of a kernel matrix.

    The paper's Algorithm 1: starting from ``e = diag(K)``, each iteration picks
    the row ``t`` with the largest residual ``e[t]`` among the rows not yet
    selected (ties go to the lowest row index), sets ``nu = sqrt(e[t])``,
    appends ``p = (K[:, t] - P P[t]^T) / nu`` as a new column of P and updates
    ``e -= p**2``.  It stops when P has ``max_rank`` columns, when the trace
    error ``tr(K - P P^T) = sum(e)`` is ``<= tol``, or when the largest residual
    is at the rounding level (the numerical rank of K: the paper's corollary,
    never more iterations than ``rank(K)``).  The kernel matrix is never formed:
    the cost is ``O(n s (d + s))`` time and ``O(n s)`` memory.

    Parameters
    ----------
    X : array-like or dask array of shape (n_samples, n_features)
        The data.  A dask array must be chunked by rows only (columns in one
        block); each row chunk is one task per iteration on the cluster.
    kernel : str, callable or Kernel, default="gaussian"
        ``"gaussian"`` (``exp(-gamma ||x-y||^2)``), ``"laplacian"``,
        ``"polynomial"``, ``"linear"``, a callable ``f(A, B)`` returning a
        kernel block, or a :class:`~dkicf.kernels.Kernel`.
    gamma : float or "median", default=None
        Kernel width; ``None`` means ``"median"`` for the Gaussian and
        Laplacian kernels (see :func:`dkicf.kernels.median_gamma`) and
        ``1 / n_features`` for the polynomial kernel.
    degree, coef0 : polynomial kernel parameters.
    max_rank : int, default=100
        Largest number of columns of P (the paper's ``s``).
    tol : float, default=1e-3
        Stop once the trace error ``tr(K - P P^T)`` is ``<= tol`` (absolute,
        as the paper's epsilon; ``tr(K) = n`` for the Gaussian kernel).
    rank_tol : float, optional
        A pivot whose residual ``e[t]`` is ``<= rank_tol`` is rounding noise and
        ends the factorization.  Default: ``eps * max(diag K) * max(n, c)``,
        LAPACK's rule for pivoted Cholesky with ``c`` the kernel's rounding
        factor.
    client : distributed.Client or str, optional
        Cluster to run on for dask input (default: the current client).
    persist : bool, default=True
        Dask input only: keep X's chunks in worker memory (one read), or re-read
        them from their source on every pass (data larger than the cluster).
    random_state : int, optional
        Seed of the median heuristic's sample.
    progress : callable, optional
        Called with an :class:`ICFProgress` after every iteration.

    Returns
    -------
    ICFResult

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf import incomplete_cholesky
    >>> X = np.random.default_rng(0).normal(size=(200, 2))
    >>> res = incomplete_cholesky(X, kernel="gaussian", gamma=0.5, max_rank=20)
    >>> res.P.shape
    (200, 20)
    >>> bool(np.all(np.diff(res.trace_errors) <= 0))
    True
    """
    dask_input = is_dask_array(X)
    X = check_array_2d(X, "X")
    n, d = X.shape
    max_rank = _check_int(max_rank, "max_rank")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}.")
    capacity = min(max_rank, n)
    kernel_obj = _resolve_kernel(X, kernel, gamma, degree, coef0, random_state)
    if dask_input:
        backend = DaskBackend(X, kernel_obj, capacity, client, persist)
    else:
        backend = NumpyBackend(X, kernel_obj, capacity)
    try:
        return _greedy_loop(backend, kernel_obj, n, d, capacity, tol, rank_tol, progress)
    finally:
        backend.close()


def _resolve_kernel(X, kernel, gamma, degree, coef0, random_state) -> Kernel:
    if isinstance(kernel, Kernel):
        return kernel
    needs_sample = (
        isinstance(kernel, str)
        and kernel.lower() not in ("linear",)
        and (gamma is None or isinstance(gamma, str))
    )
    sample = _sample_rows(X, 2000, random_state) if needs_sample else None
    seed = 0 if random_state is None else int(np.random.default_rng(random_state).integers(2**31))
    return make_kernel(kernel, gamma=gamma, degree=degree, coef0=coef0, X_sample=sample, seed=seed)


def _sample_rows(X, m: int, random_state) -> np.ndarray:
    """A seeded sample of rows (without replacement), gathering only those rows."""
    n = X.shape[0]
    rng = np.random.default_rng(random_state)
    idx = np.sort(rng.choice(n, size=min(m, n), replace=False))
    if is_dask_array(X):
        return np.asarray(X[idx].compute(), dtype=np.float64)
    return np.asarray(X[idx], dtype=np.float64)


def _greedy_loop(backend, kernel, n, d, capacity, tol, rank_tol, progress) -> ICFResult:
    start = time.perf_counter()
    summary = backend.summary(1, first=True)
    initial_trace = summary["trace"]
    max_diag = float(summary["values"][0]) if summary["values"].size else 0.0
    if rank_tol is None:
        rank_tol = _EPS * max_diag * max(n, kernel.roundoff(summary.get("max_sqnorm", 0.0), d))
    history = _chunk.History(kernel, capacity, d)
    trace_errors: list[float] = []
    stop = "max_rank"
    trace = initial_trace
    while True:
        i = history.rank
        if i >= capacity:
            stop = "max_rank"
            break
        if trace <= tol:
            stop = "tol"
            break
        t = int(summary["index"][0])
        e_t = float(summary["values"][0])
        if not e_t > rank_tol:
            stop = "numerical_rank"
            break
        block = _chunk.PivotBlock(
            kernel=kernel,
            index=np.array([t], dtype=np.int64),
            rows=summary["x_rows"][:1],
            aux=None if summary["aux"] is None else summary["aux"][:1],
            U=summary["p_rows"][:1],
            L=np.array([[math.sqrt(e_t)]]),
            rank=i,
        )
        history.append(block)
        summary = backend.apply(block, history)
        trace = summary["trace"]
        trace_errors.append(trace)
        if progress is not None:
            progress(
                ICFProgress(
                    rank=history.rank,
                    max_rank=capacity,
                    trace_error=trace,
                    initial_trace=initial_trace,
                    elapsed=time.perf_counter() - start,
                    n_passes=summary["n_passes"],
                )
            )
    r = history.rank
    P, residual = backend.result_arrays(r)
    logger.info(
        "incomplete Cholesky: rank %d, trace error %.3e (from %.3e), stop: %s, %.2f s",
        r, trace, initial_trace, stop, time.perf_counter() - start,
    )
    return ICFResult(
        pivots=history.index[:r].copy(),
        P=P,
        trace_errors=np.array(trace_errors, dtype=np.float64),
        residual=residual,
        L=np.ascontiguousarray(history.L[:r, :r]),
        pivot_rows=np.ascontiguousarray(history.rows[:r]),
        kernel=kernel,
        initial_trace=initial_trace,
        stop_reason=stop,
        n_passes=int(summary["n_passes"]),
        elapsed=time.perf_counter() - start,
        info={"rank_tol": rank_tol},
    )
