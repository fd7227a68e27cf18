"""The k-means' driver: initialisation, mini-batch and Lloyd phases, restarts, checkpoints.

Every random choice is made here, on the driver, and addresses rows by
global index; the backends of :mod:`dkicf._kmeans_tasks` only read P.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ._commit import StateCheckpoint
from ._kmeans_config import KMeansProgress, KMeansResult, _Config
from ._kmeans_rows import _check_finite, _rows_in_new_buffer
from ._kmeans_tasks import _cluster_sums, _nearest
from ._memory import KMEANS_FETCH_BYTES, KMEANS_FETCH_ROWS, kmeans_fetch_rows
from ._services import chunk_digest, mapped_empty
from .errors import CheckpointMismatchError, worker_failure

logger = logging.getLogger("dkicf.kmeans")

# Mini-batch: a centre whose count is below this fraction of the largest count
# is starved (it sits where almost no data is) and is re-seeded.
_REASSIGNMENT_RATIO = 1e-3


# Mini-batch prefetch: rows of as many future steps as fit in this budget
# (the memory plan counts one such fetch on the workers).
_PREFETCH_ROWS = KMEANS_FETCH_ROWS
_PREFETCH_BYTES = KMEANS_FETCH_BYTES


# A remote P: the first fetch of as many runs as fit in this budget is brought
# while k-means|| runs (the driver waits on the workers then).
_AHEAD_BYTES = 5 * _PREFETCH_BYTES


# Restarts whose inertias differ by less than this (relative) are a tie, won by
# the earlier one: rounding differences between chunkings never pick the run.
_TIE_RTOL = 1e-12


# Default steps between checkpoint commits: a commit costs a few small writes,
# about what a mini-batch step costs; a Lloyd iteration is a pass over P.
_CHECKPOINT_EVERY = {"minibatch": 100, "lloyd": 5}


# k-means||: rounds of oversampling, and candidates drawn per round per cluster.
_PARALLEL_ROUNDS = 3


_PARALLEL_OVERSAMPLING = 2


@dataclass
class _Position:
    """Where the fit is, for the error that reports a task killing its workers.

    The drivers update it before each request to the workers: ``phase`` is
    ``"fingerprint"`` (of P, for the checkpoint), ``"init"``, ``"minibatch"``,
    ``"lloyd"`` (a shared Lloyd pass of the ``runs``) or ``"labels"`` (the
    labels of the run ``restart``, and a measure of the final centres of
    the other ``runs``); ``fetch`` is the range of mini-batch steps whose
    rows are being fetched.
    """

    n_init: int
    phase: str = "fingerprint"
    restart: int = 0
    step: int = 0
    fetch: tuple[int, int] | None = None
    runs: list[int] | None = None

    def at(self, phase: str, step: int = 0, fetch: tuple[int, int] | None = None) -> None:
        self.phase, self.step, self.fetch = phase, step, fetch

    def __str__(self) -> str:
        run = f"run {self.restart + 1}/{self.n_init}"
        if self.runs is not None:
            run = (f"run {self.runs[0] + 1}/{self.n_init}" if len(self.runs) == 1 else
                   f"runs {', '.join(str(r + 1) for r in self.runs)} of {self.n_init}")
        if self.phase == "fingerprint":
            return "the fingerprint of P for the checkpoint, before the first run"
        if self.phase == "labels" and self.runs is not None and len(self.runs) > 1:
            return (f"the pass that labels the rows for run {self.restart + 1}/{self.n_init} "
                    f"and measures the final centres of {run}")
        if self.phase == "labels":
            return f"the assignment pass for the labels of the best run ({run})"
        if self.phase == "init":
            return f"{run}, initialisation"
        if self.phase == "lloyd":
            return f"{run}, Lloyd iteration {self.step}"
        where = f"{run}, mini-batch step {self.step}"
        if self.fetch is not None:
            lo, hi = self.fetch
            steps = f"steps {lo}-{hi}" if hi > lo else f"step {lo}"
            where += f" (fetching the rows of {steps})"
        return where


def _init_samples(backend, cfg: _Config, rngs: list) -> list:
    """Each run's seeded sample of rows (drawn with its own ``rngs[r]``), in one fetch.

    The sample is drawn by global row index, so it is the same rows whatever
    the chunking and whichever runs share the fetch; only those rows travel.
    """
    indices = [np.sort(rng.choice(backend.n, size=cfg.init_size, replace=False))
               for rng in rngs]
    if not indices:
        return []
    rows = backend.rows(np.concatenate(indices))
    if not backend.checked:
        _check_finite(rows, np.concatenate(indices))
    return np.split(rows, np.cumsum([i.shape[0] for i in indices])[:-1])


def _initial_centers(cfg: _Config, rng: np.random.Generator, sample, candidates):
    """Initial centres, and the mean feature variance of the run's ``sample`` of rows.

    k-means++ runs on the sample; k-means|| reclusters the run's weighted
    ``candidates()`` and uses the sample only for the variance, which
    scales ``tol``.  ``rng`` is the generator that drew the sample.
    """
    variance = float(np.mean(np.var(sample, axis=0)))
    if not isinstance(cfg.init, str):
        return cfg.init.copy(), variance
    seed = int(rng.integers(2**31 - 1))
    if cfg.init == "k-means++":
        from sklearn.cluster import kmeans_plusplus

        centers, _ = kmeans_plusplus(sample, cfg.n_clusters, random_state=seed)
        return np.asarray(centers, dtype=np.float64), variance
    cands, weights = candidates()
    # Imported once the candidates are asked for: the first import in a process
    # takes 1-2 s, which k-means|| overlaps with its passes (_import_reclustering).
    from sklearn.cluster import KMeans, kmeans_plusplus

    # One weighted k-means++ start and Lloyd on the candidates: more starts
    # there find the candidates' own optimum, which every run then shares
    # (on the rings, the wrong basin); the runs' diversity matters more.
    centers, _ = kmeans_plusplus(cands, cfg.n_clusters, sample_weight=weights,
                                 random_state=seed)
    centers = KMeans(cfg.n_clusters, init=centers, n_init=1, random_state=seed).fit(
        cands, sample_weight=weights).cluster_centers_
    return np.asarray(centers, dtype=np.float64), variance


def _import_reclustering() -> None:
    """Import what reclusters the candidates (scikit-learn's k-means, 1-2 s the first time
    in a process), while the workers draw them."""
    import sklearn.cluster  # noqa: F401


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
    first = np.array([rng.integers(backend.n) for rng in rngs])
    keys = [[int(rng.integers(np.iinfo(np.int64).max)) for rng in rngs]
            for _ in range(_PARALLEL_ROUNDS)]
    cands, counts = backend.parallel_candidates(first, ell, keys, meanwhile=_import_reclustering)
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


def _overflow_error(inertia: float) -> ValueError:
    """The error for squared distances past float64 (P's values about 1e154 or more)."""
    return ValueError(
        f"the k-means' squared distances overflow float64 (inertia {inertia}): P's values "
        "are too large (about 1e154 or more).  Divide P by a constant, which leaves the "
        "clustering the same, and run it again.")


def _minibatch_step(x, centers, counts, rng, reseed: bool):
    """One mini-batch step: new centres (counts updated in place) and the batch inertia."""
    k = centers.shape[0]
    labels, d2 = _nearest(x, centers, np.einsum("ij,ij->i", centers, centers))
    batch_inertia = float(d2.sum())
    if not math.isfinite(batch_inertia):
        raise _overflow_error(batch_inertia)
    n_j = np.bincount(labels, minlength=k)
    hit = n_j > 0
    total = counts[hit] + n_j[hit]
    new = centers.copy()
    sums = _cluster_sums(x, labels, k)
    new[hit] = (centers[hit] * counts[hit, None] + sums[hit]) / total[:, None]
    counts[hit] = total
    if reseed:
        _reseed_starved(new, counts, x, d2, rng)
    return new, batch_inertia


def _batches_per_fetch(cfg: _Config, s: int) -> int:
    """Mini-batch steps whose rows one fetch brings (within the prefetch budget)."""
    return max(1, kmeans_fetch_rows(s, _PREFETCH_ROWS, _PREFETCH_BYTES) // cfg.batch_size)


class _FirstFetches:
    """The rows of each run's first mini-batch fetch, brought by a thread of the driver
    while the k-means|| passes run (a remote P only; within :data:`_AHEAD_BYTES`).

    They depend on the run's seed only: the batches are drawn here, from the
    run's own stream, as :func:`_run_minibatch` would draw them, and the
    run continues the stream where they leave it.  A fetch that failed
    raises when its run takes it.
    """

    def __init__(self, backend, cfg: _Config, streams: dict, restarts):
        from concurrent.futures import ThreadPoolExecutor

        self.ahead, self.pool = {}, None
        if not getattr(backend, "remote", False) or cfg.algorithm == "lloyd":
            return
        per = _batches_per_fetch(cfg, backend.s)
        m, b = min(per, cfg.max_iter), cfg.batch_size
        count = min(len(restarts), _AHEAD_BYTES // max(1, 8 * per * b * backend.s))
        if count < 1:
            return
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dkicf-batches")
        for restart in list(restarts)[:count]:
            rng = np.random.default_rng(streams[restart][1])
            fetch = {"step": 1, "m": m, "rng": rng.bit_generator.state}
            index = _draw_batches(rng, backend.n, m, b)
            job = self.pool.submit(_rows_in_new_buffer, backend, index, m * b)
            self.ahead[restart] = (fetch, rng.bit_generator.state, index, job)

    def take(self, restart: int):
        """``(fetch, rng state after it, index, future of (its rows, their buffer))``, or
        None."""
        return self.ahead.pop(restart, None)

    def close(self) -> None:
        """Drop the fetches not taken (a fit that failed or stopped)."""
        self.ahead.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def _draw_batches(batch_rng, n: int, m: int, b: int) -> np.ndarray:
    """The row indices of ``m`` batches of ``b``: one draw per step."""
    return np.concatenate([batch_rng.integers(0, n, size=b) for _ in range(m)])


def _fetch_batches(backend, batch_rng, m: int, b: int, skip: int = 0,
                   out: np.ndarray | None = None) -> deque:
    """Draw the row indices of ``m`` batches; fetch the rows of all but the first ``skip``.

    One draw per step, so the batches do not depend on how many are fetched
    at once; a resumed run redraws a whole fetch to leave the generator where
    the uninterrupted run left it, and fetches only the batches still to come.
    ``out``: rows for at least the fetch, reused from fetch to fetch (the
    batches returned are views of it, valid until the next fetch).
    """
    index = _draw_batches(batch_rng, backend.n, m, b)
    if skip >= m:
        return deque()
    index = index[skip * b:]
    return _batch_queue(backend.rows(index, None if out is None else out[:index.shape[0]]),
                        index, m - skip, not backend.checked)


def _batch_queue(rows: np.ndarray, index: np.ndarray, m: int, check: bool) -> deque:
    """The fetched ``rows`` (at ``index``) as a queue of ``m`` batches; ``check``: raise
    naming the first row that holds NaN or infinity (rows of a P not checked yet).

    Once a pass over P has checked every chunk (k-means|| does before the
    mini-batch steps), checking each fetch again would cost the driver a
    read of all its rows: 54 ms a run at s = 150, serial time.
    """
    if check:
        _check_finite(rows, index)
    return deque(np.split(rows, m))


def _run_minibatch(backend, centers, cfg: _Config, tol_abs, batch_rng, reseed_rng, report,
                   ckpt, saved, pos: _Position, ahead=None):
    n, s = backend.n, backend.s
    k, b = cfg.n_clusters, cfg.batch_size
    alpha = min(1.0, 2.0 * b / (n + 1))
    per_fetch = _batches_per_fetch(cfg, s)
    fetch, queue = None, deque()
    if saved is None and ahead is not None:  # the first fetch, brought ahead (_FirstFetches)
        fetch, state, index, job = ahead
        batch_rng.bit_generator.state = state
        pos.at("minibatch", 1, (1, fetch["m"]))
        rows, buffer = job.result()
        queue = _batch_queue(rows, index, fetch["m"], not backend.checked)
    else:
        # The rows of a fetch, in one array for all of them: each fetch's own array
        # (over 32 MiB, so mapped and faulted in afresh) cost as much as the transfer.
        # Its pages are faulted in at once, not one trap a page as the rows land.
        buffer = mapped_empty((min(per_fetch, cfg.max_iter) * b, s))
    if saved is None:
        first, counts = 1, np.zeros(k)
        ewa = ewa_min = None
        no_improvement = since_reseed = 0
    else:
        first, counts = saved["step"] + 1, np.array(saved["counts"], dtype=np.float64)
        ewa, ewa_min = saved["ewa"], saved["ewa_min"]
        no_improvement, since_reseed = saved["no_improvement"], saved["since_reseed"]
        fetch = saved["fetch"]
        batch_rng.bit_generator.state = fetch["rng"]
        pos.at("minibatch", first, (first, fetch["step"] + fetch["m"] - 1))
        queue = _fetch_batches(backend, batch_rng, fetch["m"], b, skip=first - fetch["step"],
                               out=buffer)
        reseed_rng.bit_generator.state = saved["reseed_rng"]
    stop = "max_iter"
    for step in range(first, cfg.max_iter + 1):
        if not queue:
            m = min(per_fetch, cfg.max_iter - step + 1)
            fetch = {"step": step, "m": m, "rng": batch_rng.bit_generator.state}
            pos.at("minibatch", step, (step, step + m - 1))
            queue = _fetch_batches(backend, batch_rng, m, b, out=buffer)
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
        stopping = None
        if step > 1:
            if cfg.tol > 0 and shift <= tol_abs:
                stopping = "tol"
            else:
                if ewa_min is None or ewa < ewa_min:
                    ewa_min, no_improvement = ewa, 0
                else:
                    no_improvement += 1
                if cfg.max_no_improvement is not None and (
                        no_improvement >= cfg.max_no_improvement):
                    stopping = "no_improvement"
        last = cfg.algorithm == "minibatch" and (stopping is not None or step == cfg.max_iter)
        report(step, n * (mean_inertia if ewa is None else ewa), shift, "minibatch", last)
        if stopping is not None:
            stop = stopping
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


def _lloyd_update(backend, run: _Run, parts: list, cfg: _Config, it: int, report) -> None:
    """Lloyd iteration ``it`` of one run, from its summaries of the pass (chunk order).

    Alone (``"lloyd"``), ``tol`` bounds the centres' movement as in
    scikit-learn's ``KMeans``.  After mini-batch steps, a run stops when no
    label changes or when a pass lowers the inertia by at most ``tol``
    times itself.  A run whose last pass left its centres where they were
    (no label changed) has its final inertia and counts from that pass.
    """
    k, s = run.centers.shape
    sums = np.zeros((k, s))
    counts = np.zeros(k, dtype=np.int64)
    for part in parts:  # chunk order, whatever worker answered first
        sums += part["sums"]
        counts += part["counts"]
    relocated = bool((counts == 0).any())
    if relocated:
        _relocate_empty(backend, sums, counts, parts, k)
    new = run.centers.copy()
    full = counts > 0
    new[full] = sums[full] / counts[full, None]
    shift = float(np.sum((new - run.centers) ** 2))
    inertia = math.fsum(p["inertia"] for p in parts)
    run.centers, run.n_iter = new, run.n_iter + 1
    if shift == 0.0:  # the same labels as the pass before: Lloyd's fixed point
        run.stop = "converged"
        if not relocated:  # this pass measured the final centres
            run.inertia, run.counts = inertia, counts
    elif cfg.algorithm != "lloyd":
        if run.previous is not None and run.previous - inertia <= cfg.tol * inertia:
            run.stop = "tol"
    elif shift <= run.tol_abs:
        run.stop = "tol"
    if run.stop is None and it >= cfg.max_iter:
        run.stop = "max_iter"
    run.previous = inertia
    report(it, inertia, shift, "lloyd", run.stop is not None)


def _same_centers(centers: list) -> list[tuple[int, np.ndarray | None]]:
    """For each set of centres, the first one equal to it bit for bit, in any order.

    Returns ``(j, order)`` per set ``i``: ``centers[i][a]`` is ``centers[j][order[a]]``
    (``order`` None where ``j == i``).  A set with a repeated centre or a
    NaN is its own (a row's tie between two centres could go either way).
    Rows at the same distance from two distinct centres go to the first
    in each run's own order: where a pass finds such a tie, the runs that
    hold those centres in another order are computed apart
    (:func:`_order_matters`).
    """
    first: dict[bytes, tuple[int, np.ndarray]] = {}
    out = []
    for i, c in enumerate(centers):
        idx = np.lexsort(c.T[::-1])
        rows = np.ascontiguousarray(c[idx])
        unique = np.isfinite(rows).all() and not (rows[1:] == rows[:-1]).all(axis=1).any()
        key = rows.tobytes() if unique else None
        if key is None or key not in first:
            if key is not None:
                first[key] = (i, idx)
            out.append((i, None))
            continue
        j, idx_j = first[key]
        order = np.empty_like(idx)
        order[idx] = idx_j
        out.append((j, order))
    return out


def _slots(same: list) -> dict[int, int]:
    """Of :func:`_same_centers`'s answer: each distinct set's place among the distinct sets
    (those computed), by its index among all."""
    distinct = [j for j, (first, _) in enumerate(same) if first == j]
    return {j: place for place, j in enumerate(distinct)}


def _order_matters(same: list, slot: dict, tied: list) -> list[int]:
    """The sets that :func:`_same_centers` gave another set's results in another order,
    where that set had a row at two of its centres (``tied``, by place among the
    distinct sets): their labels, so their sums and counts, are their own, computed
    apart."""
    return [j for j, (first, order) in enumerate(same) if order is not None
            and tied[slot[first]] and (order != np.arange(order.size)).any()]


def _reordered(summary: dict, order: np.ndarray) -> dict:
    """A run's summary of a chunk (:func:`~dkicf._kmeans_tasks._lloyd_summary`) for the
    same centres in another order: centre ``a`` is the summary's ``order[a]``."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return {**summary, "sums": summary["sums"][order], "counts": summary["counts"][order],
            "far_label": inverse[summary["far_label"]]}


def _shared_passes(backend, cfg: _Config, runs: _Runs, report, ckpt, pos: _Position) -> None:
    """The Lloyd iterations of every run in the same passes over P, then their measurement.

    Each pass reads P once for all the runs still iterating (one matrix
    product for all their centres: a run's distances are what they would be
    alone up to rounding, its sums add the same rows in the same order)
    and for the runs that stopped without a measure of their final centres,
    whose inertia and counts that pass gives.  Runs holding the same centres
    (restarts that reached the same partition) are computed once, and each
    takes the summaries in its own centres' order; each still applies its
    own stopping rule.  Where a row lies at the same distance from two of
    those centres, its label depends on their order (the first wins): the
    runs that hold them in another order are then computed again, in a
    pass of their own.  A run that stops leaves the passes; they end when
    every run has stopped, and the labels pass measures the runs still
    unmeasured (:func:`_measure_and_label`).
    """
    k = cfg.n_clusters
    while True:
        group = [i for i, run in enumerate(runs.runs) if run.stop is None or run.inertia is None]
        moving = [i for i in group if runs.runs[i].stop is None]
        if not moving:
            return  # what is left to measure, the labels pass measures (_measure_and_label)
        it = runs.lloyd + 1
        pos.at("lloyd", it)
        pos.runs = group
        same = _same_centers([runs.runs[i].centers for i in group])
        slot = _slots(same)
        parts = backend.lloyd_pass([runs.runs[group[j]].centers for j in slot], k)
        tied = [any(part[place]["tied"] for part in parts) for place in range(len(slot))]
        apart = _order_matters(same, slot, tied)
        again = backend.lloyd_pass([runs.runs[group[j]].centers for j in apart], k) \
            if apart else []
        alone = {j: [part[m] for part in again] for m, j in enumerate(apart)}
        for j, i in enumerate(group):
            first, order = same[j]
            if j in alone:
                own = alone[j]
            else:
                own = [part[slot[first]] for part in parts]
                if order is not None:
                    own = [_reordered(summary, order) for summary in own]
            run = runs.runs[i]
            if run.stop is None:
                _lloyd_update(backend, run, own, cfg, it, lambda *a, i=i: report(i, *a))
            else:
                run.inertia = math.fsum(p["inertia"] for p in own)
                run.counts = np.sum([p["counts"] for p in own], axis=0, dtype=np.int64)
        runs.lloyd = it
        if ckpt is not None and ckpt.due(it, cfg.max_iter, "lloyd"):
            ckpt.save()


def _full_pass(backend, centers: list, tied: list | None = None):
    """The labels of all rows to the first set of centres, and each set's inertia and
    per-centre counts (chunk results reduced in order), in one pass.

    ``tied``, if given, receives for each set whether some row has two of its
    centres at its minimum (see :func:`~dkicf._kmeans_tasks._chunk_assign`).
    """
    labels, stats = backend.full_pass(centers)
    inertias, counts = [], []
    for j, c in enumerate(centers):
        inertias.append(math.fsum(st[j]["inertia"] for st in stats))
        total = np.zeros(c.shape[0], dtype=np.int64)
        for st in stats:
            total += st[j]["counts"]
        counts.append(total)
        if tied is not None:
            tied.append(any(st[j]["tied"] for st in stats))
    return labels, inertias, counts


def _measure_and_label(backend, runs: _Runs, pos: _Position):
    """The final centres of the runs not measured yet, measured in the pass that labels
    the rows for the likely best run; the labels of the best run.

    The likely best is the lowest inertia so far (a run's measured one, else
    that of its last Lloyd pass, which its final centres do not exceed by
    more than rounding), ties to the earlier run.  Only when a run that
    pass measures turns out better are the labels computed again, in a
    pass of their own.
    """
    def so_far(i):
        run = runs.runs[i]
        value = run.inertia if run.inertia is not None else run.previous
        return math.inf if value is None else value

    guess = min(range(len(runs.runs)), key=so_far)
    todo = [i for i, run in enumerate(runs.runs) if run.inertia is None and i != guess]
    sets = [guess] + todo
    same = _same_centers([runs.runs[i].centers for i in sets])
    slot = _slots(same)
    pos.restart, pos.runs = guess, sorted(sets[j] for j in slot)
    pos.at("labels", runs.runs[guess].n_iter)
    tied = []
    labels, inertias, counts = _full_pass(backend, [runs.runs[sets[j]].centers for j in slot],
                                          tied)
    # Their counts are their own; a tie leaves every row's distance, so the inertia stands.
    apart = [j for j in _order_matters(same, slot, tied) if runs.runs[sets[j]].inertia is None]
    alone = dict(zip(apart, _full_pass(backend, [runs.runs[sets[j]].centers
                                                 for j in apart])[2])) if apart else {}
    for j, i in enumerate(sets):
        run, (first, order) = runs.runs[i], same[j]
        if run.inertia is None:
            run.inertia = inertias[slot[first]]
            run.counts = alone[j] if j in alone else (
                counts[slot[first]] if order is None else counts[slot[first]][order])
    best = runs.pick_best()
    return labels if best.restart == guess else None


@dataclass
class _Run:
    """One restart: its centres and where it stands, as a commit records it."""

    centers: np.ndarray
    tol_abs: float
    n_iter: int = 0  # mini-batch steps and Lloyd iterations so far
    previous: float | None = None  # inertia of its last Lloyd pass
    stop: str | None = None  # why its last phase stopped; None while it iterates
    inertia: float | None = None  # full-pass inertia of its final centres, once measured
    counts: np.ndarray | None = None

    def state(self) -> dict:
        return {"tol_abs": self.tol_abs, "n_iter": self.n_iter, "previous": self.previous,
                "stop": self.stop, "inertia": self.inertia}


@dataclass
class _Best:
    """The kept run: the lowest full-pass inertia, ties to the earlier run."""

    centers: np.ndarray
    counts: np.ndarray
    inertia: float
    n_iter: int
    stop: str
    restart: int


@dataclass
class _Runs:
    """Where the fit stands: the runs through their first phase, the shared Lloyd passes."""

    seeds: list[int]
    restart: int = 0  # runs whose initialisation and mini-batch phase are done
    runs: list[_Run] = field(default_factory=list)
    lloyd: int = 0  # Lloyd iterations of the shared passes so far
    best: _Best | None = None

    @property
    def n_steps_total(self) -> int:
        return sum(run.n_iter for run in self.runs)

    def pick_best(self) -> _Best:
        best = None
        for r, run in enumerate(self.runs):
            if best is None or run.inertia < best.inertia * (1 - _TIE_RTOL):
                best = _Best(run.centers, run.counts, run.inertia, run.n_iter, run.stop, r)
        self.best = best
        return best


# Layout of the commits' state; a commit of another layout is refused on resume.
_LAYOUT = 2


class _Checkpointer:
    """The commits of one k-means fit.

    A commit holds the seeds, every run that finished its first phase (its
    centres, counts and stopping state), the shared Lloyd iterations so
    far and, in the middle of a run's mini-batch phase, that run's own
    state: step, centres, counts, the generators' states and the stopping
    counters.  Commits come every ``every`` steps of a mini-batch phase,
    after each run's first phase, every ``every`` shared Lloyd iterations,
    and at the end (with the kept run).
    """

    def __init__(self, store, every: dict):
        self.store, self.every = store, every
        self.runs: _Runs | None = None

    @property
    def url(self) -> str:
        return self.store.url

    def due(self, step: int, max_iter: int, phase: str) -> bool:
        """Whether to commit after ``step`` of ``phase`` (never after its last: the run's
        end, or the next phase, commits)."""
        return step % self.every[phase] == 0 and step < max_iter

    def save(self, step: int = 0, arrays: dict | None = None, run: dict | None = None,
             finished: bool = False) -> None:
        """Commit the runs so far and, with ``run``, the state of the current run at ``step``."""
        runs = self.runs
        arrays = dict(arrays or {})
        if runs.runs:
            arrays["runs_centers"] = np.stack([r.centers for r in runs.runs])
            k = runs.runs[0].centers.shape[0]
            arrays["runs_counts"] = np.stack([
                np.zeros(k, dtype=np.int64) if r.counts is None else r.counts
                for r in runs.runs])
        best = runs.best
        state = {
            "layout": _LAYOUT, "seeds": runs.seeds, "restart": runs.restart,
            "lloyd": runs.lloyd, "runs": [r.state() for r in runs.runs], "run": run,
            "best": None if best is None else {
                "inertia": best.inertia, "n_iter": best.n_iter, "stop": best.stop,
                "restart": best.restart,
            },
        }
        self.store.save(runs.n_steps_total + step, arrays, state, finished=finished)

    def restore(self, runs: _Runs) -> tuple[dict | None, dict]:
        """Load the last commit into ``runs`` and keep them to commit later.

        Returns the state of the run the commit interrupted (None at a run
        boundary or in the shared Lloyd passes) and what the result's
        ``info`` records.
        """
        self.runs = runs
        loaded = self.store.load()
        info = {"checkpoint": self.url, "resumed_from": None, "already_finished": False}
        if loaded is None:
            logger.info("no k-means commit at %s yet: starting from the first run", self.url)
            return None, info
        _, arrays, state = loaded
        if state.get("layout") != _LAYOUT:
            raise CheckpointMismatchError(
                f"the k-means checkpoint at {self.url!r} was written by an earlier version of "
                "dkicf, whose commits this one cannot continue: pass overwrite=True (dkicf "
                "fit: --overwrite) to start the k-means again there."
            )
        runs.seeds = [int(v) for v in state["seeds"]]
        runs.restart, runs.lloyd = state["restart"], state["lloyd"]
        for r, saved in enumerate(state["runs"]):
            run = _Run(centers=arrays["runs_centers"][r], tol_abs=saved["tol_abs"],
                       n_iter=saved["n_iter"], previous=saved["previous"], stop=saved["stop"],
                       inertia=saved["inertia"])
            if run.inertia is not None:
                run.counts = arrays["runs_counts"][r]
            runs.runs.append(run)
        run = state["run"]
        shared = runs.restart == len(runs.seeds)  # every run is through its first phase
        step = run["step"] if run is not None else runs.lloyd if shared else 0
        info["resumed_from"] = {"restart": runs.restart, "step": step}
        if self.store.finished:
            info["already_finished"] = True
            runs.pick_best()
            logger.info(
                "the k-means checkpoint at %s holds a finished fit (%d runs, best inertia "
                "%.6e); nothing to do but one assignment pass for the labels",
                self.url, len(runs.seeds), runs.best.inertia,
            )
            return None, info
        if shared:
            logger.info("resuming k-means from %s: the runs' shared Lloyd iteration %d",
                        self.url, step)
        else:
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


def _worker_failure(exc: BaseException, pos: _Position, ckpt: _Checkpointer | None,
                    url: str | None):
    """The :class:`~dkicf.errors.WorkerFailureError` of a k-means task that killed its workers.

    It names the run and the step (or the shared pass) and, with a
    checkpoint, its last commit, from which ``resume=True`` continues.
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
        n_init = len(state["seeds"])
        if state["run"] is not None:
            at = f"at run {state['restart'] + 1}/{n_init}, mini-batch step {state['run']['step']}"
        elif state["restart"] < n_init:
            at = f"at the start of run {state['restart'] + 1}/{n_init}"
        elif state["lloyd"]:
            at = f"at Lloyd iteration {state['lloyd']} of the runs' shared passes"
        else:
            at = "before the runs' shared Lloyd passes"
        hint = (f"The last k-means checkpoint, {at}, is in {url!r}: {resume} to continue "
                "from it.")
    elif url is not None:
        hint = (f"No k-means checkpoint was committed yet in {url!r}: {resume} to use it, "
                "from the first run.")
    else:
        hint = ("Pass checkpoint= (dkicf fit: --checkpoint DIR) and resume=True after a "
                "failure (--resume) to be able to resume.")
    return worker_failure(exc, "k-means", pos.step, ckpt, where=str(pos), resume_hint=hint)


def _check_distinct(backend, k: int) -> None:
    """Refuse more clusters than P has distinct rows (some would stay empty)."""
    direction = np.random.default_rng(0).standard_normal(backend.s)
    found = np.unique(np.concatenate(backend.distinct(k, direction))).size
    if found < k:
        raise ValueError(
            f"n_clusters={k} is larger than the number of distinct rows of P ({found}): "
            f"pass n_clusters <= {found}."
        )


def _first_phases(backend, cfg: _Config, runs: _Runs, saved, report, ckpt,
                  pos: _Position) -> None:
    """Each run's initialisation and mini-batch phase, one run after the other.

    ``saved`` is the state of a run resumed in its middle.  The k-means||
    candidates of all the runs still to start are drawn in the same passes,
    and their init samples in one fetch.
    """
    pending = {}  # k-means|| candidates of the runs still to start, oversampled together

    def candidates(restart):
        if restart not in pending:
            todo = range(restart, cfg.n_init)
            found = _oversample(backend, cfg.n_clusters, [
                tuple(np.random.SeedSequence(runs.seeds[r]).spawn(5)[3:]) for r in todo
            ], pos)
            pending.update(zip(todo, found))
        return pending.pop(restart)

    streams = {r: np.random.SeedSequence(runs.seeds[r]).spawn(3)
               for r in range(runs.restart, cfg.n_init)}  # init, batches, re-seeding
    fresh = range(runs.restart + (saved is not None), cfg.n_init)
    init_rngs = {r: np.random.default_rng(streams[r][0]) for r in fresh}
    pos.at("init")
    samples = dict(zip(fresh, _init_samples(backend, cfg, [init_rngs[r] for r in fresh])))
    ahead = _FirstFetches(backend, cfg, streams, fresh)
    try:
        _each_run(backend, cfg, runs, saved, report, ckpt, pos, streams, init_rngs, samples,
                  candidates, ahead)
    finally:
        ahead.close()


def _each_run(backend, cfg: _Config, runs: _Runs, saved, report, ckpt, pos: _Position,
              streams: dict, init_rngs: dict, samples: dict, candidates, ahead) -> None:
    """The runs of :func:`_first_phases` one after the other: initial centres, mini-batch."""
    for restart in range(runs.restart, cfg.n_init):
        pos.restart, pos.runs = restart, None
        _, batch_ss, reseed_ss = streams[restart]
        if saved is None:
            pos.at("init")
            centers, variance = _initial_centers(
                cfg, init_rngs[restart], samples.pop(restart),
                lambda restart=restart: candidates(restart),
            )
            tol_abs = cfg.tol * variance
        else:  # resumed in the middle of this run
            centers, tol_abs = saved["centers"], saved["tol_abs"]
        run = _Run(centers=centers, tol_abs=tol_abs)
        if cfg.algorithm != "lloyd":
            run.centers, run.n_iter, stop = _run_minibatch(
                backend, centers, cfg, tol_abs, np.random.default_rng(batch_ss),
                np.random.default_rng(reseed_ss),
                lambda *a, restart=restart: report(restart, *a), ckpt, saved, pos,
                ahead=None if saved is not None else ahead.take(restart),
            )
            if cfg.algorithm == "minibatch":
                run.stop = stop
        saved = None
        runs.runs.append(run)
        runs.restart = restart + 1
        if ckpt is not None:
            ckpt.save()


def _fit(backend, cfg: _Config, seeds, progress, ckpt: _Checkpointer | None, pos: _Position):
    start = time.perf_counter()
    pos.at("init")
    _check_distinct(backend, cfg.n_clusters)
    runs = _Runs(seeds=[int(v) for v in seeds])
    saved, info = None, {}
    if ckpt is not None:
        saved, info = ckpt.restore(runs)

    def report(restart, step, inertia, shift, phase, done=False):
        if progress is not None:
            progress(
                KMeansProgress(
                    restart=restart, n_init=cfg.n_init, step=step, max_iter=cfg.max_iter,
                    inertia=float(inertia), center_shift=shift,
                    elapsed=time.perf_counter() - start, phase=phase, done=done,
                )
            )

    labels = None
    if runs.best is None:  # not a finished fit read back from its checkpoint
        _first_phases(backend, cfg, runs, saved, report, ckpt, pos)
        _shared_passes(backend, cfg, runs, report, ckpt, pos)
        labels = _measure_and_label(backend, runs, pos)
        for restart, run in enumerate(runs.runs):
            logger.info("k-means (%s) run %d/%d: %d steps, stop: %s, inertia %.6e",
                        cfg.algorithm, restart + 1, cfg.n_init, run.n_iter, run.stop,
                        run.inertia)
        if ckpt is not None:
            ckpt.save(finished=True)
    best = runs.best
    if not math.isfinite(best.inertia):
        raise _overflow_error(best.inertia)
    if labels is None:
        pos.restart, pos.runs = best.restart, None
        pos.at("labels", best.n_iter)
        labels, _, _ = _full_pass(backend, [best.centers])
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
        inertias=[run.inertia for run in runs.runs],
        stop_reason=best.stop,
        info=info,
    )
