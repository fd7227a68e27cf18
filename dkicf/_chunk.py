"""Block kernels of the factorization: what one dask task does to one row chunk.

The same functions run the in-memory (numpy) backend, where the whole dataset is
one chunk, and the distributed backend, where each row chunk of X is one task.
That is what makes both backends choose the same pivots and produce the same P.

A chunk's state is logically immutable: :func:`chunk_update` writes the new
columns into slots of the preallocated buffer that no earlier state uses and
returns a new state object with a new residual vector.  A task that is re-run
(after a worker failure, or recomputed from its lineage) therefore overwrites
the same slots with the same values and never applies an update twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular
from threadpoolctl import threadpool_limits

from .kernels import Kernel

_FLOAT = np.float64


class NonFiniteError(ValueError):
    """X holds NaN or infinity."""


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


class ChunkState:
    """Factor rows, residual diagonal and kernel values of one row chunk.

    ``P`` is a Fortran-ordered ``(n_rows, capacity)`` buffer: column ``k`` is
    contiguous, so ``P[:, :rank] @ u`` streams one contiguous block of memory.
    Only the first ``rank`` columns are meaningful.
    """

    __slots__ = ("P", "e", "aux", "rank", "offset", "n_passes", "pivots")

    def __init__(self, P, e, aux, rank, offset, n_passes=0, pivots=None):
        self.P = P
        self.e = e
        self.aux = aux
        self.rank = rank
        self.offset = offset
        self.n_passes = n_passes
        # Local row indices of the pivots that lie in this chunk.
        self.pivots = np.empty(0, dtype=np.int64) if pivots is None else pivots

    @property
    def n_rows(self) -> int:
        return self.e.shape[0]

    def __sizeof__(self) -> int:  # used by dask's memory accounting
        aux = 0 if self.aux is None else self.aux.nbytes
        return int(self.P.nbytes + self.e.nbytes + aux + 64)


def as_float(x: np.ndarray) -> np.ndarray:
    """Float64 C-ordered view or copy of a chunk (float32 input is widened here)."""
    return np.ascontiguousarray(x, dtype=_FLOAT)


def check_finite(x: np.ndarray, offset: int = 0, chunk: int | None = None) -> None:
    """Raise a :class:`NonFiniteError` naming the first bad row."""
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0]) + offset
        where = f" (chunk {chunk})" if chunk is not None else ""
        raise NonFiniteError(
            f"X contains NaN or infinity: first at row {bad}{where}. "
            "Remove or impute those rows before clustering."
        )


def chunk_init(
    x: np.ndarray, kernel: Kernel, offset: int, capacity: int, chunk: int | None = None
) -> ChunkState:
    """Check the chunk, compute its kernel diagonal and allocate its factor buffer."""
    with threadpool_limits(1):
        check_finite(x, offset, chunk)
        x = as_float(x)
        aux = kernel.prepare(x)
        e = np.array(kernel.diag(x, aux), dtype=_FLOAT)
        if e.size and (not np.isfinite(e).all() or e.min() < 0):
            bad = int(np.flatnonzero(~(e >= 0))[0]) + offset
            raise ValueError(
                f"the kernel's diagonal is negative or not finite at row {bad}: "
                f"k(x, x) = {e[bad - offset]!r}. The kernel must be positive semi-definite."
            )
    P = np.empty((x.shape[0], capacity), dtype=_FLOAT, order="F")
    return ChunkState(P, e, aux, 0, offset, n_passes=1)


def chunk_stats(state: ChunkState, m: int = 1, x: np.ndarray | None = None, rows: bool = False):
    """Small summary of a chunk: trace, its ``m`` largest residuals and more.

    Returns
    -------
    dict with ``trace`` (sum of the residual diagonal), ``values`` and
    ``index`` (global row indices) of the ``m`` largest residuals in
    decreasing order, ties broken by the lowest index; ``n_passes``;
    ``max_sqnorm`` of the rows when ``x`` is given; and, with ``rows=True``,
    the candidates' rows of X (``x_rows``, ``aux``) and of P (``p_rows``).
    """
    e = state.e
    n = e.shape[0]
    out = {"trace": float(e.sum()), "n_passes": state.n_passes}
    if n == 0:
        top = np.empty(0, dtype=np.int64)
    elif m == 1:
        top = np.array([int(np.argmax(e))])
    else:
        m = min(m, n)
        part = np.argpartition(-e, m - 1)[:m] if m < n else np.arange(n)
        top = part[np.lexsort((part, -e[part]))]
    out["values"] = e[top].copy()
    out["index"] = top.astype(np.int64) + state.offset
    if x is not None and n and state.rank == 0:
        out["max_sqnorm"] = float(np.einsum("ij,ij->i", x, x).max())
    if rows:
        out["x_rows"], out["aux"], out["p_rows"], _ = chunk_rows(x, state, top)
    return out


def chunk_rows(x: np.ndarray, state: ChunkState, local: np.ndarray):
    """Rows of X (float64) and of P (first ``rank`` columns) at local indices."""
    local = np.asarray(local, dtype=np.int64)
    xr = as_float(np.asarray(x)[local])
    aux = None if state.aux is None else state.aux[local].copy()
    pr = np.array(state.P[local, : state.rank], dtype=_FLOAT)
    return xr, aux, pr, state.e[local].copy()


def update_rows(x, P, e, aux, block: PivotBlock, lo: int, hi: int) -> None:
    """Rows ``lo:hi`` of one pivot-block update, in place on ``P`` and ``e``.

    ``p = (K[:, T] - P[:, :i] U^T) L^{-T}`` and ``e -= rowsum(p**2)``: for
    ``b = 1`` this is exactly one iteration of the paper's Algorithm 1.
    Residuals that rounding makes slightly negative are clamped to zero.
    """
    i, b = block.rank, block.index.shape[0]
    G = block.kernel.block(x[lo:hi], block.rows, None if aux is None else aux[lo:hi], block.aux)
    if i:
        G -= P[lo:hi, :i] @ block.U.T
    if b == 1:
        G /= block.L[0, 0]
        P[lo:hi, i] = G[:, 0]
        G = G[:, 0]
        G *= G
        sq = G
    else:
        G = solve_triangular(block.L, G.T, lower=True, check_finite=False).T
        P[lo:hi, i : i + b] = G
        sq = np.einsum("ij,ij->i", G, G)
    ep = e[lo:hi]
    ep -= sq
    np.maximum(ep, 0.0, out=ep)


def finish_block(P, e, offset: int, block: PivotBlock, pivots: np.ndarray) -> np.ndarray:
    """Make the pivot rows of P exactly the rows of L and zero their residuals.

    In exact arithmetic a selected row has a zero residual, so its entries in
    every later column vanish; rounding leaves ~1e-17 there.  Writing the
    exact values keeps ``L = P[pivots]`` lower triangular.  Returns the
    chunk's local pivot indices including the new ones.
    """
    i, b = block.rank, block.index.shape[0]
    if pivots.size:
        P[pivots, i : i + b] = 0.0
    local = block.index - offset
    mine = (local >= 0) & (local < e.shape[0])
    if mine.any():
        rows = local[mine]
        P[rows, i : i + b] = block.L[mine]
        e[rows] = 0.0
        pivots = np.concatenate([pivots, rows])
    return pivots


def chunk_update(x: np.ndarray, state: ChunkState, block: PivotBlock) -> ChunkState:
    """Add the block's ``b`` columns to this chunk's piece of P (one dask task).

    Writes only columns ``rank:rank+b`` of the shared buffer and returns a new
    state with a new residual vector: the input state stays valid, so a task
    that runs twice gives the same result.
    """
    i = block.rank
    if state.rank != i:
        raise RuntimeError(f"chunk at rank {state.rank} received a block for rank {i}")
    with threadpool_limits(1):
        x = as_float(x)
        e = state.e.copy()
        update_rows(x, state.P, e, state.aux, block, 0, e.shape[0])
        pivots = finish_block(state.P, e, state.offset, block, state.pivots)
    return ChunkState(
        state.P, e, state.aux, i + block.index.shape[0], state.offset, state.n_passes + 1, pivots
    )


def chunk_P(state: ChunkState, rank: int) -> np.ndarray:
    """The chunk's rows of P, first ``rank`` columns (a view)."""
    return state.P[:, :rank]


def chunk_residual(state: ChunkState) -> np.ndarray:
    return state.e



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


def chunk_rebase(
    x: np.ndarray,
    previous_key: str,
    history: History,
    offset: int,
    capacity: int,
    chunk: int,
) -> ChunkState:
    """Start a new lineage for a chunk at the history's rank.

    If the worker still holds the chunk's current state (under
    ``previous_key``), it is reused as is; otherwise (its worker died) the
    state is rebuilt by replaying every block of the history on the chunk's
    rows of X, which reproduces it bit for bit.
    """
    try:
        from distributed import get_worker

        data = get_worker().data
        if previous_key in data:
            state = data[previous_key]
            if isinstance(state, ChunkState) and state.rank == history.rank:
                return state
    except (ImportError, ValueError):
        pass
    state = chunk_init(x, history.kernel, offset, capacity, chunk)
    for k in range(len(history.bounds) - 1):
        state = chunk_update(x, state, history.block(k))
    return state
