"""Pivot rules that add a block of pivots per pass over the data.

The paper's Algorithm 1 (``pivoting="greedy"``) reads X once per pivot.  The
rules here choose ``b`` pivots from a small candidate set on the driver and
add them all with one pass (:func:`dkicf._chunk.chunk_update` applies a block
``p = (K[:, T] - P U^T) L^{-T}``):

* ``"block-greedy"``: the candidates are the ``m`` largest residuals; greedy
  pivoted Cholesky on their Schur complement ``S_CC = K_CC - P_C P_C^T``
  accepts pivots only while the chosen candidate's updated residual beats the
  ``(m+1)``-th largest residual, which bounds every other row's residual.  The
  accepted pivots are then exactly those of the sequential greedy rule
  (see ``docs/pivoting.md`` for the argument and its floating-point margin).
* ``"rpcholesky"``: randomly pivoted Cholesky (Chen, Epperly, Tropp and
  Webber, 2023) in its accelerated, blocked form (Epperly, Tropp and Webber,
  2024): i.i.d. candidates drawn with probability proportional to the residual,
  then rejection sampling on the driver so that each accepted pivot is
  distributed as in the one-at-a-time algorithm.  The random numbers of a row
  depend only on the seed, the draw and the row's global index, so the pivots
  do not depend on the chunking of X or on the number of workers.

This module holds the chunk task that feeds these rules
(:func:`chunk_block_stats`, run with ``backend.map_chunks``), the driver-side
selection of a block (:func:`greedy_block`, :func:`rpcholesky_block`) and the
adaptive choice of the candidate count and block size (:class:`BlockSizer`).
The pass loop itself is in :mod:`dkicf.icf`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._candidates import (  # noqa: F401  (re-exported: the chunk task of the block rules)
    CandidateRequest,
    _top_rows,
    accept_uniforms,
    chunk_block_stats,
    same_request,
)
from .kernels import Kernel

__all__ = [
    "PIVOT_RULES",
    "PivotRule",
    "RuleContext",
    "ordered_block",
    "register_rule",
    "accept_uniforms",
    "BlockChoice",
    "BlockSizer",
    "Candidates",
    "CandidateRequest",
    "block_traces",
    "check_pivoting",
    "chunk_block_stats",
    "gather_candidates",
    "greedy_block",
    "rounding_margin",
    "rpcholesky_block",
    "rpcholesky_key",
]

_EPS = np.finfo(np.float64).eps
# Bytes one chunk task may spend on the block's kernel columns (n_rows x b
# float64, about three copies: the block, its triangular solve, the write).
_TASK_BYTES = 256 << 20
# Bytes of candidate rows (of X and of P) the driver fetches per pass.
_CANDIDATE_BYTES = 256 << 20
# Multiply-adds above which the driver's panel is split over the pass's threads.
_PARALLEL_WORK = 1 << 22


def check_pivoting(pivoting, block_size, block_delta) -> tuple[str, int | None, float]:
    """Validate the pivot-rule parameters of :func:`dkicf.incomplete_cholesky`.

    Returns
    -------
    (rule, block_size, block_delta) with the rule name in lower case.
    """
    rule = pivoting.lower() if isinstance(pivoting, str) else pivoting
    if rule not in PIVOT_RULES:
        valid = ", ".join(repr(r) for r in PIVOT_RULES)
        raise ValueError(f"pivoting must be one of {valid}, got {pivoting!r}.")
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
            raise TypeError(
                f"block_size must be an integer or None, got {block_size!r} of type "
                f"{type(block_size).__name__}."
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if PIVOT_RULES[rule].one_per_pass:
            raise ValueError(
                f"block_size={block_size} has no effect with pivoting={rule!r}, which adds one "
                "pivot per pass; use pivoting='block-greedy' (same pivots as 'greedy') or "
                "'rpcholesky'."
            )
        block_size = int(block_size)
    if (
        isinstance(block_delta, bool)
        or not isinstance(block_delta, numbers.Real)
        or not 0.0 <= block_delta < 1.0
    ):
        raise ValueError(f"block_delta must be a number in [0, 1), got {block_delta!r}.")
    if block_delta and not PIVOT_RULES[rule].uses_block_delta:
        users = ", ".join(repr(r) for r, c in PIVOT_RULES.items() if c.uses_block_delta)
        raise ValueError(
            f"block_delta={block_delta} applies to pivoting={users} only, "
            f"got pivoting={rule!r}."
        )
    return rule, block_size, float(block_delta)


def rpcholesky_key(random_state) -> np.ndarray:
    """The 128-bit Philox key of the random pivots, derived once from ``random_state``.

    ``None`` draws fresh entropy; an integer gives a reproducible key; a
    ``numpy.random.Generator`` contributes one draw.  The key is a child of the
    seed (its own spawn key), so it is independent of the median heuristic's
    sample, which uses the same ``random_state``.
    """
    if isinstance(random_state, np.random.Generator):
        entropy = int(random_state.integers(2**63))
    elif random_state is None:
        entropy = None
    elif isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        entropy = int(random_state)
    else:
        raise TypeError(
            "random_state must be None, an integer or a numpy.random.Generator, "
            f"got {type(random_state).__name__}."
        )
    seq = np.random.SeedSequence(entropy, spawn_key=(0x52504348,))  # "RPCH"
    return seq.generate_state(2, np.uint64)


# ------------------------------------------------------------------ driver side


@dataclass
class Candidates:
    """Candidate rows on the driver.

    Attributes
    ----------
    index : (m,) global row indices (distinct).
    values : (m,) their residuals ``e`` at the start of the block.
    rows, aux : their rows of X (float64) and kernel auxiliary values.
    U : (m, i) their rows of P.
    bound : float
        ``"top"``: the largest residual outside the candidates (``-inf`` if
        every row is a candidate).
    draws : (T,) int array, optional
        ``"race"``: positions in ``index`` of the i.i.d. draws, in arrival order.
    """

    index: np.ndarray
    values: np.ndarray
    rows: np.ndarray
    aux: np.ndarray | None
    U: np.ndarray
    bound: float = -np.inf
    draws: np.ndarray | None = None


def gather_candidates(backend, lo: int, hi: int, request: CandidateRequest):
    """One map over the chunks, then the candidates' rows.

    Only the selected candidates' rows of X and P travel to the driver,
    whatever the number of chunks; neither step reads X anew.

    Parameters
    ----------
    backend : NumpyBackend or DaskBackend
    lo, hi : int
        Columns of P whose sums of squares are wanted (the block the last
        pass added; ``lo == hi`` for none).
    request : CandidateRequest

    Returns
    -------
    colsq : ndarray of shape (hi - lo,)
        Sums over all rows of the squared columns ``lo:hi`` of P.
    candidates : Candidates or None
        None if ``request.count == 0``.  For ``"top"``, sorted by decreasing
        residual (ties to the lowest index) with the bound set; for
        ``"race"``, distinct rows with ``draws`` in arrival order.
    """
    parts = backend.map_chunks(chunk_block_stats, lo, hi, request)
    colsq = np.array([math.fsum(c) for c in zip(*(p["colsq"] for p in parts))])
    if request.count == 0:
        return colsq, None
    key = np.concatenate([p["key"] for p in parts])
    index = np.concatenate([p["index"] for p in parts])
    if request.rule == "top":
        order = np.lexsort((index, -key))
        if not _complete_top(parts, order, request.count + 1):
            # A chunk sent fewer of its largest residuals than the overall
            # top may hold: ask every chunk in full (a map, no pass over X).
            parts = backend.map_chunks(chunk_block_stats, lo, lo, request)
            key = np.concatenate([p["key"] for p in parts])
            index = np.concatenate([p["index"] for p in parts])
            order = np.lexsort((index, -key))
        top, rest = order[: request.count], order[request.count : request.count + 1]
        cand_index = index[top]
        xr, aux, pr, er = backend.rows(cand_index)
        cand = Candidates(cand_index, er, xr, aux, pr)
        if rest.size:
            cand.bound = float(key[rest[0]])
        return colsq, cand
    order = np.lexsort((index, key))[: request.count]
    drawn = index[order]
    unique, draws = np.unique(drawn, return_inverse=True)
    xr, aux, pr, er = backend.rows(unique)
    return colsq, Candidates(unique, er, xr, aux, pr, draws=draws.reshape(-1))


def _complete_top(parts: list, order: np.ndarray, need: int) -> bool:
    """Whether the ``need`` first entries of the merged ``order`` are the true ones.

    A chunk that was cut (sent its largest residuals only) holds nothing
    that ranks above the last entry it sent; that entry must rank no higher
    than the ``need``-th overall, ties broken by the row index as the order.
    """
    if not any(p.get("cut", False) for p in parts):
        return True
    if order.shape[0] < need:
        return False
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    start = 0
    for p in parts:
        count = p["key"].shape[0]
        if p.get("cut", False) and (count == 0 or rank[start + count - 1] < need - 1):
            return False
        start += count
    return True


@dataclass
class BlockChoice:
    """The pivots accepted from the candidates, ready for a :class:`PivotBlock`.

    Attributes
    ----------
    order : (b,) positions in the candidate arrays, in pivot order.
    L : (b, b) lower-triangular factor of the candidates' Schur complement in that order.
    reason : why the block ended: ``"cap"``, ``"bound"``, ``"ambiguous"``,
        ``"rank"``, ``"tol"`` or ``"exhausted"``.
    """

    order: np.ndarray
    L: np.ndarray
    reason: str


class _SmallCholesky:
    """Pivoted Cholesky of the candidates' Schur complement, left-looking.

    Only columns of ``S_CC = K_CC - P_C P_C^T`` that may be needed are formed,
    a panel at a time (the pivot asked for and the candidates most likely to
    follow it), each panel one kernel block and one matrix product.  Panels
    start at 8 columns and double, so the cost is ``O(m b (d + i + b))`` for
    ``b`` pivots out of ``m`` candidates, at matrix-matrix speed.
    """

    def __init__(
        self, kernel: Kernel, cand: Candidates, b_max: int, panel: int | None = None,
        pool=None, n_threads: int = 1,
    ):
        self.kernel, self.cand = kernel, cand
        m = cand.index.shape[0]
        # The first panel is the expected block size (the last block's, if
        # known): one kernel block for most of the pivots, few columns wasted.
        self.panel = max(8, min(panel or 8, b_max, 1024))
        # Later panels: a quarter of the expected block each (doubling from 8
        # without an expectation).
        self.later_panel = 8 if panel is None else max(8, self.panel // 4)
        self.grow = panel is None
        self.pool, self.n_threads = pool, n_threads
        self.d = cand.values.astype(np.float64).copy()
        self.values_sum = float(self.d.sum())
        self.free = np.ones(m, dtype=bool)
        self.Lc = np.zeros((m, b_max), order="F")
        self.order: list[int] = []
        # Cached Schur-complement columns: slot of each candidate (-1: none)
        # and how many of the block's pivots each cached column already has.
        self.slot = np.full(m, -1, dtype=np.int64)
        self.S = np.empty((m, min(m, 2 * self.panel)), order="F")
        self.applied = np.empty(self.S.shape[1], dtype=np.int64)
        self.n_cached = 0

    @property
    def k(self) -> int:
        return len(self.order)

    def _columns(self, G, a: int, z: int, pick: np.ndarray) -> None:
        """Rows ``a:z`` of the Schur-complement columns ``pick``, written into ``G``."""
        cand, k = self.cand, self.k
        aux_a = None if cand.aux is None else cand.aux[a:z]
        aux_p = None if cand.aux is None else cand.aux[pick]
        g = self.kernel.block(cand.rows[a:z], cand.rows[pick], aux_a, aux_p)
        if cand.U.shape[1]:
            g -= cand.U[a:z] @ cand.U[pick].T
        if k:
            g -= self.Lc[a:z, :k] @ self.Lc[pick, :k].T
        G[a:z] = g

    def _fill(self, c: int, likely) -> None:
        """Form the columns of ``c`` and of the first uncached ``likely()`` candidates."""
        likely = likely()
        extra = likely[(self.slot[likely] < 0) & self.free[likely] & (likely != c)]
        pick = np.concatenate([[c], extra[: self.panel - 1]]).astype(np.int64)
        m = self.S.shape[0]
        start, stop = self.n_cached, self.n_cached + pick.shape[0]
        if stop > self.S.shape[1]:
            grown = np.empty((m, max(stop, 2 * self.S.shape[1])), order="F")
            grown[:, :start] = self.S[:, :start]
            self.S = grown
            self.applied = np.resize(self.applied, grown.shape[1])
        G = self.S[:, start:stop]
        work = m * pick.shape[0] * (self.cand.rows.shape[1] + self.cand.U.shape[1] + self.k)
        workers = self.n_threads if self.pool is not None else 1
        if workers > 1 and work >= _PARALLEL_WORK:
            # The pass's threads are idle while the driver chooses: rows split between them.
            edges = np.linspace(0, m, workers + 1).round().astype(np.int64)
            futs = [self.pool.submit(self._columns, G, int(a), int(z), pick)
                    for a, z in zip(edges[:-1], edges[1:]) if z > a]
            for f in futs:
                f.result()
        else:
            self._columns(G, 0, m, pick)
        self.applied[start:stop] = self.k
        self.slot[pick] = np.arange(start, stop)
        self.n_cached = stop
        self.panel = self.later_panel
        if self.grow:
            self.later_panel = min(2 * self.later_panel, 256)

    def take(self, c: int, likely) -> None:
        """Make candidate ``c`` the next pivot.

        ``likely()`` lists the candidates to form along with ``c`` if its
        column is not cached yet (called only then).
        """
        k = self.k
        if self.slot[c] < 0:
            self._fill(c, likely)
        j = self.slot[c]
        col = self.S[:, j].copy()
        k0 = int(self.applied[j])
        if k > k0:
            col -= self.Lc[:, k0:k] @ self.Lc[c, k0:k]
        nu = math.sqrt(self.d[c])
        col /= nu
        # Pivots already in the block have a zero residual: their entries vanish.
        col[~self.free] = 0.0
        col[c] = nu
        self.Lc[:, k] = col
        d = self.d
        d -= col * col
        np.maximum(d, 0.0, out=d)
        d[c] = 0.0
        self.free[c] = False
        self.order.append(c)

    def by_residual(self) -> np.ndarray:
        """Free candidates by decreasing updated residual (the greedy rule's likely next)."""
        free = np.flatnonzero(self.free)
        return free[np.argsort(-self.d[free], kind="stable")]

    def best(self) -> tuple[int, float]:
        """The free candidate of largest updated residual, ties to the lowest row index."""
        return _best(self.d, self.free, self.cand.index)

    def trace_upper_bound(self, trace: float) -> float:
        """``tr(K - P P^T)`` after the pivots so far is at most this.

        Rows outside the candidates only lose residual, so the drop of the
        candidates' residuals is a lower bound on the drop of the trace.
        """
        return trace - (self.values_sum - float(self.d.sum()))

    def choice(self, reason: str) -> BlockChoice:
        order = np.array(self.order, dtype=np.int64)
        L = np.tril(self.Lc[order, : order.shape[0]])
        return BlockChoice(order, L, reason)


def rounding_margin(max_diag: float, roundoff: float, rank: int, m: int) -> float:
    """Residual differences below this are treated as rounding, not as an order.

    The driver's updated residuals and the chunks' (or the sequential
    algorithm's) residuals are computed by different sequences of operations;
    both have errors of order ``eps * max(diag K) * (c + i + m)`` with ``c`` the
    kernel's rounding factor.  A pivot decision closer than this is left to the
    next pass, where the chunks' own residuals decide as the sequential rule does.
    """
    return 8.0 * _EPS * max_diag * (roundoff + rank + m)


def greedy_block(
    kernel: Kernel,
    cand: Candidates,
    *,
    b_max: int,
    rank_tol: float,
    margin: float,
    delta: float = 0.0,
    trace: float = np.inf,
    tol: float = 0.0,
    panel: int | None = None,
    pool=None,
    n_threads: int = 1,
) -> BlockChoice:
    """Greedy pivots on the candidates while they provably equal the sequential ones.

    The first pivot is the largest residual (the candidates come sorted by the
    sequential rule).  Each later one is the candidate with the largest
    updated residual ``v`` and is accepted only if

    * ``v > bound + margin``: every row outside the candidates has a residual
      ``<= bound`` now (residuals never increase), so no row outside can beat
      it; a tie with a row outside, or a gap within rounding, ends the block;
    * no other free candidate is within ``margin`` of ``v`` unless exactly
      equal (an exact tie goes to the lowest row index, as sequentially);
    * ``v > rank_tol + margin``: below that the sequential rule may stop for
      the numerical rank, which the next pass's residuals decide.

    With ``delta > 0`` the first test becomes ``v >= (1 - delta) * bound`` and
    the second is dropped: larger blocks, pivots no longer exactly the
    sequential ones.  The block also ends once the trace error is certainly
    ``<= tol`` (the exact stopping pivot is found from the pass's column sums).

    Parameters
    ----------
    kernel : Kernel
    cand : Candidates
        The ``"top"`` candidates, sorted as the sequential rule ranks them.
    b_max : int
        Largest number of pivots.
    rank_tol : float
        The numerical-rank threshold of the factorization.
    margin : float
        Residual differences treated as rounding (:func:`rounding_margin`).
    delta : float, default=0.0
        ``block_delta``.
    trace, tol : float
        Trace error at the start of the block and the factorization's ``tol``.
    panel : int, optional
        Expected number of pivots (the last block's): the size of the first
        panel of Schur-complement columns formed.  None or 1: the first
        pivot's column alone is formed first, and a block that ends there
        is returned without the panels.
    pool : concurrent.futures.Executor, optional
        Idle threads (``n_threads`` of them) that share the work of large panels.

    Returns
    -------
    BlockChoice
    """
    if panel is None or panel <= 1:  # after a block of one, likely one again
        lone = _lone_pivot(kernel, cand, b_max, rank_tol, margin, delta, trace, tol)
        if lone is not None:
            return lone
    chol = _SmallCholesky(kernel, cand, b_max, panel, pool, n_threads)
    chol.take(chol.best()[0], chol.by_residual)
    reason = "cap"
    while chol.k < b_max:
        if chol.trace_upper_bound(trace) <= tol:
            reason = "tol"
            break
        if not chol.free.any():
            reason = "exhausted"
            break
        c, v = chol.best()
        refused = _refused(chol.d, chol.free, v, cand.bound, rank_tol, margin, delta)
        if refused is not None:
            reason = refused
            break
        chol.take(c, chol.by_residual)
    return chol.choice(reason)


def _best(d: np.ndarray, free: np.ndarray, index: np.ndarray) -> tuple[int, float]:
    """Position and value of the largest ``d`` among ``free``, ties to the lowest ``index``."""
    vals = np.where(free, d, -np.inf)
    v = vals.max()
    ties = np.flatnonzero(vals == v)
    return int(ties[np.argmin(index[ties])]), float(v)


def _refused(d, free, v: float, bound: float, rank_tol: float, margin: float,
             delta: float) -> str | None:
    """Why the free candidate of updated residual ``v`` (the largest) may not be the
    block's next pivot (:func:`greedy_block`'s tests), or None if it may."""
    if not v > rank_tol + margin:
        return "rank"
    if delta:
        return "bound" if v < (1.0 - delta) * bound else None
    if not v > bound + margin:
        return "bound"
    if np.any(d[free & (d >= v - margin)] != v):
        return "ambiguous"
    return None


def _lone_pivot(kernel, cand, b_max, rank_tol, margin, delta, trace, tol):
    """The block of :func:`greedy_block` if it ends at its first pivot, else None.

    The tests of the block's second pivot, on the candidates' residuals
    updated by the first pivot's column alone: where blocks stay at one
    pivot (a kernel near the identity) this is all a block costs, without
    the panels of the small Cholesky.
    """
    values = cand.values.astype(np.float64)
    m = values.shape[0]
    if m == 0:
        return None
    free = np.ones(m, dtype=bool)
    c = _best(values, free, cand.index)[0]
    nu = math.sqrt(values[c])
    lone = BlockChoice(np.array([c], dtype=np.int64), np.array([[nu]]), "cap")
    if b_max <= 1:
        return lone
    aux = None if cand.aux is None else cand.aux[c:c + 1]
    col = kernel.block(cand.rows, cand.rows[c:c + 1], cand.aux, aux)[:, 0]
    if cand.U.shape[1]:
        col -= cand.U @ cand.U[c]
    col /= nu
    d = values - col * col
    np.maximum(d, 0.0, out=d)
    d[c] = 0.0
    if trace - (float(values.sum()) - float(d.sum())) <= tol:
        lone.reason = "tol"
        return lone
    if m == 1:
        lone.reason = "exhausted"
        return lone
    free[c] = False
    refused = _refused(d, free, _best(d, free, cand.index)[1], cand.bound, rank_tol, margin,
                       delta)
    if refused is None:
        return None
    lone.reason = refused
    return lone


def rpcholesky_block(
    kernel: Kernel,
    cand: Candidates,
    uniforms: np.ndarray,
    *,
    b_max: int,
    rank_tol: float,
    trace: float = np.inf,
    tol: float = 0.0,
    panel: int | None = None,
    pool=None,
    n_threads: int = 1,
) -> BlockChoice:
    """Accelerated RPCholesky's rejection step on i.i.d. draws proportional to ``e``.

    Draw ``j`` (row ``s``) is accepted if ``u_j * e[s] < d[s]``, with ``d`` the
    residual updated by the pivots accepted before it in this block: given the
    earlier pivots, each accepted pivot is distributed proportionally to the
    current residual, as in the sequential algorithm (Epperly, Tropp and
    Webber, 2024).  The first draw is always accepted.  Rows whose updated
    residual is ``<= rank_tol`` are rounding noise and are never accepted.

    Parameters
    ----------
    kernel : Kernel
    cand : Candidates
        The ``"race"`` candidates (distinct rows and the draws).
    uniforms : ndarray of shape (len(cand.draws),)
        One uniform in [0, 1) per draw (:func:`accept_uniforms`).
    b_max, rank_tol, trace, tol, panel, pool, n_threads :
        As for :func:`greedy_block`.

    Returns
    -------
    BlockChoice
    """
    chol = _SmallCholesky(kernel, cand, b_max, panel, pool, n_threads)
    reason = "exhausted"
    for j, s in enumerate(cand.draws):
        if chol.k == b_max:
            reason = "cap"
            break
        if chol.k and chol.trace_upper_bound(trace) <= tol:
            reason = "tol"
            break
        v = chol.d[s]
        if v > rank_tol and uniforms[j] * cand.values[s] < v:
            chol.take(int(s), lambda j=j: _first_occurrences(cand.draws[j + 1 :]))
    return chol.choice(reason)


def _first_occurrences(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a`` in the order they first appear."""
    _, first = np.unique(a, return_index=True)
    return a[np.sort(first)]


def block_traces(trace_after: float, colsq: np.ndarray) -> np.ndarray:
    """``tr(K - P P^T)`` after each pivot of a block, from the pass's per-column sums.

    After pivot ``j`` of the block the residual is the one after the block plus
    the squares of the block's later columns (a pivot row's entries in its own
    later columns are zero), so the trace is ``trace_after + sum(colsq[j+1:])``.
    """
    b = colsq.shape[0]
    later = np.zeros(b)
    if b > 1:
        later[:-1] = np.cumsum(colsq[::-1])[::-1][1:]
    return trace_after + later


class BlockSizer:
    """Adaptive candidate count ``m`` and largest block ``b`` of the block rules.

    ``b`` is capped by ``block_size`` (if given), by ``max_rank - rank`` and by
    memory: a chunk task holds ``rows_per_task x b`` kernel values, in at
    most ``task_bytes`` (a share of a worker's memory; default 256 MiB).  ``m``
    starts at ``n / 32`` (within [64, 4096]) and doubles while at least one
    candidate in 16 is accepted (a larger candidate set lowers the bound and
    lets more pivots through), unless the pivots left to add are fewer than
    the last block's; it stays below ``max(1024, n / 8)`` so that
    the driver's work, about ``m / n`` of a pass, stays small.  For RPCholesky, ``m`` is the number
    of draws, sized from the observed acceptance rate to fill a block.
    """

    def __init__(
        self,
        rule: str,  # "top" (block greedy's largest residuals) or "draws" (RPCholesky's)
        capacity: int,
        n: int,
        d: int,
        rows_per_task: int,
        block_size: int | None,
        task_bytes: float | None = None,
    ):
        self.rule = rule
        self.capacity = capacity
        self.n = n
        self.d = d
        budget = _TASK_BYTES if task_bytes is None else min(_TASK_BYTES, task_bytes)
        b_mem = max(1, int(budget // (24 * max(rows_per_task, 1))))
        self.b_cap = block_size if block_size is not None else b_mem
        if rule in ("top", "block-greedy"):
            self.m = min(n, max(64, min(n // 32, 4096)))
        else:
            self.m = min(n, self.b_cap, 64)
        self.acceptance = 0.5

    def state(self) -> dict:
        """The adapted sizes, for a checkpoint (everything else follows from the parameters)."""
        return {"m": int(self.m), "acceptance": float(self.acceptance)}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state` (a resumed run then sizes its blocks as the original)."""
        self.m, self.acceptance = int(state["m"]), float(state["acceptance"])

    def block_max(self, rank: int) -> int:
        return max(1, min(self.b_cap, self.capacity - rank))

    def m_max(self, rank: int) -> int:
        fit = _CANDIDATE_BYTES // (8 * (self.d + rank + 4))
        return max(1, min(self.n, fit, max(1024, self.n // 8)))

    def count(self, rank: int) -> int:
        """Candidates to ask for at this rank."""
        return max(1, min(self.m, self.m_max(rank)))

    def update(self, rank: int, m_used: int, b: int, reason: str) -> None:
        """Adapt ``m`` after a block of ``b`` pivots chosen from ``m_used`` candidates."""
        if self.rule in ("top", "block-greedy"):
            if reason == "cap":
                self.m = max(self.m, 2 * b)
            elif 16 * b >= m_used and self.capacity - (rank + b) > b:
                # Grow for larger blocks, unless the rest fits in one like this.
                self.m = 2 * m_used
        else:
            rate = b / max(m_used, 1)
            self.acceptance = 0.5 * self.acceptance + 0.5 * max(rate, 0.02)
            want = self.block_max(rank)
            self.m = max(1, math.ceil(want / self.acceptance))
        self.m = max(1, min(self.m, self.m_max(rank)))


# Rows that the driver's work on a block's candidates costs about as much as, set
# when that work took about 2 ms against 0.2 ms for a pass over 1,800 rows of 64
# features (numpy backend).  Single passes are considered only where n is below
# m + _DRIVER_ROWS; a run of them doubles up to _RUN_CAP times (m + _DRIVER_ROWS) / n.
_DRIVER_ROWS = 32768
_RUN_CAP = 16


def _run_cap(n: int, m: int) -> int:
    """The longest run of single passes at ``n`` rows and ``m`` candidates (0: none)."""
    return _RUN_CAP * ((m + _DRIVER_ROWS) // max(n, 1))


def _single_pass(blocks: list, n: int, m: int) -> bool:
    """Whether block greedy's next pass adds the largest residual alone (a greedy pass).

    Blocks stay at one pivot where the kernel matrix is near the identity
    (no candidate is provably next): the candidates then cost more than
    they save while a pass is cheap next to the driver's work on them.
    After ``k`` blocks in a row ended at one pivot (by the bound or a near
    tie), the next ``2**(k-1)`` passes, at most :func:`_run_cap`, take one
    pivot each the greedy way; then a block is tried again.  So the tried
    blocks number about ``log2`` of the passes, and a run of single passes
    is never longer than the passes before it.  The pivots are those of the
    sequential rule either way; the choice depends only on the blocks so
    far, so a resumed fit and every backend make the same one.
    """
    cap = _run_cap(n, m)
    if cap < 1 or not blocks:
        return False
    since, start = _singles_run(blocks)
    return _run_goes_on(since, _streak(blocks, start), cap)


def _run_goes_on(since: int, streak: int, cap: int) -> bool:
    """After ``streak`` tried blocks of one and ``since`` single passes: another one."""
    return streak > 0 and since < min(2 ** (streak - 1), cap)


def _singles_run(blocks: list) -> tuple[int, int]:
    """How many single passes end ``blocks``, and the index of the block before them."""
    k = len(blocks) - 1
    while k >= 0 and blocks[k][2] == "single":
        k -= 1
    return len(blocks) - 1 - k, k


def _streak(blocks: list, k: int, longest: int = 64) -> int:
    """Tried blocks of one pivot (by the bound or a near tie) in a row up to ``blocks[k]``,
    single passes between them skipped; counted up to ``longest``."""
    streak = 0
    while k >= 0 and streak < longest:
        _, b, why = blocks[k]
        if why != "single":
            if b != 1 or why not in ("bound", "ambiguous"):
                break
            streak += 1
        k -= 1
    return streak


def ordered_block(kernel: Kernel, cand: Candidates, reason: str = "cap") -> BlockChoice:
    """Every candidate a pivot, in the order given: the Cholesky factor of their Schur complement.

    For rules that decide the pivots themselves (a rule defined outside dkicf
    needs only this to turn its rows into a block).  The candidates must have
    residuals above rounding, in that order.
    """
    chol = _SmallCholesky(kernel, cand, max(1, cand.index.shape[0]))
    for c in range(cand.index.shape[0]):
        chol.take(c, lambda c=c: np.arange(c + 1, cand.index.shape[0]))
    return chol.choice(reason)


# ------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class RuleContext:
    """What a pivot rule sees of the factorization when it chooses a block.

    Attributes
    ----------
    kernel : Kernel
    n, d, capacity : int
        Rows and features of X, and the largest rank.
    rank_tol, max_diag, roundoff : float
        The numerical-rank threshold, ``max(diag K)`` and the kernel's
        rounding factor (they set the margin of rounding).
    tol : float
        The trace tolerance of the factorization.
    fetch : callable
        ``fetch(index)`` returns the :class:`Candidates` of the global rows
        ``index`` (their rows of X and of P and their residuals; no pass
        over X).
    small : dict
        ``panel``, ``pool`` and ``n_threads`` for the driver's Cholesky of
        the candidates (see :func:`greedy_block`).
    """

    kernel: Kernel
    n: int
    d: int
    capacity: int
    rank_tol: float
    max_diag: float
    roundoff: float
    tol: float
    fetch: Callable
    small: dict


class PivotRule:
    """How the driver loop of :func:`dkicf.incomplete_cholesky` chooses its pivots.

    A rule is a class with a ``name``, registered with :func:`register_rule`;
    the name is then valid for ``pivoting=`` everywhere (the estimator, the
    CLI's ``--pivoting``).  One instance serves one factorization.  A rule
    with ``one_per_pass = True`` runs the paper's sequential loop (the largest
    residual, one pivot per pass); any other rule adds a block of pivots per
    pass: before each pass the loop asks it for a :meth:`request` (the
    candidates the chunks return with the last block's column sums, or none)
    and then for the block itself (:meth:`choose`).

    Parameters
    ----------
    capacity, n, d : int
        The largest rank, and the rows and features of X.
    block_size : int, optional
        The user's cap on the pivots per pass.
    block_delta : float
        ``block_delta=`` of :func:`dkicf.incomplete_cholesky` (rules with
        ``uses_block_delta`` only).
    random_state : None, int or numpy.random.Generator
        Seed of a randomized rule (drawn from once, when the rule is made).
    """

    #: Name for ``pivoting=``.
    name: ClassVar[str] = ""
    #: One line for the documentation and the CLI's help.
    description: ClassVar[str] = ""
    #: The paper's sequential loop: one pivot, the largest residual, per pass.
    one_per_pass: ClassVar[bool] = False
    #: Whether ``block_delta`` applies.
    uses_block_delta: ClassVar[bool] = False
    #: How :class:`BlockSizer` adapts the candidate count: "top" or "draws".
    sizing: ClassVar[str] = "draws"

    def __init__(self, *, capacity: int, n: int, d: int, block_size: int | None = None,
                 block_delta: float = 0.0, random_state=None):
        self.capacity, self.n, self.d = capacity, n, d
        self.block_size, self.block_delta = block_size, block_delta
        self.sizer: BlockSizer | None = None

    def size_blocks(self, rows_per_task: int, task_bytes: float | None = None) -> None:
        """Cap the blocks by what one task holds (called by the loop once the backend is up)."""
        self.sizer = BlockSizer(self.sizing, self.capacity, self.n, self.d, rows_per_task,
                                self.block_size, task_bytes)

    def request(self, rank: int, rank_tol: float) -> CandidateRequest:
        """The candidates the chunks should return for a block at ``rank`` (default: none)."""
        return CandidateRequest()

    def choose(self, ctx: RuleContext, rank: int, cand: Candidates | None, b_max: int,
               trace: float) -> tuple[Candidates, BlockChoice, int]:
        """The next block: ``(candidates, choice among them, candidates used)``.

        ``cand`` holds the rows of the last :meth:`request` (None if it asked
        for none); a rule may instead ``ctx.fetch`` rows of its own.  At most
        ``b_max`` pivots; ``trace`` is the trace error before the block.
        """
        raise NotImplementedError(f"pivot rule {self.name!r} does not choose blocks")

    def stash(self, rank: int) -> int:
        """Candidates whose rows of X streamed chunks should keep for a request at ``rank``."""
        return 0

    def single_pass(self, blocks: list, n: int, rank: int) -> bool:
        """Whether the next pass should add the largest residual alone (a greedy pass)."""
        return False

    def state(self) -> dict:
        """The rule's own state for a checkpoint (JSON-able)."""
        return {"key": None, "draw": 0}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state`, as read back from a checkpoint."""


PIVOT_RULES: dict[str, type[PivotRule]] = {}


def register_rule(cls: type[PivotRule]) -> type[PivotRule]:
    """Make a :class:`PivotRule` subclass valid for ``pivoting=`` under its ``name``.

    Usable as a class decorator.  A name already taken by another class is
    refused.
    """
    if not (isinstance(cls, type) and issubclass(cls, PivotRule)):
        raise TypeError(f"a pivot rule must be a PivotRule subclass, got {cls!r}.")
    name = cls.name
    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"a pivot rule needs a lower-case name, got {name!r}.")
    if PIVOT_RULES.get(name, cls) is not cls:
        raise ValueError(f"the pivot rule name {name!r} is taken by {PIVOT_RULES[name]!r}.")
    PIVOT_RULES[name] = cls
    return cls


@register_rule
class Greedy(PivotRule):
    name = "greedy"
    description = "the paper's Algorithm 1 as written: the largest residual, one pivot per pass"
    one_per_pass = True


@register_rule
class BlockGreedy(PivotRule):
    name = "block-greedy"
    description = ("the greedy pivots, several per pass: those of the largest residuals that "
                   "provably come next")
    uses_block_delta = True
    sizing = "top"
    #: (blocks, their number, single passes ending them, the streak before those, run length or 0)
    _memo: tuple | None = None

    def request(self, rank, rank_tol):
        return CandidateRequest("top", self.sizer.count(rank))

    def choose(self, ctx, rank, cand, b_max, trace):
        m = cand.index.shape[0]
        margin = rounding_margin(ctx.max_diag, ctx.roundoff, rank, m)
        choice = greedy_block(ctx.kernel, cand, b_max=b_max, rank_tol=ctx.rank_tol,
                              margin=margin, delta=self.block_delta, trace=trace, tol=ctx.tol,
                              **ctx.small)
        return cand, choice, m

    def stash(self, rank):
        # The next candidates are the largest residuals after this pass.
        return self.sizer.count(rank)

    def single_pass(self, blocks, n, rank):
        memo = self._memo
        grown = (memo is not None and memo[0] is blocks and memo[1] == len(blocks) - 1
                 and blocks[-1][2] == "single")
        if grown and memo[4]:
            # Inside a run whose length is known: one more single pass.
            since = memo[2] + 1
            self._memo = (blocks, len(blocks), since, memo[3], memo[4])
            return since < memo[4]
        if self.block_delta or not blocks:
            return False
        cap = _run_cap(n, self.sizer.count(rank))
        if cap < 1:
            return False
        # As _single_pass, kept up to date pass by pass: the streak before a run of
        # single passes does not change while the run grows.
        if memo is not None and memo[0] is blocks and memo[1] == len(blocks):
            since, streak = memo[2], memo[3]
        elif grown:
            since, streak = memo[2] + 1, memo[3]
        else:
            since, start = _singles_run(blocks)
            streak = _streak(blocks, start)
        # The run's length, when the cap (lower with fewer candidates at a higher rank)
        # cannot shrink before it ends: then the passes only count.
        limit = min(2 ** (streak - 1), cap) if streak > 0 else 0
        if limit and _run_cap(n, self.sizer.count(rank + limit)) != cap:
            limit = 0
        self._memo = (blocks, len(blocks), since, streak, limit)
        return _run_goes_on(since, streak, cap)


@register_rule
class RPCholesky(PivotRule):
    name = "rpcholesky"
    description = ("randomly pivoted Cholesky, blocked with rejection sampling; seeded, "
                   "independent of the chunking")

    def __init__(self, *, random_state=None, **kw):
        super().__init__(**kw)
        self.key = rpcholesky_key(random_state)
        self.draw = 0

    def request(self, rank, rank_tol):
        return CandidateRequest("race", self.sizer.count(rank), self.key, self.draw,
                                floor=rank_tol)

    def choose(self, ctx, rank, cand, b_max, trace):
        uniforms = accept_uniforms(self.key, self.draw, cand.draws.shape[0])
        choice = rpcholesky_block(ctx.kernel, cand, uniforms, b_max=b_max,
                                  rank_tol=ctx.rank_tol, trace=trace, tol=ctx.tol, **ctx.small)
        self.draw += 1
        return cand, choice, int(cand.draws.shape[0])

    def state(self):
        return {"key": [format(int(k), "016x") for k in self.key], "draw": int(self.draw)}

    def restore(self, state):
        if state.get("key") is not None:  # the commit's, also when random_state=None
            self.key = np.array([int(k, 16) for k in state["key"]], dtype=np.uint64)
        self.draw = int(state["draw"])
