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
import math
import numbers
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _chunk
from ._validation import check_positive_int
from .errors import CheckpointMismatchError

__all__ = ["SCHEMA_VERSION", "StateCheckpoint", "open_storage", "p_rows_for"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Columns of P per Zarr chunk: the unit in which tasks flush P.
COLUMN_BLOCK = 32
_ROWS_LOW, _ROWS_HIGH = 4096, 8192
_CHECKPOINT, _P_STORE = "icf-checkpoint", "icf-P"

# Test hook: called as ``_fault_hook(phase, iteration)`` after each write phase
# of a checkpoint ("P", "e", "arrays", "commit"), to simulate a driver crash.
_fault_hook: Callable[[str, int], None] | None = None


# --------------------------------------------------------------------------- layout


def p_rows_for(chunks: tuple[int, ...]) -> int:
    """Rows per Zarr chunk of P for X's row chunks (0 if they need rechunking).

    The result divides every row chunk but the last, so each task writes
    whole Zarr chunks: the largest such divisor in ``[4096, 8192]``, or the
    common chunk size itself when it is smaller or has no divisor there.
    Irregular chunks whose common divisor is small (< 1024 and smaller than
    the chunks) give 0.
    """
    inner = [int(c) for c in chunks[:-1]] or [int(chunks[0])]
    g = math.gcd(*inner)
    if g <= _ROWS_HIGH:
        return g if (g >= 1024 or g >= max(inner)) else 0
    for r in range(_ROWS_HIGH, _ROWS_LOW - 1, -1):
        if g % r == 0:
            return r
    return g


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


def _kw(options: dict | None) -> dict:
    """``storage_options=`` for zarr and dask, only when there are options."""
    return {"storage_options": options} if options else {}


def _fs(url: str, options: dict | None = None):
    import fsspec

    return fsspec.core.url_to_fs(url, **(options or {}))


def _occupied(url: str, options: dict | None = None) -> bool:
    """Whether anything is at ``url`` (an empty directory counts as free)."""
    fs, path = _fs(url, options)
    if not fs.exists(path):
        return False
    return not (fs.isdir(path) and not fs.ls(path))


def _dkicf_attrs(url: str, kind: str, options: dict | None = None) -> dict | None:
    """The dkicf attributes of the Zarr node at ``url`` if dkicf made it as ``kind``."""
    import zarr

    try:
        node = zarr.open(store=url, mode="r", **_kw(options))
    except Exception:  # not a Zarr node at all
        return None
    meta = node.attrs.asdict().get("dkicf")
    if isinstance(meta, dict) and meta.get("kind") == kind:
        return meta
    return None


def _claim(
    url: str, kind: str, *, overwrite: bool, resume: bool, what: str, options: dict | None = None
) -> dict | None:
    """Check a location before the fit; return the existing node's attributes to resume.

    Nothing that dkicf did not create is ever removed or written into.
    """
    if not _occupied(url, options):
        return None
    meta = _dkicf_attrs(url, kind, options)
    if meta is None:
        raise FileExistsError(
            f"the {what} location {url!r} already holds data that is not a dkicf {what}; "
            "it is left untouched. Choose another location."
        )
    if resume:
        return meta
    if not overwrite:
        resumable = kind == _CHECKPOINT or kind.startswith("state-")
        hint = "resume=True to continue it, " if resumable else ""
        raise FileExistsError(
            f"a dkicf {what} already exists at {url!r}. Pass {hint}overwrite=True to "
            "replace it, or choose another location."
        )
    fs, path = _fs(url, options)
    logger.info("overwrite=True: removing the dkicf %s at %s", what, url)
    fs.rm(path, recursive=True)
    return None


def _check_still_there(url: str, kind: str, what: str, options: dict | None = None) -> None:
    """Refuse to commit into a checkpoint that was removed or replaced since it was opened.

    Writing on would re-create its folders and leave a checkpoint with some
    arrays and no commit (or another run's commit) behind.
    """
    if _dkicf_attrs(url, kind, options) is None:
        from .io import DkicfIOError

        # A store that cannot be reached fails here, instead of being reported
        # as a removed checkpoint (which would be given up though it resumes).
        _occupied(url, options)
        raise DkicfIOError(
            f"the {what} at {url!r} was removed or replaced while the fit ran; the fit stops "
            "rather than write a partial checkpoint there. Run it again (with a new "
            "checkpoint, or none): nothing was published at the output."
        )


def _location(value, name: str) -> str | None:
    """A path-like or URL as a string, a local path made absolute (workers share it)."""
    from .io import absolute_location

    if value is None or isinstance(value, str):
        return absolute_location(value)
    if hasattr(value, "__fspath__"):
        return absolute_location(str(value.__fspath__()))
    raise TypeError(f"{name} must be a path or URL string, got {type(value).__name__}.")


def _create_failed(url: str, what: str, exc: Exception) -> OSError:
    return OSError(f"cannot create the {what} at {url!r}: {exc}")


def _new_p_array(group_or_url, name, n, capacity, p_rows, cb, attrs=None, options=None):
    import zarr

    kw = dict(
        shape=(n, capacity), chunks=(p_rows, cb), dtype="float64",
        compressors=None,  # P is dense float noise: compression costs time, saves nothing
        fill_value=np.nan, attributes=attrs or {},
    )
    if isinstance(group_or_url, str):
        return zarr.create_array(store=group_or_url, zarr_format=3, **kw, **_kw(options))
    return group_or_url.create_array(name, **kw)


# --------------------------------------------------------------------------- fingerprints


def _jsonable(value):
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _digests(X, dask_input: bool, client) -> list[str]:
    """One digest per row chunk of X (one extra pass over the data for dask input)."""
    if not dask_input:
        return [_chunk.chunk_digest(X)]
    from ._cluster import get_client

    c = get_client(client)
    futs = c.compute([_delayed_digest(b) for b in X.to_delayed().ravel()])
    return c.gather(futs)


def _delayed_digest(block):
    import dask

    return dask.delayed(_chunk.chunk_digest, pure=True)(block)


def _describe_differences(saved: dict, now: dict, chunks) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if a == b:
            continue
        if key == "digests" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            offsets = np.concatenate([[0], np.cumsum(chunks)])
            bad = [j for j, (u, v) in enumerate(zip(a, b)) if u != v]
            j = bad[0]
            out.append(
                f"the data differ in {len(bad)} row chunk(s), first chunk {j} "
                f"(rows {offsets[j]}-{offsets[j + 1] - 1})"
            )
        else:
            out.append(f"{key}: checkpoint {a!r}, this call {b!r}")
    return out


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
        arr = zarr.open_array(store=self.p_spec.root, mode="r+", **self.p_spec.zarr_kwargs())
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
        group = zarr.open_group(store=spec.root, mode="r+", **spec.zarr_kwargs())
        lo = self._saved_rank
        if r > lo:
            group["L"][lo:r, :r] = history.L[lo:r, :r]
            group["pivot_rows"][lo:r] = history.rows[lo:r]
            if history.aux is not None:
                group["pivot_aux"][lo:r] = history.aux[lo:r]
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

    def _load_history(self, kernel, capacity: int) -> _chunk.History:
        import zarr

        c = self.commit
        r = c["rank"]
        group = zarr.open_group(store=self.url, mode="r", **self.ckpt_spec.zarr_kwargs())
        aux = np.asarray(group["pivot_aux"][:r]) if c["has_aux"] else None
        return _chunk.History.restore(
            kernel, capacity, np.asarray(c["pivots"], dtype=np.int64),
            np.asarray(group["pivot_rows"][:r]), aux, np.asarray(group["L"][:r, :r]),
            c["bounds"],
        )

    def load_result(self, kernel, dask_input: bool):
        """The result of a finished fit, read back from the checkpoint."""
        import zarr

        from .icf import ICFResult, cut_factor

        c = self.commit
        r = c["rank"]
        history = self._load_history(kernel, max(r, 1))
        kw = self.ckpt_spec.zarr_kwargs()
        group = zarr.open_group(store=self.url, mode="r", **kw)
        if dask_input:
            import dask.array as da

            chunks = tuple(self.layout["chunks"])
            P = da.from_zarr(self.url, component="P", chunks=(chunks, group["P"].shape[1]), **kw)
            P = P[:, :r]
            residual = da.from_zarr(self.url, component=c["e"], chunks=(chunks,), **kw)
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


def _phase(name: str, iteration: int) -> None:
    if _fault_hook is not None:
        _fault_hook(name, iteration)


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
    cb = min(COLUMN_BLOCK, capacity)
    token = uuid.uuid4().hex
    opts = dict(storage_options or {})
    opts_json = json.dumps(opts, sort_keys=True) if opts else ""
    in_memory = not dask_input
    if dask_input:
        from ._backends import check_worker_memory, store_columns
        from ._cluster import get_client

        X, p_rows = _aligned(X)
        chunks = tuple(int(c) for c in X.chunks[0])
        if p_store is None:
            in_memory = _p_in_memory(
                p_storage, checkpoint, resume, opts, get_client(client), chunks, d, X.dtype,
                capacity, persist,
            )
        if not in_memory:  # tails of P between passes: as many columns as memory allows
            cb = store_columns(get_client(client), n, capacity, COLUMN_BLOCK)
            # Before any pass over the data (the fingerprint's is the first).
            spec = _chunk.StoreSpec("", "P", token, cb)
            check_worker_memory(get_client(client), chunks, d, X.dtype, capacity, spec, True)
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
                 persist) -> bool:
    """Whether a checkpointed dask fit keeps P in worker memory (see open_storage)."""
    from ._backends import check_worker_memory

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
        check_worker_memory(client, chunks, d, dtype, capacity, None, persist)
        return True
    try:
        check_worker_memory(client, chunks, d, dtype, capacity, None, persist)
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


def _check_compatible(url, meta, params, input_fp, chunks) -> None:
    """Refuse a checkpoint of another schema, data or parameters, saying what differs."""
    if meta.get("schema") != SCHEMA_VERSION:
        raise CheckpointMismatchError(
            f"the checkpoint at {url!r} has schema version {meta.get('schema')!r}; this dkicf "
            f"reads version {SCHEMA_VERSION}. Start a new checkpoint elsewhere."
        )
    saved = meta["fingerprint"]
    saved_input = {k: saved["input"].get(k) for k in input_fp}
    diffs = _describe_differences(saved["params"], params, chunks)
    diffs += _describe_differences(saved_input, input_fp, chunks)
    if diffs:
        raise CheckpointMismatchError(
            f"cannot resume from the checkpoint at {url!r}: it was written for a different "
            "fit: " + "; ".join(diffs)
            + ". Use a new checkpoint location (or overwrite=True with resume=False)."
        )


# --------------------------------------------------------------------------- small driver states


class StateCheckpoint:
    """A double-buffered checkpoint of a driver's small state (k-means centres, RNG states).

    For the iterative stages whose state fits in the driver's memory: a few
    arrays (centres, counts) and a JSON-able dict (step, restart, the
    generators' ``bit_generator.state``, running averages).  Each
    :meth:`save` writes the arrays it is given to their spare buffers
    (``name_0`` or ``name_1``, never the committed one) and then commits
    with one write of the group's attributes, so a crash at any point leaves
    the previous commit intact.  An array not given keeps its committed
    value: what changes rarely is not rewritten at every commit.

    Parameters
    ----------
    url : str
        Local path or fsspec URL of the Zarr group (for example
        ``checkpoint + "/kmeans"`` next to the factorization's arrays).
    kind : str
        What is checkpointed (``"kmeans"``); a group of another kind is refused.
    params : dict
        Fingerprint of the parameters (JSON-able values): resuming with
        different ones is refused with a message naming the differences.
    input : dict, optional
        Fingerprint of the data, checked the same way: ``shape``, ``dtype``,
        ``chunks`` (row chunks) and ``digests`` (one per row chunk, as
        :func:`dkicf._chunk.chunk_digest` gives), or any subset of them.
    resume, overwrite : bool
        As for :func:`dkicf.incomplete_cholesky`.
    storage_options : dict, optional
        fsspec options of ``url``.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from dkicf.checkpoint import StateCheckpoint
    >>> url = tempfile.mkdtemp() + "/km"
    >>> ck = StateCheckpoint(url, "kmeans", {"n_clusters": 2}, resume=True)
    >>> rng = np.random.default_rng(0)
    >>> ck.save(5, {"centers": np.eye(2)}, {"rng": rng.bit_generator.state})
    >>> step, arrays, state = StateCheckpoint(url, "kmeans", {"n_clusters": 2},
    ...                                       resume=True).load()
    >>> step, arrays["centers"].tolist()
    (5, [[1.0, 0.0], [0.0, 1.0]])
    """

    def __init__(self, url, kind: str, params: dict, *, input: dict | None = None,
                 resume: bool = False, overwrite: bool = False,
                 storage_options: dict | None = None):
        import zarr

        self.url = _location(url, "checkpoint")
        self._kw = _kw(storage_options)
        self.kind = f"state-{kind}"
        self.params = _jsonable(params)
        input_fp = _jsonable(input or {})
        existing = _claim(self.url, self.kind, overwrite=overwrite, resume=resume,
                          what=f"{kind} checkpoint", options=storage_options)
        if existing is None:
            meta = {"schema": SCHEMA_VERSION, "kind": self.kind,
                    "fingerprint": {"input": input_fp, "params": self.params}, "commit": None}
            try:
                zarr.create_group(store=self.url, zarr_format=3, attributes={"dkicf": meta},
                                  **self._kw)
            except OSError as exc:
                raise _create_failed(self.url, f"{kind} checkpoint", exc) from exc
        else:
            _check_compatible(self.url, existing, self.params, input_fp,
                              input_fp.get("chunks", ()))
            meta = existing
        self.meta = meta

    @property
    def finished(self) -> bool:
        """Whether the last commit was marked as the end of the stage."""
        return bool(self.commit and self.commit["finished"])

    @property
    def commit(self) -> dict | None:
        return self.meta["commit"]

    def load(self) -> tuple[int, dict[str, np.ndarray], dict] | None:
        """The committed ``(step, arrays, state)``, or None before the first commit."""
        import zarr

        c = self.commit
        if c is None:
            return None
        group = zarr.open_group(store=self.url, mode="r", **self._kw)
        arrays = {name: np.asarray(group[f"{name}_{buf}"][...])
                  for name, buf in c["arrays"].items()}
        return c["step"], arrays, c["state"]

    def save(self, step: int, arrays: dict[str, np.ndarray], state: dict,
             finished: bool = False) -> None:
        """Write ``arrays`` to their spare buffers, then commit ``step`` and ``state``."""
        import zarr

        buffers = dict(self.commit["arrays"]) if self.commit else {}
        _check_still_there(self.url, self.kind, f"{self.kind.removeprefix('state-')} checkpoint",
                           self._kw.get("storage_options"))
        group = zarr.open_group(store=self.url, mode="r+", **self._kw)
        for name, value in arrays.items():
            value = np.asarray(value)
            spare = 1 - buffers[name] if name in buffers else 0
            key = f"{name}_{spare}"
            old = group.get(key)
            if old is None or old.shape != value.shape or old.dtype != value.dtype:
                # Small arrays, one chunk each, uncompressed: a commit costs a few writes.
                old = group.create_array(key, shape=value.shape, dtype=value.dtype,
                                         chunks=value.shape or None, compressors=None,
                                         overwrite=True)
            old[...] = value
            buffers[name] = spare
        _phase("arrays", step)
        commit = {"step": int(step), "arrays": buffers, "state": _jsonable(state),
                  "finished": bool(finished)}
        meta = dict(self.meta, commit=commit)
        group.attrs.update({"dkicf": meta})
        _phase("commit", step)
        self.meta = meta
