"""The factorization's records: pivot blocks, the pivot history, progress and result.

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

__all__ = ["History", "ICFProgress", "ICFResult", "PivotBlock", "cut_factor"]


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


@dataclass
class PivotBlock:
    """What the driver sends to every chunk to add ``b`` pivots at rank ``i``.

    Attributes
    ----------
    kernel : Kernel
    index : (b,) global row indices of the new pivots, in selection order.
    rows : (b, d) float64 rows of X of the new pivots.
    aux : (b,) kernel auxiliary values of those rows, or None.
    U : (b, i) rows of P of the new pivots (columns before the block).
    L : (b, b) lower-triangular Cholesky factor of ``K_TT - U U^T``.
    rank : i, the number of columns before the block.
    """

    kernel: Kernel
    index: np.ndarray
    rows: np.ndarray
    aux: np.ndarray | None
    U: np.ndarray
    L: np.ndarray
    rank: int


class History:
    """The pivots chosen so far, in blocks: enough to rebuild any chunk's state.

    Every chunk's rows of P are a deterministic function of its rows of X and
    of this history (the blocks replayed in order give bit-identical columns),
    which is what lets the distributed backend cut task lineage and still
    recover a chunk that a dead worker took with it.
    """

    def __init__(self, kernel: Kernel, capacity: int, n_features: int):
        self.kernel = kernel
        self.index = np.empty(capacity, dtype=np.int64)
        self.rows = np.empty((capacity, n_features))
        self.aux = None
        self.L = np.zeros((capacity, capacity))
        self.bounds: list[int] = [0]

    @property
    def rank(self) -> int:
        return self.bounds[-1]

    def append(self, block: PivotBlock) -> None:
        i, b = block.rank, block.index.shape[0]
        if i != self.rank:
            raise RuntimeError(f"history at rank {self.rank} received a block for rank {i}")
        self.index[i : i + b] = block.index
        self.rows[i : i + b] = block.rows
        if block.aux is not None:
            if self.aux is None:
                self.aux = np.empty(self.index.shape[0])
            self.aux[i : i + b] = block.aux
        self.L[i : i + b, :i] = block.U
        self.L[i : i + b, i : i + b] = block.L
        self.bounds.append(i + b)

    def block(self, k: int) -> PivotBlock:
        """The ``k``-th block, exactly as it was sent."""
        i, j = self.bounds[k], self.bounds[k + 1]
        return PivotBlock(
            kernel=self.kernel,
            index=self.index[i:j].copy(),
            rows=self.rows[i:j].copy(),
            aux=None if self.aux is None else self.aux[i:j].copy(),
            U=self.L[i:j, :i].copy(),
            L=self.L[i:j, i:j].copy(),
            rank=i,
        )

    @classmethod
    def restore(
        cls, kernel: Kernel, capacity: int, index, rows, aux, L, bounds: list[int]
    ) -> History:
        """The history of a checkpoint: its first ``bounds[-1]`` pivots and blocks."""
        rows = np.asarray(rows, dtype=np.float64)
        h = cls(kernel, capacity, rows.shape[1])
        r = bounds[-1]
        h.index[:r] = index
        h.rows[:r] = rows
        if aux is not None:
            h.aux = np.empty(capacity)
            h.aux[:r] = aux
        h.L[:r, :r] = L
        h.bounds = [int(b) for b in bounds]
        return h

    def snapshot(self) -> History:
        """A compact copy (only the filled part) to ship to workers."""
        r = self.rank
        h = History.__new__(History)
        h.kernel = self.kernel
        h.index = self.index[:r].copy()
        h.rows = self.rows[:r].copy()
        h.aux = None if self.aux is None else self.aux[:r].copy()
        h.L = self.L[:r, :r].copy()
        h.bounds = list(self.bounds)
        return h
