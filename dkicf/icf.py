"""Incomplete Cholesky factorization of a kernel matrix (the paper's Algorithm 1).

The factorization is a driver loop.  Each iteration

1. asks every row chunk for a small summary (trace of its residual diagonal,
   its largest residual and where);
2. picks the pivot ``t = argmax e`` over the whole dataset (ties go to the
   lowest global row index) and fetches only row ``t`` of X and of P;
3. sends every chunk the pivot, so that each chunk computes its piece of the
   kernel column ``K[:, t]``, the new column of P and the residual update.

With a numpy array the dataset is one chunk in this process; with a dask array
each row chunk is a dask task on the workers of a ``distributed`` cluster, P
stays in those workers' memory in chunks, and the driver only ever holds
``O(s^2 + s d)`` numbers.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np

from . import pivoting as _pivoting
from ._backends import DaskBackend, FactorBackend, NumpyBackend
from ._cluster import get_client
from ._factor import History, ICFProgress, ICFResult, PivotBlock, cut_factor
from ._memory import _Workers, measure_workers
from ._plan import FitPlan
from ._services import threadpool_limits
from ._validation import check_array_2d, is_dask_array
from .checkpoint import open_storage
from .errors import DegenerateKernelWarning, worker_failure, worker_failure_types
from .kernels import Kernel, make_kernel

__all__ = ["ICFResult", "ICFProgress", "incomplete_cholesky"]

logger = logging.getLogger(__name__)

_EPS = np.finfo(np.float64).eps


# --------------------------------------------------------------------------- driver


def _check_int(value, name, low=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}.")
    return int(value)


def incomplete_cholesky(
    X,
    *,
    kernel: str | Callable | Kernel = "gaussian",
    gamma: float | str | None = None,
    degree: int = 3, coef0: float = 1.0,
    max_rank: int = 100, tol: float = 1e-3, rank_tol: float | None = None,
    client=None, persist: bool = True,
    random_state: int | None = 0,
    progress: Callable[[ICFProgress], None] | None = None,
    pivoting: str = "block-greedy", block_size: int | None = None, block_delta: float = 0.0,
    p_store: str | None = None,
    checkpoint: str | None = None, checkpoint_every: int = 25,
    p_storage: str = "auto", resume: bool = False, overwrite: bool = False,
    storage_options: dict | None = None,
    plan: FitPlan | None = None,
) -> ICFResult:
    """Incomplete Cholesky factorization ``K ~ P P^T`` of a kernel matrix.

    The paper's Algorithm 1: from ``e = diag(K)``, each iteration takes the
    row ``t`` of largest residual (ties to the lowest index), appends ``p =
    (K[:, t] - P P[t]^T) / sqrt(e[t])`` to P and updates ``e -= p**2``,
    until ``max_rank`` columns, a trace error ``sum(e) <= tol`` or the
    numerical rank of K.  K is never formed: ``O(n s (d + s))`` time.

    Parameters
    ----------
    X : array-like or dask array of shape (n_samples, n_features)
        The data; a dask array's row chunks are tasks on the cluster.
    kernel : str, callable or Kernel, default="gaussian"
        A name of :func:`dkicf.kernels.kernel_names` (``"gaussian"``:
        ``exp(-gamma ||x-y||^2)``), a callable ``f(A, B)`` or a ``Kernel``.
    gamma : float or "median", default=None
        Kernel width; ``None``: ``"median"`` (:func:`dkicf.kernels.median_gamma`)
        for the Gaussian and Laplacian kernels, ``1 / n_features`` otherwise.
    degree, coef0 : polynomial kernel parameters.
    max_rank : int, default=100
        Largest number of columns of P (the paper's ``s``).
    tol : float, default=1e-3
        Stop at a trace error ``tr(K - P P^T) <= tol`` (the paper's epsilon).
    rank_tol : float, optional
        A largest residual ``<= rank_tol`` is rounding noise and ends the
        factorization (default: LAPACK's rule, ``eps * max(diag K) * max(n, c)``).
    client : distributed.Client or str, optional
        Cluster for dask input (default: the current client).
    persist : bool, default=True
        Dask input: keep X's chunks in worker memory, else re-read them each pass.
    random_state : int, optional
        Seed of the median heuristic's sample and of RPCholesky's pivots.
    progress : callable, optional
        Called with an :class:`ICFProgress` after every pass.
    pivoting : str, default="block-greedy"
        A name of :data:`dkicf.pivoting.PIVOT_RULES`: ``"greedy"`` (the
        paper's loop, one pivot per pass), ``"block-greedy"`` (the same
        pivots, several per pass, except where residuals tie within
        rounding) or ``"rpcholesky"`` (randomly pivoted, independent of the
        chunking).  See ``docs/pivoting.md``.
    block_size : int, optional
        Block rules: the most pivots per pass (default: what a task's memory
        allows); fix it for RPCholesky pivots that repeat on another cluster.
    block_delta : float, default=0.0
        Block greedy: accept candidates within a factor ``1 - block_delta``
        of the bound (fewer passes; the pivots are no longer exactly greedy's).
    p_store : str, optional
        Dask input only: a Zarr array (path or fsspec URL) for a P larger
        than the cluster's memory (same pivots, P equal to rounding).
    checkpoint, checkpoint_every, resume, overwrite, storage_options
        Commit to the Zarr group ``checkpoint`` (fsspec ``storage_options``)
        every ``checkpoint_every`` passes; ``resume=True`` continues it to the
        uninterrupted result; ``overwrite=True`` replaces a dkicf store, never
        anything else.  See ``docs/checkpoints.md``.
    p_storage : {"auto", "memory", "zarr"}, default="auto"
        With ``checkpoint``: P in worker memory, in the checkpoint, or either.
    plan : FitPlan, optional
        The fit's plan, whose measurement of the workers the checks use.

    Returns
    -------
    ICFResult

    Examples
    --------
    >>> import numpy as np
    >>> X = np.random.default_rng(0).normal(size=(200, 2))
    >>> res = incomplete_cholesky(X, gamma=0.5, max_rank=20)
    >>> seq = incomplete_cholesky(X, gamma=0.5, max_rank=20, pivoting="greedy")
    >>> bool(np.array_equal(res.pivots, seq.pivots)), res.n_passes < seq.n_passes
    (True, True)
    """
    dask_input = is_dask_array(X)
    X = check_array_2d(X, "X")
    n, d = X.shape
    max_rank = _check_int(max_rank, "max_rank")
    capacity = min(max_rank, n)
    name, block_size, block_delta, rule = _make_rule(X, tol, capacity, pivoting, block_size,
                                                     block_delta, random_state)
    kernel_obj = _resolve_kernel(X, kernel, gamma, degree, coef0, random_state)
    _check_p_storage(p_storage, p_store, checkpoint, dask_input)
    client, workers = _cluster_of(dask_input, client, plan)
    storage = None
    if p_store is not None or checkpoint is not None:
        X, storage = _open_storage(
            X, dask_input, kernel_obj, rule, capacity, persist, client, workers, p_storage,
            p_store=p_store, checkpoint=checkpoint, every=checkpoint_every, resume=resume,
            overwrite=overwrite, storage_options=storage_options,
            fit={"max_rank": max_rank, "tol": tol, "rank_tol": rank_tol,
                 "random_state": random_state, "pivoting": name,
                 "block_size": block_size, "block_delta": block_delta},
        )
        if storage.finished:
            return storage.load_result(kernel_obj, dask_input)
    backend = _make_backend(X, dask_input, kernel_obj, capacity, client, workers, persist,
                            storage)
    result = _run_loop(backend, rule, kernel_obj, n, d, capacity, tol, rank_tol, progress,
                       storage)
    if storage is not None:
        result.info.update(storage.info())
    _warn_if_degenerate(result, n)
    return result


def _make_rule(X, tol, capacity, pivoting, block_size, block_delta, random_state):
    """The checked rule name and block parameters, and the pivot rule made from them."""
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}.")
    name, block_size, block_delta = _pivoting.check_pivoting(pivoting, block_size, block_delta)
    # Made before the kernel: a randomized rule draws its key from random_state first.
    rule = _pivoting.PIVOT_RULES[name](capacity=capacity, n=X.shape[0], d=X.shape[1],
                                       block_size=block_size, block_delta=block_delta,
                                       random_state=random_state)
    return name, block_size, block_delta, rule


def _cluster_of(dask_input: bool, client, plan: FitPlan | None):
    """The fit's client and its one measurement of the workers (None, None for numpy)."""
    if not dask_input:
        return None, None
    client = get_client(client)
    if plan is not None and plan.workers is not None:
        return client, plan.workers
    return client, measure_workers(client)


def _open_storage(X, dask_input, kernel, rule, capacity, persist, client, workers, p_storage,
                  *, fit: dict, **where):
    """P's store or the checkpoint, opened (or claimed) for this fit's parameters."""
    params = {**kernel.get_params(), **fit}
    if rule.one_per_pass:  # the block parameters shape the blocks, hence the pivots
        del params["block_size"], params["block_delta"]
    return open_storage(X, dask_input=dask_input, capacity=capacity, params=params,
                        client=client, workers=workers, p_storage=p_storage,
                        persist=persist, **where)


def _run_loop(backend, rule, kernel, n, d, capacity, tol, rank_tol, progress, storage):
    """The rule's driver loop on ``backend``; a worker failure becomes dkicf's error.

    With dask, the driver's own products (the candidates' small Cholesky)
    run on one BLAS thread: BLAS's other threads, woken by each product,
    spin for a while after it on cores that the workers need.  Held from
    the driver's thread, the limit also holds in-process workers to one
    BLAS thread where OpenBLAS ignores limits set from their threads (see
    docs/checkpoints.md).  The numpy backend limits BLAS itself when it
    runs a thread pool.
    """
    limit = threadpool_limits(1) if isinstance(backend, DaskBackend) else nullcontext()
    with limit:
        try:
            if rule.one_per_pass:
                return _greedy_loop(backend, kernel, n, d, capacity, tol, rank_tol, progress,
                                    storage)
            return _block_loop(backend, kernel, n, d, capacity, tol, rank_tol, progress, rule,
                               storage)
        except worker_failure_types() as exc:
            backend.abort()
            raise worker_failure(exc, "factorization", backend.step, storage) from exc
        except BaseException:
            backend.abort()
            raise
        finally:
            backend.close()


def _make_backend(X, dask_input, kernel, capacity, client, workers: _Workers | None, persist,
                  storage) -> FactorBackend:
    """The backend of the fit, its chunk states new or rebuilt from the storage's commit."""
    restore = None if storage is None else storage.restore_point
    if dask_input:
        backend = DaskBackend(X, kernel, capacity, client, persist,
                              store=None if storage is None else storage.p_spec,
                              restore=restore, workers=workers)
    else:
        backend = NumpyBackend(X, kernel, capacity, restore=restore, checked=True)
    if storage is not None:
        storage.attach(backend)
    return backend


def _check_p_storage(p_storage, p_store, checkpoint, dask_input: bool) -> None:
    """Refuse a ``p_storage`` that is unknown or contradicts the other arguments."""
    if p_storage not in ("auto", "memory", "zarr"):
        raise ValueError(f"p_storage must be 'auto', 'memory' or 'zarr', got {p_storage!r}.")
    if p_storage == "memory" and p_store is not None:
        raise ValueError(
            "p_store= keeps P in a Zarr array, and p_storage='memory' asks for it in worker "
            "memory: drop one of them."
        )
    if p_storage == "zarr":
        if not dask_input:
            raise ValueError(
                "p_storage='zarr' keeps P in Zarr for dask input; a numpy X and its P live "
                "in this process's memory. Pass da.from_array(X, chunks=...) or drop it."
            )
        if p_store is None and checkpoint is None:
            raise ValueError(
                "p_storage='zarr' needs a Zarr location for P: p_store= (or checkpoint=)."
            )


def _resolve_kernel(X, kernel, gamma, degree, coef0, random_state) -> Kernel:
    if isinstance(kernel, Kernel):
        return kernel
    needs_sample = (
        isinstance(kernel, str)
        and kernel.lower() not in ("linear",)
        and (gamma is None or isinstance(gamma, str))
    )
    sample = _sample_rows(X, 2000, random_state) if needs_sample else None
    seed = 0 if random_state is None else int(np.random.default_rng(random_state).integers(2**31))
    return make_kernel(kernel, gamma=gamma, degree=degree, coef0=coef0, X_sample=sample, seed=seed)


def _warn_if_degenerate(result: ICFResult, n: int) -> None:
    """Warn when, for this data and kernel width, K is numerically I or the all-ones matrix."""
    r = result.rank
    final = float(result.trace_errors[-1]) if result.trace_errors.size else result.initial_trace
    own = float(np.sum(np.diag(result.L) ** 2))  # each pivot's own residual
    cross = result.initial_trace - final - own  # what the columns explained of other rows
    if r >= 2 and cross <= 1e-3 * own:
        warnings.warn(
            f"the kernel matrix is numerically the identity for this data: each of the {r} "
            f"columns of P explained only its own pivot (other rows' residuals fell by "
            f"{max(cross, 0.0):.3g}, against {own:.3g} for the pivots), so the effective rank "
            f"reached is {r} of {n} with no structure shared between points. The kernel width "
            f"is too narrow ({result.kernel!r}); try a smaller gamma or gamma='median'.",
            DegenerateKernelWarning,
            stacklevel=3,
        )
    elif (
        result.kernel.name in ("gaussian", "laplacian")
        and 1 <= r <= 2 < n
        and final <= 1e-8 * result.initial_trace
    ):
        warnings.warn(
            f"the kernel matrix is numerically the all-ones matrix for this data: the "
            f"factorization reached its numerical rank {r} after {r} iteration(s), so all "
            f"{n} points look the same to the kernel. The kernel width is too wide "
            f"({result.kernel!r}) or the rows are nearly identical; try a larger gamma "
            "or gamma='median'.",
            DegenerateKernelWarning,
            stacklevel=3,
        )


def _sample_rows(X, m: int, random_state) -> np.ndarray:
    """A seeded sample of rows (without replacement), gathering only those rows."""
    n = X.shape[0]
    rng = np.random.default_rng(random_state)
    idx = np.sort(rng.choice(n, size=min(m, n), replace=False))
    if is_dask_array(X):
        return np.asarray(X[idx].compute(), dtype=np.float64)
    return np.asarray(X[idx], dtype=np.float64)


def _stop_reason(rank, capacity, trace, tol, summary, rank_tol) -> str | None:
    """Algorithm 1's stopping rule before adding a pivot at ``rank``, or None to go on.

    The rank budget, then the trace error ``<= tol``, then the numerical rank
    (the largest residual no longer above rounding), in that order.
    """
    if rank >= capacity:
        return "max_rank"
    if trace <= tol:
        return "tol"
    if not float(summary["values"][0]) > rank_tol:
        return "numerical_rank"
    return None


def _greedy_loop(
    backend: FactorBackend, kernel, n, d, capacity, tol, rank_tol, progress, storage=None
) -> ICFResult:
    start = time.perf_counter()
    summary = backend.summary(1, first=True)
    initial_trace = summary["trace"]
    max_diag = float(summary["values"][0]) if summary["values"].size else 0.0
    if rank_tol is None:
        rank_tol = _EPS * max_diag * max(n, kernel.roundoff(summary.get("max_sqnorm", 0.0), d))
    history = History(kernel, capacity, d)
    trace_errors: list[float] = []
    stop = "max_rank"
    trace = initial_trace
    if storage is not None:  # on resume: the history and traces of the checkpoint
        initial_trace, rank_tol, trace = storage.begin(
            history, trace_errors, initial_trace, rank_tol
        )
    while True:
        i = history.rank
        reason = _stop_reason(i, capacity, trace, tol, summary, rank_tol)
        if reason is not None:
            stop = reason
            break
        t = int(summary["index"][0])
        e_t = float(summary["values"][0])
        block = PivotBlock(
            kernel=kernel,
            index=np.array([t], dtype=np.int64),
            rows=summary["x_rows"][:1],
            aux=None if summary["aux"] is None else summary["aux"][:1],
            U=summary["p_rows"][:1],
            L=np.array([[math.sqrt(e_t)]]),
            rank=i,
        )
        history.append(block)
        summary = backend.apply(block, history)
        trace = summary["trace"]
        trace_errors.append(trace)
        if storage is not None:
            storage.step(history, trace_errors, summary)
        if progress is not None:
            progress(
                ICFProgress(
                    rank=history.rank,
                    max_rank=capacity,
                    trace_error=trace,
                    initial_trace=initial_trace,
                    elapsed=time.perf_counter() - start,
                    n_passes=summary["n_passes"],
                )
            )
    r = history.rank
    if storage is not None:
        storage.finish(history, trace_errors, stop, summary)
    P, residual = backend.result_arrays(r)
    logger.info(
        "incomplete Cholesky: rank %d, trace error %.3e (from %.3e), stop: %s, %.2f s",
        r, trace, initial_trace, stop, time.perf_counter() - start,
    )
    return _result(history, r, P, residual, trace_errors, kernel, initial_trace, stop,
                   summary, start, {"rank_tol": rank_tol})


def _rows_per_task(backend: FactorBackend, n: int) -> int:
    """Rows whose block columns an update task holds at once (sizes a pivot block).

    With P in memory an update writes the block's columns into P's buffer,
    allocated at full rank, and works through its rows a slice at a time,
    so the numpy backend and dask chunks alike hold about the numpy
    backend's thread share of rows.  A Zarr-backed chunk allocates a new
    tail for its whole chunk when the block does not fit in its free columns.
    """
    rows = NumpyBackend._BLOCK_ROWS
    if backend.store is not None:
        rows = max(backend.chunks)
    return int(min(n, rows))


_NO_CANDIDATES = _pivoting.CandidateRequest()
_NO_SUMS = np.empty(0)
_NO_SUMS.flags.writeable = False


def _block_loop(
    backend: FactorBackend, kernel, n, d, capacity, tol, rank_tol, progress, rule, storage=None,
) -> ICFResult:
    """Several pivots per pass, chosen by ``rule`` (a :class:`~dkicf.pivoting.PivotRule`).

    Each iteration is one pass (``backend.apply`` of a pivot block) plus one
    small map over the chunk states (:func:`dkicf.pivoting.chunk_block_stats`)
    that returns the per-column sums of squares of the block just added (for
    the per-pivot trace errors) together with the rule's next candidates.
    Neither re-reads X.  The stopping rules are those of :func:`_greedy_loop`,
    pivot by pivot: if the trace error falls to ``tol`` inside a block, the
    result is cut where the sequential loop would have stopped.  A checkpoint
    commits between blocks, with the loop's and the rule's own state
    (:func:`_block_state`), so that a resumed run chooses the same blocks.
    """
    start = time.perf_counter()
    rule.size_blocks(_rows_per_task(backend, n), backend.task_bytes)
    summary = backend.summary(1, first=True, ahead=_first_request(rule, storage))
    initial_trace = summary["trace"]
    max_diag = float(summary["values"][0]) if summary["values"].size else 0.0
    roundoff = kernel.roundoff(summary.get("max_sqnorm", 0.0), d)
    if rank_tol is None:
        rank_tol = _EPS * max_diag * max(n, roundoff)
    history = History(kernel, capacity, d)
    trace_errors: list[float] = []
    blocks: list[tuple[int, int, str]] = []  # (candidates, pivots, why the block ended)
    trace = initial_trace
    if storage is not None:
        initial_trace, rank_tol, trace = storage.begin(
            history, trace_errors, initial_trace, rank_tol
        )
        saved = storage.driver_state
        if saved is not None:  # resumed: the loop continues where the commit left it
            max_diag, roundoff = saved["max_diag"], saved["roundoff"]
            rule.sizer.restore(saved["sizer"])
            rule.restore(saved)
            blocks = [(int(m), int(b), str(why)) for m, b, why in saved["blocks"]]
    ctx = _pivoting.RuleContext(
        kernel, n, d, capacity, rank_tol, max_diag, roundoff, tol,
        fetch=lambda index: _fetch_candidates(backend, index),
        small={"panel": None, "pool": backend.pool, "n_threads": backend.n_threads},
    )
    lo = hi = history.rank  # columns whose per-column sums are still to fetch (none at a commit)
    r = history.rank  # rank of the result (less than history.rank if tol is met inside a block)
    stop = "max_rank"
    ahead = None  # the last pass's answer to rule.single_pass for this one
    while True:
        i = history.rank
        done = _stop_reason(i, capacity, trace, tol, summary, rank_tol) is not None
        single = not done and (rule.single_pass(blocks, n, i) if ahead is None else ahead)
        request = _NO_CANDIDATES if done or single else rule.request(i, rank_tol)
        colsq, cand = _NO_SUMS, None
        if hi > lo or request.count:
            colsq, cand = _pivoting.gather_candidates(backend, lo, hi, request)
        if hi > lo:
            traces = _pivoting.block_traces(trace, colsq)
            below = np.flatnonzero(traces[:-1] <= tol)
            # Inside the block, the sequential loop would have stopped after pivot lo + below[0].
            kept = int(below[0]) + 1 if below.size else hi - lo
            trace_errors.extend(traces[:kept].tolist())
            r, trace = lo + kept, float(traces[kept - 1])
            _report(progress, r, capacity, trace, initial_trace, start, summary)
            if below.size:
                stop = "tol"
                break
        if done:
            stop = _stop_reason(i, capacity, trace, tol, summary, rank_tol)
            break
        if storage is not None:
            storage.step(history, trace_errors, summary, iteration=len(blocks),
                         driver=_block_state(max_diag, roundoff, rule, blocks))
        if single:
            # The largest residual alone, as the greedy rule: the same pivot
            # as a block would start with, without the candidates' cost.
            blocks.append((0, 1, "single"))
            block = _single_block(kernel, summary, i)
            b = 1
        else:
            ctx.small["panel"] = blocks[-1][1] if blocks else None  # sized from the last block
            cand, choice, m_used = rule.choose(ctx, i, cand, rule.sizer.block_max(i), trace)
            order = choice.order
            b = order.shape[0]
            blocks.append((m_used, b, choice.reason))
            rule.sizer.update(i, m_used, b, choice.reason)
            block = PivotBlock(kernel=kernel, index=cand.index[order], rows=cand.rows[order],
                               aux=None if cand.aux is None else cand.aux[order],
                               U=cand.U[order], L=choice.L, rank=i)
        history.append(block)
        ahead = rule.single_pass(blocks, n, i + b)
        summary = _apply_block(backend, rule, block, history, ahead, rank_tol)
        trace = summary["trace"]
        if b == 1:
            trace_errors.append(trace)
            r, lo, hi = i + 1, i + 1, i + 1
            _report(progress, r, capacity, trace, initial_trace, start, summary)
        else:
            lo, hi = i, i + b
    if storage is not None:
        storage.finish(history, trace_errors, stop, summary, rank=r, iteration=len(blocks),
                       driver=_block_state(max_diag, roundoff, rule, blocks))
    P, residual = cut_factor(*backend.result_arrays(history.rank), r)
    logger.info(
        "incomplete Cholesky (%s): rank %d in %d passes, trace error %.3e (from %.3e), "
        "stop: %s, %.2f s",
        rule.name, r, summary["n_passes"], trace, initial_trace, stop,
        time.perf_counter() - start,
    )
    info = {"rank_tol": rank_tol, "pivoting": rule.name,
            "block_sizes": [b for _, b, _ in blocks], "blocks": blocks}
    return _result(history, r, P, residual, trace_errors, kernel, initial_trace, stop,
                   summary, start, info)


def _first_request(rule, storage) -> tuple | None:
    """``(rank, request)`` of the block loop's first gather, for the set-up's summary to
    bring along, where the summary cannot change it: a fit that starts at rank 0 (not
    resumed) with a rule that asks for the largest residuals.  Else None."""
    if storage is not None and storage.driver_state is not None:
        return None
    request = rule.request(0, 0.0)  # "top" requests do not depend on the rank threshold
    return (0, request) if request.rule == "top" and request.count else None


def _apply_block(backend, rule, block, history, single_next: bool, rank_tol) -> dict:
    """The pass of ``block``; its update tasks also return what the next gather asks for.

    That is the new columns' sums after a block of several pivots and the
    candidates unless a lone pivot or no block (the capacity is reached) comes
    next, saving a round trip on dask.  After one pivot the pass's own trace
    is the trace error: no column sums.
    """
    i, b = block.rank, block.index.shape[0]
    if single_next and b == 1:
        return backend.apply(block, history, 1, stash=0, prefetch=None)
    nxt = (i + 1, i + 1) if b == 1 else (i, i + b)
    # After a block that fills the capacity no block follows: its column sums alone.
    none_next = single_next or i + b >= history.index.shape[0]
    request = _NO_CANDIDATES if none_next else rule.request(i + b, rank_tol)
    return backend.apply(block, history, 1, stash=0 if none_next else rule.stash(i + b),
                         prefetch=(*nxt, request))


def _report(progress, rank, capacity, trace, initial_trace, start, summary) -> None:
    if progress is not None:
        progress(ICFProgress(rank=rank, max_rank=capacity, trace_error=trace,
                             initial_trace=initial_trace, elapsed=time.perf_counter() - start,
                             n_passes=summary["n_passes"]))


def _fetch_candidates(backend, index) -> _pivoting.Candidates:
    """The rows of X and of P, and the residuals, of the global rows ``index``."""
    index = np.asarray(index, dtype=np.int64)
    xr, aux, pr, er = backend.rows(index)
    return _pivoting.Candidates(index, er, xr, aux, pr)


def _single_block(kernel, summary, rank: int) -> PivotBlock:
    """The pivot block of the largest residual alone (from a pass's summary)."""
    return PivotBlock(
        kernel=kernel,
        index=np.array([int(summary["index"][0])], dtype=np.int64),
        rows=summary["x_rows"][:1],
        aux=None if summary["aux"] is None else summary["aux"][:1],
        U=summary["p_rows"][:1],
        L=np.array([[math.sqrt(float(summary["values"][0]))]]),
        rank=rank,
    )


def _block_state(max_diag, roundoff, rule, blocks) -> dict:
    """The block loop's state that a checkpoint keeps besides the history (JSON-able)."""
    return {
        "max_diag": float(max_diag),
        "roundoff": float(roundoff),
        **rule.state(),
        "sizer": rule.sizer.state(),
        "blocks": [[int(m), int(b), why] for m, b, why in blocks],
    }


def _result(history, r, P, residual, trace_errors, kernel, initial_trace, stop, summary, start,
            info) -> ICFResult:
    """The result of a driver loop that stopped at rank ``r``."""
    return ICFResult(
        pivots=history.index[:r].copy(),
        P=P,
        trace_errors=np.array(trace_errors, dtype=np.float64),
        residual=residual,
        L=np.ascontiguousarray(history.L[:r, :r]),
        pivot_rows=np.ascontiguousarray(history.rows[:r]),
        kernel=kernel,
        initial_trace=initial_trace,
        stop_reason=stop,
        n_passes=int(summary["n_passes"]),
        elapsed=time.perf_counter() - start,
        info=info,
    )
