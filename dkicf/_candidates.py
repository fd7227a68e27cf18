"""Chunk-side candidate statistics of the block pivot rules.

One small task per chunk state (:func:`chunk_block_stats`) returns the sums
of squares of the block's new columns of P and this chunk's candidates for
the next block: its largest residuals (``"top"``) or its first arrivals in
the seeded exponential race of RPCholesky (``"race"``).  The random numbers
of a row depend only on the key, the draw and the row's global index.  The
driver side of the rules is in :mod:`dkicf.pivoting`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CandidateRequest",
    "accept_uniforms",
    "chunk_block_stats",
    "rows_reaching_top",
    "same_request",
]

# Philox counter words that separate the random streams of one draw.
_STREAM_FIRST, _STREAM_LATER, _STREAM_ACCEPT = 0, 1, 2



@dataclass(frozen=True)
class CandidateRequest:
    """What :func:`chunk_block_stats` returns besides the per-column sums.

    Attributes
    ----------
    rule : {"top", "race"}
        ``"top"``: the ``count`` largest residuals (ties to the lowest row
        index) and the next one, which bounds all the others.  ``"race"``:
        the ``count`` first arrivals of an exponential race in which row ``j``
        arrives at rate ``e[j]``: ``count`` i.i.d.
        draws with probability proportional to the residual.
    count : int
        Number of candidates (0: only the per-column sums).
    key : (2,) uint64 array, optional
        Philox key of the race.
    draw : int
        Draw number, part of the counter of every random number of the race.
    floor : float
        Race only: rows whose residual is ``<= floor`` (rounding noise) never
        arrive.
    limit : int
        ``"top"`` only: a chunk returns at most this many of its largest
        residuals (0: ``count + 1``), and says whether it held more
        (``cut``).  :func:`gather_candidates` checks that no chunk was cut
        above the ``count + 1`` largest overall, and asks again in full if
        one was: the candidates are the same either way.
    """

    rule: str = "top"
    count: int = 0
    key: np.ndarray | None = None
    draw: int = 0
    floor: float = 0.0
    limit: int = 0


def same_request(a: CandidateRequest, b: CandidateRequest) -> bool:
    """Whether two requests ask for the same candidates (keys compared by value; a
    ``limit`` changes how they are sent, not which they are)."""
    same_key = (a.key is None and b.key is None) or (
        a.key is not None and b.key is not None and np.array_equal(a.key, b.key)
    )
    return (a.rule, a.count, a.draw, a.floor) == (b.rule, b.count, b.draw, b.floor) and same_key


def chunk_block_stats(x, state, offset: int, lo: int, hi: int, request: CandidateRequest) -> dict:
    """Per-column sums of squares of P[:, lo:hi] and this chunk's candidates.

    Runs as ``backend.map_chunks(chunk_block_stats, lo, hi, request)``; reads
    the chunk's state only (not X), so it is not a pass over the data.  With P
    kept in Zarr, the columns come from :meth:`~dkicf._chunk.ChunkState.columns`:
    those the block's update already flushed are read back from Zarr.

    Returns
    -------
    dict with ``colsq`` (``(hi - lo,)`` sums over the chunk's rows of the
    squared new columns), and ``key``/``index`` of the candidates: residuals
    (``"top"``, to sort in decreasing order) or arrival times (``"race"``,
    increasing), with global row indices.
    """
    if hi > lo:
        P = state.columns(lo, hi)
        out = {"colsq": np.einsum("ij,ij->j", P, P)}
    else:
        out = {"colsq": np.empty(0)}
    e = state.e
    if request.count == 0 or e.shape[0] == 0:
        out["key"], out["index"] = np.empty(0), np.empty(0, dtype=np.int64)
    elif request.rule == "top":
        want = request.count + 1
        take = min(want, request.limit) if request.limit else want
        local = top_rows_of(state, take)
        if take < want and e.shape[0] > take and e[local[-1]] == e[local[0]]:
            # Cut inside a tie at the chunk's largest value (a flat residual,
            # the first passes of a Gaussian kernel): the overall top is then
            # the lowest-indexed tied rows, often all from one chunk, which a
            # cut would have to ask again.  Indices and residuals are small;
            # the chunk sends them in full.
            take = want
            local = top_rows_of(state, take)
        out["key"], out["index"] = e[local].copy(), local + offset
        out["cut"] = take < want and e.shape[0] > take
    else:
        out["key"], out["index"] = _race_arrivals(
            e, offset, request.count, request.key, request.draw, request.floor
        )
    return out


def top_rows_of(state, m: int) -> np.ndarray:
    """:func:`_top_rows` of ``state.e``, kept on the state for the next ask of the same ``m``.

    A pass's update selects its chunk's largest residuals for the candidate
    statistics, and the rows sent with the pass are the same selection: an
    ``O(rows)`` partition made once.  A state that cannot keep it (rows of
    a state, :class:`~dkicf._chunk.RowRange`) computes it each time.
    """
    e = state.e
    # The numpy backend updates its one state in place: the pass count tells
    # a selection of this pass's residuals from one of an earlier pass's.
    when = (m, getattr(state, "rank", None), getattr(state, "n_passes", None))
    memo = getattr(state, "top", None)
    if memo is not None and memo[0] == when and memo[1] is e:
        return memo[2]
    local = _top_rows(e, m)
    with contextlib.suppress(AttributeError):
        state.top = (when, e, local)
    return local


def _top_rows(e: np.ndarray, m: int) -> np.ndarray:
    """Local indices of the ``m`` largest entries, decreasing, ties to the lowest index.

    Every entry tied with the ``m``-th value is considered before cutting, so
    the rows kept at a tie are the lowest-indexed ones, as the sequential
    rule's ``argmax`` would take them.
    """
    n = e.shape[0]
    if m >= n:
        return np.lexsort((np.arange(n), -e))
    threshold = _mth_largest(e, m)
    # Those above the m-th value, sorted; then the lowest-indexed rows tied
    # with it (many, while the residuals are still flat): no sort of the tie.
    above = np.flatnonzero(e > threshold)
    above = above[np.lexsort((above, -e[above]))]
    tied = np.flatnonzero(e == threshold)[: m - above.shape[0]]
    return np.concatenate([above, tied])


def _mth_largest(e: np.ndarray, m: int) -> float:
    """The ``m``-th largest entry of ``e`` (``1 <= m <= len(e)``).

    Where at least ``m`` entries share the largest value (the first passes
    of a kernel whose diagonal is constant), that value is found in two
    scans: a partition is slow on many equal values.
    """
    top = e.max()
    if m == 1 or np.count_nonzero(e == top) >= m:
        return top
    return e[np.argpartition(-e, m - 1)[m - 1]]


def _uniform01(raw: np.ndarray) -> np.ndarray:
    """Doubles in [0, 1) from raw 64-bit words (the top 53 bits)."""
    return (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _row_uniforms(key, draw: int, lo: int, count: int) -> np.ndarray:
    """Uniforms of global rows ``lo .. lo+count-1`` for a draw: word ``g`` of one Philox stream.

    Philox is counter based: each counter value yields four 64-bit words, so
    the stream is entered at row ``lo`` without generating the rows before it.
    """
    bitgen = np.random.Philox(key=key, counter=[lo // 4, 0, _STREAM_FIRST, draw])
    return _uniform01(bitgen.random_raw(count + lo % 4)[lo % 4 :])


class _RowStreams:
    """Exponential gaps between a row's later arrivals: one Philox stream per row.

    The stream of global row ``g`` starts at counter ``(0, g, 1, draw)``; one
    bit generator is re-pointed from row to row (cheaper than creating one).
    """

    def __init__(self, key, draw: int):
        self.bitgen = np.random.Philox(key=key)
        self.state = self.bitgen.state
        self.draw = draw

    def gaps(self, row: int, count: int) -> np.ndarray:
        self.state["state"]["counter"] = np.array(
            [0, row, _STREAM_LATER, self.draw], dtype=np.uint64
        )
        self.state["buffer_pos"] = 4
        self.bitgen.state = self.state
        return -np.log1p(-_uniform01(self.bitgen.random_raw(count)))


def _race_arrivals(e, offset, count, key, draw, floor):
    """This chunk's ``count`` first arrivals of the exponential race (times, global rows).

    Row ``g`` arrives at the times of a Poisson process of rate ``e[g]``: the
    first after ``E_1 / e[g]``, later ones after further ``E_k / e[g]`` with
    ``E_k ~ Exp(1)``.  The merged process's arrivals are i.i.d. draws with
    probability ``e[g] / sum(e)``.  A row that is not among the ``count`` first
    *first* arrivals cannot have any of the ``count`` first arrivals, so only
    those rows draw later gaps.
    """
    n = e.shape[0]
    first = -np.log1p(-_row_uniforms(key, draw, offset, n))
    live = e > floor
    times = np.full(n, np.inf)
    times[live] = first[live] / e[live]
    k = min(count, int(live.sum()))
    if k == 0:
        return np.empty(0), np.empty(0, dtype=np.int64)
    rows = np.argpartition(times, k - 1)[:k] if k < n else np.flatnonzero(live)
    rows = rows[np.argsort(times[rows], kind="stable")]
    # Arrivals after the count-th first arrival cannot be among the count first ones.
    t_max = times[rows[-1]] if k == count else np.inf
    all_t, all_g = [times[rows]], [rows]
    streams = _RowStreams(key, draw)
    for rank, j in enumerate(rows):
        # The row ranked `rank` by first arrival holds at most count - rank of them.
        limit = count - rank - 1
        size = min(limit, 4)
        while size:
            gaps = streams.gaps(int(j) + offset, size)
            later = times[j] + np.cumsum(gaps) / e[j]
            if later[-1] > t_max or size == limit:
                later = later[later <= t_max]
                all_t.append(later)
                all_g.append(np.full(later.shape[0], j))
                break
            size = min(limit, 4 * size)
    t = np.concatenate(all_t)
    g = np.concatenate(all_g)
    keep = np.lexsort((g, t))[:count]
    return t[keep], g[keep].astype(np.int64) + offset


def rows_reaching_top(e: np.ndarray, m: int) -> np.ndarray:
    """Increasing indices of the entries ``>=`` the ``m``-th largest of ``e``.

    Every entry tied with the ``m``-th value is included, so a cut that
    breaks ties by the lowest index can be made from these rows alone.
    """
    n = e.shape[0]
    if m >= n:
        return np.arange(n)
    return np.flatnonzero(e >= _mth_largest(e, m))


def accept_uniforms(key, draw: int, count: int) -> np.ndarray:
    """The rejection step's uniforms of a draw (driver side, independent of chunking)."""
    bitgen = np.random.Philox(key=key, counter=[0, 0, _STREAM_ACCEPT, draw])
    return _uniform01(bitgen.random_raw(count))


def match_rows(parts: list | None, index: np.ndarray):
    """Which of ``index`` the rows fetched with a pass hold, and where.

    ``parts``: :func:`~dkicf._chunk.chunk_top_rows` answers (global rows
    first), or None.  Returns ``(have, take)``: a mask over ``index``, and
    the positions of the held ones in the concatenated parts (None if none
    is held).
    """
    have = np.zeros(index.shape[0], dtype=bool)
    if not parts:
        return have, None
    where = np.concatenate([p[0] for p in parts])
    if where.shape[0] == 0:
        return have, None
    order = np.argsort(where, kind="stable")
    pos = np.minimum(np.searchsorted(where[order], index), where.shape[0] - 1)
    have = where[order][pos] == index
    return have, (order[pos[have]] if have.any() else None)


def taken_rows(parts: list, take: np.ndarray) -> tuple:
    """``(x, aux, p, e)`` rows at positions ``take`` of the concatenated ``parts``
    (:func:`match_rows`); aux None where the kernel has none."""
    return tuple(None if parts[0][k] is None else np.concatenate([p[k] for p in parts])[take]
                 for k in range(1, 5))


def top_share(count: int, rows: int, n: int) -> int:
    """Largest residuals a chunk of ``rows`` of ``n`` sends of the ``count`` largest overall:
    twice its share, and at least 64 more."""
    return int(min(count, math.ceil(2 * count * rows / max(n, 1)) + 64))
