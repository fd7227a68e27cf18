"""P in Zarr, and checkpoints of the factorization that a crashed driver resumes from.

Two kinds of Zarr node, both created by the driver before any heavy work:

* a **P store** (``p_store=``): one array ``(n, capacity)`` of float64, in
  chunks of ``(p_rows, cb)`` rows and columns.  ``p_rows`` divides the row
  chunks of X, so every task writes whole Zarr chunks of its own; the tasks
  keep only the last ``< cb`` columns in memory and stream the rest.
* a **checkpoint** group (``checkpoint=``) holding that P array and

  - ``e_0``, ``e_1``: two buffers for the residual diagonal, written in turn,
    so that the committed one is never overwritten in place;
  - ``L``, ``pivot_rows``, ``pivot_aux``: rows of the pivot history, written
    before the commit; a row once written never changes;
  - the group attributes, rewritten in one small write that is the commit
    point: schema version, iteration, rank, the current residual buffer,
    pivots, block bounds, trace history, and fingerprints of the input and of
    the parameters.

Every value written is a deterministic function of X and the parameters, so a
write that is repeated (a task re-run, or a driver resumed after a crash
between a write and its commit) stores identical bytes.  Resuming rebuilds
each chunk's state from the committed arrays by a leaf task that reads Zarr,
and continues with exactly the pivots and columns the uninterrupted run
computes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import numpy as np

from . import _chunk, _memory
from ._cluster import get_client
from ._commit import (
    _CHECKPOINT,
    _P_STORE,
    SCHEMA_VERSION,
    _check_compatible,
    _check_still_there,
    _claim,
    _create_failed,
    _dkicf_attrs,
    _jsonable,
    _kw,
    _location,
    _phase,
)
from ._factor import History, ICFResult, cut_factor
from ._memory import _ROWS_HIGH, check_worker_memory, p_rows_for, store_columns
from ._services import chunk_digest
from ._validation import check_positive_int

__all__ = ["open_storage", "p_rows_for"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- layout


def _aligned(X):
    """X with row chunks whose Zarr layout is possible (rechunked only if needed)."""
    p = p_rows_for(X.chunks[0])
    if p:
        return X, p
    size = int(max(X.chunks[0]))
    logger.info(
        "X's row chunks %s have no common size for P's Zarr chunks; rechunking to %d rows",
        X.chunks[0], size,
    )
    X = X.rechunk({0: size})
    return X, p_rows_for(X.chunks[0])


# --------------------------------------------------------------------------- locations


def _new_p_array(group_or_url, name, n, capacity, p_rows, cb, attrs=None, options=None):
    import zarr

    kw = dict(
        shape=(n, capacity), chunks=(p_rows, cb), dtype="float64",
        compressors=None,  # P is dense float noise: compression costs time, saves nothing
        fill_value=np.nan, attributes=attrs or {}, dimension_names=("row", "column"),
    )
    if isinstance(group_or_url, str):
        return zarr.create_array(store=group_or_url, zarr_format=3, **kw, **_kw(options))
    return group_or_url.create_array(name, **kw)


# --------------------------------------------------------------------------- fingerprints


def _digests(X, dask_input: bool, client) -> list[str]:
    """One digest per row chunk of X (one extra pass over the data for dask input)."""
    if not dask_input:
        return [chunk_digest(X)]
    c = get_client(client)
    futs = c.compute([_delayed_digest(b) for b in X.to_delayed().ravel()])
    return c.gather(futs)


def _delayed_digest(block):
    import dask

    return dask.delayed(chunk_digest, pure=True)(block)


# --------------------------------------------------------------------------- storage objects


class _Storage:
    """What the driver calls: ``begin`` before the loop, ``step`` after each
    iteration, ``finish`` after the last one.  The base class only keeps P in Zarr.

    ``step`` and ``finish`` take, from the block rules' loop, ``iteration``
    (passes so far; default: one per trace error, as for ``"greedy"``) and
    ``driver``, the loop's own JSON-able state, which a resumed run reads back
    from ``driver_state``.  ``finish`` takes ``rank``, the result's rank when
    ``tol`` was met inside the last block (the factor in storage goes on to
    the end of that block).
    """

    finished = False
    restore_point = None
    driver_state = None

    def __init__(self, spec: _chunk.StoreSpec | None):
        self.p_spec = spec
        self.backend = None

    def attach(self, backend) -> None:
        self.backend = backend

    def info(self) -> dict:
        """What the result's ``info`` records about the storage."""
        return {"p_store": self.p_spec.root}

    def begin(self, history, trace_errors, initial_trace, rank_tol):
        return initial_trace, rank_tol, initial_trace

    def step(self, history, trace_errors, summary, *, iteration=None, driver=None) -> None:
        pass

    def finish(self, history, trace_errors, stop, summary, *, rank=None, iteration=None,
               driver=None) -> None:
        pass


class PStore(_Storage):
    """P of one fit in a Zarr array; its attributes describe the fit once it is done."""

    def finish(self, history, trace_errors, stop, summary, *, rank=None, iteration=None,
               driver=None) -> None:
        import zarr

        r = history.rank if rank is None else rank
        self.backend.write_p(self.p_spec, r)  # the tails: P is complete before it says so
        arr = zarr.open_array(store=self.p_spec.root, mode="r+", zarr_format=3,
                              **self.p_spec.zarr_kwargs())
        meta = dict(arr.attrs.asdict()["dkicf"])
        meta.update(
            status="finished", rank=r, stop_reason=stop,
            pivots=history.index[:r].tolist(), kernel=_jsonable(history.kernel.get_params()),
        )
        arr.attrs.update({"dkicf": meta})


class Checkpoint(_Storage):
    """The checkpoint of one factorization: commits every ``every`` iterations and at the end."""

    def __init__(self, spec, every: int, meta: dict, layout: dict):
        super().__init__(spec)
        self.ckpt_spec = spec
        self.every = every
        self.meta = meta
        self.layout = layout
        commit = meta.get("commit")
        self.commit = commit
        self.finished = bool(commit and commit["finished"])
        self.current = commit["e"] if commit else "e_1"
        self._saved_rank = commit["rank"] if commit else 0
        self._saved_iteration = commit["iteration"] if commit else 0
        self._elapsed_before = commit["elapsed"] if commit else 0.0
        self._start = time.perf_counter()
        self._initial_trace = self._rank_tol = None
        self._resumed_from = commit["rank"] if commit else None
        if commit and not self.finished:
            self.restore_point = (spec, self._point(commit))
            self.driver_state = commit.get("driver")
        self._group, self._members = None, {}

    def _member(self, name: str):
        """The array ``name`` of the checkpoint's group, opened once (see :meth:`_save`)."""
        if name not in self._members:
            self._members[name] = self._group[name]
        return self._members[name]

    @staticmethod
    def _point(commit: dict) -> dict:
        """What a chunk task needs to rebuild its state from a commit."""
        return {
            "iteration": commit["iteration"], "rank": commit["rank"], "e": commit["e"],
            "n_passes": commit["n_passes"], "pivots": np.asarray(commit["pivots"], dtype=np.int64),
        }

    @property
    def url(self) -> str:
        return self.ckpt_spec.root

    def info(self) -> dict:
        return {
            "checkpoint": self.url,
            "resumed_from": self._resumed_from,
            "already_finished": False,
            "p_storage": "memory" if self.p_spec is None else "zarr",
        }

    # ------------------------------------------------------------------ driver hooks

    def begin(self, history, trace_errors, initial_trace, rank_tol):
        if self.commit is None:
            self._initial_trace, self._rank_tol = initial_trace, rank_tol
            return initial_trace, rank_tol, initial_trace
        c = self.commit
        saved = self._load_history(history.kernel, history.index.shape[0])
        r = saved.rank
        history.index[:r] = saved.index[:r]
        history.rows[:r] = saved.rows[:r]
        history.aux = saved.aux
        history.L[:r, :r] = saved.L[:r, :r]
        history.bounds = list(saved.bounds)
        trace_errors.extend(c["trace_errors"])
        self._initial_trace, self._rank_tol = c["initial_trace"], c["rank_tol"]
        logger.info(
            "resuming the factorization from %s: iteration %d, rank %d",
            self.url, c["iteration"], r,
        )
        trace = trace_errors[-1] if trace_errors else c["initial_trace"]
        return c["initial_trace"], c["rank_tol"], trace

    def step(self, history, trace_errors, summary, *, iteration=None, driver=None) -> None:
        it = len(trace_errors) if iteration is None else iteration
        if it - self._saved_iteration >= self.every:
            self._save(history, trace_errors, summary, it, driver)

    def finish(self, history, trace_errors, stop, summary, *, rank=None, iteration=None,
               driver=None) -> None:
        it = len(trace_errors) if iteration is None else iteration
        self._save(history, trace_errors, summary, it, driver, stop=stop, result_rank=rank)

    # ------------------------------------------------------------------ writing

    def _save(self, history, trace_errors, summary, it: int, driver: dict | None = None,
              stop: str | None = None, result_rank: int | None = None) -> None:
        import zarr

        r = history.rank
        spec, backend = self.ckpt_spec, self.backend
        _check_still_there(spec.root, _CHECKPOINT, "checkpoint",
                           spec.zarr_kwargs().get("storage_options"))
        cb = spec.columns
        backend.write_p(spec, self._saved_rank // cb * cb)
        _phase("P", it)
        target = "e_0" if self.current == "e_1" else "e_1"
        backend.write_e(spec, target)
        _phase("e", it)
        if self._group is None:
            # Opened once: every open reads the node's metadata again, a round trip
            # each on an object store.  The check above reads it at every commit.
            self._group = zarr.open_group(store=spec.root, mode="r+", zarr_format=3,
                                          **spec.zarr_kwargs())
        group, lo = self._group, self._saved_rank
        if r > lo:
            self._member("L")[lo:r, :r] = history.L[lo:r, :r]
            self._member("pivot_rows")[lo:r] = history.rows[lo:r]
            if history.aux is not None:
                self._member("pivot_aux")[lo:r] = history.aux[lo:r]
        _phase("arrays", it)
        commit = {
            "iteration": it,
            "rank": r,
            "e": target,
            "pivots": history.index[:r].tolist(),
            "bounds": [int(b) for b in history.bounds],
            "has_aux": history.aux is not None,
            "trace_errors": [float(t) for t in trace_errors],
            "initial_trace": float(self._initial_trace),
            "rank_tol": float(self._rank_tol),
            "n_passes": int(summary["n_passes"]),
            "finished": stop is not None,
            "stop_reason": stop,
            "p_storage": "memory" if self.p_spec is None else "zarr",
            "elapsed": self._elapsed_before + time.perf_counter() - self._start,
        }
        if driver is not None:
            commit["driver"] = driver
        if result_rank is not None and result_rank < r:
            commit["result_rank"] = int(result_rank)
        meta = dict(self.meta, commit=commit)
        group.attrs.update({"dkicf": meta})  # the commit: one small metadata write
        _phase("commit", it)
        self.meta, self.commit, self.current = meta, commit, target
        self._saved_rank, self._saved_iteration = r, it
        logger.info("checkpoint committed at %s: iteration %d, rank %d", spec.root, it, r)
        if stop is None:
            backend.rebase_from(spec, self._point(commit))

    # ------------------------------------------------------------------ reading

    def _load_history(self, kernel, capacity: int) -> History:
        import zarr

        c = self.commit
        r = c["rank"]
        group = zarr.open_group(store=self.url, mode="r", zarr_format=3,
                                **self.ckpt_spec.zarr_kwargs())
        aux = np.asarray(group["pivot_aux"][:r]) if c["has_aux"] else None
        return History.restore(
            kernel, capacity, np.asarray(c["pivots"], dtype=np.int64),
            np.asarray(group["pivot_rows"][:r]), aux, np.asarray(group["L"][:r, :r]),
            c["bounds"],
        )

    def load_result(self, kernel, dask_input: bool):
        """The result of a finished fit, read back from the checkpoint."""
        import zarr

        c = self.commit
        r = c["rank"]
        history = self._load_history(kernel, max(r, 1))
        kw = self.ckpt_spec.zarr_kwargs()
        group = zarr.open_group(store=self.url, mode="r", zarr_format=3, **kw)
        if dask_input:
            import dask.array as da

            chunks = tuple(self.layout["chunks"])
            stored = group["P"]
            P = da.from_zarr(stored, chunks=(chunks, stored.shape[1]))[:, :r]
            residual = da.from_zarr(group[c["e"]], chunks=(chunks,))
        else:
            P = np.asarray(group["P"][:, :r])
            residual = np.asarray(group[c["e"]][:])
        # A block rule that met tol inside its last block: the result is cut there.
        r = c.get("result_rank", r)
        P, residual = cut_factor(P, residual, r)
        info = {
            "rank_tol": c["rank_tol"], "checkpoint": self.url,
            "resumed_from": r, "already_finished": True,
            "elapsed_checkpointed": c["elapsed"],
        }
        if c.get("driver") is not None:
            blocks = [(int(m), int(b), str(why)) for m, b, why in c["driver"]["blocks"]]
            info.update(pivoting=self.meta["fingerprint"]["params"]["pivoting"],
                        block_sizes=[b for _, b, _ in blocks], blocks=blocks)
        logger.info(
            "the checkpoint at %s holds a finished factorization (rank %d, stop: %s); "
            "nothing to do", self.url, r, c["stop_reason"],
        )
        return ICFResult(
            pivots=history.index[:r].copy(),
            P=P,
            trace_errors=np.array(c["trace_errors"], dtype=np.float64),
            residual=residual,
            L=np.ascontiguousarray(history.L[:r, :r]),
            pivot_rows=np.ascontiguousarray(history.rows[:r]),
            kernel=kernel,
            initial_trace=c["initial_trace"],
            stop_reason=c["stop_reason"],
            n_passes=c["n_passes"],
            elapsed=0.0,
            info=info,
        )


# --------------------------------------------------------------------------- entry point


def open_storage(
    X,
    *,
    dask_input: bool,
    capacity: int,
    params: dict[str, Any],
    p_store: str | None,
    checkpoint: str | None,
    every: int,
    resume: bool,
    overwrite: bool,
    client=None,
    storage_options: dict | None = None,
    p_storage: str = "auto",
    persist: bool = True,
    workers: _memory._Workers | None = None,
):
    """Check and create (or open, to resume) the Zarr storage of one factorization.

    With dask input and a checkpoint, ``p_storage`` says where P lives
    (see :func:`dkicf.incomplete_cholesky`): ``"auto"`` keeps it in worker
    memory when it fits there (X held too if ``persist``), else in the
    checkpoint; a resumed checkpoint keeps the choice it recorded.

    Everything here happens before the first pass over the data that the fit
    itself makes: a location that exists, cannot be written, or holds a
    checkpoint of other data or parameters is refused with a message naming
    the problem.

    Returns
    -------
    X : the input, rechunked by rows if P's Zarr layout needs it.
    storage : PStore or Checkpoint
    """
    if p_store is not None and checkpoint is not None:
        raise ValueError(
            "pass either p_store= or checkpoint=, not both: a checkpoint keeps P in its own "
            f"Zarr group ({checkpoint!r}/P)."
        )
    if p_store is not None and not dask_input:
        raise ValueError(
            "p_store= keeps P in Zarr for dask input; a numpy X and its P live in this "
            "process's memory. Pass da.from_array(X, chunks=...) or drop p_store."
        )
    p_store = _location(p_store, "p_store")
    checkpoint = _location(checkpoint, "checkpoint")
    every = check_positive_int(every, "checkpoint_every")
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}.")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=, the location to resume from.")
    n, d = X.shape
    cb = min(_memory.COLUMN_BLOCK, capacity)
    token = uuid.uuid4().hex
    opts = dict(storage_options or {})
    opts_json = json.dumps(opts, sort_keys=True) if opts else ""
    in_memory = not dask_input
    if dask_input:
        X, p_rows = _aligned(X)
        chunks = tuple(int(c) for c in X.chunks[0])
        if p_store is None:
            in_memory = _p_in_memory(
                p_storage, checkpoint, resume, opts, get_client(client), chunks, d, X.dtype,
                capacity, persist, workers,
            )
        if not in_memory:  # tails of P between passes: as many columns as memory allows
            cb = store_columns(get_client(client), n, capacity, _memory.COLUMN_BLOCK,
                               workers=workers)
            # Before any pass over the data (the fingerprint's is the first).
            spec = _chunk.StoreSpec("", "P", token, cb)
            check_worker_memory(get_client(client), chunks, d, X.dtype, capacity, spec, True,
                                workers=workers)
    else:
        chunks, p_rows = (n,), min(n, _ROWS_HIGH)
    if p_store is not None:
        _claim(p_store, _P_STORE, overwrite=overwrite, resume=False, what="P store",
               options=opts)
        attrs = {"dkicf": {"schema": SCHEMA_VERSION, "kind": _P_STORE, "status": "running"}}
        try:
            _new_p_array(p_store, None, n, capacity, p_rows, cb, attrs, opts)
        except OSError as exc:
            raise _create_failed(p_store, "P store", exc) from exc
        return X, PStore(_chunk.StoreSpec(p_store, "", token, cb, opts_json))
    layout = {"chunks": list(chunks), "p_rows": p_rows, "columns": cb, "capacity": capacity,
              "p_storage": "memory" if in_memory else "zarr"}
    params = _jsonable(params)
    shape_fp = {"shape": [n, d], "chunks": list(chunks), "dtype": str(np.dtype(X.dtype))}
    existing = _claim(checkpoint, _CHECKPOINT, overwrite=overwrite, resume=resume,
                      what="checkpoint", options=opts)
    if existing is not None:
        _check_compatible(checkpoint, existing, params, shape_fp, chunks)
        digests = _digests(X, dask_input, client)
        _check_compatible(checkpoint, existing, params, dict(shape_fp, digests=digests), chunks)
        spec = _chunk.StoreSpec(checkpoint, "P", token, existing["layout"]["columns"], opts_json)
        ckpt = Checkpoint(spec, every, existing, existing["layout"])
        if ckpt.commit is None:
            logger.info("the checkpoint at %s has no commit yet: starting from the beginning",
                        checkpoint)
    else:
        if resume:
            logger.info("no checkpoint at %s: starting a new factorization there", checkpoint)
        digests = _digests(X, dask_input, client)
        meta = {
            "schema": SCHEMA_VERSION,
            "kind": _CHECKPOINT,
            "fingerprint": {"input": dict(shape_fp, digests=digests), "params": params},
            "layout": layout,
            "commit": None,
        }
        try:
            _create_checkpoint(checkpoint, meta, n, d, capacity, p_rows, cb, opts)
        except OSError as exc:
            raise _create_failed(checkpoint, "checkpoint", exc) from exc
        spec = _chunk.StoreSpec(checkpoint, "P", token, cb, opts_json)
        ckpt = Checkpoint(spec, every, meta, layout)
    if in_memory:
        ckpt.p_spec = None  # P stays in memory; the commits write its new columns
    return X, ckpt


def _p_in_memory(p_storage, checkpoint, resume, options, client, chunks, d, dtype, capacity,
                 persist, workers=None) -> bool:
    """Whether a checkpointed dask fit keeps P in worker memory (see open_storage)."""

    if p_storage == "auto" and resume:
        existing = _dkicf_attrs(checkpoint, _CHECKPOINT, options) or {}
        commit = existing.get("commit")
        if isinstance(commit, dict):
            # Where the committed columns were computed; checkpoints written
            # before the choice was recorded kept P in Zarr.
            p_storage = commit.get("p_storage") or "zarr"
    if p_storage == "zarr":
        return False
    if p_storage == "memory":
        check_worker_memory(client, chunks, d, dtype, capacity, None, persist, workers=workers)
        return True
    try:
        check_worker_memory(client, chunks, d, dtype, capacity, None, persist, workers=workers)
    except ValueError as exc:
        logger.info("P does not fit the workers' memory (%s): kept in the checkpoint", exc)
        return False
    return True


def _create_checkpoint(url, meta, n, d, capacity, p_rows, cb, options=None) -> None:
    import zarr

    group = zarr.create_group(store=url, zarr_format=3, attributes={"dkicf": meta},
                              **_kw(options))
    _new_p_array(group, "P", n, capacity, p_rows, cb)
    for name in ("e_0", "e_1"):
        group.create_array(name, shape=(n,), chunks=(p_rows,), dtype="float64",
                           compressors=None, fill_value=np.nan)
    rows = min(capacity, 64)
    group.create_array("L", shape=(capacity, capacity), chunks=(rows, capacity),
                       dtype="float64", fill_value=0.0)
    group.create_array("pivot_rows", shape=(capacity, d), chunks=(rows, d), dtype="float64",
                       fill_value=0.0)
    group.create_array("pivot_aux", shape=(capacity,), chunks=(capacity,), dtype="float64",
                       fill_value=0.0)


# --------------------------------------------------------------------------- small driver states


