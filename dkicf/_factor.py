"""The factorization's result and progress records, and the cut of a factor to a rank.

Below both the driver loop (:mod:`dkicf.icf`) and the storage that rebuilds a
finished factorization from a checkpoint (:mod:`dkicf.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular

from ._validation import is_dask_array
from .kernels import Kernel

__all__ = ["ICFProgress", "ICFResult", "cut_factor"]


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


def cut_factor(P, residual, r: int):
    """The factor cut to its first ``r`` columns, and the residual of the cut factor.

    The squares of the dropped columns are added back column after column,
    so numpy and dask arrays, in any memory order, give the same bits (a
    finished checkpoint rebuilds the result this way from Zarr).
    """
    if P.shape[1] == r:
        return P, residual
    dropped = P[:, r:]
    if is_dask_array(dropped):
        squares = dropped.rechunk({1: -1}).map_blocks(
            _squares_by_column, drop_axis=1, meta=np.empty(0, dtype=np.float64)
        )
    else:
        squares = _squares_by_column(dropped)
    return P[:, :r], residual + squares


def _squares_by_column(A) -> np.ndarray:
    out = A[:, 0] * A[:, 0]
    for k in range(1, A.shape[1]):
        out += A[:, k] * A[:, k]
    return out
