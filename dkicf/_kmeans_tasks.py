"""The k-means' chunk kernels and its two backends: a thread pool here, or dask tasks.

Each kernel reads one row chunk of P and returns a summary of size
``O(k s)``: labels and distances stay with the chunk.  The numpy backend runs
the kernels over row blocks of an in-memory P; the dask backend runs them as
tasks where P's chunks live.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol

import numpy as np
from scipy import sparse

from ._cluster import get_client
from ._kmeans_rows import _check_finite, _column_major, _copy_rows, _place_rows, _take_rows
from ._memory import _gib, _worker_resources
from ._services import (
    ChunkBackend,
    LazyChunk,
    _aligned,
    chunk_digest,
    chunk_futures,
    materialize,
    scratch,
    threadpool_limits,
)
from ._validation import is_dask_array

# Rows x centres of the distance block a chunk kernel holds at once.
_BLOCK_ELEMENTS = 1 << 20


# Bytes of rows (float64) per block of a chunk kernel: a block stays in cache while
# every run's centres are compared with it.
_BLOCK_BYTES = 4 << 20


# Numpy backend: rows per block of its thread pool, at least.
_MIN_BLOCK_ROWS = 16384


def _nearest(x: np.ndarray, centers: np.ndarray, c_sq: np.ndarray):
    """Nearest centre of each row (ties to the lowest index) and the squared distance to it.

    ``||x||^2 - 2 x.c + ||c||^2`` in float64, clamped at 0 (rounding can make a
    point at a centre slightly negative).  For the driver's mini-batch steps;
    the passes over chunks use :func:`_nearest_by_runs`.
    """
    # This thread's scratch block: a fresh one would fault in new pages in a worker.
    d = scratch("kmeans-distances", (x.shape[0], centers.shape[0]))
    np.matmul(x, centers.T, out=d)
    d *= -2.0
    d += c_sq
    d += np.einsum("ij,ij->i", x, x)[:, None]
    labels = np.argmin(d, axis=1).astype(np.int64, copy=False)
    d2 = d[np.arange(x.shape[0]), labels]
    np.maximum(d2, 0.0, out=d2)
    return labels, d2


def _nearest_by_runs(x: np.ndarray, scaled: np.ndarray, c_sq: np.ndarray, width: int,
                     tied: np.ndarray | None = None):
    """Each run's nearest centre for each row (ties to the lowest index) and the squared
    distance to it, as ``(runs, rows)`` arrays.

    ``scaled`` is ``-2 c`` for the runs' centres side by side, ``width`` a
    run (``(runs * width, s)``, float64), ``c_sq`` their ``||c||^2``.  The
    distances ``||x||^2 - 2 x.c + ||c||^2`` are formed centres by rows, so
    that each run's minimum is a vectorised pass per centre along the rows
    and the first centre reaching it is found the same way: an argmin over
    each row's few centres costs a third of the product at ``k = 10``
    (:func:`_first_reaching`).
    Clamped at 0 (rounding can make a row at a centre slightly negative).
    ``tied`` (bool, one per run), if given, is set for each run where some
    row has two centres or more at its minimum.
    """
    rows = x.shape[0]
    runs = scaled.shape[0] // width
    d = np.matmul(scaled, x.T, out=scratch("kmeans-distances", (scaled.shape[0], rows)))
    d += c_sq[:, None]
    d += np.einsum("ij,ij->i", x, x)
    by_run = d.reshape(runs, width, rows)
    least = np.minimum.reduce(by_run, axis=1, out=scratch("kmeans-least", (runs, rows)))
    near = _first_reaching(by_run, least, "kmeans", tied)
    # A NaN minimum (a row whose squares overflow, next to a centre as large) is
    # reached by none: centre 0, so that a label never leaves its run's range.
    np.putmask(near, near == width, 0)
    np.maximum(least, 0.0, out=least)
    return near, least


def _first_reaching(d: np.ndarray, least: np.ndarray, slot: str,
                    tied: np.ndarray | None = None) -> np.ndarray:
    """Index along the second-to-last axis of ``d`` (``(..., m, rows)``) of the first entry
    equal to ``least`` (its minimum over that axis), as int64; ``m`` where none is (a
    NaN minimum).

    A vectorised pass per entry along the rows, like the minimum itself: no
    argmin over each row's few entries.  ``slot`` names this thread's
    scratch arrays.  ``tied`` (bool, of ``d.shape[:-2]``), if given, is set
    where some row has two entries or more at the minimum: the first of them
    then depends on the entries' order.
    """
    m = d.shape[-2]
    # Counts and places up to m in the narrowest integers that hold them (uint8:
    # 1.7-2.3x faster than int32 at 10-20 entries).
    kind = np.uint8 if m < 256 else np.uint16 if m < 65536 else np.int64
    reached = np.equal(d, least[..., None, :], out=scratch(f"{slot}-reached", d.shape, np.bool_))
    if tied is not None:
        tied |= (np.add.reduce(reached, axis=-2, dtype=kind) > 1).any(axis=-1)
    # The first at the minimum: the largest of (m - j) where it is reached.
    weight = np.arange(m, 0, -1, dtype=kind)[:, None]
    top = np.maximum.reduce(np.multiply(reached, weight, out=scratch(
        f"{slot}-first", d.shape, kind)), axis=-2)
    return np.subtract(m, top, dtype=np.int64)


def _cluster_sums(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Per-centre sums of the rows: the sparse (k, m) indicator times the (m, s) rows.

    ``labels`` is ``(m,)``, or ``(m, runs)`` with each run's labels offset
    into its own range of the ``k`` sums: one indicator with ``runs`` ones a
    row serves them all, and each sum adds its rows in row order either way.
    ``m * s`` additions a run.  A dense indicator would cost ``k`` times more
    and goes through a matrix-product shape (few rows, a long inner
    dimension) that BLAS handles badly.
    """
    m = x.shape[0]
    per = labels.size // m if m else 1
    onehot = sparse.csr_matrix((np.ones(m * per), labels.reshape(-1),
                                np.arange(0, m * per + 1, per)), shape=(m, k))
    return np.asarray(onehot.T @ x)


def _row_blocks(p, offset: int, width: int, check: bool, views: bool = False):
    """``(lo, hi, rows)`` of a chunk in blocks that keep the kernels' working set small.

    A block holds at most ``_BLOCK_ELEMENTS / width`` rows (its distances to
    ``width`` centres) and about ``_BLOCK_BYTES`` of rows, so that a pass
    over several runs' centres reads each block from cache.  The block
    size depends on P's width and ``width`` only.  Rows are widened to
    float64 block by block; ``check``: raise on NaN or infinity (P that was
    not validated yet).

    A chunk that is not C-ordered float64 (a factorization's P is
    Fortran-ordered) is copied block by block into this thread's scratch
    block, C-ordered, while the block is in cache: the passes' kernels read
    Fortran-ordered rows several times slower, and a C-ordered copy of the
    whole chunk would double P in memory.  The block is only valid until
    the next one.  ``views=True``: a Fortran-ordered float64 chunk's blocks
    are its own rows, not copied (for kernels that read them by columns).
    """
    step = max(256, min(_BLOCK_ELEMENTS // max(1, width), _BLOCK_BYTES // (8 * max(1, p.shape[1]))))
    direct = isinstance(p, np.ndarray) and p.dtype == np.float64 and (
        p.flags.c_contiguous or (views and _column_major(p)))
    for lo in range(0, p.shape[0], step):
        hi = min(lo + step, p.shape[0])
        if direct:
            x = p[lo:hi]
        else:
            x = scratch("kmeans-rows", (hi - lo, p.shape[1]))
            _copy_rows(x, p[lo:hi])
        if check:
            _check_finite(x, offset + lo)
        yield lo, hi, x


def _packed(centers: list) -> tuple[np.ndarray, np.ndarray, int]:
    """The runs' centres side by side for one product: ``-2 c`` padded to the largest
    ``k`` (the width of a run), their squared norms (infinite for the padding, which no
    row is nearest to), and that width."""
    runs, width = len(centers), max(c.shape[0] for c in centers)
    scaled = np.zeros((runs * width, centers[0].shape[1]))
    c_sq = np.full(runs * width, np.inf)
    for r, c in enumerate(centers):
        np.multiply(c, -2.0, out=scaled[r * width:r * width + c.shape[0]])
        c_sq[r * width:r * width + c.shape[0]] = np.einsum("ij,ij->i", c, c)
    return scaled, c_sq, width


def _scan(p, offset: int, centers: list, with_sums: bool, check: bool = True,
          tied: np.ndarray | None = None):
    """Labels, squared distances and (optionally) per-centre sums of one row chunk,
    for each set of centres in ``centers`` (one per run).

    One read of the chunk and one matrix product serve every run: the runs'
    centres side by side (padded to the largest ``k`` with centres no row
    is nearest to), so that the rows are packed for the product once, not
    once a run (twice as fast at ``k = 10`` and five runs).  A run's
    distances are therefore its own up to rounding, not bit for bit what
    they would be alone; its sums add the same rows in the same order.
    Works in row blocks (:func:`_row_blocks`) so that the distance block
    stays small whatever the chunk size.  ``tied``: see :func:`_nearest_by_runs`.
    """
    n, s = p.shape
    runs = len(centers)
    scaled, c_sq, width = _packed(centers)
    labels = np.empty((runs, n), dtype=np.int64)
    d2 = np.empty((runs, n))
    sums = np.zeros((runs * width, s)) if with_sums else None
    first = np.arange(0, runs * width, width)
    # Without sums (whose sparse product wants rows), a column-major P is read by
    # columns, as in k-means||: the product is the short, wide C x rows^T either way.
    by_columns = not with_sums and _column_major(p)
    for lo, hi, x in _row_blocks(p, offset, runs * width, check, views=by_columns):
        near, dist = _nearest_by_runs(x, scaled, c_sq, width, tied)
        labels[:, lo:hi] = near
        d2[:, lo:hi] = dist
        if with_sums:
            near += first[:, None]
            sums += _cluster_sums(x, near.T, runs * width)
    if with_sums:
        sums = [sums[r * width:r * width + c.shape[0]] for r, c in enumerate(centers)]
    return list(labels), list(d2), sums


def _chunk_assign(p, offset: int, centers: list, check: bool = True):
    """One chunk of a full pass: the labels of the first set of centres, and the inertia
    and counts of every set.

    The first set has a product of its own, the others share a second one
    over the same row blocks: its labels and inertia are bit for bit those
    of a pass for it alone (what a fit resumed from a finished checkpoint
    computes).  A set's ``tied``: some row has two of its centres at its
    minimum (its counts then depend on the centres' order).
    """
    n = p.shape[0]
    labels, d2 = np.empty((len(centers), n), dtype=np.int64), np.empty((len(centers), n))
    tied = np.zeros(len(centers), dtype=bool)
    packs = [(slice(0, 1), _packed(centers[:1]))]
    if len(centers) > 1:
        packs.append((slice(1, None), _packed(centers[1:])))
    # Row blocks sized for the first set alone, as in its own pass; each block is read
    # once for both products (a column-major chunk by columns, in place).
    for lo, hi, x in _row_blocks(p, offset, packs[0][1][2], check, views=_column_major(p)):
        for runs, pack in packs:
            labels[runs, lo:hi], d2[runs, lo:hi] = _nearest_by_runs(x, *pack, tied[runs])
    stats = [{"inertia": float(dist.sum()), "counts": np.bincount(lab, minlength=c.shape[0]),
              "tied": bool(t)} for lab, dist, c, t in zip(labels, d2, centers, tied)]
    return labels[0], stats


def _chunk_lloyd(p, offset: int, centers: list, n_far: int, check: bool = True) -> list[dict]:
    """One chunk of a Lloyd iteration of several runs (``centers``: one set per run).

    For each run: per-centre sums and counts, inertia, and the farthest
    points (largest squared distance to their centre, with their global
    index and label), the candidates for re-seeding empty clusters; and
    whether some row has two of the run's centres at its minimum
    (``tied``: the labels then depend on the centres' order).
    """
    tied = np.zeros(len(centers), dtype=bool)
    labels, d2, sums = _scan(p, offset, centers, with_sums=True, check=check, tied=tied)
    return [_lloyd_summary(lab, dist, total, c.shape[0], n_far, offset, bool(t))
            for lab, dist, total, c, t in zip(labels, d2, sums, centers, tied)]


def _lloyd_summary(labels, d2, sums, k: int, n_far: int, offset: int,
                   tied: bool = False) -> dict:
    """A run's summary of one chunk of a Lloyd iteration (see :func:`_chunk_lloyd`)."""
    n = labels.shape[0]
    m = min(n_far, n)
    far = np.arange(n)
    if m < n:
        # Everything tied with the m-th largest, then ties to the lowest index:
        # the chunk's candidates are the same whatever the chunk boundaries.
        far = np.flatnonzero(d2 >= np.partition(d2, n - m)[n - m])
    far = far[np.lexsort((far, -d2[far]))[:m]]
    return {
        "sums": sums,
        "counts": np.bincount(labels, minlength=k),
        "inertia": float(d2.sum()),
        "far_d2": d2[far],
        "far_index": far.astype(np.int64) + offset,
        "far_label": labels[far],
        "tied": tied,
    }


class _Nearest(NamedTuple):
    """k-means|| state of one chunk: each run's ``(d2, label)`` (squared distance to its
    nearest candidate so far, float64, and that candidate's number, int32) and the rows'
    ``||x||^2``.

    The squared norms are those of the first pass, kept for the later ones:
    computed again, they read the whole chunk once more a pass (a sixth of
    an update's time over 250,000 rows and five runs).
    """

    runs: list
    x_sq: np.ndarray


def _chunk_nearest_update(p, offset: int, state: _Nearest | None, cands: list, firsts: list,
                          check: bool = True):
    """k-means|| of several runs at once: each row's nearest candidate, updated with new ones.

    ``state`` is None or the chunk's :class:`_Nearest` for the candidates
    so far; ``cands[r]`` are run ``r``'s new candidates (possibly none),
    numbered from ``firsts[r]``.  The chunk is read once for all runs,
    with one matrix product per run (so that a run's distances do not depend
    on which runs share the pass).  The distances only weigh the draws and
    the candidates (the runs' Lloyd passes are float64), so they are formed
    in float32, as the products are: ``||c||^2 - 2 x.c`` for every candidate
    (half the time of float64, the pass's main cost), and ``||x||^2`` added in
    float64 to the nearest one only.  A row moves to a new candidate only if
    strictly nearer (ties to the lowest number, as an argmin over all of
    them).  Returns the new state and each run's sum of squared distances.
    """
    n = p.shape[0]
    first = state is None
    if first:  # fresh arrays: the task's own, changed in place
        # Labels as int32 (a run has far fewer candidates): the state is held
        # on the workers for the whole of k-means||, twice while a round runs.
        new = [(np.full(n, np.inf), np.zeros(n, dtype=np.int32)) for _ in cands]
        state = _Nearest(new, np.empty(n))
    else:
        # Only the runs with new candidates change: the others keep their arrays.
        new = [(d2.copy(), label.copy()) if c.shape[0] else (d2, label)
               for (d2, label), c in zip(state.runs, cands)]
    # -2 c in float32 is exactly -2 times c in float32: the product is -2 x.c, rounded as x.c.
    scaled = [(-2.0 * c).astype(np.float32) for c in cands]
    c_sq = [np.einsum("ij,ij->i", c, c).astype(np.float32)[:, None] for c in cands]
    # A Fortran-ordered P is read as it lies: its rows go to float32 held
    # transposed (a copy along its columns), and each product is the short,
    # wide candidates x rows^T, not a transposing copy of the rows and a tall,
    # skinny product (an update took 1.1-1.75x less time over 250,000 rows).
    by_columns = _column_major(p)
    for lo, hi, x in _row_blocks(p, offset, max(c.shape[0] for c in cands), check and not first,
                                 views=by_columns):
        x_sq = state.x_sq[lo:hi]
        if first:
            np.einsum("ij,ij->i", x, x, out=x_sq)
            # A row holding NaN or infinity has no finite sum of squares: only a
            # block with such a sum is searched for them (a read of the block
            # less; a row whose finite squares overflow passes, as it would).
            if check and not np.isfinite(x_sq).all():
                _check_finite(x, offset + lo)
        x32 = scratch("kmpar-rows", x.shape[::-1] if by_columns else x.shape, np.float32)
        np.copyto(x32, x.T if by_columns else x, casting="same_kind")
        rows_t = x32 if by_columns else x32.T
        for r, (d2, label) in enumerate(new):
            if cands[r].shape[0]:
                near, dist = _nearest_candidate(scaled[r], c_sq[r], rows_t, x_sq)
                better = dist < d2[lo:hi]
                np.copyto(d2[lo:hi], dist, where=better)
                np.copyto(label[lo:hi], near + firsts[r], where=better)
    return _Nearest(new, state.x_sq), [float(d2.sum()) for d2, _ in new]


def _nearest_candidate(scaled: np.ndarray, c_sq: np.ndarray, rows_t: np.ndarray,
                       x_sq: np.ndarray) -> tuple[np.ndarray | int, np.ndarray]:
    """Each row's nearest candidate (ties to the lowest index; 0 for all rows where
    there is one candidate) and its squared distance.

    ``scaled`` is ``-2 c`` (float32, candidates by rows), ``c_sq`` their
    ``||c||^2`` (float32 column), ``rows_t`` the rows transposed (float32,
    features by rows) and ``x_sq`` their ``||x||^2`` (float64).  The minimum
    over the candidates is taken along the long axis, a vectorised pass per
    candidate, and the first candidate that reaches it found the same way:
    no argmin over each row's few candidates, which costs more than the
    product at 20 candidates.
    """
    m, rows = scaled.shape[0], rows_t.shape[1]
    part = np.matmul(scaled, rows_t, out=scratch("kmpar-cross", (m, rows), np.float32))
    part += c_sq
    if m == 1:  # a run's first pass: the one candidate (a NaN distance is never better)
        least, near = part[0], 0
    else:
        least = np.minimum.reduce(part, axis=0, out=scratch("kmpar-least", (rows,), np.float32))
        near = _first_reaching(part, least, "kmpar")  # m where none (NaN): never better
    dist = least.astype(np.float64)
    dist += x_sq
    np.maximum(dist, 0.0, out=dist)  # rounding can make a row at a candidate slightly negative
    return near, dist


def _uniform(key: int, index: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1), one per global row index, from a counter-based hash.

    SplitMix64 of ``key + index * golden``: a row's number depends on the key
    and its index only, not on the chunk that holds it.  Computed in place,
    with one temporary: in a worker each fresh array of a chunk's length
    faults in its pages.
    """
    z = index.astype(np.uint64)
    t = np.empty_like(z)
    with np.errstate(over="ignore"):
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(key)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(z, np.uint64(shift), out=t)
            z ^= t
            z *= np.uint64(mult)
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
    z >>= np.uint64(11)
    u = z.astype(np.float64)
    u *= 2.0**-53
    return u


def _chunk_oversample(p, offset: int, state: _Nearest, phis: list, ell: float,
                      keys: list) -> list:
    """k-means||: for each run, its rows drawn with probability ``min(1, ell d2 / phi)``.

    A run whose ``phi`` is 0 (or below) draws none.  Returns the rows
    (float64) of each run, in row order.
    """
    out = []
    index = np.arange(offset, offset + p.shape[0], dtype=np.int64)
    for (d2, _), phi, key in zip(state.runs, phis, keys):
        if not phi > 0:
            out.append(np.empty((0, p.shape[1])))
            continue
        u = _uniform(key, index)
        u *= phi
        local = np.flatnonzero(u < ell * d2)
        out.append(_take_rows(p, local))
    return out


def _state_counts(state: _Nearest, sizes: list) -> list:
    """k-means||: per run, how many rows of the chunk each candidate is nearest to."""
    return [np.bincount(label, minlength=m) for (_, label), m in zip(state.runs, sizes)]


def _phi_totals(phis: list) -> list:
    """k-means||: each run's sum of squared distances over the chunks' sums, correctly
    rounded whatever their order (0 where it is not positive: such a run draws nothing).

    ``phis``: one list of per-run sums per chunk, or (dask) one such list of
    lists per group of chunks."""
    if phis and isinstance(phis[0][0], list):
        phis = [part for group in phis for part in group]
    totals = (math.fsum(part[r] for part in phis) for r in range(len(phis[0])))
    return [v if v > 0 else 0.0 for v in totals]


def _add_draws(cands: list, draws: list, order=None) -> tuple[list, list, list]:
    """k-means||: the chunks' drawn rows per run (chunk order), the number of each run's
    candidates before them, and the candidates with them.

    ``draws``: per chunk, or (dask) per group of chunks, the chunks of the
    groups listed in ``order``."""
    if order is not None:
        flat = [part for group in draws for part in group]
        draws = [flat[i] for i in np.argsort(order, kind="stable")]
    drawn = [np.concatenate([part[r] for part in draws]) for r in range(len(cands))]
    return drawn, [c.shape[0] for c in cands], [np.concatenate(pair) for pair in zip(cands, drawn)]


def _group_update(run, blocks: list, starts: list, previous, drawn: list, firsts: list,
                  check: bool) -> list:
    """k-means|| distance update of a group's chunks: per chunk ``(state, phis)``
    (``previous``: the group's last update, None before the first)."""
    return [run(_chunk_nearest_update, b, start, None if previous is None else previous[i][0],
                drawn, firsts, check) for i, (b, start) in enumerate(zip(blocks, starts))]


def _group_phis(updated: list) -> list:
    return [phis for _, phis in updated]


def _group_draw(run, blocks: list, starts: list, updated: list, live: list, ell: float,
                keys: list) -> list:
    """k-means||: the rows each chunk of a group draws, per chunk."""
    return [run(_chunk_oversample, b, start, updated[i][0], live, ell, keys)
            for i, (b, start) in enumerate(zip(blocks, starts))]


def _group_counts(updated: list, sizes: list) -> list:
    """k-means||: a group's counts per candidate, added over its chunks, per run."""
    return _sum_counts([_state_counts(state, sizes) for state, _ in updated])


def _parallel_rounds(backend, first: np.ndarray, ell: float, keys: list) -> tuple[list, list]:
    """k-means|| round by round through the backend's passes (the numpy backend's way).

    ``first``: each run's first candidate's row index; ``keys[t][r]``: the
    hash key of run ``r``'s draws in round ``t``.  Returns each run's
    candidates and, per candidate, the number of rows nearest to it.
    """
    rows = backend.rows(first)
    cands = [rows[r:r + 1] for r in range(len(first))]
    state, phis = backend.nearest_update(None, cands, [0] * len(first))
    for round_keys in keys:
        live = _phi_totals(phis)
        if not any(live):
            break
        drawn = backend.oversample(state, live, ell, round_keys)
        if not any(rows.shape[0] for rows in drawn):
            continue
        state, phis = backend.nearest_update(state, drawn, [c.shape[0] for c in cands])
        cands = [np.concatenate([c, rows]) for c, rows in zip(cands, drawn)]
    return cands, backend.candidate_counts(state, [c.shape[0] for c in cands])


def _chunk_distinct(p, offset: int, k: int, direction: np.ndarray,
                    check: bool = True) -> np.ndarray:
    """Up to ``k`` distinct projections of the chunk's rows on ``direction``.

    Equal rows have equal projections; distinct rows have distinct ones
    (almost surely, for a random direction).  The chunk is read in blocks
    and the scan stops once ``k`` are found, usually in the first block.
    """
    found = np.empty(0)
    for lo in range(0, p.shape[0], 4096):
        x = np.asarray(p[lo:lo + 4096], dtype=np.float64)
        if check:
            _check_finite(x, offset + lo)
        found = np.unique(np.concatenate([found, x @ direction]))
        if found.size >= k:
            break
    return found[:k]


def _chunk_take(p, local: np.ndarray) -> np.ndarray:
    """Rows of a chunk at local indices, as float64."""
    return _take_rows(p, np.asarray(local, dtype=np.int64))


def _rows_of(taken: tuple) -> np.ndarray:
    """The rows of ``_DaskBackend._take`` (its parts and their order), as asked."""
    parts, order = taken
    return np.concatenate(parts)[order]


def _split_rows(rows: np.ndarray) -> list:
    """One candidate per run: the runs' first rows, each a (1, s) array."""
    return [rows[r:r + 1] for r in range(rows.shape[0])]


def _sizes(cands: list) -> list:
    return [c.shape[0] for c in cands]


def _sum_counts(parts: list) -> list:
    """k-means||: the chunks' counts per candidate, added per run."""
    return [np.sum([part[r] for part in parts], axis=0) for r in range(len(parts[0]))]


def _in_task_chunks(run, fn, blocks: list, starts: list, *args) -> list:
    """``run(fn, chunk, start, *args)`` (:func:`_in_task`) over several chunks in one
    task, their results in order."""
    return [run(fn, b, start, *args) for b, start in zip(blocks, starts)]


def _in_task(fn, *args):
    """Run a block kernel in a dask task with one BLAS thread.

    Workers already run one task per core; threaded BLAS inside the tasks
    would oversubscribe them.
    """
    with threadpool_limits(1):
        return fn(materialize(args[0]), *args[1:])


class KMeansBackend(ChunkBackend, Protocol):
    """What the k-means driver (:mod:`dkicf._kmeans_runs`) asks of a backend.

    Each method is one read of P (a pass, or a map over the chunks that
    returns summaries of size ``O(k s)``), except :meth:`rows`, which fetches
    sampled rows.  :class:`_NumpyBackend` and :class:`_DaskBackend` implement it.
    """

    n: int
    #: Whether P lives elsewhere (rows travel, and may be fetched ahead while a pass runs).
    remote: bool
    #: Whether every row of P was checked for NaN and infinity (rows fetched from it
    #: need no check of their own).
    checked: bool

    def rows(self, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of P at the global indices ``index`` (float64), written into ``out`` if given.

        May be called from a second thread of the driver while a pass runs.
        """

    def lloyd_pass(self, centers: list, n_far: int) -> list[list[dict]]:
        """Per chunk, per set of centres (one per run, all in one read of P): per-centre
        sums and counts, inertia and the ``n_far`` farthest rows."""

    def full_pass(self, centers: list):
        """Per chunk: the labels of the first set of centres (kept where the chunk
        lives), and each set's inertia and counts."""

    def parallel_candidates(self, first: np.ndarray, ell: float, keys: list, meanwhile=None):
        """k-means|| for several runs: their candidates and the rows nearest to each
        (see :func:`_parallel_rounds`); one read of P per round.  ``meanwhile()``,
        if given, runs in the driver while the rounds do (or before them)."""

    def distinct(self, k: int, direction: np.ndarray) -> list[np.ndarray]:
        """Up to ``k`` distinct rows per chunk (the check that k fits P)."""

    def digests(self) -> tuple[tuple[int, ...], list[str]]:
        """Row chunks and one digest per chunk: the data's fingerprint."""

    def close(self) -> None:
        """Release threads or futures."""


class _NumpyBackend:
    """P in this process, scanned in row blocks by a pool of threads.

    One thread per core, each with one BLAS thread: the block kernels are
    the dask backend's, and numpy releases the GIL in them.  Blocks are
    reduced in row order, so the result does not depend on which thread
    finished first.
    """

    remote = False
    checked = True  # on entry (check_array_2d)

    def __init__(self, P: np.ndarray):
        self.P = P
        self.n, self.s = P.shape
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        rows = max(_MIN_BLOCK_ROWS, -(-self.n // (4 * threads)))
        self.offsets = np.append(np.arange(0, self.n, rows), self.n).astype(np.int64)
        nblocks = len(self.offsets) - 1
        self.pool = ThreadPoolExecutor(min(threads, nblocks)) if min(threads, nblocks) > 1 \
            else None

    def _map(self, fn, *args, per_block=None) -> list:
        """``fn(block, offset, *per_block[j], *args)`` for every row block, in block order."""

        def one(j):
            lo, hi = int(self.offsets[j]), int(self.offsets[j + 1])
            own = () if per_block is None else (per_block[j],)
            return fn(self.P[lo:hi], lo, *own, *args)

        blocks = range(len(self.offsets) - 1)
        with threadpool_limits(1):
            if self.pool is None:
                return [one(j) for j in blocks]
            return list(self.pool.map(one, blocks))

    def rows(self, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return _take_rows(self.P, np.asarray(index, dtype=np.int64), out, self.pool)

    # P was checked for NaN and infinity on entry (check_array_2d): check=False.
    def lloyd_pass(self, centers: list, n_far: int) -> list[list[dict]]:
        return self._map(_chunk_lloyd, centers, n_far, False)

    def full_pass(self, centers: list):
        parts = self._map(_chunk_assign, centers, False)
        return np.concatenate([labels for labels, _ in parts]), [st for _, st in parts]

    def nearest_update(self, state, cands: list, firsts: list):
        per_block = [None] * (len(self.offsets) - 1) if state is None else state
        parts = self._map(_chunk_nearest_update, cands, firsts, False, per_block=per_block)
        return [st for st, _ in parts], [phi for _, phi in parts]

    def oversample(self, state, phis: list, ell: float, keys: list) -> list:
        parts = self._map(_chunk_oversample, phis, ell, keys, per_block=state)
        return [np.concatenate([part[r] for part in parts]) for r in range(len(phis))]

    def candidate_counts(self, state, sizes: list) -> list:
        parts = [_state_counts(st, sizes) for st in state]
        return [np.sum([part[r] for part in parts], axis=0) for r in range(len(sizes))]

    def parallel_candidates(self, first: np.ndarray, ell: float, keys: list, meanwhile=None):
        if meanwhile is not None:  # the rounds run in this thread's calls: nothing to overlap
            meanwhile()
        return _parallel_rounds(self, first, ell, keys)

    def distinct(self, k: int, direction: np.ndarray) -> list[np.ndarray]:
        return self._map(_chunk_distinct, k, direction, False)

    def digests(self) -> tuple[tuple[int, ...], list[str]]:
        """Row chunks and one digest per chunk: the data's fingerprint."""
        return (self.n,), [chunk_digest(self.P)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


class _DaskBackend:
    """Row chunks of a dask P, one task per chunk and pass on the cluster.

    The chunks are computed once into worker memory and stay there for the
    whole run; what comes back to the driver is sampled rows and per-chunk
    summaries.  Task keys are tokens of everything a task depends on (chunk
    key and arguments) and of the fit: two requests that share a key compute
    the same value, and a fit never picks up another fit's tasks, such as
    the erred ones of a fit that failed and whose exception is still held.
    """

    remote = True

    def __init__(self, P, client, persist: bool = True, limits: list[int] | None = None,
                 row_bytes: int = 0):
        import uuid

        self.token = uuid.uuid4().hex
        self.client = get_client(client)
        self._lock = threading.Lock()
        if P.numblocks[1] != 1:
            P = P.rechunk({1: -1})
        self.n, self.s = (int(v) for v in P.shape)
        self.chunks = tuple(int(c) for c in P.chunks[0])
        self.offsets = np.concatenate([[0], np.cumsum(self.chunks)]).astype(np.int64)
        _check_fits(self.client, P, limits, persist, row_bytes)
        if persist:
            # Chunks that arrived by a transfer (P made from a numpy array, for one)
            # are copied once where they are into memory the worker allocated; the
            # others are kept as they are, under their own keys: a second key for the
            # same array would count it twice in the workers' memory (dask sizes a
            # key by its array's bytes), and a factorization's P taking a fifth of the
            # workers' memory would then be spilled to disk and read back.
            self._held = chunk_futures(P, self.client) or self.client.compute(
                list(P.to_delayed().ravel()))
            self._blocks = None  # which chunks to copy is asked with the first pass
        else:
            # Each task reads its chunk from P's source (e.g. Zarr) and lets it go.
            self._held, self._blocks = None, LazyChunk.row_chunks(P)
        # P's rows are checked for NaN and infinity by the first full pass
        # only: on 2 cores the check took as long as a Lloyd pass's own work.
        self._check = True
        self._persist, self._grouping = persist, None

    @property
    def blocks(self) -> list:
        """P's chunks as the passes read them: futures in worker memory (or lazy chunks).

        Found on first use, inside the caller's handling of workers that die:
        a chunk is kept under its own key (:func:`_held_as_is`) or copied.
        """
        with self._lock:  # the first use may come from a thread fetching rows ahead
            if self._blocks is None:
                as_is = self.client.gather(self.client.map(
                    _held_as_is, self._held, key=[f"kmeans-as-is-{self.token}-{j}"
                                                  for j in range(len(self._held))]))
                self._blocks = [f if keep else self.client.submit(
                    _aligned, f, key=f"kmeans-p-{self.token}-{j}")
                    for j, (f, keep) in enumerate(zip(self._held, as_is))]
                self._held = None
        return self._blocks

    def _starts(self) -> list[int]:
        return [int(off) for off in self.offsets[:-1]]

    def _checked(self, parts):
        """``parts`` of a full pass came back: every chunk of P was checked."""
        self._check = False
        return parts

    @property
    def checked(self) -> bool:
        """Whether a full pass checked every chunk of P for NaN and infinity."""
        return not self._check

    def _map(self, name: str, fn, chunks, *args, each=()) -> list:
        """``fn(block_j, *args_j)`` for each chunk ``j`` of ``chunks``, sent in one message.

        ``each`` lists the positions in ``args`` that hold one value per
        chunk of ``chunks``; the others go to every chunk.  One ``client.map``
        is one update of the scheduler's graph, where a submit per chunk cost
        one each (tens of chunks per pass on a large cluster).
        """
        from dask.base import tokenize

        chunks = list(chunks)
        per = [[a[i] if pos in each else a for pos, a in enumerate(args)]
               for i in range(len(chunks))]
        blocks = [self.blocks[j] for j in chunks]
        keys = [f"kmeans-{name}-{tokenize(self.token, b.key, *a)}"
                for b, a in zip(blocks, per)]
        columns = [list(col) for col in zip(*per)] if args else []
        return self.client.map(_in_task, [fn] * len(chunks), blocks, *columns, key=keys)

    def _parts(self, futures, index: int, suffix: str) -> list:
        """Futures of item ``index`` of each of ``futures`` (tuples), in one message."""
        return self.client.map(operator.getitem, futures, [index] * len(futures),
                               key=[f"{f.key}-{suffix}" for f in futures])

    def rows(self, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        futs, order = self._take(index)
        # Chunks hold contiguous row ranges: in chunk order the parts are in `uniq` order.
        parts = self.client.gather(futs)
        if out is None:
            return np.concatenate(parts)[order]
        return _place_rows(parts, order, out)

    def lloyd_pass(self, centers: list, n_far: int) -> list[list[dict]]:
        return self._grouped_pass("lloyd", _chunk_lloyd, centers, n_far)

    def _grouped_pass(self, name: str, fn, *args) -> list:
        """``fn(chunk, offset, *args, check)`` on every chunk, one task per group of chunks
        (:meth:`_groups`), the results in chunk order."""
        from dask.base import tokenize

        groups = self._groups() or [[j] for j in range(len(self.chunks))]
        blocks = [[self.blocks[j] for j in g] for g in groups]
        starts = [[int(self.offsets[j]) for j in g] for g in groups]
        keys = [f"kmeans-{name}-{tokenize(self.token, [b.key for b in bs], *args)}"
                f"-{int(self._check)}" for bs in blocks]
        futs = self.client.map(_in_task_chunks, [_in_task] * len(groups),
                               [fn] * len(groups), blocks, starts,
                               *[[a] * len(groups) for a in args],
                               [self._check] * len(groups), key=keys)
        parts = [None] * len(self.chunks)
        for g, found in zip(groups, self.client.gather(futs)):
            for j, part in zip(g, found):
                parts[j] = part
        return self._checked(parts)

    def _groups(self) -> list[list[int]] | None:
        """P's chunks grouped by the worker thread that holds them, in chunk order: a
        pass sends one task per group, not per chunk (a task costs the scheduler and
        the workers a few milliseconds, a pass's whole work on a small P).

        None (a group per chunk) while some chunk is not held yet, or for chunks
        read from P's source in every task.  Found once per fit: a chunk computed
        again elsewhere after a worker died is fetched by its group's task.
        """
        if self._grouping is not None or not self._persist:
            return self._grouping
        holders = self.client.who_has(self.blocks)
        nthreads = self.client.nthreads()
        homes = [(holders.get(b.key) or [None])[0] for b in self.blocks]
        if None in homes:
            return None
        by_home: dict[str, list[int]] = {}
        for j, home in enumerate(homes):
            by_home.setdefault(home, []).append(j)
        groups = []
        for home, chunks in by_home.items():
            n = min(len(chunks), max(1, nthreads.get(home, 1)))
            groups += [[int(j) for j in part] for part in np.array_split(chunks, n)]
        self._grouping = sorted(groups)
        return self._grouping

    def full_pass(self, centers: list):
        import dask.array as da

        both = self._map("assign", _chunk_assign, range(len(self.chunks)), self._starts(),
                         centers, self._check, each=(0,))
        labels = self._parts(both, 0, "labels")
        stats = self._checked(self.client.gather(self._parts(both, 1, "stats")))
        labels = da.concatenate(
            [
                da.from_delayed(f, shape=(c,), dtype=np.int64)
                for f, c in zip(labels, self.chunks)
            ]
        )
        return labels, stats

    def parallel_candidates(self, first: np.ndarray, ell: float, keys: list, meanwhile=None):
        """k-means|| as one graph: every round's passes, sums and draws, sent at once.

        The tasks are those of :func:`_parallel_rounds`, one per group of
        chunks (:meth:`_groups`), with the reductions between rounds (the
        runs' sums, the drawn rows) run as tasks too: only the candidates
        and their counts come back, in one request, where round by round the
        driver would wait for the workers twice a round.  The distance
        states stay with their chunks; what moves between workers is the
        groups' sums and drawn rows, a few rows per run.
        """
        submit = self.client.submit
        groups = self._groups() or [[j] for j in range(len(self.chunks))]
        order = [j for group in groups for j in group]
        blocks = [[self.blocks[j] for j in group] for group in groups]
        starts = [[int(self.offsets[j]) for j in group] for group in groups]
        name = f"kmpar-{self.token}"
        cands = submit(_rows_of, self._take(first), key=f"{name}-first")
        cands = submit(_split_rows, cands, key=f"{name}-cands-0")
        firsts = [0] * len(first)
        updated, drawn = [None] * len(groups), cands
        for t, round_keys in enumerate([None, *keys]):
            if round_keys is not None:
                phis = [submit(_group_phis, u, key=f"{name}-phi-{t}-{g}")
                        for g, u in enumerate(updated)]
                live = submit(_phi_totals, phis, key=f"{name}-phi-{t}")
                draws = [submit(_group_draw, _in_task, b, st, u, live, ell, round_keys,
                                key=f"{name}-draw-{t}-{g}")
                         for g, (b, st, u) in enumerate(zip(blocks, starts, updated))]
                added = submit(_add_draws, cands, draws, order, key=f"{name}-add-{t}")
                drawn, firsts, cands = (self._item(added, i, f"{name}-add-{t}") for i in range(3))
            updated = [submit(_group_update, _in_task, b, st, u, drawn, firsts,
                              self._check and t == 0, key=f"{name}-update-{t}-{g}")
                       for g, (b, st, u) in enumerate(zip(blocks, starts, updated))]
        sizes = submit(_sizes, cands, key=f"{name}-sizes")
        counts = [submit(_group_counts, u, sizes, key=f"{name}-counts-{g}")
                  for g, u in enumerate(updated)]
        total = submit(_sum_counts, counts, key=f"{name}-counts")
        if meanwhile is not None:
            meanwhile()  # while the workers run the rounds
        cands, total = self.client.gather([cands, total])
        return self._checked(cands), total

    def _item(self, future, index: int, prefix: str):
        return self.client.submit(operator.getitem, future, index, key=f"{prefix}-{index}")

    def _take(self, index: np.ndarray) -> list:
        """Futures of the rows at the global ``index`` (in sorted order of the unique
        indices, chunk by chunk) and the order that puts them back as asked."""
        index = np.asarray(index, dtype=np.int64)
        uniq, inverse = np.unique(index, return_inverse=True)
        owner = np.searchsorted(self.offsets, uniq, side="right") - 1
        cuts = np.searchsorted(owner, np.arange(len(self.chunks) + 1))
        wanted = [(j, uniq[lo:hi] - self.offsets[j])
                  for j, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])) if hi > lo]
        futs = self._map("rows", _chunk_take, [j for j, _ in wanted],
                         [local for _, local in wanted], each=(0,))
        return futs, inverse.ravel()

    def distinct(self, k: int, direction: np.ndarray) -> list[np.ndarray]:
        futs = self._map("distinct", _chunk_distinct, range(len(self.chunks)),
                         self._starts(), k, direction, each=(0,))
        return self.client.gather(futs)

    def digests(self) -> tuple[tuple[int, ...], list[str]]:
        """Row chunks and one digest per chunk, hashed where the chunks live."""
        futs = self._map("digest", chunk_digest, range(len(self.chunks)))
        return self.chunks, self.client.gather(futs)

    def close(self) -> None:
        self._blocks, self._held = [], None


def _held_as_is(x) -> bool:
    """Whether the passes keep a chunk of P as it is: a block of rows of a Fortran-ordered
    matrix (a factorization's P), or contiguous and aligned (else :func:`_aligned` copies it).

    The passes copy their row blocks into C order themselves (:func:`_row_blocks`),
    so a Fortran-ordered chunk costs no copy of the whole chunk, at any
    alignment: a block at an odd row of its buffer, or of a buffer with an
    odd number of rows, is read as fast (one 250,000 x 150 chunk, one
    thread: a Lloyd pass 0.233-0.239 s either way), where a copy would hold
    that part of P twice.
    """
    if not (isinstance(x, np.ndarray) and x.ndim == 2):
        return False
    if x.strides[0] == x.itemsize and x.strides[1] >= x.shape[0] * x.itemsize:
        return True
    return bool((x.flags.c_contiguous or x.flags.f_contiguous) and x.ctypes.data % 16 == 0)


def _check_fits(client, P, limits: list[int] | None = None, persist: bool = True,
                row_bytes: int = 0) -> None:
    """Refuse a k-means whose data exceed the cluster's memory (its workers would be killed).

    What the workers hold: P with ``persist``, and ``row_bytes`` a row of
    the k-means's own state (:func:`dkicf._memory.kmeans_row_bytes`).
    ``limits``: the workers' memory limits as the fit's plan measured them
    (default: asked of ``client``)."""
    if limits is None:
        limits, _ = _worker_resources(client)
    if not (limits and all(limits)):
        return
    total = sum(limits)
    state = int(P.shape[0]) * int(row_bytes)
    p_bytes = int(np.prod(P.shape)) * P.dtype.itemsize if persist else 0
    if p_bytes + state <= total:
        return
    cluster = f"the {_gib(total)} of memory of the cluster's {len(limits)} workers"
    if persist and state < total:
        raise ValueError(
            f"P is {_gib(p_bytes)} and the k-means's state {_gib(state)}, more than {cluster}, "
            "so P cannot be held there: pass persist=False to read P's chunks from its "
            "source (for example the Zarr array of a factorization run with p_store=) in "
            "every pass, or add workers or memory."
        )
    raise ValueError(
        f"the k-means's state of P's {P.shape[0]} rows ({row_bytes} bytes a row: a distance "
        f"and a label for each run of k-means||) is {_gib(state)}, more than {cluster}: lower "
        "n_init, pass init='k-means++', or add workers or memory."
    )


def _backend(P, client, persist: bool = True, limits: list[int] | None = None,
             row_bytes: int = 0) -> KMeansBackend:
    """The backend of P: ``row_bytes`` a row of the k-means's state for the memory check."""
    if is_dask_array(P):
        return _DaskBackend(P, client, persist, limits, row_bytes)
    return _NumpyBackend(P)
