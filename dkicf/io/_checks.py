"""Safety checks on Zarr metadata, made before any chunk is read."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import zarr
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore

from .._validation import check_dtype
from ._stores import (
    _META_KEYS,
    DkicfIOError,
    MissingChunkError,
    _local_path,
    _missing_chunk_message,
)

# Codecs that turn chunk bytes into Python objects; pickle runs arbitrary code.
_OBJECT_CODECS = frozenset(
    {"pickle", "json", "json2", "msgpack", "msgpack2", "vlen-utf8", "vlen-bytes",
     "vlen-array", "categorize", "object"}
)
_V3_REAL_TYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)

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


def _stored_grid(arr: zarr.Array) -> list | None:
    """The array's regular chunk grid (its shards' where sharded) as its stored metadata
    document writes it, or None where there is no such document or grid.

    Newer zarr versions read some invalid lengths (0, say) as valid ones when
    they open an array, and warn; the document tells what was written.
    """
    from zarr.core.buffer import default_buffer_prototype

    v3 = arr.metadata.zarr_format == 3
    name = "zarr.json" if v3 else ".zarray"
    path = arr.store_path.path
    try:
        buf = sync(arr.store_path.store.get(f"{path}/{name}" if path else name,
                                            prototype=default_buffer_prototype()))
        doc = None if buf is None else json.loads(buf.to_bytes())
    except (OSError, ValueError):  # unreadable here: the opened array's grid is checked
        return None
    if not isinstance(doc, dict):
        return None
    if not v3:
        grid = doc.get("chunks")
    else:
        spec = doc.get("chunk_grid")
        config = spec.get("configuration") if isinstance(spec, dict) else None
        regular = isinstance(config, dict) and spec.get("name") == "regular"
        grid = config.get("chunk_shape") if regular else None
    return grid if isinstance(grid, list) else None


def _check_extent(arr: zarr.Array, url: str, *, every_chunk: bool) -> None:
    """Refuse metadata that claims more than the store holds or this machine can plan for."""
    # Runs before anything sized by the metadata is built (a shape of 10**13
    # rows would exhaust memory building its graph).  Objects are chunks, or
    # shards; with every_chunk they are counted in the store (_check_present).
    stored = _stored_grid(arr)
    grid = stored if stored is not None else (getattr(arr, "shards", None) or arr.chunks)
    if len(grid) != len(arr.shape) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= _MAX_LENGTH for c in grid
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
    """Refuse a local store that holds a symbolic link to anything outside it."""
    # Linked data would be read as this store's, and could end up in an output
    # (a model keeps pivot rows of X).  The location itself may be a link, and
    # links that stay inside the store are fine.
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
    nbytes = math.prod(arr.shape) * np.dtype(arr.dtype).itemsize
    available = psutil.virtual_memory().available
    if nbytes > available:
        raise DkicfIOError(
            f"refusing {url}: its metadata claims shape {tuple(arr.shape)} of {arr.dtype}, "
            f"{nbytes / 2**30:.3g} GiB to read whole, more than the {available / 2**30:.3g} "
            "GiB this machine has available. The group's arrays are small in a model or "
            "checkpoint: the metadata is damaged; restore the group or fit again."
        )

