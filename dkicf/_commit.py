"""Claims, fingerprints and atomic commit records: what both stages of a fit commit with.

A location that dkicf writes to is first *claimed* (:func:`_claim`): it must be
free, or hold a dkicf node of the expected kind (to resume or, with
``overwrite=True``, to replace); nothing dkicf did not create is ever removed.
A resumable node records *fingerprints* of the data and of the parameters,
and a resumed run that differs is refused with the differences named
(:func:`_check_compatible`).  A *commit* is one small write of the node's
attributes after every array it refers to is written, so a crash at any
point leaves the previous commit intact.  This module knows states, not
algorithms: the factorization's storage (:mod:`dkicf.checkpoint`) and the
k-means (:class:`StateCheckpoint`) build on it.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable

import fsspec
import numpy as np

from ._version import LAYOUT_SCHEMA
from .errors import CheckpointMismatchError
from .io import DkicfIOError, absolute_location

__all__ = ["SCHEMA_VERSION", "StateCheckpoint"]

logger = logging.getLogger(__name__)


# The Zarr layout's schema (docs/zarr-layout.md); checkpoints of schema 1 are the same.
SCHEMA_VERSION = LAYOUT_SCHEMA
# Kinds of the nodes the factorization creates (the k-means' are "state-...").
_CHECKPOINT, _P_STORE = "icf-checkpoint", "icf-P"

# Test hook: called as ``_fault_hook(phase, iteration)`` after each write phase
# of a checkpoint ("P", "e", "arrays", "commit"), to simulate a driver crash.
_fault_hook: Callable[[str, int], None] | None = None


def _kw(options: dict | None) -> dict:
    """``storage_options=`` for zarr and dask, only when there are options."""
    return {"storage_options": options} if options else {}


def _fs(url: str, options: dict | None = None):
    return fsspec.core.url_to_fs(url, **(options or {}))


def _occupied(url: str, options: dict | None = None) -> bool:
    """Whether anything is at ``url`` (an empty directory counts as free)."""
    fs, path = _fs(url, options)
    if not fs.exists(path):
        return False
    return not (fs.isdir(path) and not fs.ls(path))


def _dkicf_attrs(url: str, kind: str, options: dict | None = None) -> dict | None:
    """The dkicf attributes of the Zarr node at ``url`` if dkicf made it as ``kind``."""
    import zarr  # imported on use: the CLI's parser reads this package without zarr

    try:
        node = zarr.open(store=url, mode="r", zarr_format=3, **_kw(options))
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
    if value is None or isinstance(value, str):
        return absolute_location(value)
    if hasattr(value, "__fspath__"):
        return absolute_location(str(value.__fspath__()))
    raise TypeError(f"{name} must be a path or URL string, got {type(value).__name__}.")


def _create_failed(url: str, what: str, exc: Exception) -> OSError:
    return OSError(f"cannot create the {what} at {url!r}: {exc}")


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


def _phase(name: str, iteration: int) -> None:
    if _fault_hook is not None:
        _fault_hook(name, iteration)


def _check_compatible(url, meta, params, input_fp, chunks) -> None:
    """Refuse a checkpoint of another schema, data or parameters, saying what differs."""
    schema = meta.get("schema")
    number = isinstance(schema, int) and not isinstance(schema, bool)
    if not (number and 1 <= schema <= SCHEMA_VERSION):
        newer = number and schema > SCHEMA_VERSION
        hint = "Upgrade dkicf to resume it, or start" if newer else "Start"
        raise CheckpointMismatchError(
            f"the checkpoint at {url!r} has schema version {schema!r}; this dkicf "
            f"reads versions 1 to {SCHEMA_VERSION}. {hint} a new checkpoint elsewhere."
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
        :func:`dkicf._services.chunk_digest` gives), or any subset of them.
    resume, overwrite : bool
        As for :func:`dkicf.incomplete_cholesky`.
    storage_options : dict, optional
        fsspec options of ``url``.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from dkicf._commit import StateCheckpoint
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
        import zarr  # imported on use: the CLI's parser reads this package without zarr

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
        self._group, self._arrays = None, {}  # opened by the first save

    @property
    def finished(self) -> bool:
        """Whether the last commit was marked as the end of the stage."""
        return bool(self.commit and self.commit["finished"])

    @property
    def commit(self) -> dict | None:
        return self.meta["commit"]

    def load(self) -> tuple[int, dict[str, np.ndarray], dict] | None:
        """The committed ``(step, arrays, state)``, or None before the first commit."""
        import zarr  # imported on use: the CLI's parser reads this package without zarr

        c = self.commit
        if c is None:
            return None
        group = zarr.open_group(store=self.url, mode="r", zarr_format=3, **self._kw)
        arrays = {name: np.asarray(group[f"{name}_{buf}"][...])
                  for name, buf in c["arrays"].items()}
        return c["step"], arrays, c["state"]

    def save(self, step: int, arrays: dict[str, np.ndarray], state: dict,
             finished: bool = False) -> None:
        """Write ``arrays`` to their spare buffers, then commit ``step`` and ``state``."""
        import zarr  # imported on use: the CLI's parser reads this package without zarr

        buffers = dict(self.commit["arrays"]) if self.commit else {}
        _check_still_there(self.url, self.kind, f"{self.kind.removeprefix('state-')} checkpoint",
                           self._kw.get("storage_options"))
        if self._group is None:
            # The group and its arrays are opened once: each open reads metadata
            # again, a round trip on an object store.  The check above reads the
            # group's at every commit.
            self._group = zarr.open_group(store=self.url, mode="r+", zarr_format=3,
                                          **self._kw)
        group = self._group
        for name, value in arrays.items():
            value = np.asarray(value)
            spare = 1 - buffers[name] if name in buffers else 0
            key = f"{name}_{spare}"
            old = self._arrays[key] if key in self._arrays else group.get(key)
            if old is None or old.shape != value.shape or old.dtype != value.dtype:
                # Small arrays, one chunk each, uncompressed: a commit costs a few writes.
                old = group.create_array(key, shape=value.shape, dtype=value.dtype,
                                         chunks=value.shape or None, compressors=None,
                                         overwrite=True)
            old[...] = value
            self._arrays[key] = old
            buffers[name] = spare
        _phase("arrays", step)
        commit = {"step": int(step), "arrays": buffers, "state": _jsonable(state),
                  "finished": bool(finished)}
        meta = dict(self.meta, commit=commit)
        group.attrs.update({"dkicf": meta})
        _phase("commit", step)
        self.meta = meta
