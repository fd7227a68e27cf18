"""Rows of P for the k-means' kernels: gathered by index, copied, checked, and their layout.

A factorization's P is Fortran-ordered (each column contiguous): these read
it by columns where rows would be read several times slower.
"""

from __future__ import annotations

import numpy as np

from ._services import mapped_empty

# Rows gathered at a time into an ``out`` array: their temporary stays a few MiB.
_GATHER_ROWS = 4096


def _take_rows(p, local: np.ndarray, out: np.ndarray | None = None, pool=None) -> np.ndarray:
    """Rows ``local`` of a chunk as a C-ordered float64 array (written into ``out`` if given).

    A Fortran-ordered chunk (a factorization's P) is read column by column,
    each a contiguous run: fancy indexing its rows would visit every column
    once per row, several times slower.  With ``out`` the rows go there a
    few thousand at a time, without a temporary the size of the whole
    (a fresh large array costs its page faults on every fetch), and rows
    asked in no order (a mini-batch fetch) are read in increasing order and
    put in their places: each column is then read forwards, not at random
    (1.8x faster on a factorization's P of 10^6 x 150).  ``pool``: threads
    that gather the pieces side by side.
    """
    fortran = isinstance(p, np.ndarray) and p.ndim == 2 and p.strides[0] == p.itemsize
    if out is None:
        if fortran:
            return np.ascontiguousarray(p.T[:, local].T, dtype=np.float64)
        return np.asarray(p[local], dtype=np.float64).reshape(len(local), p.shape[1])
    if local.shape[0] > 1 and not (local[1:] >= local[:-1]).all():
        order = np.argsort(local, kind="stable")
        ranked = local[order]
    else:
        order, ranked = None, local

    def piece(a: int) -> None:
        rows = ranked[a:a + _GATHER_ROWS]
        taken = p.T[:, rows].T if fortran else p[rows]
        if order is None:
            out[a:a + rows.shape[0]] = taken
        else:
            out[order[a:a + rows.shape[0]]] = taken

    starts = range(0, local.shape[0], _GATHER_ROWS)
    if pool is None or len(starts) < 2:
        for a in starts:
            piece(a)
    else:
        list(pool.map(piece, starts))
    return out


def _place_rows(parts: list, inverse: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.concatenate(parts)[inverse]``, written into ``out`` piece by piece.

    ``parts`` are consecutive row ranges of one array (its unique rows in
    order) and ``inverse`` maps each wanted row to its row there.  Neither
    the concatenation nor the result is allocated: the temporaries are a
    few thousand rows.
    """
    where = np.argsort(inverse, kind="stable")
    ranked = inverse[where]
    start = 0
    for part in parts:
        lo, hi = np.searchsorted(ranked, [start, start + part.shape[0]])
        for a in range(lo, hi, _GATHER_ROWS):
            b = min(a + _GATHER_ROWS, hi)
            out[where[a:b]] = part[ranked[a:b] - start]
        start += part.shape[0]
    return out


def _copy_rows(dst: np.ndarray, src) -> None:
    """``dst[...] = src`` into a C-ordered ``dst``, a column-major ``src`` a few columns at a time.

    Copied whole, each row of a column-major block reads one element from
    every column, each in a page of its own: with more columns than the
    processor keeps page translations for, every row misses them all.  A
    group of columns that fills a cache line of ``dst`` per row keeps both
    the pages and the lines at hand (about 1.5x faster on a 150-column P).
    """
    if isinstance(src, np.ndarray) and src.ndim == 2 and src.strides[0] < src.strides[1]:
        width = max(1, 64 // dst.itemsize)
        for j in range(0, src.shape[1], width):
            np.copyto(dst[:, j:j + width], src[:, j:j + width], casting="same_kind")
    else:
        np.copyto(dst, src, casting="same_kind")


def _column_major(p) -> bool:
    """Whether ``p`` is a float64 array laid out by columns (a factorization's P, or rows of
    it: each column contiguous, the next one further on)."""
    return (isinstance(p, np.ndarray) and p.ndim == 2 and p.dtype == np.float64
            and p.shape[1] > 1 and p.strides[0] == p.itemsize and p.strides[1] > p.itemsize)


def _check_finite(x: np.ndarray, rows: int | np.ndarray) -> None:
    """Raise naming the first row of P that holds NaN or infinity.

    ``rows`` is the global index of ``x``'s first row, or of all its rows.
    """
    if np.isfinite(x).all():
        return
    bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
    row = int(rows[bad]) if isinstance(rows, np.ndarray) else rows + bad
    raise ValueError(
        f"P contains NaN or infinity: first at row {row}. "
        "Remove or impute those rows before clustering."
    )


def _rows_in_new_buffer(backend, index: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``backend.rows(index)`` written into a new buffer of ``rows`` rows, and the buffer
    (for the run's later fetches).

    The buffer's pages are faulted in at once (:func:`mapped_empty`), here in
    the fetching thread: filled page by page, a fresh 123 MB buffer took
    0.34 s instead of 0.09 s, time the run then waited for.
    """
    buffer = mapped_empty((rows, backend.s))
    return backend.rows(index, buffer[:index.shape[0]]), buffer
