"""Reading arrays and dataset stores as checked dask arrays."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import zarr

from ..errors import DkicfError
from ._checks import _check_extent, _check_links, _check_meta, _describe, check_store_safe
from ._layout import _read_layout
from ._stores import (
    DkicfIOError,
    _group_arrays,
    _join,
    _not_an_array,
    _probe,
    _store,
    absolute_location,
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
    >>> from dkicf.io import write_group
    >>> d = tempfile.mkdtemp()
    >>> write_group(os.path.join(d, "m.zarr"), {"X": np.ones((3, 2))}, {})
    >>> open_array(os.path.join(d, "m.zarr", "X")).shape
    (3, 2)
    """
    return _open_checked(url, storage_options, ndim=2, every_chunk=True)[0]


class _Reads:
    """A Zarr array as dask reads it, with damaged chunk data reported as a DkicfIOError."""

    # zarr and the codecs raise many types on bytes that do not decode (zstd's
    # RuntimeError, a reshape's ValueError, ...); the error names store and rows.

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
    import dask.array as da  # imported on first use: slow to import
    from dask.base import tokenize

    # A chunk longer than its dimension (zarr allows it) is read as the whole dimension.
    chunks = tuple(c if isinstance(c, tuple) else max(1, min(c, n))
                   for c, n in zip(chunks, arr.shape))
    reads = _Reads(arr, url)
    return da.from_array(reads, chunks=chunks, name=f"from-zarr-{tokenize(reads, chunks)}",
                         meta=np.empty((0,) * arr.ndim, dtype=arr.dtype), asarray=True)


def _check_label_values(url: str, values) -> None:
    """The dataset attribute ``label_values``: absent, or a list of numbers or strings."""
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
    >>> from dkicf.io import write_group
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
        ``label_values`` (or None) and ``attrs`` (the dkicf attributes of the
        group or array, without the layout's ``schema`` and ``kind``).

    Raises
    ------
    DkicfIOError
        Everything :func:`open_array` refuses; a group without ``X``; a ``y``
        that is not 1-D integer with one label per row of X; attributes of a
        later layout schema than this dkicf reads (stores of earlier schemas,
        attributes at the top level, are read).

    Examples
    --------
    >>> import tempfile, os
    >>> from dkicf.io import generate
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
        attrs = _read_layout(dict(arr.attrs), url)[1]
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
        group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r",
                                zarr_format=node.zarr_format)
        attrs = _read_layout(dict(group.attrs), url)[1]
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
    >>> from dkicf.io import write_group
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



def open_member(url, name: str, *, storage_options: dict | None = None):
    """A dask array over member ``name`` (any dimension) of a group, checked like the rest.

    Returns None when the group has no such array.
    """

    url = absolute_location(url)
    if name not in _group_arrays(url, storage_options):
        return None
    arr, where = _open_checked(_join(url, name), storage_options, ndim=None)
    return _from_zarr(arr, where, arr.chunks)

