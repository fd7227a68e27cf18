"""K-means on the rows of the factor P, in memory or on a dask cluster.

Kernel k-means on an incomplete Cholesky factorization ``K ~ P P^T`` is plain
k-means on the rows of P.  This module clusters those rows: in this process
for a numpy P, and on a ``distributed`` cluster for a dask P chunked by rows.

Three algorithms share one layout:

* ``"minibatch"`` (Sculley 2010, as scikit-learn's ``MiniBatchKMeans``): the
  driver draws the batches' global row indices from its own generator, fetches
  only those rows (the rows of many future steps in one request, since the
  indices do not depend on the centres) and updates the centres itself;
* ``"lloyd"``: one pass over P per iteration; each row chunk returns its
  per-centre sums and counts, its inertia and its few farthest points, and the
  driver reduces them in chunk order;
* ``"minibatch-lloyd"`` (the default): mini-batch steps bring the centres close
  cheaply, then Lloyd passes take them to Lloyd's fixed point.

Centres start from k-means++ on a seeded sample of rows, or from k-means||
(Bahmani et al. 2012): a few passes that oversample candidates from all of P.

Row chunks never leave the workers: the driver receives sampled rows and
per-chunk summaries of size ``O(k s)``, and labels stay a dask array chunked
like P.  Every random choice is made on the driver and addresses rows by
global index, so the result does not depend on the number of workers or on
the chunking.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import os
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import sparse

from ._chunk import LazyChunk, chunk_digest, materialize, threadpool_limits
from ._validation import check_array_2d, check_positive_int, is_dask_array
from .errors import worker_failure, worker_failure_types

if TYPE_CHECKING:
    import dask.array as da

__all__ = ["ALGORITHMS", "KMeansProgress", "KMeansResult", "assign", "kmeans"]

logger = logging.getLogger(__name__)

ALGORITHMS = ("minibatch-lloyd", "minibatch", "lloyd")
INITS = ("k-means++", "k-means||")

# Mini-batch: a centre whose count is below this fraction of the largest count
# is starved (it sits where almost no data is) and is re-seeded.
_REASSIGNMENT_RATIO = 1e-3
# Mini-batch prefetch: rows of as many future steps as fit in this budget.
_PREFETCH_ROWS = 65536
_PREFETCH_BYTES = 64 << 20
# Rows x centres of the distance block a chunk kernel holds at once.
_BLOCK_ELEMENTS = 1 << 20
# Numpy backend: rows per block of its thread pool, at least.
_MIN_BLOCK_ROWS = 16384
# Restarts whose inertias differ by less than this (relative) are a tie, won by
# the earlier one: rounding differences between chunkings never pick the run.
_TIE_RTOL = 1e-12
# Default steps between checkpoint commits: a commit costs a few small writes,
# about what a mini-batch step costs; a Lloyd iteration is a pass over P.
_CHECKPOINT_EVERY = {"minibatch": 100, "lloyd": 5}
# k-means||: rounds of oversampling, and candidates drawn per round per cluster.
_PARALLEL_ROUNDS = 5
_PARALLEL_OVERSAMPLING = 2


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
        over P each).  ``step`` counts the steps of this phase.
    """

    restart: int
    n_init: int
    step: int
    max_iter: int
    inertia: float
    center_shift: float
    elapsed: float
    phase: str = "minibatch"


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
        continued from (``"resumed_from"``: ``{"restart": r, "step": s}``, or
        None for a new fit) and whether the checkpoint already held the
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


# --------------------------------------------------------------------------- block kernels


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


def _nearest(x: np.ndarray, centers: np.ndarray, c_sq: np.ndarray, x_sq=None):
    """Nearest centre of each row (ties to the lowest index) and the squared distance to it.

    ``||x||^2 - 2 x.c + ||c||^2`` in float64, clamped at 0 (rounding can make a
    point at a centre slightly negative).  ``x_sq``: the rows' ``||x||^2``, when
    the caller already has them.
    """
    d = x @ centers.T
    d *= -2.0
    d += c_sq
    d += (np.einsum("ij,ij->i", x, x) if x_sq is None else x_sq)[:, None]
    labels = np.argmin(d, axis=1).astype(np.int64, copy=False)
    d2 = d[np.arange(x.shape[0]), labels]
    np.maximum(d2, 0.0, out=d2)
    return labels, d2


def _cluster_sums(x: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Per-centre sums of the rows: the sparse (k, m) indicator times the (m, s) rows.

    ``m * s`` additions.  A dense indicator would cost ``k`` times more and
    goes through a matrix-product shape (few rows, a long inner dimension)
    that BLAS handles badly.
    """
    m = x.shape[0]
    onehot = sparse.csr_matrix((np.ones(m), labels, np.arange(m + 1)), shape=(m, k))
    return np.asarray(onehot.T @ x)


def _row_blocks(p, offset: int, width: int, check: bool):
    """``(lo, hi, rows)`` of a chunk in blocks of about ``_BLOCK_ELEMENTS / width`` rows.

    The rows are widened to float64 block by block; ``check``: raise on NaN
    or infinity (P that was not validated yet).
    """
    step = max(256, _BLOCK_ELEMENTS // max(1, width))
    for lo in range(0, p.shape[0], step):
        hi = min(lo + step, p.shape[0])
        x = np.asarray(p[lo:hi], dtype=np.float64)
        if check:
            _check_finite(x, offset + lo)
        yield lo, hi, x


def _scan(p, offset: int, centers: np.ndarray, with_sums: bool, check: bool = True):
    """Labels, squared distances and (optionally) per-centre sums of one row chunk.

    Works in row blocks so that the distance block stays small whatever the
    chunk size; rows are widened to float64 block by block.  ``check``: raise
    on NaN or infinity (P that was not validated yet).
    """
    n, s = p.shape
    k = centers.shape[0]
    c_sq = np.einsum("ij,ij->i", centers, centers)
    labels = np.empty(n, dtype=np.int64)
    d2 = np.empty(n)
    sums = np.zeros((k, s)) if with_sums else None
    for lo, hi, x in _row_blocks(p, offset, k, check):
        labels[lo:hi], d2[lo:hi] = _nearest(x, centers, c_sq)
        if with_sums:
            sums += _cluster_sums(x, labels[lo:hi], k)
    return labels, d2, sums


def _chunk_assign(p, offset: int, centers: np.ndarray, check: bool = True):
    """One chunk of a full pass: its labels, and its inertia and counts."""
    labels, d2, _ = _scan(p, offset, centers, with_sums=False, check=check)
    stats = {
        "inertia": float(d2.sum()),
        "counts": np.bincount(labels, minlength=centers.shape[0]),
    }
    return labels, stats


def _chunk_lloyd(p, offset: int, centers: np.ndarray, n_far: int, check: bool = True) -> dict:
    """One chunk of a Lloyd iteration: per-centre sums and counts, inertia, farthest points.

    The farthest points (largest squared distance to their centre, with their
    global index and label) are the candidates for re-seeding empty clusters.
    """
    labels, d2, sums = _scan(p, offset, centers, with_sums=True, check=check)
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
        "counts": np.bincount(labels, minlength=centers.shape[0]),
        "inertia": float(d2.sum()),
        "far_d2": d2[far],
        "far_index": far.astype(np.int64) + offset,
        "far_label": labels[far],
    }


def _chunk_nearest_update(p, offset: int, states, cands: list, firsts: list,
                          check: bool = True):
    """k-means|| of several runs at once: each row's nearest candidate, updated with new ones.

    ``states`` is None or the chunk's ``(d2, label)`` per run for its
    candidates so far; ``cands[r]`` are run ``r``'s new candidates (possibly
    none), numbered from ``firsts[r]``.  The chunk is read once for all runs,
    with one matrix product per run (so that a run's distances do not depend
    on which runs share the pass).  A row moves to a new
    candidate only if strictly nearer (ties to the lowest number, as an
    argmin over all of them).  Returns the new states and each run's sum of
    squared distances.
    """
    n = p.shape[0]
    if states is None:
        states = [(np.full(n, np.inf), np.zeros(n, dtype=np.int64)) for _ in cands]
    # Only the runs with new candidates change: the others keep their arrays.
    new = [(d2.copy(), label.copy()) if c.shape[0] else (d2, label)
           for (d2, label), c in zip(states, cands)]
    c_sq = [np.einsum("ij,ij->i", c, c) for c in cands]
    for lo, hi, x in _row_blocks(p, offset, sum(c.shape[0] for c in cands), check):
        x_sq = np.einsum("ij,ij->i", x, x)
        for r, (d2, label) in enumerate(new):
            if cands[r].shape[0] == 0:
                continue
            near, dist = _nearest(x, cands[r], c_sq[r], x_sq)
            better = dist < d2[lo:hi]
            d2[lo:hi][better] = dist[better]
            label[lo:hi][better] = near[better] + firsts[r]
    return new, [float(d2.sum()) for d2, _ in new]


def _uniform(key: int, index: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1), one per global row index, from a counter-based hash.

    SplitMix64 of ``key + index * golden``: a row's number depends on the key
    and its index only, not on the chunk that holds it.
    """
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _chunk_oversample(p, offset: int, states, phis: list, ell: float, keys: list) -> list:
    """k-means||: for each run, its rows drawn with probability ``min(1, ell d2 / phi)``.

    A run whose ``phi`` is 0 (or below) draws none.  Returns the rows
    (float64) of each run, in row order.
    """
    out = []
    for (d2, _), phi, key in zip(states, phis, keys):
        if not phi > 0:
            out.append(np.empty((0, p.shape[1])))
            continue
        u = _uniform(key, np.arange(offset, offset + d2.shape[0], dtype=np.int64))
        local = np.flatnonzero(u * phi < ell * d2)
        out.append(np.asarray(p[local], dtype=np.float64).reshape(local.size, p.shape[1]))
    return out


def _state_counts(states, sizes: list) -> list:
    """k-means||: per run, how many rows of the chunk each candidate is nearest to."""
    return [np.bincount(label, minlength=m) for (_, label), m in zip(states, sizes)]


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
    return np.asarray(p[local], dtype=np.float64)


def _in_task(fn, *args):
    """Run a block kernel in a dask task with one BLAS thread.

    Workers already run one task per core; threaded BLAS inside the tasks
    would oversubscribe them.
    """
    with threadpool_limits(1):
        return fn(materialize(args[0]), *args[1:])


# --------------------------------------------------------------------------- backends


class _NumpyBackend:
    """P in this process, scanned in row blocks by a pool of threads.

    One thread per core, each with one BLAS thread: the block kernels are
    the dask backend's, and numpy releases the GIL in them.  Blocks are
    reduced in row order, so the result does not depend on which thread
    finished first.
    """

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

    def rows(self, index: np.ndarray) -> np.ndarray:
        return np.asarray(self.P[index], dtype=np.float64)

    # P was checked for NaN and infinity on entry (check_array_2d): check=False.
    def lloyd_pass(self, centers: np.ndarray, n_far: int) -> list[dict]:
        return self._map(_chunk_lloyd, centers, n_far, False)

    def full_pass(self, centers: np.ndarray):
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

    def __init__(self, P, client, persist: bool = True):
        import uuid

        from ._cluster import get_client

        self.token = uuid.uuid4().hex
        self.client = get_client(client)
        if P.numblocks[1] != 1:
            P = P.rechunk({1: -1})
        self.n, self.s = (int(v) for v in P.shape)
        self.chunks = tuple(int(c) for c in P.chunks[0])
        self.offsets = np.concatenate([[0], np.cumsum(self.chunks)]).astype(np.int64)
        if persist:
            _check_fits(self.client, P)
            self.blocks = self.client.compute(list(P.to_delayed().ravel()))
        else:
            # Each task reads its chunk from P's source (e.g. Zarr) and lets it go.
            self.blocks = LazyChunk.row_chunks(P)

    def _submit(self, name: str, fn, j: int, *args):
        from dask.base import tokenize

        block = self.blocks[j]
        key = f"kmeans-{name}-{tokenize(self.token, block.key, *args)}"
        return self.client.submit(_in_task, fn, block, *args, key=key)

    def rows(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index, dtype=np.int64)
        uniq, inverse = np.unique(index, return_inverse=True)
        owner = np.searchsorted(self.offsets, uniq, side="right") - 1
        cuts = np.searchsorted(owner, np.arange(len(self.chunks) + 1))
        futs = [
            self._submit("rows", _chunk_take, j, uniq[lo:hi] - self.offsets[j])
            for j, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:]))
            if hi > lo
        ]
        # Chunks hold contiguous row ranges: in chunk order the parts are in `uniq` order.
        return np.concatenate(self.client.gather(futs))[inverse.ravel()]

    def lloyd_pass(self, centers: np.ndarray, n_far: int) -> list[dict]:
        futs = [
            self._submit("lloyd", _chunk_lloyd, j, int(off), centers, n_far)
            for j, off in enumerate(self.offsets[:-1])
        ]
        return self.client.gather(futs)

    def full_pass(self, centers: np.ndarray):
        import dask.array as da

        both = [
            self._submit("assign", _chunk_assign, j, int(off), centers)
            for j, off in enumerate(self.offsets[:-1])
        ]
        labels = [
            self.client.submit(operator.getitem, f, 0, key=f"{f.key}-labels") for f in both
        ]
        stats = self.client.gather(
            [self.client.submit(operator.getitem, f, 1, key=f"{f.key}-stats") for f in both]
        )
        labels = da.concatenate(
            [
                da.from_delayed(f, shape=(c,), dtype=np.int64)
                for f, c in zip(labels, self.chunks)
            ]
        )
        return labels, stats

    def nearest_update(self, state, cands: list, firsts: list):
        """k-means|| pass: new per-chunk states (futures, kept on the workers) and their sums."""
        both = [
            self._submit("kmpar", _chunk_nearest_update, j, int(off),
                         None if state is None else state[j], cands, firsts)
            for j, off in enumerate(self.offsets[:-1])
        ]
        new = [self.client.submit(operator.getitem, f, 0, key=f"{f.key}-state") for f in both]
        phi = self.client.gather(
            [self.client.submit(operator.getitem, f, 1, key=f"{f.key}-phi") for f in both]
        )
        return new, phi

    def oversample(self, state, phis: list, ell: float, keys: list) -> list:
        futs = [
            self._submit("kmpar-draw", _chunk_oversample, j, int(off), state[j], phis, ell, keys)
            for j, off in enumerate(self.offsets[:-1])
        ]
        parts = self.client.gather(futs)
        return [np.concatenate([part[r] for part in parts]) for r in range(len(phis))]

    def candidate_counts(self, state, sizes: list) -> list:
        futs = [self.client.submit(_state_counts, st, sizes, key=f"{st.key}-counts")
                for st in state]
        parts = self.client.gather(futs)
        return [np.sum([part[r] for part in parts], axis=0) for r in range(len(sizes))]

    def distinct(self, k: int, direction: np.ndarray) -> list[np.ndarray]:
        futs = [self._submit("distinct", _chunk_distinct, j, int(off), k, direction)
                for j, off in enumerate(self.offsets[:-1])]
        return self.client.gather(futs)

    def digests(self) -> tuple[tuple[int, ...], list[str]]:
        """Row chunks and one digest per chunk, hashed where the chunks live."""
        futs = [self._submit("digest", chunk_digest, j) for j in range(len(self.chunks))]
        return self.chunks, self.client.gather(futs)

    def close(self) -> None:
        self.blocks = None


def _check_fits(client, P) -> None:
    """Refuse to hold a P larger than the cluster's memory (its workers would be killed)."""
    from ._backends import _gib, _worker_resources

    limits, _ = _worker_resources(client)
    if limits and all(limits):
        nbytes = int(np.prod(P.shape)) * P.dtype.itemsize
        if nbytes > sum(limits):
            raise ValueError(
                f"P is {_gib(nbytes)}, more than the {_gib(sum(limits))} of memory of the "
                f"cluster's {len(limits)} workers, so it cannot be held there: pass "
                "persist=False to read P's chunks from its source (for example the Zarr "
                "array of a factorization run with p_store=) in every pass, or add workers "
                "or memory."
            )


def _backend(P, client, persist: bool = True):
    return _DaskBackend(P, client, persist) if is_dask_array(P) else _NumpyBackend(P)


def _full_pass(backend, centers: np.ndarray):
    """Labels, inertia and per-centre counts of all rows (chunk results reduced in order)."""
    labels, stats = backend.full_pass(centers)
    inertia = math.fsum(st["inertia"] for st in stats)
    counts = np.zeros(centers.shape[0], dtype=np.int64)
    for st in stats:
        counts += st["counts"]
    return labels, inertia, counts


# --------------------------------------------------------------------------- drivers


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


@dataclass
class _Position:
    """Where the fit is, for the error that reports a task killing its workers.

    The drivers update it before each request to the workers: ``phase`` is
    ``"fingerprint"`` (of P, for the checkpoint), ``"init"``, ``"minibatch"``,
    ``"lloyd"``, ``"assign"`` (a run's full pass) or ``"labels"`` (the best
    run's labels after a resume); ``fetch`` is the range of mini-batch steps
    whose rows are being fetched.
    """

    n_init: int
    phase: str = "fingerprint"
    restart: int = 0
    step: int = 0
    fetch: tuple[int, int] | None = None

    def at(self, phase: str, step: int = 0, fetch: tuple[int, int] | None = None) -> None:
        self.phase, self.step, self.fetch = phase, step, fetch

    def __str__(self) -> str:
        run = f"run {self.restart + 1}/{self.n_init}"
        if self.phase == "fingerprint":
            return "the fingerprint of P for the checkpoint, before the first run"
        if self.phase == "labels":
            return f"the assignment pass for the labels of the best run ({run})"
        if self.phase == "init":
            return f"{run}, initialisation"
        if self.phase == "assign":
            return f"{run}, final assignment pass"
        if self.phase == "lloyd":
            return f"{run}, Lloyd iteration {self.step}"
        where = f"{run}, mini-batch step {self.step}"
        if self.fetch is not None:
            lo, hi = self.fetch
            steps = f"steps {lo}-{hi}" if hi > lo else f"step {lo}"
            where += f" (fetching the rows of {steps})"
        return where


def _initial_centers(backend, cfg: _Config, rng: np.random.Generator, candidates):
    """Initial centres, and the mean feature variance of a seeded sample of rows.

    The sample is drawn by global row index, so it is the same rows whatever
    the chunking; only those rows are fetched.  k-means++ runs on it;
    k-means|| reclusters the run's weighted ``candidates()`` and uses the
    sample only for the variance, which scales ``tol``.
    """
    from sklearn.cluster import KMeans, kmeans_plusplus

    index = np.sort(rng.choice(backend.n, size=cfg.init_size, replace=False))
    sample = backend.rows(index)
    _check_finite(sample, index)
    variance = float(np.mean(np.var(sample, axis=0)))
    if not isinstance(cfg.init, str):
        return cfg.init.copy(), variance
    seed = int(rng.integers(2**31 - 1))
    if cfg.init == "k-means++":
        centers, _ = kmeans_plusplus(sample, cfg.n_clusters, random_state=seed)
        return np.asarray(centers, dtype=np.float64), variance
    cands, weights = candidates()
    # One weighted k-means++ start and Lloyd on the candidates: more starts
    # there find the candidates' own optimum, which every run then shares
    # (on the rings, the wrong basin); the runs' diversity matters more.
    centers, _ = kmeans_plusplus(cands, cfg.n_clusters, sample_weight=weights,
                                 random_state=seed)
    centers = KMeans(cfg.n_clusters, init=centers, n_init=1, random_state=seed).fit(
        cands, sample_weight=weights).cluster_centers_
    return np.asarray(centers, dtype=np.float64), variance


def _oversample(backend, k: int, seeds: list, pos: _Position) -> list:
    """The candidates of k-means|| (Bahmani et al. 2012) and their weights, for several runs.

    For each run, with a generator from its own seed (and another for the
    rare fill-in below): one row drawn uniformly starts the
    candidates; each of ``_PARALLEL_ROUNDS`` rounds draws every row
    independently with probability ``min(1, l d2 / phi)`` (``l = 2k``,
    ``d2`` its squared distance to the run's nearest candidate, ``phi``
    their sum) and adds the drawn rows.  A candidate's weight is the number
    of rows nearest to it.  The runs share the passes: one pass over P per
    round updates every run's distances, which stay on the workers.  Draws
    hash the global row index, so the candidates depend neither on the
    chunking nor on which runs share the passes.
    """
    ell = float(_PARALLEL_OVERSAMPLING * k)
    rngs = [np.random.default_rng(ss) for ss, _ in seeds]
    pos.at("init", 0)
    first = backend.rows(np.array([rng.integers(backend.n) for rng in rngs]))
    cands = [first[r:r + 1] for r in range(len(rngs))]
    state, phis = backend.nearest_update(None, cands, [0] * len(rngs))
    for rnd in range(1, _PARALLEL_ROUNDS + 1):
        phi = [math.fsum(part[r] for part in phis) for r in range(len(rngs))]
        keys = [int(rng.integers(np.iinfo(np.int64).max)) for rng in rngs]
        live = [v if v > 0 else 0.0 for v in phi]
        if not any(live):
            break
        pos.at("init", rnd)
        drawn = backend.oversample(state, live, ell, keys)
        if not any(rows.shape[0] for rows in drawn):
            continue
        state, phis = backend.nearest_update(state, drawn, [c.shape[0] for c in cands])
        cands = [np.concatenate([c, rows]) for c, rows in zip(cands, drawn)]
    counts = backend.candidate_counts(state, [c.shape[0] for c in cands])
    out = []
    for (_, fill), c, w in zip(seeds, cands, counts):
        w = w.astype(np.float64)
        if np.unique(c, axis=0).shape[0] < k:
            # Fewer distinct candidates than clusters (P's rows sit on a few
            # points): rows drawn uniformly fill in, as k-means++ would.
            rng = np.random.default_rng(fill)
            extra = backend.rows(np.sort(rng.choice(backend.n, size=k, replace=False)))
            c, w = np.concatenate([c, extra]), np.concatenate([w, np.ones(k)])
        out.append((c, w))
    return out


def _reseed_starved(centers, counts, x, d2, rng: np.random.Generator) -> None:
    """Move starved centres to batch points drawn with probability ~ squared distance.

    A centre is starved when its count is below ``_REASSIGNMENT_RATIO`` of the
    largest count (zero included).  As in scikit-learn, the fewest-count
    centres go first, at most half a batch of them, and a re-seeded centre
    gets the smallest count of the others so the next batch does not wipe it.
    """
    starved = np.flatnonzero(counts < _REASSIGNMENT_RATIO * counts.max())
    if starved.size == 0:
        return
    starved = starved[np.argsort(counts[starved], kind="stable")]
    n_new = min(starved.size, max(1, x.shape[0] // 2), np.count_nonzero(d2))
    if n_new == 0:
        return
    fed = np.ones(counts.shape[0], dtype=bool)
    fed[starved] = False
    starved = starved[:n_new]
    pick = rng.choice(x.shape[0], size=n_new, replace=False, p=d2 / d2.sum())
    centers[starved] = x[pick]
    counts[starved] = counts[fed].min()


def _minibatch_step(x, centers, counts, rng, reseed: bool):
    """One mini-batch step: new centres (counts updated in place) and the batch inertia."""
    k = centers.shape[0]
    labels, d2 = _nearest(x, centers, np.einsum("ij,ij->i", centers, centers))
    n_j = np.bincount(labels, minlength=k)
    hit = n_j > 0
    total = counts[hit] + n_j[hit]
    new = centers.copy()
    sums = _cluster_sums(x, labels, k)
    new[hit] = (centers[hit] * counts[hit, None] + sums[hit]) / total[:, None]
    counts[hit] = total
    if reseed:
        _reseed_starved(new, counts, x, d2, rng)
    return new, float(d2.sum())


def _fetch_batches(backend, batch_rng, m: int, b: int, skip: int = 0) -> deque:
    """Draw the row indices of ``m`` batches; fetch the rows of all but the first ``skip``.

    One draw per step, so the batches do not depend on how many are fetched
    at once; a resumed run redraws a whole fetch to leave the generator where
    the uninterrupted run left it, and fetches only the batches still to come.
    """
    index = np.concatenate([batch_rng.integers(0, backend.n, size=b) for _ in range(m)])
    if skip >= m:
        return deque()
    index = index[skip * b:]
    rows = backend.rows(index)
    _check_finite(rows, index)
    return deque(np.split(rows, m - skip))


def _run_minibatch(backend, centers, cfg: _Config, tol_abs, batch_rng, reseed_rng, report,
                   ckpt, saved, pos: _Position):
    n, s = backend.n, backend.s
    k, b = cfg.n_clusters, cfg.batch_size
    alpha = min(1.0, 2.0 * b / (n + 1))
    per_fetch = max(1, min(_PREFETCH_ROWS, _PREFETCH_BYTES // (8 * s)) // b)
    if saved is None:
        first, counts = 1, np.zeros(k)
        ewa = ewa_min = None
        no_improvement = since_reseed = 0
        fetch, queue = None, deque()
    else:
        first, counts = saved["step"] + 1, np.array(saved["counts"], dtype=np.float64)
        ewa, ewa_min = saved["ewa"], saved["ewa_min"]
        no_improvement, since_reseed = saved["no_improvement"], saved["since_reseed"]
        fetch = saved["fetch"]
        batch_rng.bit_generator.state = fetch["rng"]
        pos.at("minibatch", first, (first, fetch["step"] + fetch["m"] - 1))
        queue = _fetch_batches(backend, batch_rng, fetch["m"], b, skip=first - fetch["step"])
        reseed_rng.bit_generator.state = saved["reseed_rng"]
    stop = "max_iter"
    for step in range(first, cfg.max_iter + 1):
        if not queue:
            m = min(per_fetch, cfg.max_iter - step + 1)
            fetch = {"step": step, "m": m, "rng": batch_rng.bit_generator.state}
            pos.at("minibatch", step, (step, step + m - 1))
            queue = _fetch_batches(backend, batch_rng, m, b)
        x = queue.popleft()
        since_reseed += b
        # Re-seeding starved centres would strip small clusters (their centres
        # see few batch points) before the Lloyd phase, which does not bring
        # them back: mini-batch-then-Lloyd leaves empty clusters to Lloyd.
        reseed = cfg.algorithm == "minibatch" and (
            bool((counts == 0).any()) or since_reseed >= 10 * k)
        if reseed:
            since_reseed = 0
        new, batch_inertia = _minibatch_step(x, centers, counts, reseed_rng, reseed)
        shift = float(np.sum((new - centers) ** 2))
        centers = new
        mean_inertia = batch_inertia / b
        # The first batch measures the initial centres: the average starts at step 2.
        if step > 1:
            ewa = mean_inertia if ewa is None else ewa * (1 - alpha) + mean_inertia * alpha
        report(step, n * (mean_inertia if ewa is None else ewa), shift, "minibatch")
        if step > 1:
            if cfg.tol > 0 and shift <= tol_abs:
                stop = "tol"
                break
            if ewa_min is None or ewa < ewa_min:
                ewa_min, no_improvement = ewa, 0
            else:
                no_improvement += 1
            if cfg.max_no_improvement is not None and no_improvement >= cfg.max_no_improvement:
                stop = "no_improvement"
                break
        if ckpt is not None and ckpt.due(step, cfg.max_iter, "minibatch"):
            ckpt.save(step, {"centers": centers, "counts": counts}, {
                "phase": "minibatch", "step": step, "tol_abs": tol_abs, "ewa": ewa,
                "ewa_min": ewa_min, "no_improvement": no_improvement, "since_reseed": since_reseed,
                "fetch": fetch, "reseed_rng": reseed_rng.bit_generator.state,
            })
    return centers, step, stop


def _relocate_empty(backend, sums, counts, parts, n_far: int) -> None:
    """Give each empty cluster one of the points farthest from their centre.

    Candidates are the global ``n_far`` farthest points (ties to the lowest
    index), merged from the chunks' own farthest points: the same set for any
    chunking.  A point leaves its cluster only if that cluster keeps a point.
    An empty cluster left without a candidate keeps its centre.
    """
    empty = np.flatnonzero(counts == 0)
    far_d2 = np.concatenate([p["far_d2"] for p in parts])
    far_index = np.concatenate([p["far_index"] for p in parts])
    far_label = np.concatenate([p["far_label"] for p in parts])
    chosen = []
    for i in np.lexsort((far_index, -far_d2))[:n_far]:
        if len(chosen) == empty.size:
            break
        if far_d2[i] > 0 and counts[far_label[i]] > 1:
            counts[far_label[i]] -= 1
            chosen.append(i)
    if not chosen:
        return
    rows = backend.rows(far_index[chosen])
    for j, i, row in zip(empty, chosen, rows):
        sums[far_label[i]] -= row
        sums[j] = row
        counts[j] = 1


def _run_lloyd(backend, centers, cfg: _Config, tol_abs, report, ckpt, saved,
               pos: _Position, refine: bool = False, done: int = 0):
    """Lloyd iterations until the centres stay put, ``tol`` or ``max_iter``.

    Alone (``refine=False``), ``tol`` bounds the centres' movement as in
    scikit-learn's ``KMeans``.  After mini-batch steps (``refine=True``,
    ``done`` of them), a run stops when no label changes or when a pass
    lowers the inertia by at most ``tol`` times itself.
    """
    k, s = centers.shape
    stop = "max_iter"
    first = 1 if saved is None else saved["step"] + 1
    previous = None if saved is None else saved.get("inertia")
    for it in range(first, cfg.max_iter + 1):
        pos.at("lloyd", it)
        parts = backend.lloyd_pass(centers, k)
        sums = np.zeros((k, s))
        counts = np.zeros(k, dtype=np.int64)
        for part in parts:  # chunk order, whatever worker answered first
            sums += part["sums"]
            counts += part["counts"]
        relocated = bool((counts == 0).any())
        if relocated:
            _relocate_empty(backend, sums, counts, parts, k)
        new = centers.copy()
        full = counts > 0
        new[full] = sums[full] / counts[full, None]
        shift = float(np.sum((new - centers) ** 2))
        centers = new
        inertia = math.fsum(p["inertia"] for p in parts)
        report(it, inertia, shift, "lloyd")
        if shift == 0.0:  # the same labels as the pass before: Lloyd's fixed point
            # This pass measured the final centres: no assignment pass is needed.
            return centers, it, "converged", None if relocated else (inertia, counts)
        if refine:
            if previous is not None and previous - inertia <= cfg.tol * inertia:
                stop = "tol"
                break
        elif shift <= tol_abs:
            stop = "tol"
            break
        previous = inertia
        if ckpt is not None and ckpt.due(it, cfg.max_iter, "lloyd"):
            ckpt.save(done + it, {"centers": centers}, {
                "phase": "lloyd", "step": it, "tol_abs": tol_abs, "inertia": inertia,
                "done": done,
            })
    return centers, it, stop, None


# --------------------------------------------------------------------------- checkpoints


@dataclass
class _Best:
    """The run with the lowest full-pass inertia so far."""

    centers: np.ndarray
    counts: np.ndarray
    inertia: float
    n_iter: int
    stop: str
    restart: int
    labels: Any = None  # None when the run finished before a resume


@dataclass
class _Runs:
    """What the runs so far leave behind: the state between two runs."""

    seeds: list[int]
    restart: int = 0
    inertias: list[float] = field(default_factory=list)
    n_steps_total: int = 0
    best: _Best | None = None


class _Checkpointer:
    """The commits of one k-means fit: every ``every`` steps of a run, and after each run.

    A commit holds the runs so far (their seeds, full-pass inertias, step
    count and best centres) and, in the middle of a run, that run's own
    state: step, centres, counts, the generators' states and the stopping
    counters.  The best centres are written only when they change.
    """

    def __init__(self, store, every: dict):
        self.store, self.every = store, every
        self.runs: _Runs | None = None
        self._best_saved = None

    @property
    def url(self) -> str:
        return self.store.url

    def due(self, step: int, max_iter: int, phase: str) -> bool:
        """Whether to commit after ``step`` of ``phase`` (never after its last: the run's
        end, or the next phase, commits)."""
        return step % self.every[phase] == 0 and step < max_iter

    def save(self, step: int = 0, arrays: dict | None = None, run: dict | None = None) -> None:
        """Commit the runs so far and, with ``run``, the state of the current run at ``step``."""
        runs = self.runs
        arrays = dict(arrays or {})
        best = runs.best
        if best is not None and best is not self._best_saved:
            arrays.update(best_centers=best.centers, best_counts=best.counts)
        state = {
            "seeds": runs.seeds, "restart": runs.restart, "inertias": runs.inertias,
            "n_steps_total": runs.n_steps_total, "run": run,
            "best": None if best is None else {
                "inertia": best.inertia, "n_iter": best.n_iter, "stop": best.stop,
                "restart": best.restart,
            },
        }
        finished = run is None and runs.restart == len(runs.seeds)
        self.store.save(runs.n_steps_total + step, arrays, state, finished=finished)
        self._best_saved = best

    def restore(self, runs: _Runs) -> tuple[dict | None, dict]:
        """Load the last commit into ``runs`` and keep them to commit later.

        Returns the state of the run the commit interrupted (None at a run
        boundary) and what the result's ``info`` records.
        """
        self.runs = runs
        loaded = self.store.load()
        info = {"checkpoint": self.url, "resumed_from": None, "already_finished": False}
        if loaded is None:
            logger.info("no k-means commit at %s yet: starting from the first run", self.url)
            return None, info
        _, arrays, state = loaded
        runs.seeds = [int(v) for v in state["seeds"]]
        runs.restart, runs.n_steps_total = state["restart"], state["n_steps_total"]
        runs.inertias = [float(v) for v in state["inertias"]]
        if state["best"] is not None:
            runs.best = _Best(centers=arrays["best_centers"], counts=arrays["best_counts"],
                              **state["best"])
            self._best_saved = runs.best
        run = state["run"]
        step = 0 if run is None else run["step"]
        info["resumed_from"] = {"restart": runs.restart, "step": step}
        if self.store.finished:
            info["already_finished"] = True
            logger.info(
                "the k-means checkpoint at %s holds a finished fit (%d runs, best inertia "
                "%.6e); nothing to do but one assignment pass for the labels",
                self.url, len(runs.seeds), runs.best.inertia,
            )
            return None, info
        logger.info("resuming k-means from %s: run %d/%d at step %d",
                    self.url, runs.restart + 1, len(runs.seeds), step)
        if run is None:
            return None, info
        return dict(run, centers=arrays["centers"], counts=arrays.get("counts")), info


def _seed_fingerprint(random_state, seeds) -> int | str | None:
    """How ``random_state`` shows in the fingerprint: the seed itself, or the runs' seeds.

    None draws fresh seeds: a fit resumed with None continues with the
    seeds its checkpoint saved.
    """
    if random_state is None:
        return None
    if isinstance(random_state, numbers.Integral) and not isinstance(random_state, bool):
        return int(random_state)
    return f"{type(random_state).__name__} giving seeds {chunk_digest(np.asarray(seeds))[:12]}"


def _open_checkpoint(backend, P, cfg: _Config, seed, url, every, resume: bool,
                     overwrite: bool, storage_options) -> _Checkpointer:
    """Claim (or open, to resume) the checkpoint after fingerprinting P on its workers."""
    from .checkpoint import StateCheckpoint

    params = {
        "n_clusters": cfg.n_clusters, "algorithm": cfg.algorithm,
        "init": cfg.init if isinstance(cfg.init, str) else f"array {chunk_digest(cfg.init)}",
        "batch_size": cfg.batch_size, "n_init": cfg.n_init, "max_iter": cfg.max_iter,
        "tol": cfg.tol, "max_no_improvement": cfg.max_no_improvement,
        "init_size": cfg.init_size, "random_state": seed,
    }
    chunks, digests = backend.digests()
    data = {"shape": [backend.n, backend.s], "chunks": list(chunks),
            "dtype": str(np.dtype(P.dtype)), "digests": digests}
    store = StateCheckpoint(url, "kmeans", params, input=data, resume=resume,
                            overwrite=overwrite, storage_options=storage_options)
    return _Checkpointer(store, every)


def _worker_failure(exc: BaseException, pos: _Position, algorithm: str,
                    ckpt: _Checkpointer | None, url: str | None):
    """The :class:`~dkicf.errors.WorkerFailureError` of a k-means task that killed its workers.

    It names the run and the step (or pass) and, with a checkpoint, its last
    commit, from which ``resume=True`` continues.
    """
    resume = "call again with resume=True (dkicf fit: --resume)"
    commit = None if ckpt is None else ckpt.store.commit
    if ckpt is not None:
        url = ckpt.url
    if commit is not None and commit["finished"]:
        hint = (f"The k-means checkpoint in {url!r} holds the finished fit: {resume} to get "
                "its result after one assignment pass.")
    elif commit is not None:
        state = commit["state"]
        run = f"run {state['restart'] + 1}/{len(state['seeds'])}"
        if state["run"] is None:
            at = f"at the start of {run}"
        else:
            phase = state["run"].get("phase", "lloyd" if algorithm == "lloyd" else "minibatch")
            unit = "Lloyd iteration" if phase == "lloyd" else "mini-batch step"
            at = f"at {run}, {unit} {state['run']['step']}"
        hint = (f"The last k-means checkpoint, {at}, is in {url!r}: {resume} to continue "
                "from it.")
    elif url is not None:
        hint = (f"No k-means checkpoint was committed yet in {url!r}: {resume} to use it, "
                "from the first run.")
    else:
        hint = ("Pass checkpoint= (dkicf fit: --checkpoint DIR) and resume=True after a "
                "failure (--resume) to be able to resume.")
    return worker_failure(exc, "k-means", pos.step, ckpt, where=str(pos), resume_hint=hint)


# --------------------------------------------------------------------------- the fit


def _run_phases(backend, centers, cfg: _Config, tol_abs, report, ckpt, saved,
                pos: _Position, batch_ss, reseed_ss):
    """The mini-batch and Lloyd phases of one run: its centres, steps, stop reason and,
    when its last Lloyd pass measured the final centres, that pass's inertia and counts.

    ``saved`` is the state of a run resumed in its middle: the phase it was
    in (mini-batch for commits that do not say) and that phase's state.
    """
    phase = "minibatch" if cfg.algorithm != "lloyd" else "lloyd"
    if saved is not None:
        phase = saved.get("phase", phase)
    done = 0
    if phase == "minibatch":
        centers, done, stop = _run_minibatch(
            backend, centers, cfg, tol_abs,
            np.random.default_rng(batch_ss), np.random.default_rng(reseed_ss), report,
            ckpt, saved, pos,
        )
        saved = None
        if cfg.algorithm == "minibatch":
            return centers, done, stop, None
    elif saved is not None:
        done = saved.get("done", 0)
    centers, n_lloyd, stop, final = _run_lloyd(
        backend, centers, cfg, tol_abs, report, ckpt, saved, pos,
        refine=cfg.algorithm != "lloyd", done=done,
    )
    return centers, done + n_lloyd, stop, final


def _check_distinct(backend, k: int) -> None:
    """Refuse more clusters than P has distinct rows (some would stay empty)."""
    direction = np.random.default_rng(0).standard_normal(backend.s)
    found = np.unique(np.concatenate(backend.distinct(k, direction))).size
    if found < k:
        raise ValueError(
            f"n_clusters={k} is larger than the number of distinct rows of P ({found}): "
            f"pass n_clusters <= {found}."
        )


def _fit(backend, cfg: _Config, seeds, progress, ckpt: _Checkpointer | None, pos: _Position):
    start = time.perf_counter()
    pos.at("init")
    _check_distinct(backend, cfg.n_clusters)
    runs = _Runs(seeds=[int(v) for v in seeds])
    saved, info = None, {}
    if ckpt is not None:
        saved, info = ckpt.restore(runs)
    pending = {}  # k-means|| candidates of the runs still to start, oversampled together

    def candidates(restart):
        if restart not in pending:
            todo = range(restart, cfg.n_init)
            found = _oversample(backend, cfg.n_clusters, [
                tuple(np.random.SeedSequence(runs.seeds[r]).spawn(5)[3:]) for r in todo
            ], pos)
            pending.update(zip(todo, found))
        return pending.pop(restart)

    for restart in range(runs.restart, cfg.n_init):
        runs.restart = pos.restart = restart
        init_ss, batch_ss, reseed_ss = np.random.SeedSequence(runs.seeds[restart]).spawn(3)
        if saved is None:
            pos.at("init")
            centers, variance = _initial_centers(
                backend, cfg, np.random.default_rng(init_ss),
                lambda restart=restart: candidates(restart),
            )
            tol_abs = cfg.tol * variance
        else:  # resumed in the middle of this run
            centers, tol_abs = saved["centers"], saved["tol_abs"]

        def report(step, inertia, shift, phase, restart=restart):
            if progress is not None:
                progress(
                    KMeansProgress(
                        restart=restart, n_init=cfg.n_init, step=step, max_iter=cfg.max_iter,
                        inertia=float(inertia), center_shift=shift,
                        elapsed=time.perf_counter() - start, phase=phase,
                    )
                )

        centers, n_iter, stop, final = _run_phases(backend, centers, cfg, tol_abs, report,
                                                   ckpt, saved, pos, batch_ss, reseed_ss)
        saved = None
        runs.n_steps_total += n_iter
        if final is None:
            pos.at("assign", n_iter)
            labels, inertia, counts = _full_pass(backend, centers)
        else:  # labels of the best run only, by one pass at the end
            labels, (inertia, counts) = None, final
        runs.inertias.append(inertia)
        logger.info(
            "k-means (%s) run %d/%d: %d steps, stop: %s, inertia %.6e",
            cfg.algorithm, restart + 1, cfg.n_init, n_iter, stop, inertia,
        )
        if runs.best is None or inertia < runs.best.inertia * (1 - _TIE_RTOL):
            runs.best = _Best(centers, counts, inertia, n_iter, stop, restart, labels)
        runs.restart = restart + 1
        if ckpt is not None:
            ckpt.save()
    best = runs.best
    labels = best.labels
    if labels is None:  # not kept (or the run ended before a resume): one pass away
        pos.restart = best.restart
        pos.at("labels", best.n_iter)
        labels, _, _ = _full_pass(backend, best.centers)
    n_found = int(np.count_nonzero(best.counts))
    if n_found < cfg.n_clusters:
        warnings.warn(
            f"only {n_found} of n_clusters={cfg.n_clusters} clusters have points: P has too "
            "few distinct rows for that many clusters.",
            RuntimeWarning,
            stacklevel=3,
        )
    return KMeansResult(
        cluster_centers=best.centers,
        labels=labels,
        inertia=best.inertia,
        n_iter=best.n_iter,
        n_steps_total=runs.n_steps_total,
        inertias=runs.inertias,
        stop_reason=best.stop,
        info=info,
    )


# --------------------------------------------------------------------------- validation


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


# --------------------------------------------------------------------------- public API


def kmeans(
    P,
    n_clusters: int,
    *,
    algorithm: str = "minibatch-lloyd",
    init: str | np.ndarray = "k-means||",
    batch_size: int = 1024,
    n_init: int = 5,
    max_iter: int = 100,
    tol: float = 1e-4,
    max_no_improvement: int | None = 10,
    init_size: int | None = None,
    random_state: int | np.random.Generator | None = None,
    client=None,
    progress: Callable[[KMeansProgress], None] | None = None,
    checkpoint: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    storage_options: dict | None = None,
    persist: bool = True,
) -> KMeansResult:
    """K-means on the rows of P, in memory or on a dask cluster.

    Each run starts from k-means++ on a seeded sample of ``init_size`` rows
    (drawn by global row index; only those rows are fetched) or from
    k-means|| over all of P, then

    * ``algorithm="minibatch-lloyd"`` (the default): the mini-batch steps
      below, then full-batch Lloyd iterations from where they stopped, until
      no label changes or an iteration lowers the inertia by at most ``tol``
      times itself.  The mini-batch phase is cheap (it reads sampled rows
      only) and leaves few Lloyd passes to do; the Lloyd phase reaches
      Lloyd's fixed point, which mini-batch alone stops short of.
    * ``algorithm="minibatch"`` (Sculley 2010, as scikit-learn's
      ``MiniBatchKMeans``): each step draws ``batch_size`` row indices with
      replacement, fetches those rows, assigns them to the nearest centre and
      moves each centre ``j`` to ``(c_j v_j + S_j) / (v_j + n_j)``, where
      ``v_j`` counts the points it has received so far and ``n_j``, ``S_j``
      are the count and sum of its batch points.  The rows of several future
      steps are fetched in one request (about 64k rows).  A centre whose
      count stays below ``1e-3`` times the largest (or at zero) is re-seeded
      at a batch point drawn with probability proportional to the point's
      squared distance to its centre.
    * ``algorithm="lloyd"``: full-batch Lloyd, one pass over P per iteration,
      from the initial centres.

    In Lloyd iterations an empty cluster takes the point farthest from its
    centre (found from each chunk's few farthest points); a centre is never
    set to zero.  Each Lloyd iteration is one distributed pass: the chunks
    return per-centre sums and counts, no row of P moves.

    The run with the lowest inertia, measured by a full pass over P, is kept,
    together with that pass's labels.  The result depends on ``random_state``
    only: not on the number of workers nor on the chunking of P (up to
    rounding in Lloyd's sums).

    Parameters
    ----------
    P : ndarray or dask array of shape (n_samples, n_features)
        The rows to cluster.  A dask array is used chunked by rows (column
        blocks are merged first); its chunks are computed once into worker
        memory and never gathered: the driver only receives sampled rows and
        per-chunk summaries.
    n_clusters : int
        Number of clusters ``k``, at most the number of distinct rows of P
        (checked by a cheap pass that stops once ``k`` are found).
    algorithm : {"minibatch-lloyd", "minibatch", "lloyd"}, default="minibatch-lloyd"
        See above.  Cost per run: mini-batch reads ``max_iter * batch_size``
        sampled rows at most; each Lloyd iteration is a pass over P (one
        matrix product of ``n_samples * n_features * n_clusters``).
    init : {"k-means||", "k-means++"} or ndarray of shape (n_clusters, n_features), \
default="k-means||"
        Initial centres.  ``"k-means++"``: k-means++ with local trials on the
        init sample.  ``"k-means||"`` (Bahmani et al. 2012): 5 rounds, each
        one pass over P, draw about ``2 * n_clusters`` candidates per round
        from all rows with probability proportional to their squared distance
        to the candidates so far; the candidates, weighted by the rows
        nearest to them, are clustered on the driver by weighted k-means++.
        It finds small clusters that a sample of P misses, at the cost of
        6 passes over P, which all runs share (each run draws its own
        candidates; the passes update every run's distances at once).  With
        an array, there is a single run
        (``n_init`` is not used); the init sample is still drawn to scale
        ``tol``.
    batch_size : int, default=1024
        Rows per mini-batch step (at most ``n_samples``).  Also sets the
        default ``init_size``.
    n_init : int, default=5
        Number of runs, each from its own initialisation; the lowest inertia
        wins.  Five runs of the default find the optimum that scikit-learn's
        ``KMeans(n_init=10)`` finds on every case of the quality benchmark;
        three miss it on one case in 60.
    max_iter : int, default=100
        Largest number of mini-batch *steps* (batches, not epochs as in
        scikit-learn's ``MiniBatchKMeans``) and of Lloyd *iterations* (passes
        over P) per run; ``"minibatch-lloyd"`` caps each phase.
    tol : float, default=1e-4
        Mini-batch steps, and ``"lloyd"``: stop when the sum of the squared
        movements of the centres in a step is ``<= tol * v``, where ``v`` is
        the mean variance of the features on the init sample (as
        scikit-learn's ``KMeans``; relative, so rescaling P does not change
        the result).  Mini-batch ignores it at 0.  The Lloyd phase of
        ``"minibatch-lloyd"``: stop when an iteration lowers the inertia by
        at most ``tol`` times the inertia.  Every Lloyd iteration stops the
        run when no label changes (``tol=0``: only then).
    max_no_improvement : int or None, default=10
        Mini-batch only: stop when the exponentially weighted batch inertia
        has not improved for this many consecutive steps (None: never).
    init_size : int, optional
        Rows sampled for k-means++ and for the variance that scales ``tol``.
        Default ``max(3 * batch_size, 10 * n_clusters)``; at most
        ``n_samples``.
    random_state : int, numpy Generator or None
        Seed of every random choice (samples, batches, re-seeding), all drawn
        on the driver.
    client : distributed.Client or str, optional
        Cluster for a dask P (default: the current client).  Unused for numpy.
    progress : callable, optional
        Called with a :class:`KMeansProgress` after each step or iteration.
    checkpoint : str, optional
        Zarr group (local path or fsspec URL) where the fit commits its state
        every ``checkpoint_every`` steps of a run and after each run: the
        run, its step, centres and counts, the generators' states, the
        stopping counters, and the best run so far.  A driver that crashes
        resumes from it with ``resume=True`` and ends with exactly the
        centres, labels and inertia of an uninterrupted fit.  Creating it
        fingerprints P (one digest per row chunk, computed where the chunk is).
    checkpoint_every : int, optional
        Mini-batch steps or Lloyd iterations between commits within a run;
        default 100 steps and 5 iterations.
    resume : bool, default=False
        Continue the checkpoint at ``checkpoint`` (start it if there is none).
        A checkpoint that holds a finished fit gives its result with no step
        run, after one assignment pass for the labels.
    overwrite : bool, default=False
        Replace an existing dkicf k-means checkpoint (never anything that
        dkicf did not create).
    storage_options : dict, optional
        fsspec options (credentials, endpoint) of ``checkpoint``.
    persist : bool, default=True
        Dask P only: compute P's chunks once into worker memory (the
        fastest).  ``False`` reads each chunk from P's source (for example
        the Zarr array of a factorization run with ``p_store=``) in every task
        that needs it, so that a P larger than the cluster's memory is never
        held, at the cost of a read of P per pass and per batch of
        mini-batch steps fetched.  The result is the same.  ``True`` with a P
        larger than the memory of the cluster's workers raises ValueError
        before any task runs.

    Returns
    -------
    KMeansResult

    Raises
    ------
    ValueError
        For an invalid parameter (the message names it and its value) or a
        P holding NaN or infinity.
    dkicf.errors.CheckpointMismatchError
        When resuming a checkpoint written for other data or parameters; the
        message names each difference.
    FileExistsError
        When ``checkpoint`` holds something else than a dkicf k-means
        checkpoint, or one exists and neither ``resume`` nor ``overwrite`` is set.
    dkicf.errors.WorkerFailureError
        When a task killed every worker that ran it (the scheduler's
        ``allowed-failures``); the message names the run and the step or pass
        and, with ``checkpoint``, the last commit, which ``resume=True``
        continues.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kmeans import kmeans
    >>> rng = np.random.default_rng(0)
    >>> P = np.concatenate([rng.normal(c, 0.1, size=(100, 2)) for c in (0.0, 5.0)])
    >>> res = kmeans(P, 2, random_state=0)
    >>> res.cluster_centers.shape
    (2, 2)
    >>> np.bincount(res.labels).tolist()
    [100, 100]

    On a cluster, with P a dask array chunked by rows, the labels stay
    distributed:

    >>> import dask.array as da  # doctest: +SKIP
    >>> from dkicf import local_cluster  # doctest: +SKIP
    >>> client = local_cluster(2)  # doctest: +SKIP
    >>> res = kmeans(da.from_array(P, chunks=(50, 2)), 2, random_state=0)  # doctest: +SKIP
    >>> res.labels.chunks  # doctest: +SKIP
    ((50, 50, 50, 50),)
    """
    P = check_array_2d(P, "P")
    n, s = P.shape
    cfg = _check_config(
        n, s, n_clusters, algorithm, init, batch_size, n_init, max_iter, tol,
        max_no_improvement, init_size, progress,
    )
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}.")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=, the location to resume from.")
    if checkpoint_every is None:
        checkpoint_every = dict(_CHECKPOINT_EVERY)
    else:
        every = check_positive_int(checkpoint_every, "checkpoint_every")
        checkpoint_every = {"minibatch": every, "lloyd": every}
    if not isinstance(persist, bool):
        raise TypeError(f"persist must be True or False, got {persist!r}.")
    seeds = np.random.default_rng(random_state).integers(np.iinfo(np.int64).max,
                                                         size=cfg.n_init)
    backend = _backend(P, client, persist)
    pos, ckpt = _Position(cfg.n_init), None
    try:
        if checkpoint is not None:
            ckpt = _open_checkpoint(
                backend, P, cfg, _seed_fingerprint(random_state, seeds), checkpoint,
                checkpoint_every, resume, overwrite, storage_options,
            )
        return _fit(backend, cfg, seeds, progress, ckpt, pos)
    except worker_failure_types() as exc:
        err = _worker_failure(exc, pos, cfg.algorithm, ckpt, checkpoint)
        # The error must not keep the failed fit's futures alive (its
        # traceback keeps its lines, not its frames' variables, nor the best
        # run's labels): their erred tasks, P's chunks among them when they
        # were lost with the dying workers, are released, and a resume in this
        # session computes them again instead of failing on their errors.
        traceback.clear_frames(exc.__traceback__)
        ckpt = None
        raise err from exc
    finally:
        backend.close()


def assign(P, centers, *, client=None) -> tuple[Any, float]:
    """Nearest centre of every row of P and the inertia: one full pass.

    Parameters
    ----------
    P : ndarray or dask array of shape (n_samples, n_features)
        As in :func:`kmeans`.
    centers : array-like of shape (n_clusters, n_features)
    client : distributed.Client or str, optional
        Cluster for a dask P (default: the current client).

    Returns
    -------
    labels : ndarray or dask array of shape (n_samples,)
        int64; a dask array chunked like P's rows for a dask P.
    inertia : float
        Sum of the squared distances of the rows to their nearest centre.

    Raises
    ------
    dkicf.errors.WorkerFailureError
        If a task of the pass killed every worker that ran it.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kmeans import assign
    >>> labels, inertia = assign(np.array([[0.0], [1.0], [10.0]]), np.array([[0.0], [10.0]]))
    >>> labels.tolist(), inertia
    ([0, 0, 1], 1.0)
    """
    P = check_array_2d(P, "P")
    centers = _check_centers(centers, None, P.shape[1], "centers")
    backend = _backend(P, client)
    try:
        labels, inertia, _ = _full_pass(backend, centers)
    except worker_failure_types() as exc:
        raise worker_failure(
            exc, "labelling", 0, where="the pass that labels the rows",
            resume_hint="Nothing is saved by this pass: call it again once the cause is fixed.",
        ) from exc
    finally:
        backend.close()
    return labels, inertia
