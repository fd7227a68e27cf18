"""Zarr in and out: opening arrays safely, dataset stores, conversion, model groups.

Stores are Zarr v3 (v2 is read too) at a local path or at an fsspec URL
(``file://``, ``memory://``, ``s3://``, ...; remote protocols need their fsspec
package, e.g. ``s3fs``).

Locations
    A relative local path means a path under this process's working
    directory.  Every function here, and every dkicf entry point that takes a
    location, makes it absolute (:func:`absolute_location`) before opening
    anything, so dask workers that run in another directory read and write
    the same files.  URLs with a scheme are left as they are.

Reading
    :func:`open_array`, :func:`as_dask` and :func:`open_dataset` read the
    store's metadata first and refuse it (:class:`DkicfIOError`) before any
    chunk is read when it declares a pickle or object codec, or a dtype that is
    not a real number.  Chunks are never unpickled.  The shape in the metadata
    is checked before anything sized by it is built: a data array must have
    every chunk its shape needs in the store (counted where listing is cheap,
    the last one looked for elsewhere), and no array may need a task graph or
    a read larger than the memory available.

Dataset layout
    A dataset store is a Zarr group holding ``X`` of shape
    ``(n_samples, n_features)``, chunked by rows with all columns in one
    chunk, and optionally ``y`` of shape ``(n_samples,)``, int64, with the same
    row chunks.  Class values ``0 .. c-1`` in ``y`` stand for the original
    labels listed in the group attribute ``label_values``.

Writing
    :func:`convert`, :func:`generate` and :func:`write_group` refuse an
    existing destination unless ``overwrite=True``.  At a local path (or
    ``file://`` URL) they write a temporary sibling directory and move it into
    place only once it is complete, so a failed write leaves no store behind,
    and with ``overwrite=True`` the old store is moved away only after the new
    one is complete.  At other URLs there is no rename: the store is written in
    place, an old one is cleared first (only with ``overwrite=True``), and a
    failed write removes what it wrote.  An existing path that is not a Zarr
    store is never replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import os
import shutil
import socket
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import FsspecStore, LocalStore

from . import synthetic
from ._validation import check_dtype
from .errors import DkicfError, worker_failure, worker_failure_types

__all__ = [
    "ClaimedError",
    "DkicfIOError",
    "MissingChunkError",
    "OutputExistsError",
    "absolute_location",
    "as_dask",
    "check_not_input",
    "check_store_safe",
    "check_writable",
    "claimed",
    "convert",
    "fingerprint",
    "generate",
    "open_array",
    "open_dataset",
    "inspect",
    "open_member",
    "read_group",
    "staged_group",
    "write_dask",
    "write_group",
    "write_members",
]

MiB = 1 << 20

# Codecs that turn chunk bytes into Python objects; pickle runs arbitrary code.
_OBJECT_CODECS = frozenset(
    {"pickle", "json", "json2", "msgpack", "msgpack2", "vlen-utf8", "vlen-bytes",
     "vlen-array", "categorize", "object"}
)
_V3_REAL_TYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
_SVMLIGHT_SUFFIXES = (".svm", ".libsvm", ".svmlight", ".txt")
_SUFFIXES = (".npy", ".npz", ".csv", ".parquet") + _SVMLIGHT_SUFFIXES
_MAX_CLASSES = 65536


class DkicfIOError(DkicfError, ValueError):
    """A store or file that cannot be read or written as asked; the message says why."""


class OutputExistsError(DkicfIOError, FileExistsError):
    """The destination already exists and overwriting was not asked for."""


class MissingChunkError(DkicfIOError):
    """A chunk of an array is not in its store, or the array is not there for this process.

    Raised in the dask task that reads the chunk and re-raised by the client
    (a plain :class:`DkicfIOError`, so that it pickles like one).
    """


# --------------------------------------------------------------------------
# locations


def absolute_location(url):
    """A store location that means the same thing in every process: local paths made absolute.

    A local path (``~`` expanded) becomes absolute against this process's
    working directory, and so does the path of a ``file://`` URL.  Other URLs
    (``s3://``, ``gs://``, ``memory://``, chained ones such as
    ``simplecache::s3://``) are returned as they are.

    Call it in the process the user works in, before a location is shipped
    to dask workers: they may run in another working directory, where a
    relative path names other files (or none).

    Parameters
    ----------
    url : str, path-like or None
        A local path or an fsspec URL.

    Returns
    -------
    str or None
        The location as a string; None for None.

    Examples
    --------
    >>> import os
    >>> absolute_location("data.zarr") == os.path.join(os.getcwd(), "data.zarr")
    True
    >>> absolute_location("s3://bucket/data.zarr")
    's3://bucket/data.zarr'
    >>> absolute_location("file:///tmp/./data.zarr")
    'file:///tmp/data.zarr'
    """
    if url is None:
        return None
    text = os.fspath(url)
    if not isinstance(text, str):
        raise TypeError(f"a store location must be a path or URL string, got {text!r}.")
    if text.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(text[len("file://") :]))
    if "://" in text:
        return text
    return os.path.abspath(os.path.expanduser(text))


def _local_path(url) -> Path | None:
    """The absolute filesystem path of a local path or ``file://`` URL, else None."""
    text = absolute_location(url)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if "://" in text:
        return None
    return Path(text)


def _fs(url: str, storage_options: dict | None):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise DkicfIOError(
            f"cannot open {url}: {exc}. Install the fsspec package for that protocol "
            "(e.g. s3fs for s3://) or pass a local path."
        ) from exc


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


_META_KEYS = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


class _CheckedReads:
    """Store mixin for an array at the store's root: no silent fill value for lost data.

    Zarr reads a chunk key that the store lacks as the fill value.  Here a
    missing chunk key (and only then: a chunk that is found costs nothing
    more) raises :class:`MissingChunkError` when the array's metadata is
    not in the store either, i.e. this process does not see the array (a
    worker on another host, or in another directory for a relative path),
    and, with ``every_chunk``, whenever a chunk is missing.
    """

    every_chunk = False

    def with_read_only(self, read_only: bool = False):
        store = super().with_read_only(read_only)
        store.every_chunk = self.every_chunk
        return store

    async def get(self, key, prototype=None, byte_range=None):
        value = await super().get(key, prototype, byte_range)
        if value is None and key.rsplit("/", 1)[-1] not in _META_KEYS:
            await self._missing(key)
        return value

    async def _missing(self, key: str) -> None:
        where = self._where()
        if not (await self.exists("zarr.json") or await self.exists(".zarray")):
            raise MissingChunkError(
                f"the Zarr array {where} is not there for the process reading it (host "
                f"{socket.gethostname()}, working directory {os.getcwd()}): every dask "
                "worker must see the store the client opened. Put it on a filesystem that "
                "all workers mount at the same path, or use a URL they can all reach "
                "(s3://, gs://, ...)."
            )
        if self.every_chunk:
            raise MissingChunkError(_missing_chunk_message(key, where))


def _missing_chunk_message(key: str, where: str, detail: str = "") -> str:
    return (
        f"chunk {key!r} of the Zarr array {where} is missing from the store{detail}; dkicf "
        "does not read a missing chunk of the data as zeros (the fill value). The "
        "store is incomplete (chunk files deleted or not copied yet): restore it, "
        "or, if it leaves out chunks equal to the fill value on purpose, rewrite it "
        "with every chunk written (zarr config array.write_empty_chunks=True)."
    )


class _CheckedLocalStore(_CheckedReads, LocalStore):
    def _where(self) -> str:
        return str(self.root)


class _StagingStore(LocalStore):
    """A local store that writes into an existing folder only, never recreating it.

    A staged output is built in a temporary folder that is removed when the
    run fails; a write task still running elsewhere at that moment (the
    others' failure does not stop it) must not bring the folder back.
    """

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(
                f"{self.root} is gone: the staged output it belonged to was abandoned."
            )

    async def _open(self, *, mode=None) -> None:
        self._check_root()
        self._is_open = True

    def _ensure_open_sync(self) -> None:
        self._check_root()
        self._is_open = True

    async def _set(self, key: str, value, exclusive: bool = False) -> None:
        self._check_root()
        await super()._set(key, value, exclusive=exclusive)


class _CheckedFsspecStore(_CheckedReads, FsspecStore):
    def _where(self) -> str:
        protocol = self.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return f"{protocol}://{self.path.lstrip('/')}"


def _store(url: str, storage_options: dict | None, *, read_only: bool,
           every_chunk: bool | None = None):
    """A Zarr store at ``url``; with ``every_chunk`` not None, one that checks its reads."""
    local = _local_path(url)
    if every_chunk is None:
        if local is not None:
            return LocalStore(local, read_only=read_only)
        return FsspecStore.from_url(url, storage_options=storage_options or {},
                                    read_only=read_only)
    if local is not None:
        store = _CheckedLocalStore(local, read_only=read_only)
    else:
        store = _CheckedFsspecStore.from_url(url, storage_options=storage_options or {},
                                             read_only=read_only)
    store.every_chunk = every_chunk
    return store


@dataclass
class _Node:
    """What the metadata at a location says, read without touching any chunk."""

    url: str
    kind: str  # "array" or "group"
    zarr_format: int
    meta: dict = field(repr=False)


class _Location:
    """A local directory or a path on an fsspec filesystem (fsspec only for URLs)."""

    def __init__(self, url: str, storage_options: dict | None):
        self.url = url
        self.local = _local_path(url)
        if self.local is None:
            self.fs, path = _fs(url, storage_options)
            self.path = path.rstrip("/")

    def read(self, name: str) -> bytes | None:
        try:
            if self.local is not None:
                return (self.local / name).read_bytes()
            return self.fs.cat_file(f"{self.path}/{name}")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def exists(self) -> bool:
        if self.local is not None:
            return os.path.lexists(self.local)
        return self.fs.exists(self.path)

    def children(self) -> list[str]:
        if self.local is not None:
            return sorted(p.name for p in self.local.iterdir()) if self.local.is_dir() else []
        found = self.fs.ls(self.path, detail=False)
        return sorted(child.rstrip("/").rsplit("/", 1)[-1] for child in found)


def _read_json(location: _Location, name: str) -> dict | None:
    raw = location.read(name)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise DkicfIOError(
            f"{location.url}: metadata file {name} is not valid JSON ({exc})."
        ) from exc
    if not isinstance(meta, dict):
        raise DkicfIOError(f"{location.url}: metadata file {name} is not a JSON object.")
    return meta


def _probe(url: str, storage_options: dict | None, *, missing_ok: bool = False) -> _Node | None:
    """Find the Zarr node at ``url`` from its metadata file alone."""
    location = _Location(url, storage_options)
    meta = _read_json(location, "zarr.json")
    if meta is not None:
        kind = meta.get("node_type")
        if kind not in ("array", "group"):
            raise DkicfIOError(f"{url}: zarr.json has node_type {kind!r}, not 'array' or 'group'.")
        return _Node(url, kind, 3, meta)
    meta = _read_json(location, ".zarray")
    if meta is not None:
        return _Node(url, "array", 2, meta)
    meta = _read_json(location, ".zgroup")
    if meta is not None:
        return _Node(url, "group", 2, meta)
    if location.exists():
        raise DkicfIOError(
            f"{url} exists but is not a Zarr store (no zarr.json, .zarray or .zgroup); "
            "pass the path of a Zarr array or group, or convert the file first with "
            "dkicf.io.convert."
        )
    if missing_ok:
        return None
    raise DkicfIOError(f"no Zarr store at {url}; check the path (and storage_options for URLs).")


def _group_arrays(url: str, storage_options: dict | None) -> list[str]:
    """Names of the arrays directly inside the group at ``url``."""
    names = []
    for name in _Location(url, storage_options).children():
        if name.startswith(".") or name == "zarr.json":
            continue
        with contextlib.suppress(DkicfIOError):
            node = _probe(_join(url, name), storage_options, missing_ok=True)
            if node is not None and node.kind == "array":
                names.append(name)
    return names


def _not_an_array(url: str, storage_options: dict | None) -> DkicfIOError:
    names = _group_arrays(url, storage_options)
    if not names:
        return DkicfIOError(f"{url} is a Zarr group, not an array, and it holds no arrays.")
    first = "X" if "X" in names else names[0]
    return DkicfIOError(
        f"{url} is a Zarr group, not an array; pass {_join(url, first)} "
        f"(its arrays: {', '.join(names)}), or use dkicf.io.open_dataset for a dataset group."
    )


# --------------------------------------------------------------------------
# safety checks on metadata


def _codec_names(spec) -> Iterator[str]:
    """Every codec name in a (nested) codec configuration, e.g. inside sharding."""
    if isinstance(spec, dict):
        name = spec.get("name", spec.get("id"))
        if isinstance(name, str):
            yield name
        for value in spec.values():
            if isinstance(value, (dict, list, tuple)):
                yield from _codec_names(value)
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            yield from _codec_names(item)


def _unsafe_codec(meta: dict) -> str | None:
    parts = [meta.get(key) for key in ("codecs", "filters", "compressor", "compressors")]
    for name in _codec_names(parts):
        short = name.lower().removeprefix("numcodecs.")
        if "pickle" in short or short in _OBJECT_CODECS:
            return name
    return None


def _unsafe_dtype(meta: dict, zarr_format: int) -> str | None:
    if zarr_format == 2:
        dtype = meta.get("dtype")
        if not isinstance(dtype, str):
            return f"structured dtype {dtype!r}"
        try:
            kind = np.dtype(dtype).kind
        except TypeError:
            return f"dtype {dtype!r}"
        return None if kind in "biuf" else f"dtype {dtype!r}"
    dtype = meta.get("data_type")
    if isinstance(dtype, str) and dtype in _V3_REAL_TYPES:
        return None
    return f"data type {dtype!r}"


def _check_meta(url: str, meta: dict, zarr_format: int) -> None:
    bad = _unsafe_dtype(meta, zarr_format)
    if bad is not None:
        raise DkicfIOError(
            f"refusing {url}: {bad} is not a real number type. Store the data as "
            "float32/float64 (or integers) without object or text columns."
        )
    codec = _unsafe_codec(meta)
    if codec is not None:
        danger = " (unpickling can run arbitrary code)" if "pickle" in codec.lower() else ""
        raise DkicfIOError(
            f"refusing {url}: its metadata declares the codec {codec!r}, which decodes chunks "
            f"into Python objects{danger}. dkicf reads numeric arrays only; rewrite the data "
            "as a float array with a numeric codec such as zstd."
        )


def _describe(arr: zarr.Array) -> str:
    store = arr.store_path.store
    path = arr.store_path.path
    if isinstance(store, LocalStore):
        return str(Path(store.root) / path) if path else str(store.root)
    if isinstance(store, FsspecStore):
        protocol = store.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        root = store.path.strip("/")
        return f"{protocol}://{root}/{path}" if path else f"{protocol}://{root}"
    return str(arr.store_path)


def check_store_safe(arr: zarr.Array, *, name: str | None = None) -> None:
    """Refuse a Zarr array whose codecs or dtype are not plain numeric ones.

    Looks at the array's metadata only (no chunk is read): codecs, filters and
    compressors (also inside sharding) must not be pickle or another codec that
    decodes to Python objects, and the dtype must be a real number type
    (:func:`dkicf._validation.check_dtype`).

    Parameters
    ----------
    arr : zarr.Array
        An open array.
    name : str, optional
        How to name the array in messages; by default its store location.

    Raises
    ------
    DkicfIOError
        Naming the store and the offending codec or dtype.

    Examples
    --------
    >>> import zarr
    >>> check_store_safe(zarr.create_array(store={}, shape=(4, 2), dtype="f8"))
    >>> check_store_safe(zarr.create_array(store={}, shape=(4,), dtype=str))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dkicf.io.DkicfIOError: refusing ...: data type 'string' is not a real number type. ...
    """
    where = name or _describe(arr)
    meta = arr.metadata.to_dict()
    _check_meta(where, meta, arr.metadata.zarr_format)
    try:
        check_dtype(arr.dtype, where)
    except TypeError as exc:
        raise DkicfIOError(f"refusing {where}: {exc}") from exc


# The largest length of a dimension or chunk: beyond it numpy and dask overflow.
_MAX_LENGTH = 2**62
# What a task graph costs the driver per chunk of an array, at least: measured
# for da.from_zarr(...).sum() (about 2.8 KB a chunk); a fit's graphs cost more.
_GRAPH_BYTES_PER_CHUNK = 2048
# Protocols whose stores are listed whole to count their chunks (a listing
# costs no more than the metadata read); others are checked at their last chunk.
_LISTED_PROTOCOLS = frozenset({"file", "local", "memory"})


def _stored_keys(arr: zarr.Array) -> Iterator[str] | None:
    """The keys of the array's stored objects, or None where listing is not cheap."""
    from zarr.core.sync import sync
    from zarr.storage import MemoryStore

    store = arr.store_path.store
    listed = isinstance(store, (LocalStore, MemoryStore))
    if isinstance(store, FsspecStore):
        protocol = store.fs.protocol
        protocols = protocol if isinstance(protocol, (tuple, list)) else (protocol,)
        listed = bool(_LISTED_PROTOCOLS.intersection(protocols))
    if not listed:
        return None
    prefix = arr.store_path.path
    prefix = f"{prefix}/" if prefix else ""

    async def keys() -> list[str]:
        return [key async for key in store.list_prefix(prefix)]

    return (key[len(prefix):] for key in sync(keys()))


def _grid(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Chunk coordinates in C order, made one at a time (itertools.product holds its ranges)."""
    coords = [0] * len(counts)
    while True:
        yield tuple(coords)
        axis = len(counts) - 1
        while axis >= 0:
            coords[axis] += 1
            if coords[axis] < counts[axis]:
                break
            coords[axis] = 0
            axis -= 1
        if axis < 0:
            return


def _check_present(arr: zarr.Array, url: str, counts: list[int], n_objects: int,
                   claimed: str) -> None:
    """Refuse an array whose store holds fewer objects than its shape needs."""
    from zarr.core.sync import sync

    keys = _stored_keys(arr)
    if keys is None:
        last = arr.metadata.encode_chunk_key(tuple(c - 1 for c in counts))
        path = arr.store_path.path
        if sync(arr.store_path.store.exists(f"{path}/{last}" if path else last)):
            return
        raise MissingChunkError(_missing_chunk_message(
            last, url, f" ({claimed}; it is the last of them)"))
    present = {key for key in keys if key.rsplit("/", 1)[-1] not in _META_KEYS}
    if len(present) >= n_objects:
        return
    # The first chunk that is missing, in grid order: found within len(present) + 1 steps.
    first = next(key for key in map(arr.metadata.encode_chunk_key, _grid(counts))
                 if key not in present)
    raise MissingChunkError(_missing_chunk_message(
        first, url, f" ({claimed}, but the store holds {len(present):,} chunk(s): the metadata "
                    "does not match the data)"))


def _check_extent(arr: zarr.Array, url: str, *, every_chunk: bool) -> None:
    """Refuse metadata that claims more than the store holds or this machine can plan for.

    Nothing sized by the metadata (a dask graph, a chunk list) may be built
    before this: a shape of 10**13 rows would exhaust memory building it.
    The number of stored objects (chunks, or shards) that the shape needs is
    checked against the memory a task graph over them takes at least, and,
    with ``every_chunk`` (an array every chunk of which must be there),
    against the objects in the store: all of them where listing is cheap
    (local and in-memory stores), the last one elsewhere.
    """
    import psutil

    grid = getattr(arr, "shards", None) or arr.chunks
    if len(grid) != len(arr.shape) or not all(
        isinstance(c, int) and 1 <= c <= _MAX_LENGTH for c in grid
    ) or not all(isinstance(s, int) and 0 <= s <= _MAX_LENGTH for s in arr.shape):
        raise DkicfIOError(
            f"refusing {url}: its metadata declares chunks {tuple(grid)} for shape "
            f"{tuple(arr.shape)}; chunks need one positive length per dimension, and "
            f"no length may pass {_MAX_LENGTH}. The metadata is damaged: restore the store "
            "or convert the data again."
        )
    counts = [-(-s // c) for s, c in zip(arr.shape, grid)]
    n_objects = math.prod(counts)
    claimed = (f"its metadata claims shape {tuple(arr.shape)} in {n_objects:,} chunk(s) of "
               f"{tuple(grid)}")
    if every_chunk and n_objects:
        _check_present(arr, url, counts, n_objects, claimed)
    available = psutil.virtual_memory().available
    if n_objects * _GRAPH_BYTES_PER_CHUNK > available:
        raise DkicfIOError(
            f"refusing {url}: {claimed}; a task graph over that many chunks needs at least "
            f"{n_objects * _GRAPH_BYTES_PER_CHUNK / 2**30:.3g} GiB, more than the "
            f"{available / 2**30:.3g} GiB this machine has available. If the shape is right, "
            "rewrite the array with larger chunks; if not, the metadata (zarr.json or "
            ".zarray) is damaged: restore the store or convert the data again."
        )


def _check_links(url: str) -> None:
    """Refuse a local store that holds a symbolic link to anything outside it.

    A chunk (or a whole member) linked from elsewhere would be read as this
    store's data, and could end up in an output (a model keeps pivot rows of
    X).  The location given may itself be a link: the store is what it
    resolves to.  Links that stay inside the store are fine.
    """
    local = _local_path(url)
    if local is None or not local.is_dir():
        return
    root = os.path.realpath(local)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                continue
            target = os.path.realpath(path)
            if os.path.commonpath([root, target]) != root:
                raise DkicfIOError(
                    f"refusing {url}: {path} is a symbolic link to {target}, outside the "
                    "store; dkicf reads only data inside the store it is given. Copy the "
                    "data into the store, or pass the linked location itself."
                )


def _check_allocation(arr: zarr.Array, url: str) -> None:
    """Refuse reading a whole array that its metadata says is larger than available memory."""
    import psutil

    nbytes = math.prod(arr.shape) * np.dtype(arr.dtype).itemsize
    available = psutil.virtual_memory().available
    if nbytes > available:
        raise DkicfIOError(
            f"refusing {url}: its metadata claims shape {tuple(arr.shape)} of {arr.dtype}, "
            f"{nbytes / 2**30:.3g} GiB to read whole, more than the {available / 2**30:.3g} "
            "GiB this machine has available. The group's arrays are small in a model or "
            "checkpoint: the metadata is damaged; restore the group or fit again."
        )


def _open_checked(
    url_or_array, storage_options: dict | None, *, ndim: int | None, every_chunk: bool = False
) -> tuple[zarr.Array, str]:
    """Open an array after its metadata passed the checks; optionally require ``ndim``.

    An array opened from a location reads through a store that refuses lost
    data (:class:`_CheckedReads`; with ``every_chunk``, any missing chunk).
    """
    if isinstance(url_or_array, zarr.Array):
        arr, url = url_or_array, _describe(url_or_array)
    else:
        url = absolute_location(url_or_array)
        node = _probe(url, storage_options)
        _check_links(url)
        if node.kind == "group":
            raise _not_an_array(url, storage_options)
        _check_meta(url, node.meta, node.zarr_format)
        try:
            arr = zarr.open_array(
                store=_store(url, storage_options, read_only=True, every_chunk=every_chunk),
                mode="r",
                zarr_format=node.zarr_format,
            )
        except (ValueError, TypeError, KeyError, OverflowError, NotImplementedError) as exc:
            raise DkicfIOError(f"cannot open the Zarr array at {url}: {exc}") from exc
    check_store_safe(arr, name=url)
    if ndim is not None and arr.ndim != ndim:
        raise DkicfIOError(
            f"{url} is {arr.ndim}-D with shape {arr.shape}; a data array must be 2-D "
            "(n_samples, n_features)."
        )
    if ndim is not None and 0 in arr.shape:
        raise DkicfIOError(
            f"{url} is empty: shape {arr.shape}; it needs at least one row and column."
        )
    _check_extent(arr, url, every_chunk=every_chunk)
    return arr, url


def open_array(url, *, storage_options: dict | None = None) -> zarr.Array:
    """Open a 2-D numeric Zarr array (v3 or v2) for reading, after safety checks.

    Parameters
    ----------
    url : str or path-like
        Local path or fsspec URL of the array (for a dataset group, its ``X``:
        ``"data.zarr/X"``).
    storage_options : dict, optional
        Passed to fsspec for URLs (credentials, endpoint, ...).

    Returns
    -------
    zarr.Array
        Opened read-only, at the absolute location (:func:`absolute_location`).
        Reading a chunk that is missing from the store raises
        :class:`MissingChunkError` instead of giving the fill value.

    Raises
    ------
    DkicfIOError
        No store at ``url``; a group instead of an array (the message lists its
        arrays); pickle/object codecs or a non-numeric dtype (refused before any
        chunk is read); not 2-D; empty; a shape whose chunks are not all in the
        store (:class:`MissingChunkError`) or whose task graph would not fit in
        memory.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> write_group(os.path.join(d, "m.zarr"), {"X": np.ones((3, 2))}, {})
    >>> open_array(os.path.join(d, "m.zarr", "X")).shape
    (3, 2)
    """
    return _open_checked(url, storage_options, ndim=2, every_chunk=True)[0]


class _Reads:
    """A Zarr array as dask reads it, with damaged chunk data reported as a DkicfIOError.

    zarr and the codecs raise many types on bytes that do not decode (a
    RuntimeError from zstd, a ValueError from a reshape, ...), from inside
    a task; this names the store and the rows instead.
    """

    def __init__(self, arr: zarr.Array, url: str):
        self.arr, self.url = arr, url
        self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim

    def __dask_tokenize__(self):
        return ("dkicf-zarr", self.url, json.dumps(self.arr.metadata.to_dict(), sort_keys=True,
                                                   default=str))

    def __getitem__(self, key):
        try:
            return self.arr[key]
        except (DkicfError, MemoryError):
            raise
        except Exception as exc:
            where = key[0] if isinstance(key, tuple) and key else key
            rows = (f"rows {where.start}:{where.stop}" if isinstance(where, slice)
                    else f"selection {key}")
            raise DkicfIOError(
                f"cannot read {rows} of the Zarr array {self.url}: the chunk data does not "
                f"decode with the codecs its metadata declares ({type(exc).__name__}: {exc}). "
                "The store is damaged: restore it or convert the data again."
            ) from exc


def _from_zarr(arr: zarr.Array, url: str, chunks):
    import dask.array as da
    from dask.base import tokenize

    # A chunk longer than its dimension (zarr allows it) is read as the whole dimension.
    chunks = tuple(c if isinstance(c, tuple) else max(1, min(c, n))
                   for c, n in zip(chunks, arr.shape))
    reads = _Reads(arr, url)
    return da.from_array(reads, chunks=chunks, name=f"from-zarr-{tokenize(reads, chunks)}",
                         meta=np.empty((0,) * arr.ndim, dtype=arr.dtype), asarray=True)


def _check_label_values(url: str, values) -> None:
    """The group attribute ``label_values``: absent, or a list of numbers or strings."""
    if values is None:
        return
    if not isinstance(values, list) or not all(isinstance(v, (str, int, float)) for v in values):
        raise DkicfIOError(
            f"refusing {url}: its attribute label_values is {str(values)[:80]}, not a list of "
            "the original class values (numbers or strings, one per class index in y). "
            "Convert the data again, or remove the attribute."
        )


def _dask_chunks(arr: zarr.Array) -> tuple[int, int]:
    rows = (getattr(arr, "shards", None) or arr.chunks)[0]
    return (rows, arr.shape[1])


def as_dask(url_or_array, *, storage_options: dict | None = None):
    """A dask array over a 2-D numeric Zarr array, one task per row chunk.

    The dask chunks follow the Zarr row chunks (shards when sharded) and hold
    all columns, so each task reads whole chunks of its own.

    Parameters
    ----------
    url_or_array : str, path-like or zarr.Array
        What :func:`open_array` accepts, or an open array (checked the same way).
    storage_options : dict, optional
        Passed to fsspec for URLs.

    Returns
    -------
    dask.array.Array
        Opened from a location, its tasks fail with :class:`MissingChunkError`
        (naming the store) where a chunk, or the whole store, is missing for
        the worker that reads it; an open array is read as it is.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> write_group(os.path.join(d, "m.zarr"), {"X": np.ones((3, 2))}, {})
    >>> float(as_dask(os.path.join(d, "m.zarr", "X")).sum().compute())
    6.0
    """
    arr, url = _open_checked(url_or_array, storage_options, ndim=2, every_chunk=True)
    return _from_zarr(arr, url, _dask_chunks(arr))


def open_dataset(url, *, storage_options: dict | None = None):
    """Open a dataset store (group with ``X`` and optional ``y``) or a bare array.

    Parameters
    ----------
    url : str or path-like
        A dataset group as written by :func:`convert` / :func:`generate`, or a
        2-D array.
    storage_options : dict, optional
        Passed to fsspec for URLs.

    Returns
    -------
    X : dask.array.Array of shape (n_samples, n_features)
        Chunked by rows like the store; a task that finds its chunk, or the
        store, missing fails with :class:`MissingChunkError`.
    y : dask.array.Array of shape (n_samples,) or None
        Integer labels with X's row chunks, when the group has ``y``.  A
        missing chunk of ``y`` reads as the fill value (class 0), as zarr
        leaves such chunks out by default, but not a store that is missing.
    info : dict
        ``url`` (absolute, :func:`absolute_location`), ``shape``, ``chunks``,
        ``n_samples``, ``n_features``, ``dtype``, ``chunk_rows``,
        ``label_values`` (or None) and ``attrs`` (the group's attributes).

    Raises
    ------
    DkicfIOError
        Everything :func:`open_array` refuses; a group without ``X``; a ``y``
        that is not 1-D integer with one label per row of X.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _ = generate("ring", os.path.join(d, "ring.zarr"), 100)
    >>> X, y, info = open_dataset(os.path.join(d, "ring.zarr"))
    >>> X.shape, y.shape, info["label_values"]
    ((100, 2), (100,), [0, 1])
    """

    url = absolute_location(url)
    node = _probe(url, storage_options)
    if node.kind == "array":
        arr = open_array(url, storage_options=storage_options)
        X = as_dask(arr)
        attrs = dict(arr.attrs)
        y = None
    else:
        _check_links(url)
        names = _group_arrays(url, storage_options)
        if "X" not in names:
            listed = ", ".join(names) or "none"
            raise DkicfIOError(
                f"{url} is a Zarr group without an array X (its arrays: {listed}); a dataset "
                "group holds X (n_samples, n_features) and optionally y."
            )
        X = as_dask(_join(url, "X"), storage_options=storage_options)
        group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r")
        attrs = dict(group.attrs)
        y = None
        if "y" in names:
            y_arr, y_url = _open_checked(_join(url, "y"), storage_options, ndim=None)
            if y_arr.ndim != 1 or y_arr.shape[0] != X.shape[0]:
                raise DkicfIOError(
                    f"{y_url} has shape {y_arr.shape}; labels need shape ({X.shape[0]},), "
                    "one per row of X."
                )
            if np.dtype(y_arr.dtype).kind not in "iu":
                raise DkicfIOError(
                    f"{y_url} has dtype {y_arr.dtype}; labels must be integers "
                    "(convert writes int64 class indices)."
                )
            y = _from_zarr(y_arr, y_url, (X.chunks[0],))
            _check_label_values(url, attrs.get("label_values"))
    info = {
        "url": url,
        "shape": [int(X.shape[0]), int(X.shape[1])],
        "chunks": [int(X.chunks[0][0]), int(X.shape[1])],
        "n_samples": int(X.shape[0]),
        "n_features": int(X.shape[1]),
        "dtype": str(X.dtype),
        "chunk_rows": int(X.chunks[0][0]),
        "label_values": attrs.get("label_values") if y is not None else None,
        "attrs": attrs,
    }
    return X, y, info


# --------------------------------------------------------------------------
# writing safely


def _is_zarr_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in ("zarr.json", ".zarray", ".zgroup"))


def check_writable(url, *, overwrite: bool = False, storage_options: dict | None = None) -> None:
    """Fail early, before any computation, if a store cannot be written at ``url``.

    Parameters
    ----------
    url : str or path-like
        The destination store.
    overwrite : bool, default=False
        Whether an existing Zarr store there may be replaced.
    storage_options : dict, optional
        Passed to fsspec for URLs.

    Raises
    ------
    DkicfIOError
        ``url`` exists and ``overwrite`` is False; ``url`` exists and is not a
        Zarr store (never replaced, even with ``overwrite``); the nearest
        existing parent of a local path is not a writable directory.

    Notes
    -----
    For non-local URLs only existence is checked; permissions show at the
    first write.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> check_writable(os.path.join(d, "new.zarr"))
    >>> check_writable(d)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dkicf.io.OutputExistsError: ... already exists; ...
    """
    url = os.fspath(url)
    local = _local_path(url)
    if local is not None:
        if os.path.lexists(local):
            if not overwrite:
                raise OutputExistsError(
                    f"{url} already exists; pass overwrite=True to replace it, or choose "
                    "another path."
                )
            if not local.is_dir() or not _is_zarr_dir(local):
                raise DkicfIOError(
                    f"{url} exists and is not a Zarr store; refusing to replace it even with "
                    "overwrite=True. Remove it yourself or choose another path."
                )
        parent = local.absolute().parent
        while not os.path.lexists(parent) and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise DkicfIOError(
                f"cannot write {url}: {parent} is not a directory; choose another path."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise DkicfIOError(
                f"cannot write {url}: no write permission in {parent}; choose another path."
            )
        return
    fs, path = _fs(url, storage_options)
    if fs.exists(path):
        if not overwrite:
            raise OutputExistsError(
                f"{url} already exists; pass overwrite=True to replace it, or choose another "
                "path."
            )
        if _probe(url, storage_options, missing_ok=True) is None:
            raise DkicfIOError(
                f"{url} exists and is not a Zarr store; refusing to replace it even with "
                "overwrite=True."
            )


def _relation(out: str, where: str) -> str | None:
    """How location ``out`` relates to ``where``: "is", "is inside", "contains" or None."""
    lo, lw = _local_path(out), _local_path(where)
    if (lo is None) != (lw is None):
        return None
    if lo is not None:
        po, pw = lo.resolve(), lw.resolve()  # symlinks and ".." too
        if po == pw:
            return "is"
        return "is inside" if pw in po.parents else "contains" if po in pw.parents else None
    to, tw = absolute_location(out).rstrip("/"), absolute_location(where).rstrip("/")
    if to == tw:
        return "is"
    return ("is inside" if to.startswith(tw + "/")
            else "contains" if tw.startswith(to + "/") else None)


def check_not_input(out, inputs: dict) -> None:
    """Refuse an output location that is, holds or lies inside one of the inputs.

    Writing there would replace (or, with ``overwrite``, delete) data the run
    still reads.

    Parameters
    ----------
    out : str or path-like
        The output location.
    inputs : dict
        What each input is called in the message (e.g. ``"the dataset"``)
        mapped to its location; None locations are ignored.

    Raises
    ------
    DkicfIOError
        ``out`` is one of the inputs, inside one, or contains one.

    Examples
    --------
    >>> check_not_input("model.zarr", {"the dataset": "data.zarr"})
    >>> check_not_input("data.zarr/out", {"the dataset": "data.zarr"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dkicf.io.DkicfIOError: the output data.zarr/out is inside the dataset data.zarr; ...
    """
    out = os.fspath(out)
    for name, where in inputs.items():
        if where is None:
            continue
        where = os.fspath(where)
        relation = _relation(out, where)
        if relation is not None:
            raise DkicfIOError(
                f"the output {out} {relation} {name} {where}; writing it would replace data "
                "this run reads. Choose another output path."
            )


@contextlib.contextmanager
def _staged(url: str, *, overwrite: bool, storage_options: dict | None):
    """Yield a store to write a new node into; publish it at ``url`` on success only."""
    with staged_group(url, overwrite=overwrite, storage_options=storage_options) as where:
        if _local_path(url) is None:
            yield _store(url, storage_options, read_only=False)
        else:
            yield LocalStore(where)


def _publish(tmp: Path, dst: Path, url: str, *, overwrite: bool) -> None:
    """Move the complete store ``tmp`` to ``dst``; an old ``dst`` goes only afterwards."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    # Checked again: the destination may have appeared while we were writing.
    check_writable(url, overwrite=overwrite)
    old = dst.parent / f".{dst.name}.dkicf-old-{uuid.uuid4().hex[:12]}"
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _jsonable(value, where: str):
    """Attributes as plain JSON values; numpy scalars and arrays become numbers and lists."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise DkicfIOError(f"attribute keys must be strings, got {key!r} in {where}.")
            out[key] = _jsonable(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(item, where) for item in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist(), where)
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DkicfIOError(f"attribute {where} is {value}; JSON attributes must be finite.")
        return value
    raise DkicfIOError(
        f"attribute {where} has type {type(value).__name__}; attributes must be JSON values "
        "(numbers, strings, booleans, None, lists, dicts). Store arrays as arrays instead."
    )


def _version() -> str:
    from . import __version__

    return __version__


def write_group(
    url,
    arrays: dict[str, np.ndarray],
    attrs: dict[str, Any],
    *,
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> None:
    """Write small numeric arrays and JSON attributes as one Zarr v3 group.

    Meant for models and checkpoints: each array is stored whole in one chunk,
    the attributes are plain JSON (nothing is ever pickled), and the group also
    gets ``created_by``.

    Parameters
    ----------
    url : str or path-like
        Destination (local path or fsspec URL).
    arrays : dict of str to array-like
        Real-valued arrays of any shape; names must be plain (no ``/``, not
        starting with ``.``).
    attrs : dict
        JSON-compatible attributes; numpy scalars and arrays are converted.
    overwrite : bool, default=False
        Replace an existing store (see the module notes on safety).
    storage_options : dict, optional
        Passed to fsspec for URLs.

    Raises
    ------
    DkicfIOError
        Existing destination without ``overwrite``; bad names; non-numeric
        arrays; attributes that are not JSON values.

    Examples
    --------
    >>> import numpy as np
    >>> write_group("memory://doc/model.zarr", {"centers": np.eye(2)}, {"k": 2})
    >>> arrays, attrs = read_group("memory://doc/model.zarr")
    >>> arrays["centers"].tolist(), attrs["k"]
    ([[1.0, 0.0], [0.0, 1.0]], 2)
    """
    url = os.fspath(url)
    checked = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise DkicfIOError(
                f"array name {name!r} for {url} must be a non-empty string without '/' "
                "that does not start with '.'."
            )
        value = np.asarray(value)
        try:
            check_dtype(value.dtype, f"array {name!r}")
        except TypeError as exc:
            raise DkicfIOError(f"cannot write {url}: {exc}") from exc
        checked[name] = value
    meta = _jsonable(dict(attrs), "attrs")
    meta.setdefault("created_by", f"dkicf {_version()}")
    with _staged(url, overwrite=overwrite, storage_options=storage_options) as store:
        group = zarr.open_group(store=store, mode="w", zarr_format=3)
        for name, value in checked.items():
            chunks = tuple(max(1, s) for s in value.shape)
            # Every chunk written, zeros too: dkicf refuses stores with chunks missing.
            arr = group.create_array(name, shape=value.shape, chunks=chunks, dtype=value.dtype,
                                     config={"write_empty_chunks": True})
            if value.size:
                arr[...] = value
        group.attrs.update(meta)


def read_group(
    url, *, storage_options: dict | None = None, names=None
) -> tuple[dict, dict]:
    """Read a group written by :func:`write_group`: arrays as numpy, attributes as a dict.

    Every array's metadata is checked (:func:`check_store_safe`) before its
    data is read; sub-groups are ignored.

    Parameters
    ----------
    url : str or path-like
        Local path or fsspec URL of the group.
    storage_options : dict, optional
        Passed to fsspec for URLs.
    names : collection of str, optional
        Read only these arrays (large members such as ``P`` stay on disk).

    Returns
    -------
    arrays : dict of str to ndarray
    attrs : dict

    Examples
    --------
    >>> import numpy as np
    >>> write_group("memory://doc/g.zarr", {"w": np.arange(3.0)}, {"note": "x"})
    >>> read_group("memory://doc/g.zarr")[0]["w"].tolist()
    [0.0, 1.0, 2.0]
    """
    url = os.fspath(url)
    node = _probe(url, storage_options)
    if node.kind != "group":
        raise DkicfIOError(
            f"{url} is a Zarr array, not a group; read it with dkicf.io.open_array, or pass "
            "the group that contains it."
        )
    group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r")
    arrays = {}
    for name in _group_arrays(url, storage_options):
        if names is not None and name not in names:
            continue
        member = _probe(_join(url, name), storage_options)
        _check_meta(_join(url, name), member.meta, member.zarr_format)
        arr = group[name]
        check_store_safe(arr, name=_join(url, name))
        _check_extent(arr, _join(url, name), every_chunk=False)
        _check_allocation(arr, _join(url, name))
        arrays[name] = np.asarray(arr[...])
    return arrays, dict(group.attrs)


# --------------------------------------------------------------------------
# chunking


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return int(value)


def _resolve_chunk_rows(chunk_rows, n: int, d: int, dtype: np.dtype) -> int:
    """Rows per chunk: ``chunk_rows``, else dask's ``"auto"`` rule for all columns in one
    chunk, which follows the ``array.chunk-size`` setting (128 MiB unless configured)."""
    if chunk_rows is None:
        from dask.array.core import normalize_chunks

        chunk_rows = normalize_chunks(("auto", -1), shape=(max(n, 1), max(d, 1)),
                                      dtype=dtype)[0][0]
    return min(_positive_int(chunk_rows, "chunk_rows"), max(n, 1))


def _target_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise DkicfIOError(f"dtype must be 'float32' or 'float64', got {dtype!r}.")
    return dt


# --------------------------------------------------------------------------
# dataset writer


class _RowSink:
    """Collects row blocks of any size and writes whole, aligned chunks."""

    def __init__(self, X, y, chunk_rows: int, n: int, url: str, progress):
        self.X, self.y = X, y
        self.chunk_rows, self.n, self.url = chunk_rows, n, url
        self.progress = progress
        self.done = 0
        self.buf_X: list[np.ndarray] = []
        self.buf_y: list[np.ndarray] = []
        self.buffered = 0

    def push(self, Xb: np.ndarray, yb: np.ndarray | None) -> None:
        if self.done + self.buffered + Xb.shape[0] > self.n:
            raise DkicfIOError(
                f"the source yields more than the {self.n} rows it announced; was it modified "
                f"while {self.url} was being written?"
            )
        self.buf_X.append(Xb)
        if self.y is not None:
            self.buf_y.append(yb)
        self.buffered += Xb.shape[0]
        while self.buffered >= self.chunk_rows:
            self._flush(self.chunk_rows)

    def _take(self, parts: list[np.ndarray], rows: int) -> np.ndarray:
        joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
        parts[:] = [joined[rows:]] if joined.shape[0] > rows else []
        return joined[:rows]

    def _flush(self, rows: int) -> None:
        lo, hi = self.done, self.done + rows
        self.X[lo:hi] = self._take(self.buf_X, rows)
        if self.y is not None:
            self.y[lo:hi] = self._take(self.buf_y, rows)
        self.buffered -= rows
        self.done = hi
        if self.progress is not None:
            self.progress(self.done, self.n)

    def close(self) -> None:
        if self.buffered:
            self._flush(self.buffered)
        if self.done != self.n:
            raise DkicfIOError(
                f"the source yielded {self.done} rows, not the {self.n} it announced; was it "
                f"modified while {self.url} was being written?"
            )


def _write_dataset(
    url: str,
    *,
    n: int,
    d: int,
    dtype: np.dtype,
    chunk_rows: int,
    labelled: bool,
    blocks: Iterator[tuple[np.ndarray, np.ndarray | None]],
    attrs: dict,
    overwrite: bool,
    storage_options: dict | None,
    progress,
) -> None:
    # Every chunk is written, also one equal to the fill value (an all-zero block
    # of X, a block of class 0 in y): readers take a missing chunk for lost data.
    every = {"write_empty_chunks": True}
    with _staged(url, overwrite=overwrite, storage_options=storage_options) as store:
        group = zarr.open_group(store=store, mode="w", zarr_format=3)
        X = group.create_array("X", shape=(n, d), chunks=(chunk_rows, d), dtype=dtype,
                               config=every)
        y = None
        if labelled:
            y = group.create_array("y", shape=(n,), chunks=(chunk_rows,), dtype=np.int64,
                                   config=every)
        sink = _RowSink(X, y, chunk_rows, n, url, progress)
        for Xb, yb in blocks:
            sink.push(Xb, yb)
        sink.close()
        group.attrs.update(_jsonable(attrs, "attrs"))


def _finite_block(block, dtype: np.dtype, start: int, src: str) -> np.ndarray:
    out = np.asarray(block).astype(dtype, copy=False)
    if not np.isfinite(out).all():
        row = start + int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
        raise DkicfIOError(
            f"{src}: row {row} contains NaN or infinity (after conversion to {dtype}); "
            "remove or impute such rows before converting."
        )
    return out


# --------------------------------------------------------------------------
# labels


class _LabelCoder:
    """Maps arbitrary label values to 0..c-1, sorted numerically when all are numbers."""

    def __init__(self, src: str):
        self.src = src
        self.seen: set = set()
        self.lookup: dict = {}
        self.values: list = []

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        if values.ndim != 1 or (values.dtype.kind == "O" and any(
                isinstance(v, (list, tuple, dict, np.ndarray)) for v in values)):
            raise DkicfIOError(
                f"{self.src}: the label column holds lists or records, not one label per row: "
                "name a column of numbers or strings as the label column."
            )
        if values.dtype.kind == "f" and np.isnan(values).any():
            raise DkicfIOError(f"{self.src}: the labels contain NaN (missing values).")
        self.seen.update(np.unique(values).tolist())
        if len(self.seen) > _MAX_CLASSES:
            raise DkicfIOError(
                f"{self.src}: more than {_MAX_CLASSES} distinct label values; that is not a "
                "class label (a regression target?). Leave label_column unset."
            )

    def finish(self) -> list:
        seen = list(self.seen)
        numeric = {}
        for token in seen:
            try:
                number = float(token)
            except (TypeError, ValueError):
                numeric = None
                break
            if not math.isfinite(number):
                numeric = None
                break
            numeric[token] = number
        if numeric is not None:
            ordered = sorted(set(numeric.values()))
            code = {value: i for i, value in enumerate(ordered)}
            self.lookup = {token: code[number] for token, number in numeric.items()}
            self.values = [int(v) if float(v).is_integer() else v for v in ordered]
        else:
            ordered = sorted(str(token) for token in seen)
            code = {value: i for i, value in enumerate(ordered)}
            self.lookup = {token: code[str(token)] for token in seen}
            self.values = ordered
        return self.values

    def encode(self, values: np.ndarray) -> np.ndarray:
        uniq, inverse = np.unique(np.asarray(values), return_inverse=True)
        try:
            codes = np.array([self.lookup[u] for u in uniq.tolist()], dtype=np.int64)
        except KeyError as exc:
            raise DkicfIOError(
                f"{self.src}: label {exc.args[0]!r} appeared only on the second pass; was the "
                "file modified during conversion?"
            ) from None
        return codes[inverse.reshape(-1)]


# --------------------------------------------------------------------------
# sources


@dataclass
class _Source:
    """A file to convert: its size, its labels, and its rows in blocks."""

    fmt: str
    n: int
    d: int
    labels: _LabelCoder | None
    read: Callable[[int], Iterator[tuple[np.ndarray, np.ndarray | None]]]


@contextlib.contextmanager
def _npy_errors(src: str, what: str):
    """Any failure to parse .npy/.npz bytes as a :class:`DkicfIOError` naming the file.

    numpy and zipfile raise many types on damaged bytes (EOFError, zlib and
    tokenizer errors, ...); reading with ``allow_pickle=False`` runs no code,
    so every one of them means a file that is not what it claims.
    """
    try:
        yield
    except DkicfError:
        raise
    except Exception as exc:
        raise DkicfIOError(
            f"cannot read {src}: {what} is damaged or not a plain numeric .npy array "
            f"({type(exc).__name__}: {exc}). Save it again with numpy.save / numpy.savez."
        ) from exc


def _npy_source(path: Path, src: str, label_column) -> _Source:
    if label_column is not None:
        raise DkicfIOError(
            f"label_column applies to .csv and .parquet sources, not {src}; store labels as "
            "y in an .npz file instead."
        )
    with _npy_errors(src, "the .npy file"):
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    _check_source_layout(arr.dtype, arr.shape, src)

    def read(rows: int):
        for lo in range(0, arr.shape[0], rows):
            with _npy_errors(src, "the .npy file"):
                block = np.array(arr[lo : lo + rows])
            yield block, None

    return _Source("npy", arr.shape[0], arr.shape[1], None, read)


def _check_source_layout(dtype: np.dtype, shape: tuple, src: str) -> None:
    try:
        check_dtype(dtype, src)
    except TypeError as exc:
        raise DkicfIOError(str(exc)) from exc
    if len(shape) != 2:
        hint = " Reshape a single feature to (n, 1) first." if len(shape) == 1 else ""
        raise DkicfIOError(
            f"{src} holds a {len(shape)}-D array of shape {shape}; X must be 2-D.{hint}"
        )


def _npz_header(zf: zipfile.ZipFile, member: str, src: str):
    """Shape, Fortran order and dtype of an .npz member, and the open stream after the header."""
    stream = zf.open(member)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        stream.close()
        raise DkicfIOError(f"{src}: member {member} has .npy format {version}, not a plain array.")
    return stream, shape, fortran, dtype


def _npz_source(path: Path, src: str, label_column) -> _Source:
    """X streamed from the zip member row block by row block; y (small) read whole."""
    if label_column is not None:
        raise DkicfIOError(
            f"label_column applies to .csv and .parquet sources, not {src}; an .npz holds its "
            "labels as the array y."
        )
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise DkicfIOError(f"{src} is not a valid .npz (zip) file: {exc}") from exc
    with zf, _npy_errors(src, "the .npz file"):
        members = zf.namelist()
        if "X.npy" not in members:
            names = ", ".join(m.removesuffix(".npy") for m in members) or "none"
            raise DkicfIOError(
                f"{src} has no array X (its arrays: {names}); save it with "
                "np.savez(path, X=X, y=y)."
            )
        stream, shape, fortran, dtype = _npz_header(zf, "X.npy", src)
        stream.close()
    _check_source_layout(dtype, shape, src)
    n, d = shape
    coder = None
    if "y.npy" in members:
        with (_npy_errors(src, "its member y.npy"), zipfile.ZipFile(path) as zf,
              zf.open("y.npy") as f):
            y = np.lib.format.read_array(f, allow_pickle=False)
        if y.ndim != 1 or y.shape[0] != n:
            raise DkicfIOError(
                f"{src}: y has shape {y.shape} but X has {n} rows; labels need shape ({n},)."
            )
        coder = _LabelCoder(src)
        coder.add(y)

    def read(rows: int):
        with _npy_errors(src, "its member X.npy"), zipfile.ZipFile(path) as zf:
            stream, _, _, _ = _npz_header(zf, "X.npy", src)
            with stream:
                if fortran:
                    # Column-major data has no contiguous rows: this member is read whole.
                    data = np.frombuffer(stream.read(), dtype=dtype).reshape(shape, order="F")
                    for lo in range(0, n, rows):
                        yield data[lo : lo + rows], _y_slice(lo, lo + rows)
                    return
                row_bytes = d * dtype.itemsize
                for lo in range(0, n, rows):
                    count = min(rows, n - lo)
                    buf = stream.read(count * row_bytes)
                    if len(buf) != count * row_bytes:
                        raise DkicfIOError(f"{src}: X.npy ends early, after row {lo}.")
                    block = np.frombuffer(buf, dtype=dtype).reshape(count, d)
                    yield block, _y_slice(lo, lo + count)

    def _y_slice(lo: int, hi: int):
        return None if coder is None else y[lo:hi]

    return _Source("npz", n, d, coder, read)


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) for non-blank lines that are not '#' comments."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            stripped = line.strip()
            if stripped and not stripped.startswith("#"):
                yield number, stripped


def _line_blocks(path: Path, rows: int, skip: int = 0):
    lines = _text_lines(path)
    for _ in islice(lines, skip):
        pass
    while True:
        block = list(islice(lines, rows))
        if not block:
            return
        yield block


def _name_or_index(label_column, names: list[str]):
    """A label column given as text: a column name if there is one, else digits as an index.

    The command line passes every value as text; ``"2"`` names the column
    called "2" when the header has one, and the third column otherwise.
    """
    if isinstance(label_column, str) and label_column not in names:
        text = label_column.strip()
        if text.lstrip("-").isdigit():
            return int(text)
    return label_column


def _feature_columns(src: str, names: list[str] | None, width: int, label_idx: int | None,
                     columns, drop_columns) -> list[int]:
    """Indices of the feature columns: ``columns`` if given, less ``drop_columns`` and the label.

    Columns are named by header name or by 0-based index (as text from the
    command line too).
    """
    def index(column) -> int:
        column = _name_or_index(column, names or [])
        if isinstance(column, str):
            if not names or column not in names:
                have = ", ".join(names) if names else "no header row"
                raise DkicfIOError(f"{src}: no column named {column!r} ({have}).")
            return names.index(column)
        if isinstance(column, numbers.Integral) and not isinstance(column, bool):
            if not -width <= column < width:
                raise DkicfIOError(f"{src}: column {column} is out of range for {width} columns.")
            return int(column) % width
        raise DkicfIOError(f"columns are named by header name or index, got {column!r}.")

    chosen = range(width) if columns is None else [index(c) for c in columns]
    dropped = {index(c) for c in drop_columns or ()}
    if label_idx is not None:
        dropped.add(label_idx)
    features = [i for i in dict.fromkeys(chosen) if i not in dropped]
    if not features:
        raise DkicfIOError(f"{src} has no feature columns left besides the label and those "
                           "dropped.")
    return features


def _csv_source(path: Path, src: str, label_column, block_rows: int, columns=None,
                drop_columns=None) -> _Source:
    first = next(_text_lines(path), None)
    if first is None:
        raise DkicfIOError(f"{src} has no data lines.")
    line = first[1]
    counts = {sep: line.count(sep) for sep in (",", "\t", ";")}
    delimiter = max(counts, key=counts.get) if max(counts.values()) else None
    fields = [part.strip().strip('"') for part in line.split(delimiter)]
    header = None
    for part in fields:
        try:
            float(part)
        except ValueError:
            header = fields
            break
    width = len(fields)
    label_idx = None
    if label_column is not None:
        label_column = _name_or_index(label_column, header or [])
        if isinstance(label_column, str):
            if header is None or label_column not in header:
                have = ", ".join(header) if header else "no header row"
                raise DkicfIOError(
                    f"{src}: no column named {label_column!r} ({have}); pass a column name from "
                    "the header or an integer index."
                )
            label_idx = header.index(label_column)
        elif isinstance(label_column, numbers.Integral) and not isinstance(label_column, bool):
            if not -width <= label_column < width:
                raise DkicfIOError(
                    f"{src}: label_column={label_column} is out of range for {width} columns."
                )
            label_idx = int(label_column) % width
        else:
            raise DkicfIOError(
                f"label_column must be a column name or index, got {label_column!r}."
            )
    features = _feature_columns(src, header, width, label_idx, columns, drop_columns)
    skip = 1 if header is not None else 0

    def column_name(i: int) -> str:
        return f"column {i + 1}" + (f" ({header[i]})" if header else "")

    def locate(block, cols) -> str:
        """Where in ``block`` a value cannot be read: line and column, counted from 1."""
        for number, text in block:
            parts = [part.strip().strip('"') for part in text.split(delimiter)]
            if len(parts) != width:
                return f"line {number} has {len(parts)} fields, not {width}"
            for i in cols:
                try:
                    float(parts[i])
                except ValueError:
                    return f"line {number}, {column_name(i)}: {parts[i]!r} is not a number"
        return f"lines {block[0][0]} to {block[-1][0]}"

    def parse(block, dtype, cols):
        try:
            values = np.loadtxt(
                [text for _, text in block], delimiter=delimiter, usecols=cols, dtype=dtype,
                ndmin=2 if dtype is np.float64 else 1, comments=None, quotechar='"',
            )
        except ValueError:
            where = locate(block, cols if dtype is np.float64 else [])
            raise DkicfIOError(
                f"{src}, {where} (lines and columns counted from 1, the header included). "
                "Fix or remove such values first, or leave the column out with "
                "drop_columns (dkicf convert: --drop-columns)."
            ) from None
        if dtype is np.float64 and not np.isfinite(values).all():
            r, c = (int(v[0]) for v in np.nonzero(~np.isfinite(values)))
            raise DkicfIOError(
                f"{src}, line {block[r][0]}, {column_name(cols[c])}: NaN or infinity "
                "(lines and columns counted from 1, the header included); remove or impute "
                "such rows before converting."
            )
        return values

    if delimiter is not None:
        return _arrow_csv_source(path, src, first[0], delimiter, header, width, label_idx,
                                 features, column_name, locate, block_rows)
    # Numbers separated by whitespace: numpy.loadtxt reads them.
    n = 0
    coder = None
    if label_idx is None:
        n = sum(1 for _ in _text_lines(path)) - skip
    else:
        coder = _LabelCoder(src)
        for block in _line_blocks(path, block_rows, skip):
            coder.add(np.char.strip(parse(block, str, [label_idx])))
            n += len(block)

    def read(rows: int):
        for block in _line_blocks(path, rows, skip):
            Xb = parse(block, np.float64, features)
            yb = None if coder is None else np.char.strip(parse(block, str, [label_idx]))
            yield Xb, yb

    return _Source("csv", n, len(features), coder, read)


def _arrow_csv_source(path: Path, src: str, first_line: int, delimiter: str, header,
                      width: int, label_idx, features: list[int], column_name, locate,
                      block_rows: int) -> _Source:
    """A delimited text file read by ``pyarrow.csv``, in record batches.

    Leading blank and ``#`` lines are skipped, and so are ``#`` lines further
    down that do not have as many fields as the data.  On a value pyarrow
    cannot read, the file's lines are scanned once to name the line and
    column.
    """
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
    except ImportError as exc:
        raise DkicfIOError(
            f"reading {src} needs pyarrow; install it (pip install 'dkicf[parquet]')."
        ) from exc
    names = list(header) if header is not None else [f"column{i}" for i in range(width)]
    skip = first_line - 1 + (header is not None)

    def comment_rows(row) -> str:
        return "skip" if (row.text or "").lstrip().startswith("#") else "error"

    def batches(include: list[int], rows: int):
        types = {names[i]: pa.float64() for i in features}
        if label_idx is not None:
            types[names[label_idx]] = pa.string()
        try:
            yield from pacsv.open_csv(
                path,
                read_options=pacsv.ReadOptions(skip_rows=skip, column_names=names,
                                               block_size=max(rows * width * 24, 1 << 20)),
                parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"',
                                                 ignore_empty_lines=True,
                                                 invalid_row_handler=comment_rows),
                convert_options=pacsv.ConvertOptions(
                    include_columns=[names[i] for i in include],
                    column_types={names[i]: types[names[i]] for i in include},
                    strings_can_be_null=False, quoted_strings_can_be_null=False),
            )
        except pa.ArrowInvalid as exc:
            where = locate_in_file(include)
            raise DkicfIOError(
                f"{src}, {where or exc} (lines and columns counted from 1, the header "
                "included). Fix or remove such values first, or leave the column out with "
                "drop_columns (dkicf convert: --drop-columns)."
            ) from None

    def locate_in_file(include: list[int]) -> str | None:
        numeric = [i for i in include if i != label_idx]
        for block in _line_blocks(path, 65536, 1 if header is not None else 0):
            where = locate(block, numeric)
            if not where.startswith("lines "):
                return where
        return None

    def data_line(index: int) -> int:
        """Line number of data row ``index`` (from 0), counting blank and '#' lines."""
        lines = _text_lines(path)
        if header is not None:
            next(lines)
        return next(islice(lines, index, None))[0]

    coder = None
    n = 0
    counted = [label_idx] if label_idx is not None else features[:1]
    if label_idx is not None:
        coder = _LabelCoder(src)
    for batch in batches(counted, block_rows):
        n += batch.num_rows
        if coder is not None:
            coder.add(np.char.strip(batch.column(0).to_numpy(zero_copy_only=False)
                                    .astype(str)))

    def read(rows: int):
        start = 0
        include = features + ([label_idx] if label_idx is not None else [])
        for batch in batches(include, rows):
            Xb = np.column_stack([batch.column(j).to_numpy(zero_copy_only=False)
                                  for j in range(len(features))]).astype(np.float64)
            bad = ~np.isfinite(Xb)
            if bad.any():
                r, c = (int(v[0]) for v in np.nonzero(bad))
                raise DkicfIOError(
                    f"{src}, line {data_line(start + r)}, {column_name(features[c])}: NaN or "
                    "infinity (lines and columns counted from 1, the header included); remove "
                    "or impute such rows before converting."
                )
            yb = None
            if label_idx is not None:
                yb = np.char.strip(batch.column(len(features)).to_numpy(zero_copy_only=False)
                                   .astype(str))
            start += batch.num_rows
            yield Xb, yb

    return _Source("csv", n, len(features), coder, read)


def _svmlight_tokens(src: str, number: int, text: str) -> tuple[str, list[tuple[int, float]]]:
    text = text.split("#", 1)[0]
    tokens = text.split()
    label = tokens[0]
    if "," in label:
        raise DkicfIOError(
            f"{src}, line {number}: multi-label value {label!r}; only one label per line is "
            "supported."
        )
    pairs = []
    for token in tokens[1:]:
        key, sep, value = token.partition(":")
        if key == "qid":
            continue
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise DkicfIOError(
                f"{src}, line {number}: cannot read {token!r}; expected index:value."
            ) from None
        if not sep:
            raise DkicfIOError(
                f"{src}, line {number}: cannot read {token!r}; expected index:value."
            )
    return label, pairs


def _svmlight_source(path: Path, src: str, label_column, block_rows: int) -> _Source:
    """svmlight text read by :func:`sklearn.datasets.load_svmlight_file`, a byte range at a
    time (``offset``/``length``, whole lines each).

    Two passes: the first finds n, the smallest and largest index and the
    labels; the second writes dense rows, with 0-based indices only if the
    file uses index 0 somewhere (one decision for the whole file).
    """
    if label_column is not None:
        raise DkicfIOError(
            f"label_column does not apply to svmlight files ({src}); their first field is the "
            "label."
        )
    from sklearn.datasets import load_svmlight_file

    size = path.stat().st_size

    def pieces(window: int, n_features: int, zero_based=True):
        for offset in range(0, size, window):
            try:
                Xs, y = load_svmlight_file(str(path), n_features=n_features,
                                           zero_based=zero_based, offset=offset, length=window,
                                           dtype=np.float64)
            except ValueError as exc:
                raise DkicfIOError(f"{src}, {_svmlight_problem(path, src) or exc}") from None
            except OverflowError:  # scikit-learn's parser keeps indices in int32
                raise DkicfIOError(
                    f"{src} has a feature index beyond {np.iinfo(np.int32).max:,}, more "
                    "columns than a dataset can hold: check the file, or renumber its features."
                ) from None
            if Xs.shape[0]:
                yield Xs, y

    coder = _LabelCoder(src)
    n = 0
    low, high = None, -1
    # The width is not known yet: any index up to int32's range is accepted.
    for Xs, y in pieces(16 * MiB, n_features=np.iinfo(np.int32).max):
        n += Xs.shape[0]
        coder.add(y)
        if Xs.nnz:
            low = int(Xs.indices.min()) if low is None else min(low, int(Xs.indices.min()))
            high = max(high, int(Xs.indices.max()))
    if n == 0:
        raise DkicfIOError(f"{src} has no data lines.")
    # Indices start at 1 in the format; a file that uses index 0 is zero-based.
    base = 0 if low == 0 else 1
    d = max(high - base + 1, 1)
    # Byte ranges of about block_rows lines: dense blocks of bounded size.
    window = max(int(block_rows * size / n), 1 << 16)

    def read(rows: int):
        for Xs, y in pieces(window, n_features=d, zero_based=base == 0):
            yield Xs.toarray(), y

    return _Source("svmlight", n, d, coder, read)


def _svmlight_problem(path: Path, src: str) -> str | None:
    """The first line of an svmlight file that load_svmlight_file refused, and why."""
    for number, text in _text_lines(path):
        try:
            _, pairs = _svmlight_tokens(src, number, text)
        except DkicfIOError as exc:
            return str(exc).removeprefix(f"{src}, ")
        for index, _ in pairs:
            if index < 0:
                return f"line {number}: negative feature index {index}."
    return None


def _parquet_source(path: Path, src: str, label_column, block_rows: int, columns=None,
                    drop_columns=None) -> _Source:
    try:
        import pyarrow as pa
        import pyarrow.dataset as pads
    except ImportError as exc:
        raise DkicfIOError(
            f"reading {src} needs pyarrow; install it (pip install 'dkicf[parquet]')."
        ) from exc
    try:
        # A file, or a directory of them (a partitioned data set), as one table.
        pf = pads.dataset(path, format="parquet")
    except (OSError, pa.ArrowException) as exc:
        raise DkicfIOError(f"cannot read {src} as Parquet: {exc}") from exc
    schema = pf.schema
    names = list(schema.names)
    label = None
    if label_column is not None:
        label_column = _name_or_index(label_column, names)
        if isinstance(label_column, str):
            if label_column not in names:
                raise DkicfIOError(
                    f"{src}: no column named {label_column!r}; columns: {', '.join(names)}."
                )
            label = label_column
        elif isinstance(label_column, numbers.Integral) and not isinstance(label_column, bool):
            if not -len(names) <= label_column < len(names):
                raise DkicfIOError(
                    f"{src}: label_column={label_column} is out of range for {len(names)} columns."
                )
            label = names[label_column]
        else:
            raise DkicfIOError(
                f"label_column must be a column name or index, got {label_column!r}."
            )
    features = [names[i] for i in _feature_columns(
        src, names, len(names), None if label is None else names.index(label), columns,
        drop_columns)]
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    bad = [f"{c} ({schema.field(c).type})" for c in features
           if not any(test(schema.field(c).type) for test in numeric)]
    if bad:
        raise DkicfIOError(
            f"{src}: columns {', '.join(bad)} are not numeric; drop them, or name the class "
            "column with label_column."
        )
    if not features:
        raise DkicfIOError(f"{src} has no feature columns besides the label.")
    coder = None
    if label is not None:
        coder = _LabelCoder(src)
        for batch in pf.to_batches(batch_size=block_rows, columns=[label]):
            column = batch.column(0)
            if column.null_count:
                raise DkicfIOError(f"{src}: label column {label!r} has missing values.")
            coder.add(column.to_numpy(zero_copy_only=False))

    def read(rows: int):
        columns = features + ([label] if label is not None else [])
        for batch in pf.to_batches(batch_size=rows, columns=columns):
            Xb = np.column_stack(
                [batch.column(i).to_numpy(zero_copy_only=False).astype(np.float64)
                 for i in range(len(features))]
            )
            yb = None
            if label is not None:
                yb = batch.column(len(features)).to_numpy(zero_copy_only=False)
            yield Xb, yb

    return _Source("parquet", pf.count_rows(), len(features), coder, read)


def _is_svmlight(path: Path, lines: int = 100) -> bool:
    """Whether a ``.txt`` file is svmlight text: ``index:value`` fields in its first lines.

    Otherwise it is read as delimited numbers (whitespace, comma, tab or
    semicolon), as :func:`numpy.loadtxt` would.
    """
    for _, text in islice(_text_lines(path), lines):
        if any(":" in token for token in text.split("#", 1)[0].split()[1:]):
            return True
    return False


def _open_source(path: Path, src: str, label_column, block_rows: int, columns=None,
                 drop_columns=None) -> _Source:
    suffix = ".parquet" if path.is_dir() else path.suffix.lower()
    table = suffix in (".csv", ".parquet") or (suffix == ".txt" and not _is_svmlight(path))
    if (columns is not None or drop_columns) and not table:
        raise DkicfIOError(
            f"columns and drop_columns apply to .csv and .parquet sources, not {src}."
        )
    if table and suffix != ".parquet":
        return _csv_source(path, src, label_column, block_rows, columns, drop_columns)
    if suffix == ".parquet":
        return _parquet_source(path, src, label_column, block_rows, columns, drop_columns)
    if suffix == ".npy":
        return _npy_source(path, src, label_column)
    if suffix == ".npz":
        return _npz_source(path, src, label_column)
    return _svmlight_source(path, src, label_column, block_rows)


def _check_block_fits(src: str, n: int, d: int, rows: int) -> None:
    """Refuse a source whose rows are too wide to hold one block of them in memory.

    The width comes from the file (the largest svmlight index, the longest
    csv line, the .npy header): a damaged or hostile file can claim any.
    """
    import psutil

    # A block is parsed as float64 and then converted: two copies at most.
    need = 2 * min(rows, n) * d * 8
    available = psutil.virtual_memory().available
    if need > available:
        raise DkicfIOError(
            f"cannot convert {src}: it has {d:,} columns, so a block of {min(rows, n):,} "
            f"row(s) needs {need / 2**30:.3g} GiB, more than the {available / 2**30:.3g} GiB "
            "available. If the file is right, convert it with fewer columns; a single huge "
            "index in an svmlight line, or a damaged header, gives such a width."
        )


def convert(
    src,
    dst,
    *,
    dtype: str = "float32",
    chunk_rows: int | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    label_column: str | int | None = None,
    progress: Callable[[int, int], None] | None = None,
    columns: list[str | int] | None = None,
    drop_columns: list[str | int] | None = None,
) -> dict[str, Any]:
    """Convert a data file to a dataset store, reading it in row blocks.

    Supported sources (by suffix): ``.npy`` (memory-mapped, copied in row
    blocks), ``.npz`` (array ``X`` and optional ``y``; X is streamed from the
    zip member, y is read whole, and a Fortran-ordered X is read whole),
    ``.csv`` (comma, tab or semicolon separated, detected from the first line,
    else whitespace; a first line with any non-numeric field is a header;
    blank lines and lines starting with ``#`` are skipped; read in blocks of
    lines), svmlight/LIBSVM text (``.svm``, ``.libsvm``, ``.svmlight``, and
    ``.txt`` whose first lines have ``index:value`` fields: read twice in
    blocks of lines, first for the size and labels; indices are 1-based
    unless the file uses index 0; written dense), other ``.txt`` files as
    ``.csv`` (delimited numbers, as :func:`numpy.loadtxt` reads them) and
    ``.parquet`` files and directories of them (a partitioned data set, read
    with ``pyarrow.dataset``; numeric columns, read batch by batch).
    Delimited text goes through ``pyarrow.csv`` and svmlight through
    :func:`sklearn.datasets.load_svmlight_file` on byte ranges.  Large
    sources are never loaded whole.

    Labels (``y`` of an .npz, the first field of svmlight lines, the
    ``label_column`` of a csv/parquet file) are stored as int64 class indices
    ``0 .. c-1``; the original values, sorted (numerically when they are all
    numbers), are saved in the attribute ``label_values``.

    Parameters
    ----------
    src : str or path-like
        A local file.
    dst : str or path-like
        The dataset store to create (local path or fsspec URL).
    dtype : {"float32", "float64"}, default="float32"
        dtype of the stored X.
    chunk_rows : int, optional
        Rows per chunk, and rows per block read from the source; by default
        dask's ``"auto"`` chunking (the ``array.chunk-size`` setting, 128 MiB
        unless configured), all columns in one chunk.
    overwrite : bool, default=False
        Replace an existing store at ``dst`` (only after the new one is
        complete, for local paths).
    storage_options : dict, optional
        Passed to fsspec for a ``dst`` URL.
    label_column : str or int, optional
        Name or index of the class column of a csv or parquet file; by default
        no labels are read from them.
    progress : callable, optional
        Called as ``progress(rows_written, n_samples)`` after every chunk.
    columns, drop_columns : list of str or int, optional
        csv and parquet: the feature columns to keep (default: all but the
        label), and columns to leave out (an id, a text column), by header
        name or 0-based index.

    Returns
    -------
    info : dict
        ``url``, ``source``, ``format``, ``shape``, ``chunks``, ``n_samples``,
        ``n_features``, ``dtype``, ``chunk_rows``, ``labels`` (bool),
        ``label_values`` and ``n_classes`` (None without labels).

    Raises
    ------
    DkicfIOError
        Missing or unsupported source, unreadable values, NaN or infinity (with
        the row), labels whose count differs from X's rows, an existing
        ``dst`` without ``overwrite``.  Nothing is left at ``dst`` then.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> np.save(os.path.join(d, "x.npy"), np.arange(12.0).reshape(6, 2))
    >>> info = convert(os.path.join(d, "x.npy"), os.path.join(d, "x.zarr"), chunk_rows=4)
    >>> info["n_samples"], info["n_features"], info["dtype"]
    (6, 2, 'float32')
    """
    path = Path(os.fspath(src)).expanduser()
    src_name = os.fspath(src)
    dst = os.fspath(dst)
    target = _target_dtype(dtype)
    parquet_dir = path.is_dir() and any(path.rglob("*.parquet"))
    if path.suffix.lower() not in _SUFFIXES and not parquet_dir:
        raise DkicfIOError(
            f"cannot convert {src_name}: unknown file type {path.suffix!r}; supported: "
            f"{', '.join(_SUFFIXES)}."
        )
    if not path.is_file() and not parquet_dir:
        raise DkicfIOError(f"cannot convert {src_name}: no such file.")
    check_writable(dst, overwrite=overwrite, storage_options=storage_options)
    if chunk_rows is not None:
        _positive_int(chunk_rows, "chunk_rows")
    # Text sources are read in blocks of this many lines before the width is known.
    block_rows = chunk_rows or 65536
    source = _open_source(path, src_name, label_column, block_rows, columns, drop_columns)
    if source.n == 0 or source.d == 0:
        raise DkicfIOError(f"{src_name} is empty: {source.n} rows, {source.d} columns.")
    rows = _resolve_chunk_rows(chunk_rows, source.n, source.d, target)
    _check_block_fits(src_name, source.n, source.d, rows)
    label_values = source.labels.finish() if source.labels is not None else None

    def blocks():
        start = 0
        for Xb, yb in source.read(rows):
            Xb = _finite_block(Xb, target, start, src_name)
            start += Xb.shape[0]
            yield Xb, (None if source.labels is None else source.labels.encode(yb))

    attrs = {
        "source": path.name,
        "source_format": source.fmt,
        "dtype": str(target),
        "shape": [source.n, source.d],
        "created_by": f"dkicf {_version()}",
    }
    if label_values is not None:
        attrs["label_values"] = label_values
    _write_dataset(
        dst, n=source.n, d=source.d, dtype=target, chunk_rows=rows,
        labelled=label_values is not None, blocks=blocks(), attrs=attrs,
        overwrite=overwrite, storage_options=storage_options, progress=progress,
    )
    return {
        "url": dst,
        "source": path.name,
        "format": source.fmt,
        "shape": [source.n, source.d],
        "chunks": [rows, source.d],
        "n_samples": source.n,
        "n_features": source.d,
        "dtype": str(target),
        "chunk_rows": rows,
        "labels": label_values is not None,
        "label_values": label_values,
        "n_classes": None if label_values is None else len(label_values),
    }


def generate(
    kind: str,
    dst,
    n: int,
    *,
    chunk_rows: int | None = None,
    dtype: str = "float64",
    random_state: int = 0,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    **params,
) -> dict[str, Any]:
    """Write a synthetic dataset (:mod:`dkicf.synthetic`) chunk by chunk to a dataset store.

    Only one chunk exists in memory at a time, so ``n`` may be far larger than
    memory (1e8 rows and more).  The stored rows are those of
    ``synthetic.generate_rows`` and do not depend on ``chunk_rows``.

    Parameters
    ----------
    kind : str
        A name in :data:`dkicf.synthetic.KINDS`.
    dst : str or path-like
        The dataset store to create.
    n : int
        Number of rows.
    chunk_rows : int, optional
        Rows per chunk; by default dask's ``"auto"`` chunking (the
        ``array.chunk-size`` setting), all columns in one chunk.
    dtype : {"float64", "float32"}, default="float64"
        dtype of the stored X.
    random_state : int, default=0
        Seed of the dataset.
    overwrite : bool, default=False
        Replace an existing store at ``dst``.
    storage_options : dict, optional
        Passed to fsspec for a ``dst`` URL.
    progress : callable, optional
        Called as ``progress(rows_written, n)`` after every chunk.
    **params
        Parameters of the kind, e.g. ``n_features`` and ``centers`` for blobs.

    Returns
    -------
    info : dict
        ``url``, ``kind``, ``shape``, ``chunks``, ``n_samples``,
        ``n_features``, ``dtype``, ``chunk_rows``, ``labels`` (True),
        ``label_values`` and ``n_classes``.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> info = generate("blobs", os.path.join(d, "b.zarr"), 1000, chunk_rows=256, centers=4)
    >>> info["n_samples"], info["n_features"], info["label_values"]
    (1000, 2, [0, 1, 2, 3])
    """
    dst = os.fspath(dst)
    described = synthetic.kind_info(kind, **params)
    seed = synthetic._check_seed(random_state)
    n = _positive_int(n, "n")
    target = _target_dtype(dtype)
    check_writable(dst, overwrite=overwrite, storage_options=storage_options)
    d = described["n_features"]
    rows = _resolve_chunk_rows(chunk_rows, n, d, target)
    label_values = list(range(described["n_classes"]))

    def blocks():
        for lo in range(0, n, rows):
            Xb, yb = synthetic.generate_rows(
                kind, lo, min(lo + rows, n), n_total=n, random_state=seed, **params
            )
            yield Xb.astype(target, copy=False), yb

    attrs = {
        "source": f"synthetic:{kind}",
        "source_format": "synthetic",
        "synthetic": {"kind": kind, "random_state": seed, "params": described["params"]},
        "dtype": str(target),
        "shape": [n, d],
        "created_by": f"dkicf {_version()}",
        "label_values": label_values,
    }
    _write_dataset(
        dst, n=n, d=d, dtype=target, chunk_rows=rows, labelled=True, blocks=blocks(),
        attrs=attrs, overwrite=overwrite, storage_options=storage_options, progress=progress,
    )
    return {
        "url": dst,
        "kind": kind,
        "shape": [n, d],
        "chunks": [rows, d],
        "n_samples": n,
        "n_features": d,
        "dtype": str(target),
        "chunk_rows": rows,
        "labels": True,
        "label_values": label_values,
        "n_classes": len(label_values),
    }


# --------------------------------------------------------------------------
# fingerprints


def fingerprint(arr_or_url, *, storage_options: dict | None = None) -> dict[str, Any]:
    """Identify an array cheaply: location, shape, chunks, dtype and a content hash.

    The hash is SHA-256 over the decoded values (C order, little-endian) of
    the first and the last chunk only, so it notices a replaced or regenerated
    array without reading it all.  Models and checkpoints store it to check
    that they are used with the data they were made from.

    Parameters
    ----------
    arr_or_url : zarr.Array, str or path-like
        An open array or the location of one (checked like :func:`open_array`,
        any number of dimensions).
    storage_options : dict, optional
        Passed to fsspec for URLs.

    Returns
    -------
    dict
        ``url``, ``shape``, ``chunks``, ``dtype``, ``zarr_format`` and
        ``content_sha256``; JSON-ready.

    Examples
    --------
    >>> import numpy as np
    >>> write_group("memory://doc/f.zarr", {"X": np.ones((5, 2))}, {})
    >>> fp = fingerprint("memory://doc/f.zarr/X")
    >>> fp["shape"], fp["chunks"], len(fp["content_sha256"])
    ([5, 2], [5, 2], 64)
    """
    arr, url = _open_checked(arr_or_url, storage_options, ndim=None)
    digest = hashlib.sha256()
    digest.update(json.dumps([list(arr.shape), str(arr.dtype)]).encode())
    if arr.size:
        chunks = arr.chunks
        first = tuple(slice(0, min(c, s)) for c, s in zip(chunks, arr.shape))
        last = tuple(slice(((s - 1) // c) * c, s) for c, s in zip(chunks, arr.shape))
        for region in (first, last):
            values = np.ascontiguousarray(arr[region])
            digest.update(values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes())
    return {
        "url": url,
        "shape": list(arr.shape),
        "chunks": list(arr.chunks),
        "dtype": str(arr.dtype),
        "zarr_format": int(arr.metadata.zarr_format),
        "content_sha256": digest.hexdigest(),
    }



# --------------------------------------------------------------------------
# claims: one run at a time writes a location

# A claim file still being written by the run that created it (it is written
# right after its exclusive creation) is read again until it is this old.
_CLAIM_WRITE_GRACE_S = 5.0


class ClaimedError(DkicfIOError):
    """Another dkicf run holds the location, or a run that held it ended without releasing it.

    Attributes
    ----------
    location : str
        The location claimed.
    holder : dict
        What the claim says of the run holding it: ``pid``, ``host``, ``since``.
    stale : bool
        True when that run is known to have ended (killed, crashed): the claim
        can be taken over (``resume=True`` or ``overwrite=True``).
    """

    def __init__(self, message: str, location: str, holder: dict, stale: bool):
        super().__init__(message)
        self.location = location
        self.holder = holder
        self.stale = stale

    def __reduce__(self):
        return (type(self), (str(self), self.location, self.holder, self.stale))


def _claim_file(local: Path) -> Path:
    return local.parent / f".{local.name}.dkicf-claim"


def _process_started(pid: int) -> float | None:
    """When process ``pid`` of this host started, or None if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return -1.0  # it exists; its start time is not ours to read


def _holder_alive(holder: dict) -> bool | None:
    """Whether the run of a claim still runs: True, False, or None (another host)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid, started = holder.get("pid"), holder.get("started")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    now = _process_started(pid)
    # A pid that was reused by a later process is not the run that claimed.
    return now is not None and (now < 0 or abs(now - started) < 1.0)


def _read_claim(path: Path) -> dict | None:
    """The record of the claim at ``path``; None once it is gone; {} while unreadable."""
    try:
        raw = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    if isinstance(holder, dict):
        return holder
    # Created but not written yet by its run, or damaged: damaged once old enough.
    return {} if time.time() - mtime < _CLAIM_WRITE_GRACE_S else {"damaged": True}


def _claim_message(what: str, url: str, holder: dict, alive: bool | None, path: Path) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    run = f"pid {holder.get('pid')} on {holder.get('host')}, since {when}"
    if holder.get("damaged"):
        return (f"{what} {url} has a claim file that is not readable ({path}); if no dkicf "
                "run is writing there, pass resume=True (dkicf fit: --resume) or "
                "overwrite=True (--overwrite) to take it over.")
    if alive:
        return (f"{what} {url} is being written by another dkicf run ({run}); two runs "
                f"cannot share it. Wait for that run to end, or choose another location.")
    if alive is None:
        return (f"{what} {url} is claimed by a dkicf run on another host ({run}); this "
                f"machine cannot tell whether it still runs. If it has ended, remove {path}.")
    return (f"{what} {url} was claimed by a dkicf run that is no longer running ({run}; "
            "killed or crashed). Pass resume=True (dkicf fit: --resume) to continue from its "
            "checkpoint, or overwrite=True (--overwrite) to start again; either takes the "
            "claim over.")


def _take_claim(url: str, what: str, take_over: bool) -> tuple[Path, str] | None:
    """Create the claim file of a local ``url``; (its path, our token), or None for URLs."""
    local = _local_path(url)
    if local is None:
        return None
    local = local.absolute()
    path = _claim_file(local)
    token = uuid.uuid4().hex
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": _process_started(os.getpid()), "since": time.time(),
              "location": str(local), "token": token}
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_claim(path)
            if holder is None:
                continue  # released meanwhile: try again
            if holder == {}:
                time.sleep(0.05)
                continue
            alive = None if holder.get("damaged") else _holder_alive(holder)
            if alive is not False and not (holder.get("damaged") and take_over):
                raise ClaimedError(_claim_message(what, url, holder, alive, path), url,
                                   holder, stale=False) from None
            if not take_over:
                raise ClaimedError(_claim_message(what, url, holder, alive, path), url,
                                   holder, stale=True) from None
            # Moved aside by one taker only: the others find the claim it makes next.
            aside = path.with_name(f"{path.name}-stale-{token}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            with contextlib.suppress(OSError):
                os.unlink(aside)
            continue
        else:
            break
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path, token


def _release_claim(path: Path, token: str) -> None:
    holder = _read_claim(path)
    if isinstance(holder, dict) and holder.get("token") == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def claimed(locations: dict[str, Any], *, take_over: bool = False):
    """Hold an exclusive claim on each location for the ``with`` block.

    A run that writes a location (an output, a checkpoint) claims it first,
    so that a second run on the same location is refused at once instead of
    mixing its writes with the first's.  The claim is a small file beside
    the location (``.NAME.dkicf-claim``) naming the process, created
    exclusively; it is removed when the block ends, also on an error.  A
    claim whose process no longer runs (killed) is stale: it is taken over
    with ``take_over=True`` and refused otherwise.  Locations other than
    local paths (object stores) are not claimed.

    Parameters
    ----------
    locations : dict
        What each location is called in messages (e.g. ``"the output"``)
        mapped to the location; None locations are skipped.
    take_over : bool, default=False
        Take over claims left by runs that no longer run.

    Raises
    ------
    ClaimedError
        A location is claimed by a running process, by one on another host,
        or (without ``take_over``) by one that ended without releasing it.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with claimed({"the output": os.path.join(d, "m.zarr")}):
    ...     with claimed({"the output": os.path.join(d, "m.zarr")}):  # doctest: +ELLIPSIS
    ...         pass
    Traceback (most recent call last):
    ...
    dkicf.io.ClaimedError: the output ... is being written by another dkicf run (pid ...
    """
    held = []
    try:
        for what, url in locations.items():
            if url is None:
                continue
            claim = _take_claim(absolute_location(os.fspath(url)), what, take_over)
            if claim is not None:
                held.append(claim)
        yield
    finally:
        for path, token in reversed(held):
            _release_claim(path, token)


# --------------------------------------------------------------------------
# outputs of a fit: a group written in stages, with large arrays from dask


@contextlib.contextmanager
def staged_group(url, *, overwrite: bool = False, storage_options: dict | None = None):
    """Yield a location to build a group in; it appears at ``url`` only when complete.

    For local paths the group is built in a temporary sibling and moved into
    place at the end (an existing group is replaced only then, and only with
    ``overwrite=True``); a failure leaves ``url`` as it was.  For other URLs
    the group is written in place after the same checks.

    Yields
    ------
    str
        The location to write to (pass it to :func:`write_group` with
        ``overwrite=True`` and to :func:`write_dask`).
    """
    url = os.fspath(url)
    check_writable(url, overwrite=overwrite, storage_options=storage_options)
    local = _local_path(url)
    if local is None:
        fs, path = _fs(url, storage_options)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        try:
            yield url
        except BaseException:
            # Twice: a write task still running when the fit failed (the others'
            # failure does not stop it) may re-create a file after the first removal.
            for pause in (0.0, 0.5):
                time.sleep(pause)
                with contextlib.suppress(Exception):
                    if fs.exists(path):
                        fs.rm(path, recursive=True)
            raise
        return
    local = local.absolute()
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.parent / f".{local.name}.dkicf-tmp-{uuid.uuid4().hex[:12]}"
    try:
        yield str(tmp)
        _publish(tmp, local, url, overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.lexists(tmp):  # a write that was under way: it cannot start another
            time.sleep(0.5)
            shutil.rmtree(tmp, ignore_errors=True)


def remove_member(group_url, name: str, *, storage_options: dict | None = None) -> None:
    """Remove the member ``name`` of a group being built (inside :func:`staged_group`)."""
    group = zarr.open_group(
        store=_store(os.fspath(group_url), storage_options, read_only=False), mode="r+"
    )
    if name in group:
        del group[name]


def write_members(
    group_url, arrays: dict, attrs: dict, *, storage_options: dict | None = None
) -> None:
    """Add small arrays and JSON attributes to a group being built (no staging of its own).

    Used inside :func:`staged_group`, where large members (``P``, ``labels``)
    are written by the cluster into the same group.
    """
    group_url = os.fspath(group_url)
    meta = _jsonable(dict(attrs), "attrs")
    meta.setdefault("created_by", f"dkicf {_version()}")
    group = zarr.open_group(store=_store(group_url, storage_options, read_only=False), mode="a",
                            zarr_format=3)
    for name, value in arrays.items():
        value = np.asarray(value)
        try:
            check_dtype(value.dtype, f"array {name!r}")
        except TypeError as exc:
            raise DkicfIOError(f"cannot write {group_url}: {exc}") from exc
        chunks = tuple(max(1, s) for s in value.shape)
        arr = group.create_array(name, shape=value.shape, chunks=chunks, dtype=value.dtype,
                                 overwrite=True, config={"write_empty_chunks": True})
        if value.size:
            arr[...] = value
    group.attrs.update(meta)


def write_dask(group_url, name: str, darr, *, storage_options: dict | None = None) -> None:
    """Write a dask array chunk by chunk as array ``name`` of an existing group.

    Rows keep the dask array's (regular) row chunks and all columns go in one
    chunk, so each task writes whole Zarr chunks of its own; nothing is
    gathered to this process.
    """
    import dask.array as da

    group_url = os.fspath(group_url)
    rows = darr.chunks[0]
    if len(set(rows[:-1])) > 1 or (len(rows) > 1 and rows[-1] > rows[0]):
        darr = darr.rechunk({0: max(rows)})
        rows = darr.chunks[0]
    if darr.ndim > 1:
        darr = darr.rechunk({i: -1 for i in range(1, darr.ndim)})
    chunks = (max(rows[0], 1),) + tuple(max(s, 1) for s in darr.shape[1:])
    local = _local_path(group_url)
    store = (_StagingStore(local) if local is not None and local.is_dir()
             else _store(group_url, storage_options, read_only=False))
    group = zarr.open_group(store=store, mode="a")
    arr = group.create_array(name, shape=darr.shape, chunks=chunks, dtype=darr.dtype,
                             overwrite=True, config={"write_empty_chunks": True})
    if darr.size:
        try:
            da.store(darr, arr, lock=False)
        except worker_failure_types() as exc:
            raise worker_failure(
                exc, "writing", 0, where=f"array {name!r} of {group_url}",
                resume_hint="Outputs are staged and moved into place only when complete, so "
                            "nothing that existed was replaced: run the command again once "
                            "the cause is fixed.",
            ) from exc


def open_member(url, name: str, *, storage_options: dict | None = None):
    """A dask array over member ``name`` (any dimension) of a group, checked like the rest.

    Returns None when the group has no such array.
    """

    url = absolute_location(url)
    if name not in _group_arrays(url, storage_options):
        return None
    arr, where = _open_checked(_join(url, name), storage_options, ndim=None)
    return _from_zarr(arr, where, arr.chunks)


def inspect(url, *, storage_options: dict | None = None) -> tuple[str, dict]:
    """What is at ``url``: ``("dataset" | "model" | "checkpoint" | "labels" | "group", details)``.

    Details are JSON-ready: shape, chunks, dtype and sizes for a dataset;
    kernel, rank and sizes for a model; for a fit's checkpoint, how far the
    factorization and k-means got and where P lives.
    """
    url = os.fspath(url)
    node = _probe(url, storage_options)
    if node.kind == "array":
        arr = open_array(url, storage_options=storage_options)
        return "dataset", _array_details(arr)
    names = _group_arrays(url, storage_options)
    group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r")
    attrs = dict(group.attrs)
    meta = attrs.get("dkicf")
    if isinstance(meta, dict) and meta.get("kind") == "icf-checkpoint":
        return "checkpoint", _checkpoint_details(url, meta, storage_options)
    if attrs.get("format") == "dkicf-model":
        details = {
            "kernel": attrs.get("kernel"),
            "n_clusters": attrs.get("params", {}).get("n_clusters"),
            "rank": attrs.get("rank"),
            "n_features": attrs.get("n_features_in"),
            "stop_reason": attrs.get("stop_reason"),
            "arrays": names,
        }
        if "P" in names:
            p = group["P"]
            details["P"] = f"shape {list(p.shape)}, chunks {list(p.chunks)}"
        if "input" in attrs:
            details["input"] = attrs["input"].get("url")
        return "model", details
    if "X" in names:
        X, y, info = open_dataset(url, storage_options=storage_options)
        details = _array_details(group["X"])
        if y is not None:
            details["labels"] = f"y, {len(info.get('label_values') or [])} classes"
        return "dataset", details
    if attrs.get("format") == "dkicf-labels":
        return "labels", {"arrays": names, "model": attrs.get("model")}
    return "group", {"arrays": names}


def _checkpoint_details(url: str, meta: dict, storage_options: dict | None) -> dict:
    """How far the checkpointed fit at ``url`` got (see :mod:`dkicf.checkpoint`)."""
    fingerprint = meta.get("fingerprint") or {}
    params = dict(fingerprint.get("params") or {})
    data = fingerprint.get("input") or {}
    layout = meta.get("layout") or {}
    commit = meta.get("commit")
    capacity = layout.get("capacity", params.get("max_rank"))
    kernel = {k: params[k] for k in ("kernel", "gamma", "degree", "coef0") if k in params}
    details: dict = {"input": f"shape {data.get('shape')}, row chunks {data.get('chunks')}",
                     "kernel": kernel, "pivoting": params.get("pivoting")}
    if not commit:
        details["factorization"] = f"started, nothing committed yet (rank up to {capacity})"
    else:
        done = "finished" if commit.get("finished") else "in progress"
        line = (f"{done}: iteration {commit['iteration']}, rank {commit['rank']} of at most "
                f"{capacity}")
        if commit.get("stop_reason"):
            line += f", stopped by {commit['stop_reason']}"
        if commit.get("trace_errors"):
            line += f", trace error {commit['trace_errors'][-1]:.6g}"
        details["factorization"] = line
        where = commit.get("p_storage") or layout.get("p_storage") or "zarr"
        details["P"] = ("in worker memory, its columns copied here at each commit"
                        if where == "memory" else "held here (Zarr)")
    details["k-means"] = _kmeans_checkpoint_line(_join(url, "kmeans"), storage_options)
    if not (commit and commit.get("finished")) or "not started" in details["k-means"]:
        details["resume"] = (f"dkicf fit <the same data> --checkpoint {url} --resume, with the "
                             "same parameters")
    return details


def _kmeans_checkpoint_line(url: str, storage_options: dict | None) -> str:
    """The state of the k-means checkpoint that a fit keeps beside its factorization."""
    try:
        group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r")
        meta = dict(group.attrs).get("dkicf") or {}
    except Exception:  # no such subgroup: k-means has not started
        return "not started"
    commit = meta.get("commit")
    if not isinstance(commit, dict):
        return "started, nothing committed yet"
    state = commit.get("state") or {}
    n_init = (meta.get("fingerprint") or {}).get("params", {}).get("n_init")
    best = state.get("best") or {}
    if commit.get("finished"):
        line = f"finished: {n_init} run(s)"
    else:
        line = f"in progress: run {int(state.get('restart', 0)) + 1} of {n_init}"
    if best.get("inertia") is not None:
        line += f", best inertia {best['inertia']:.6g}"
    return line


def _array_details(arr) -> dict:
    nbytes = int(np.prod(arr.shape)) * np.dtype(arr.dtype).itemsize
    return {
        "shape": list(arr.shape),
        "chunks": list(arr.chunks),
        "dtype": str(arr.dtype),
        "size": f"{nbytes / 2**20:.1f} MiB",
        "n_chunks": int(np.prod([-(-s // c) for s, c in zip(arr.shape, arr.chunks)])),
    }
