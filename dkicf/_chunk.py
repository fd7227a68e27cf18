"""Block kernels of the factorization: what one dask task does to one row chunk.

The same functions run the in-memory (numpy) backend, where the whole dataset is
one chunk, and the distributed backend, where each row chunk of X is one task.
That is what makes both backends choose the same pivots and produce the same P.

A chunk's state is logically immutable: :func:`chunk_update` writes the new
columns into slots of the preallocated buffer that no earlier state uses and
returns a new state object with a new residual vector.  A task that is re-run
(after a worker failure, or recomputed from its lineage) therefore overwrites
the same slots with the same values and never applies an update twice.

With P stored in Zarr (:class:`StoreSpec`), a state keeps only a *tail* of the
last columns (fewer than one column block) in memory; each full column block
is written to the chunk's own Zarr chunks exactly once, by the update that
completes it, and later updates stream the flushed blocks back block by block.
Because every value is a deterministic function of X and the pivot history,
re-running a task writes identical bytes.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.linalg.blas import dtrsm as _dtrsm

from ._candidates import chunk_block_stats, rows_reaching_top, top_rows_of
from ._factor import History, PivotBlock
from ._memory import _STREAM_BYTES
from ._services import (
    LazyChunk,
    mapped_empty,
    materialize,
    report_summary,
    scratch,
    threadpool_limits,
)
from .kernels import Kernel, _dot_t

_FLOAT = np.float64

# Rows per sub-block of a chunk task: the per-row temporaries (kernel column,
# P u, squares) stay in cache and below malloc's mmap threshold (workers run
# with a low MALLOC_TRIM_THRESHOLD_, which makes large temporaries page-fault
# on every allocation).
ROW_BLOCK = 8192


def empty_columns(n: int, cols: int, populate: bool = True) -> np.ndarray:
    """An uninitialised ``(n, cols)`` float64 Fortran-ordered buffer for columns of P.

    Large buffers are anonymous memory maps whose pages are all faulted in
    at once (``MADV_POPULATE_WRITE``): touched for the first time in the
    pass that writes each column, one trap per page would cost about as
    much as the pass on a virtual machine.  ``populate=False`` leaves the
    first touch to the caller (who may spread it over threads).

    The page size is the system's: no huge pages are asked for.  On a
    virtual machine whose guest hands freed memory back to its host, fresh
    2 MiB pages took 2.0-2.8 ms per MB to fault in, 4 KiB pages 0.4-1.0 ms
    (huge pages freed a moment before and reused: 0.1 ms, which made fits
    run back to back in one process about 10% faster).
    """
    return mapped_empty((n, cols), "F", populate)


def empty_vector(n: int) -> np.ndarray:
    """An uninitialised float64 vector, faulted in at once if large (see :func:`empty_columns`)."""
    return empty_columns(n, 1)[:, 0]


class NonFiniteError(ValueError):
    """X holds NaN or infinity."""


@dataclass(frozen=True)
class StoreSpec:
    """Where chunk tasks find the Zarr arrays of one fit (a few strings: cheap to ship).

    Attributes
    ----------
    root : str
        Local path or fsspec URL of the Zarr node: the P array itself, or the
        checkpoint group holding ``P`` and the residual buffers.
    p_path : str
        Path of the P array below ``root`` (``""`` when ``root`` is the array).
    token : str
        Identifies the creation of the arrays; keys the per-process cache of
        open arrays, so a location that is replaced is never read stale.
    columns : int
        Columns per Zarr chunk of P (``cb``): the unit in which P is flushed.
    options : str
        fsspec storage options of ``root``, as JSON (``""``: none).
    """

    root: str
    p_path: str
    token: str
    columns: int
    options: str = ""

    def array(self, name: str = "P"):
        """The open Zarr array ``name`` (``"P"`` or a sibling in the group)."""
        path = self.p_path if name == "P" else name
        return _open_array(self.root, path, self.token, self.options)

    def zarr_kwargs(self) -> dict:
        """``storage_options=`` for zarr and dask calls on ``root``, if there are any."""
        return {"storage_options": json.loads(self.options)} if self.options else {}


@functools.lru_cache(maxsize=32)
def _open_array(root: str, path: str, token: str, options: str):
    import zarr

    kw = {"storage_options": json.loads(options)} if options else {}
    return zarr.open_array(store=root, path=path or None, mode="r+", zarr_format=3, **kw)


class ChunkState:
    """Factor rows, residual diagonal and kernel values of one row chunk.

    ``P`` is a Fortran-ordered buffer: column ``k`` is contiguous, so
    ``P[:, :m] @ u`` streams one contiguous block of memory.  In memory it
    holds all ``capacity`` columns, of which the first ``rank`` are
    meaningful.  With ``store`` set, columns ``0:flushed`` live in the Zarr
    array and ``P`` is the tail: its column ``k`` is column ``flushed + k`` of
    the factor, and only its first ``rank - flushed`` columns are meaningful.
    """

    __slots__ = (
        "P", "e", "aux", "rank", "offset", "n_passes", "pivots", "flushed", "store", "cache",
        "spare", "segments", "stash", "max_sqnorm", "top",
    )

    def __init__(
        self, P, e, aux, rank, offset, n_passes=0, pivots=None, flushed=0, store=None,
        spare=None, segments=(0,),
    ):
        self.P = P
        # Local starts of the row chunks of X that this state holds (a task
        # may hold several): residual sums restart at each, so the trace is
        # the same however the chunks are grouped into tasks.
        self.segments = tuple(segments)
        self.e = e
        # The residual buffer of the previous state, reused by the next update
        # (see :func:`chunk_update`): no page faults on a fresh vector per pass.
        self.spare = spare
        self.aux = aux
        self.rank = rank
        self.offset = offset
        self.n_passes = n_passes
        # Local row indices of the pivots that lie in this chunk.
        self.pivots = np.empty(0, dtype=np.int64) if pivots is None else pivots
        self.flushed = flushed
        self.store = store
        # The chunk's summary (chunk_stats with m=1 and rows) computed by the
        # update while X was in memory, so that a streaming pass reads X once.
        self.cache = None
        # Streaming block rules: (local rows, their rows of X in float64) of
        # the largest residuals, kept by the update for the next candidate
        # request (see chunk_rows), so that fetching candidates reads no X.
        self.stash = None
        # Largest squared row norm of the chunk, known at rank 0 when the
        # kernel's auxiliary values are the squared norms (a pass saved).
        self.max_sqnorm = None
        # ((count, rank, passes), residual vector, local rows) of the last
        # selection of the largest residuals (see _candidates.top_rows_of): the
        # update's candidate statistics and the rows sent with the pass make it once.
        self.top = None

    @property
    def n_rows(self) -> int:
        return self.e.shape[0]

    def __sizeof__(self) -> int:
        """Half the bytes of the buffers: what dask's memory accounting counts for a key.

        Dask weighs a state when the update that made it finishes, while the
        update's input is still held, and consecutive states share their
        buffers (P, the two residual vectors, the kernel's auxiliary values).
        Each state counting half of them makes the pair count them once.
        Counting them whole in both made the workers spill states to disk,
        pickling all of P, once P took about 30% of their memory.
        """
        shared = self.P.nbytes + self.e.nbytes
        shared += 0 if self.spare is None else self.spare.nbytes
        shared += 0 if self.aux is None else self.aux.nbytes
        return int(shared // 2 + self.pivots.nbytes + 256)

    def __getstate__(self):
        # The spare buffer is scratch memory: not worth sending or spilling.
        return {k: getattr(self, k) for k in self.__slots__
                if k not in ("spare", "cache", "stash")}

    def __setstate__(self, state):
        for k in self.__slots__:
            setattr(self, k, state.get(k))

    def sub_blocks(self) -> list[tuple[int, int]]:
        """Row ranges of at most :data:`ROW_BLOCK` rows, restarting at each segment."""
        return sub_blocks(self.n_rows, self.segments)

    def successor(self, P, e, rank, pivots, flushed=None) -> ChunkState:
        """The state after an update: same chunk, new columns and residual."""
        return ChunkState(
            P, e, self.aux, rank, self.offset, self.n_passes + 1, pivots,
            self.flushed if flushed is None else flushed, self.store, spare=self.e,
            segments=self.segments,
        )

    def next_residual(self) -> np.ndarray:
        """A copy of ``e`` in the spare buffer (or a new one): the next state's residual.

        Two states of a chunk alternate between two buffers.  The state
        whose buffer is reused is two updates old: the driver has released
        it, and a task that consumes it cannot run again on this worker
        without its output, which holds the buffer's other half.
        """
        e = self.spare
        if e is None or e.shape != self.e.shape:
            e = empty_vector(self.e.shape[0])
        e[...] = self.e
        return e

    def columns(self, lo: int, hi: int) -> np.ndarray:
        """Columns ``lo:hi`` (``hi <= rank``) of the chunk's rows of P, wherever they live.

        A view of the buffer in memory; with ``store``, the flushed part is
        read from Zarr and the rest copied from the tail.
        """
        if self.store is None:
            return self.P[:, lo:hi]
        f = self.flushed
        out = np.empty((self.n_rows, hi - lo), dtype=_FLOAT, order="F")
        if lo < f:
            rows = slice(self.offset, self.offset + self.n_rows)
            out[:, : min(hi, f) - lo] = self.store.array()[rows, lo : min(hi, f)]
        if hi > f:
            start = max(lo, f)
            out[:, start - lo :] = self.P[:, start - f : hi - f]
        return out


def as_float(x: np.ndarray) -> np.ndarray:
    """Float64 C-ordered view or copy of a chunk (float32 input is widened here)."""
    return np.ascontiguousarray(x, dtype=_FLOAT)


def check_finite(x: np.ndarray, offset: int = 0, chunk=None) -> None:
    """Raise a :class:`NonFiniteError` naming the first bad row and its chunk.

    ``chunk`` is the index of X's row chunk, or, for a task that holds
    several consecutive chunks, ``(index of the first, their global row
    starts)``.
    """
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0]) + offset
        if isinstance(chunk, tuple):
            first, starts = chunk
            chunk = first + int(np.searchsorted(starts, bad, side="right")) - 1
        where = f" (chunk {chunk})" if chunk is not None else ""
        raise NonFiniteError(
            f"X contains NaN or infinity: first at row {bad}{where}. "
            "Remove or impute those rows before clustering."
        )


def chunk_init(
    x: np.ndarray,
    kernel: Kernel,
    offset: int,
    capacity: int,
    chunk: int | None = None,
    store: StoreSpec | None = None,
    checked: bool = False,
    run=None,
) -> ChunkState:
    """Check the chunk, compute its kernel diagonal and allocate its factor buffer.

    With ``store``, the buffer is the in-memory tail of one column block.
    ``checked=True`` skips the test for NaN and infinity (the caller made it).
    ``run(func)``, if given, calls ``func(lo, hi)`` over ranges of rows
    covering the chunk (on threads) and returns the results in order: the
    work is then split between those calls (see :func:`_init_ranges`).
    """
    x = materialize(x)
    if run is not None and store is None and x.shape[0]:
        return _init_ranges(x, kernel, offset, capacity, chunk, checked, run)
    with threadpool_limits(1):
        x, aux = _prepare(x, kernel, offset, chunk, checked)
        e = np.array(kernel.diag(x, aux), dtype=_FLOAT)
        if e.size and (not np.isfinite(e).all() or e.min() < 0):
            bad = int(np.flatnonzero(~(e >= 0))[0]) + offset
            raise ValueError(
                f"the kernel's diagonal is negative or not finite at row {bad}: "
                f"k(x, x) = {e[bad - offset]!r}. The kernel must be positive semi-definite."
            )
    width = capacity if store is None else store.columns
    P = empty_columns(x.shape[0], width)
    return _new_state(P, e, aux, offset, store, chunk, kernel)


def _new_state(P, e, aux, offset, store, chunk, kernel) -> ChunkState:
    state = ChunkState(P, e, aux, 0, offset, n_passes=1, store=store,
                       segments=segments_of(chunk, offset, e.shape[0]))
    if aux is not None and aux.size and getattr(kernel, "_aux_is_sqnorms", False):
        state.max_sqnorm = float(aux.max())
    return state


def _init_ranges(x, kernel: Kernel, offset: int, capacity: int, chunk, checked: bool, run):
    """:func:`chunk_init` with its ``O(n)`` work split into ``run``'s ranges of rows.

    The checks, the kernel's auxiliary values and diagonal are row by row,
    so they are the same values as in one call; P's buffer is touched for
    the first time by the ranges too (their rows of it), instead of one
    thread faulting in all of it.
    """
    x = as_float(x)
    n = x.shape[0]
    aux = None if kernel.prepare(x[:1]) is None else np.empty(n, dtype=_FLOAT)
    e = np.empty(n, dtype=_FLOAT)
    P = empty_columns(n, capacity, populate=False)

    # No BLAS limit here: the caller's threads run with one BLAS thread each.
    def part(lo: int, hi: int):
        xs = x[lo:hi]
        if not checked:
            check_finite(xs, offset + lo, chunk)
        a = None
        if aux is not None:
            a = aux[lo:hi]
            a[...] = kernel.prepare(xs)
        es = e[lo:hi]
        es[...] = kernel.diag(xs, a)
        bad = np.flatnonzero(~(es >= 0) | ~np.isfinite(es))
        # The first touch of this range's rows of P: the thread that will
        # update them places their pages (on its memory node, if several).
        P[lo:hi] = 0.0
        return int(bad[0]) + lo if bad.size else None

    found = [b for b in run(part) if b is not None]
    if found:
        bad = found[0]
        raise ValueError(
            f"the kernel's diagonal is negative or not finite at row {bad + offset}: "
            f"k(x, x) = {e[bad]!r}. The kernel must be positive semi-definite."
        )
    return _new_state(P, e, aux, offset, None, chunk, kernel)


class RowRange:
    """Rows ``lo:hi`` of an in-memory chunk state, read as
    :func:`~dkicf.pivoting.chunk_block_stats` reads a state (residual and columns of P)."""

    __slots__ = ("state", "lo", "hi")

    def __init__(self, state: ChunkState, lo: int, hi: int):
        self.state, self.lo, self.hi = state, lo, hi

    @property
    def e(self) -> np.ndarray:
        return self.state.e[self.lo : self.hi]

    def columns(self, lo: int, hi: int) -> np.ndarray:
        return self.state.P[self.lo : self.hi, lo:hi]


def _prepare(x, kernel: Kernel, offset: int, chunk: int | None, checked: bool = False):
    """The chunk checked and in float64, and its kernel auxiliary values."""
    if not checked:
        check_finite(x, offset, chunk)
    x = as_float(x)
    return x, kernel.prepare(x)


def chunk_stats(
    state: ChunkState,
    m: int = 1,
    x: np.ndarray | None = None,
    rows: bool = False,
    parts: list | None = None,
):
    """Small summary of a chunk: trace, its ``m`` largest residuals and more.

    ``parts`` are the per-row-block statistics of the residual (see
    :func:`row_stats`) when the caller has them already (an update computes
    them while the rows are in cache); otherwise they are computed here.
    Either way the trace is the same sum, to the last bit.

    Returns
    -------
    dict with ``trace`` (sum of the residual diagonal), ``values`` and
    ``index`` (global row indices) of the ``m`` largest residuals in
    decreasing order, ties broken by the lowest index; ``n_passes``;
    ``max_sqnorm`` of the rows when ``x`` is given; and, with ``rows=True``,
    the candidates' rows of X (``x_rows``, ``aux``) and of P (``p_rows``).
    """
    if rows and m == 1 and state.cache is not None:
        return dict(state.cache)
    x = materialize(x)
    e = state.e
    n = e.shape[0]
    if parts is None:
        parts = [p for lo, hi in state.sub_blocks() for p in row_stats(e, lo, hi)]
    trace, best = combine_row_stats(parts)
    out = {"trace": trace, "trace_parts": [p[0] for p in parts], "n_passes": state.n_passes}
    if n == 0:
        top = np.empty(0, dtype=np.int64)
    elif m == 1:
        top = np.array([best])
    else:
        m = min(m, n)
        part = np.argpartition(-e, m - 1)[:m] if m < n else np.arange(n)
        top = part[np.lexsort((part, -e[part]))]
    out["values"] = e[top].copy()
    out["index"] = top.astype(np.int64) + state.offset
    if x is not None and n and state.rank == 0:
        out["max_sqnorm"] = (
            state.max_sqnorm if state.max_sqnorm is not None
            else float(np.einsum("ij,ij->i", x, x).max())
        )
    if rows:
        out["x_rows"], out["aux"], out["p_rows"], _ = chunk_rows(x, state, top)
    return out


def sub_blocks(n: int, segments=(0,)) -> list[tuple[int, int]]:
    """``(lo, hi)`` ranges of at most :data:`ROW_BLOCK` rows of ``0:n``, restarting at each
    segment start: the units of every residual sum."""
    ends = list(segments[1:]) + [n]
    return [
        (lo, min(lo + ROW_BLOCK, end))
        for start, end in zip(segments, ends)
        for lo in range(start, end, ROW_BLOCK)
    ]


def segments_of(chunk, offset: int, n: int) -> tuple[int, ...]:
    """Local starts of X's row chunks inside a task given its chunk label."""
    if not isinstance(chunk, tuple):
        return (0,)
    _, starts = chunk
    return tuple(int(s) - offset for s in starts if offset <= s < offset + n) or (0,)


def row_stats(e: np.ndarray, lo: int, hi: int) -> list[tuple[float, float, int]]:
    """``(sum, max, argmax)`` of ``e`` over each :data:`ROW_BLOCK` rows of ``lo:hi``.

    ``lo`` is a multiple of ``ROW_BLOCK``, so the blocks are the same however
    a pass is split: the chunk's trace is the same sum whichever path made it.
    """
    out = []
    for k in range(lo, hi, ROW_BLOCK):
        seg = e[k : min(k + ROW_BLOCK, hi)]
        j = int(np.argmax(seg))
        out.append((float(seg.sum()), float(seg[j]), k + j))
    return out


def combine_row_stats(parts: list[tuple[float, float, int]]) -> tuple[float, int]:
    """The chunk's trace and the local index of its largest residual (lowest on ties)."""
    if not parts:
        return 0.0, -1
    trace = math.fsum(p[0] for p in parts)
    best = parts[0]
    for p in parts[1:]:
        if p[1] > best[1]:
            best = p
    return trace, best[2]


def refresh_row_stats(parts: list, e: np.ndarray, rows: np.ndarray, blocks: list) -> None:
    """Recompute the entries of ``parts`` (one per range of ``blocks``) that hold ``rows``."""
    if not len(rows):
        return
    los = np.array([lo for lo, _ in blocks])
    for k in np.unique(np.searchsorted(los, np.asarray(rows, dtype=np.int64), side="right") - 1):
        lo, hi = blocks[int(k)]
        parts[int(k)] = row_stats(e, lo, hi)[0]


def chunk_rows(x: np.ndarray, state: ChunkState, local: np.ndarray):
    """Rows of X (float64) and of P (first ``rank`` columns) at local indices.

    Rows of X that the update kept in ``state.stash`` are not read again: a
    streamed chunk is then not read at all.
    """
    local = np.asarray(local, dtype=np.int64)
    xr = _stashed_rows(state, local)
    if xr is None:
        xr = as_float(materialize(x)[local])
    aux = None if state.aux is None else state.aux[local].copy()
    if state.store is None:
        pr = _gather_rows(state.P, local, state.rank)
    else:
        f = state.flushed
        pr = np.empty((local.shape[0], state.rank), dtype=_FLOAT)
        if f and local.size:
            # One Zarr chunk per column block: the rows stay cheap to fetch.
            pr[:, :f] = state.store.array().get_orthogonal_selection(
                (local + state.offset, slice(0, f))
            )
        pr[:, f:] = _gather_rows(state.P, local, state.rank - f)
    return xr, aux, pr, state.e[local].copy()


# The parts of :func:`chunk_top_rows`'s answer, by name (as update reports carry them).
_TOP_ROWS = ("index", "x", "aux", "p", "e")


def chunk_top_rows(x: np.ndarray, state: ChunkState, count: int):
    """``(global rows, then chunk_rows' values)`` of the chunk's ``count`` largest residuals.

    The rows that :func:`~dkicf.pivoting.chunk_block_stats` sends for a
    request limited to ``count`` (the same ties to the lowest index).
    """
    local = top_rows_of(state, count) if state.e.shape[0] else np.empty(0, dtype=np.int64)
    return (local + state.offset, *chunk_rows(x, state, local))


def _gather_rows(P: np.ndarray, local: np.ndarray, cols: int) -> np.ndarray:
    """``P[local, :cols]`` as a new Fortran-ordered array.

    Read through the transpose, each column of the Fortran-ordered buffer is
    gathered as one contiguous run: several times faster than fancy indexing
    the rows, which visits the columns one strided element at a time.
    """
    return P[:, :cols].T[:, local].T


def _stashed_rows(state: ChunkState, local: np.ndarray) -> np.ndarray | None:
    """The rows ``local`` of X from the state's stash, or None if any is missing."""
    if state.stash is None:
        return None
    kept, rows = state.stash
    pos = np.searchsorted(kept, local)
    pos = np.minimum(pos, kept.shape[0] - 1)
    if kept.shape[0] == 0 or not np.array_equal(kept[pos], local):
        return None
    return rows[pos]


# Rows per slice of a block update: about _SLICE_BYTES of kernel values.
_SLICE_BYTES = 1 << 20
_MIN_SLICE = 256

def _scratch(slot: int, rows: int, cols: int) -> np.ndarray:
    """This thread's float64 ``(rows, cols)`` scratch array ``slot`` (see
    :func:`dkicf._services.scratch`): block updates need a slice's kernel values
    and its product with P many times per pass."""
    return scratch(("icf", slot), (rows, cols))

# Largest stash of candidate rows a chunk state keeps (bytes).
_STASH_BYTES = 32 << 20


def _stash_top(state: ChunkState, x: np.ndarray, count: int) -> None:
    """Keep the rows of X of the chunk's ``count`` largest residuals (and rows tied at the cut)."""
    e = state.e
    if count <= 0 or e.shape[0] == 0 or min(count, e.shape[0]) * x.shape[1] * 8 > _STASH_BYTES:
        return
    kept = rows_reaching_top(e, count)
    if kept.shape[0] * x.shape[1] * 8 <= _STASH_BYTES:
        state.stash = (kept, x[kept])


def update_rows(
    x, P, e, aux, block: PivotBlock, lo: int, hi: int, base=None, stats: bool = True
):
    """Rows ``lo:hi`` of one pivot-block update, in place on ``P`` and ``e``.

    ``p = (K[:, T] - P[:, :i] U^T) L^{-T}`` and ``e -= rowsum(p**2)``: for
    ``b = 1`` this is exactly one iteration of the paper's Algorithm 1, with
    the kernel column a matrix-vector product written straight into ``P``.
    Residuals that rounding makes slightly negative are clamped to zero.
    ``base``, if given, is the part of ``P U^T`` from columns that are not in
    ``P`` (the flushed columns of a Zarr-backed chunk).  ``lo`` must be a
    multiple of :data:`ROW_BLOCK`.

    Returns the :func:`row_stats` of the updated residual rows, computed
    while they are in cache.  With ``stats=False``, ``lo`` may be any row and
    the statistics returned are those of the :data:`ROW_BLOCK` units that
    lie wholly inside ``lo:hi``, as a dict keyed by their first row (see
    :func:`assemble_row_stats`).
    """
    i, b = block.rank, block.index.shape[0]
    a_aux = None if aux is None else aux[lo:hi]
    if b == 1:
        G = block.kernel.column(
            x[lo:hi], block.rows[0], a_aux, None if block.aux is None else block.aux[0]
        )
        if base is not None:
            G -= base[lo:hi, 0]
        if i:
            G -= P[lo:hi, :i] @ block.U[0]
        col = P[lo:hi, i]
        np.divide(G, block.L[0, 0], out=col)
        sq = np.multiply(col, col, out=G)
    else:
        # Slices of rows whose b kernel values fit in cache: the kernel block
        # is then formed, corrected, solved and squared before it leaves it.
        # It is formed transposed, (b, rows) C-ordered, which is P's own
        # (Fortran) layout of rows x b: its products with X and P are short
        # and wide, which OpenBLAS ran 1.1-2x faster than the tall and
        # skinny ones of the untransposed block, and it is stored into P
        # column by column.
        step = max(_MIN_SLICE, _SLICE_BYTES // (8 * b))
        sq = np.empty(hi - lo)
        Lf = np.asfortranarray(block.L)
        for a in range(lo, hi, step):
            z = min(a + step, hi)
            GT = block.kernel._block_t_into(
                x[a:z], block.rows, None if aux is None else aux[a:z], block.aux,
                _scratch(0, b, z - a),
            )
            if base is not None:
                GT -= base[a:z].T
            if i:
                # Blocks of 2-3 pivots: one matrix-vector product per pivot at any
                # rank (1.1-2x faster on P's columns, 8,192 and 20,000 rows).
                GT -= _dot_t(block.U, P[a:z, :i], _scratch(1, b, z - a), gemv_columns=0)
            # GT.T is Fortran-ordered: BLAS solves G L^T = GT.T in place.  The
            # triangular solve that scipy.linalg wraps (LAPACK's trtrs calls this
            # dtrsm), without its checks, which hold the GIL for tens of
            # microseconds per slice: the numpy backend's threads queued on them.
            G = _dtrsm(1.0, Lf, GT.T, side=1, lower=1, trans_a=1, overwrite_b=1)
            P[a:z, i : i + b] = G
            np.einsum("ij,ij->i", G, G, out=sq[a - lo : z - lo])
    ep = e[lo:hi]
    ep -= sq
    np.maximum(ep, 0.0, out=ep)
    if stats:
        return row_stats(e, lo, hi)
    first = -(-lo // ROW_BLOCK) * ROW_BLOCK
    last = hi if hi == e.shape[0] else (hi // ROW_BLOCK) * ROW_BLOCK
    return {k: s for k, s in zip(range(first, last, ROW_BLOCK), row_stats(e, first, last))}


def assemble_row_stats(e: np.ndarray, found: list[dict], blocks: list) -> list:
    """The :func:`row_stats` of every range of ``blocks`` (multiples of :data:`ROW_BLOCK`),
    taken from the tasks' ``found`` dicts, computed here for the ranges that straddle
    two tasks."""
    known = {}
    for f in found:
        known.update(f)
    return [known[lo] if lo in known else row_stats(e, lo, hi)[0] for lo, hi in blocks]


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


def chunk_update(
    x: np.ndarray, state: ChunkState, block: PivotBlock, report: tuple | None = None,
    stash: int = 0, prefetch: tuple | None = None, send_rows: bool = False,
) -> ChunkState:
    """Add the block's ``b`` columns to this chunk's piece of P (one dask task).

    Writes only columns ``rank:rank+b`` of the shared buffer and returns a new
    state whose residual is written into the buffer of the state before the
    input (:meth:`ChunkState.next_residual`): the input state stays valid, so
    a task that runs twice gives the same result.

    ``report = (topic, step, chunk)`` also sends the new state's summary to
    the driver as a dask event on ``topic`` (see :func:`report_summary`).
    ``stash > 0`` (a streamed chunk, for a block rule that will ask for that
    many candidates) keeps the X rows of the new state's largest residuals,
    so the candidates' rows are found without reading the chunk again.
    ``prefetch = (lo, hi, request)`` adds the new state's
    :func:`~dkicf.pivoting.chunk_block_stats` to the report; with
    ``send_rows`` the report also carries the rows of X and P of the
    residuals those statistics list (:func:`chunk_top_rows`), so that the
    driver needs no task to fetch the next candidates' rows.
    """
    i = block.rank
    if state.rank != i:
        raise RuntimeError(f"chunk at rank {state.rank} received a block for rank {i}")
    streamed = isinstance(x, LazyChunk)
    x = materialize(x)
    with threadpool_limits(1):
        x = as_float(x)
        e = state.next_residual()
        if state.store is not None:
            new = _update_stored(x, state, e, block)
            parts = None
        else:
            blocks = state.sub_blocks()
            parts = []
            for lo, hi in blocks:
                parts += update_rows(x, state.P, e, state.aux, block, lo, hi)
            pivots = finish_block(state.P, e, state.offset, block, state.pivots)
            refresh_row_stats(parts, e, pivots[len(state.pivots):], blocks)
            new = state.successor(state.P, e, i + block.index.shape[0], pivots)
        new.cache = chunk_stats(new, 1, x, rows=True, parts=parts)
        if streamed and stash:
            _stash_top(new, x, stash + 1)  # the candidates and the row that bounds the others
    if report is not None:
        summary = new.cache
        if prefetch is not None:
            summary = {**summary, **{f"{group}.{k}": v
                                     for group, part in _ahead(x, new, prefetch, send_rows).items()
                                     for k, v in part.items()}}
        report_summary(report, summary)
    return new


def _ahead(x, state: ChunkState, prefetch: tuple, send_rows: bool) -> dict:
    """What a task sends of the next candidate request: ``block_stats`` (its
    :func:`~dkicf.pivoting.chunk_block_stats`) and, with ``send_rows``, ``top_rows``
    (:func:`chunk_top_rows` as a dict keyed by :data:`_TOP_ROWS`)."""
    out = {"block_stats": chunk_block_stats(x, state, state.offset, *prefetch)}
    if send_rows and prefetch[2].limit:
        top = chunk_top_rows(x, state, prefetch[2].limit)
        out["top_rows"] = {k: v for k, v in zip(_TOP_ROWS, top) if v is not None}
    return out


def chunk_stats_ahead(state: ChunkState, m: int, x, prefetch: tuple, send_rows: bool) -> dict:
    """:func:`chunk_stats` with the rows, and :func:`_ahead` for the first candidate request.

    The set-up's summary then brings what the block loop's first gather and
    row fetch would ask for: one round trip to the workers before the first
    pass instead of three.
    """
    x = materialize(x)
    return {**chunk_stats(state, m, x, rows=True), **_ahead(x, state, prefetch, send_rows)}


def _update_stored(x, state: ChunkState, e: np.ndarray, block: PivotBlock) -> ChunkState:
    """:func:`chunk_update` for a chunk whose first ``flushed`` columns are in Zarr.

    The product with the flushed columns is streamed from Zarr; the block is
    then applied to the tail as if the tail were the whole of P.  Column
    blocks that become full are written to Zarr and leave the tail.
    """
    n, i, b, f = state.n_rows, block.rank, block.index.shape[0], state.flushed
    tail = state.P
    if tail.shape[1] < i - f + b:
        # A block wider than the free slots: a new buffer, the old state's stays valid.
        tail = empty_columns(n, i - f + b)
        tail[:, : i - f] = state.P[:, : i - f]
    local = replace(block, rank=i - f, U=block.U[:, f:])
    aux = state.aux
    # Row tiles of whole Zarr chunks: the flushed columns of a tile are read
    # and multiplied, then the tile is updated in cache-sized row blocks, so
    # a task's memory does not grow with its rows or with the block size.
    for t0, t1, base in _stored_tiles(state, block.U):
        xs, ts, es = x[t0:t1], tail[t0:t1], e[t0:t1]
        auxs = None if aux is None else aux[t0:t1]
        for lo in range(0, t1 - t0, ROW_BLOCK):
            update_rows(xs, ts, es, auxs, local, lo, min(lo + ROW_BLOCK, t1 - t0), base)
    pivots = finish_block(tail, e, state.offset, local, state.pivots)
    f, tail = _flush_full_blocks(state.store, state.offset, tail, f, i + b)
    return state.successor(tail, e, i + b, pivots, flushed=f)


def _stored_tiles(state: ChunkState, U: np.ndarray):
    """``(t0, t1, base)`` over row tiles of the chunk, ``base = P[t0:t1, :flushed] @ U^T``.

    Each tile is whole Zarr chunks of rows by every flushed column, at most
    about :data:`_STREAM_BYTES` (``base`` is None when nothing is flushed).
    """
    n, f = state.n_rows, state.flushed
    if not f:
        yield 0, n, None
        return
    arr = state.store.array()
    tile = int(arr.chunks[0])
    step = max(tile, _STREAM_BYTES // (8 * f) // tile * tile)
    Ut = np.ascontiguousarray(U[:, :f].T)
    for t0 in range(0, n, step):
        t1 = min(n, t0 + step)
        yield t0, t1, arr[state.offset + t0 : state.offset + t1, 0:f] @ Ut


def _flush_full_blocks(store: StoreSpec, offset: int, tail, f: int, rank: int):
    """Write the tail's full column blocks to Zarr; return the new ``flushed`` and tail."""
    cb = store.columns
    full = (rank - f) // cb * cb
    if not full:
        return f, tail
    n = tail.shape[0]
    # Whole Zarr chunks owned by this chunk alone: the only safe concurrent write,
    # and a re-run writes the same bytes.
    store.array()[offset : offset + n, f : f + full] = tail[:, :full]
    rest = rank - f - full
    new = empty_columns(n, max(cb, rest))
    new[:, :rest] = tail[:, full : full + rest]
    return f + full, new


def chunk_write_p(state: ChunkState, spec: StoreSpec, start: int) -> None:
    """Write the chunk's columns ``start:rank`` of P to ``spec``'s P array (checkpoint).

    A Zarr-backed chunk writes its tail (columns ``flushed:rank``: its full
    blocks are already there).  A partly filled column block is written as a
    whole chunk of this chunk's rows, with identical values for any re-run.
    """
    rows = slice(state.offset, state.offset + state.n_rows)
    if state.store is not None:
        start, src = state.flushed, state.P[:, : state.rank - state.flushed]
    else:
        src = state.P[:, start : state.rank]
    if src.shape[1]:
        spec.array()[rows, start : state.rank] = src


def chunk_write_e(state: ChunkState, spec: StoreSpec, name: str) -> None:
    """Write the chunk's residual diagonal to the array ``name`` of the checkpoint."""
    spec.array(name)[state.offset : state.offset + state.n_rows] = state.e


def chunk_restore(
    x: np.ndarray,
    previous_key: str | None,
    spec: StoreSpec,
    kernel: Kernel,
    offset: int,
    capacity: int,
    chunk: int | None,
    point: dict,
    stored: bool,
) -> ChunkState:
    """A chunk's state at a committed checkpoint, read from Zarr (a leaf task).

    If this worker still holds the chunk's current state (under
    ``previous_key``) at the checkpoint's rank, it is reused; otherwise the
    state is rebuilt from X and the checkpoint: the residual from the
    committed buffer ``point["e"]``, P's columns (all of them, or the tail
    only when ``stored``) from the P array.  The values are the bytes the
    state held when it was written, so the rebuilt state is bit-identical.
    """
    x = materialize(x)
    rank = int(point["rank"])
    state = _worker_state(previous_key, rank)
    if state is not None:
        return state
    with threadpool_limits(1):
        _, aux = _prepare(x, kernel, offset, chunk)
    n = x.shape[0]
    rows = slice(offset, offset + n)
    e = np.array(spec.array(point["e"])[rows], dtype=_FLOAT)
    arr = spec.array()
    if stored:
        f = rank // spec.columns * spec.columns
        P = empty_columns(n, spec.columns)
    else:
        f = 0
        P = empty_columns(n, capacity)
    if rank > f:
        P[:, : rank - f] = arr[rows, f:rank]
    g = np.asarray(point["pivots"], dtype=np.int64)
    pivots = g[(g >= offset) & (g < offset + n)] - offset
    return ChunkState(
        P, e, aux, rank, offset, int(point["n_passes"]), pivots, f, spec if stored else None,
        segments=segments_of(chunk, offset, n),
    )


def _worker_state(key: str | None, rank: int) -> ChunkState | None:
    """The state stored under ``key`` on this dask worker, if it is there at ``rank``."""
    if key is None:
        return None
    try:
        from distributed import get_worker

        data = get_worker().data
        if key in data:
            state = data[key]
            if isinstance(state, ChunkState) and state.rank == rank:
                return state
    except (ImportError, ValueError):
        pass
    return None


def chunk_P(state: ChunkState, rank: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The chunk's rows ``lo:hi`` of P, first ``rank`` columns (a view, not a copy)."""
    return state.P[lo:hi, :rank]


def chunk_residual(state: ChunkState) -> np.ndarray:
    return state.e


def chunk_rebase(
    x: np.ndarray,
    previous_key: str,
    history: History,
    offset: int,
    capacity: int,
    chunk: int,
    store: StoreSpec | None = None,
) -> ChunkState:
    """Start a new lineage for a chunk at the history's rank.

    If the worker still holds the chunk's current state (under
    ``previous_key``), it is reused as is; otherwise (its worker died) the
    state is rebuilt by replaying every block of the history on the chunk's
    rows of X, which reproduces it bit for bit (and, for a Zarr-backed chunk,
    rewrites its full column blocks with the same bytes).
    """
    x = materialize(x)
    state = _worker_state(previous_key, history.rank)
    if state is not None:
        return state
    state = chunk_init(x, history.kernel, offset, capacity, chunk, store)
    for k in range(len(history.bounds) - 1):
        state = chunk_update(x, state, history.block(k))
    return state
