"""Groups of small arrays and JSON attributes (models, labels), and members from dask."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import zarr

from .._validation import check_dtype
from ..errors import worker_failure, worker_failure_types
from ._checks import _check_allocation, _check_extent, _check_meta, check_store_safe
from ._layout import _dims, _layout_attrs, _read_layout
from ._staging import _jsonable, _staged
from ._stores import DkicfIOError, _group_arrays, _join, _local_path, _probe, _StagingStore, _store


def write_group(
    url,
    arrays: dict[str, np.ndarray],
    attrs: dict[str, Any],
    *,
    kind: str = "group",
    overwrite: bool = False,
    storage_options: dict | None = None,
) -> None:
    """Write small numeric arrays and JSON attributes as one Zarr v3 group.

    Meant for models: each array is stored whole in one chunk, with the
    dimension names of the Zarr layout where it names the array; the
    attributes are plain JSON (nothing is ever pickled), stored under the
    group attribute ``dkicf`` with the layout's ``schema``, ``kind`` and
    ``created_by`` (docs/zarr-layout.md).

    Parameters
    ----------
    url : str or path-like
        Destination (local path or fsspec URL).
    arrays : dict of str to array-like
        Real-valued arrays of any shape; names must be plain (no ``/``, not
        starting with ``.``).
    attrs : dict
        JSON-compatible attributes; numpy scalars and arrays are converted.
        ``schema`` and ``kind`` are the layout's, not allowed here.
    kind : str, default="group"
        What the group is (``"model"``, ``"labels"``, ...): :func:`read_group`
        can require it.
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
    meta = _layout_attrs(kind, _jsonable(dict(attrs), "attrs"))
    with _staged(url, overwrite=overwrite, storage_options=storage_options) as store:
        group = zarr.open_group(store=store, mode="w", zarr_format=3)
        for name, value in checked.items():
            chunks = tuple(max(1, s) for s in value.shape)
            # Every chunk written, zeros too: dkicf refuses stores with chunks missing.
            arr = group.create_array(name, shape=value.shape, chunks=chunks, dtype=value.dtype,
                                     config={"write_empty_chunks": True},
                                     dimension_names=_dims(name, value.ndim))
            if value.size:
                arr[...] = value
        group.attrs.update(meta)


def read_group(
    url, *, storage_options: dict | None = None, names=None, kind: str | None = None
) -> tuple[dict, dict]:
    """Read a group written by :func:`write_group`: arrays as numpy, attributes as a dict.

    Every array's metadata is checked (:func:`check_store_safe`) before its
    data is read; sub-groups are ignored.  Groups of the Zarr layout before
    schema 2 (attributes at the top level) are read too.

    Parameters
    ----------
    url : str or path-like
        Local path or fsspec URL of the group.
    storage_options : dict, optional
        Passed to fsspec for URLs.
    names : collection of str, optional
        Read only these arrays (large members such as ``P`` stay on disk).
    kind : str, optional
        Refuse a group that is not of this kind (``"model"``, ...).

    Returns
    -------
    arrays : dict of str to ndarray
    attrs : dict
        The attributes given to :func:`write_group`, with ``created_by``.

    Raises
    ------
    DkicfIOError
        An array instead of a group; unsafe or damaged array metadata; a group
        of another ``kind``; a group written by a newer dkicf (a later schema).

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
    group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r",
                            zarr_format=node.zarr_format)
    found, attrs = _read_layout(dict(group.attrs), url)
    if kind is not None and found != kind:
        said = f"kind {found!r}" if found is not None else "no dkicf kind"
        raise DkicfIOError(
            f"{url} is not a dkicf {kind}: its attributes say {said}. Pass a {kind} group "
            "written by dkicf."
        )
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
    return arrays, attrs


def remove_member(group_url, name: str, *, storage_options: dict | None = None) -> None:
    """Remove the member ``name`` of a group being built (inside :func:`staged_group`)."""
    group = zarr.open_group(
        store=_store(os.fspath(group_url), storage_options, read_only=False), mode="r+",
        zarr_format=3,
    )
    if name in group:
        del group[name]


def write_members(
    group_url, arrays: dict, attrs: dict, *, kind: str, storage_options: dict | None = None
) -> None:
    """Add small arrays to a group being built (no staging of its own), and set its attributes.

    Used inside :func:`staged_group`, where large members (``P``, ``labels``)
    are written by the cluster into the same group.  The group's dkicf
    attributes become ``attrs``, of ``kind``, as :func:`write_group` writes them.
    """
    group_url = os.fspath(group_url)
    meta = _layout_attrs(kind, _jsonable(dict(attrs), "attrs"))
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
                                 overwrite=True, config={"write_empty_chunks": True},
                                 dimension_names=_dims(name, value.ndim))
        if value.size:
            arr[...] = value
    group.attrs.update(meta)


def write_dask(group_url, name: str, darr, *, storage_options: dict | None = None) -> None:
    """Write a dask array chunk by chunk as array ``name`` of an existing group.

    Rows keep the dask array's (regular) row chunks and all columns go in one
    chunk, so each task writes whole Zarr chunks of its own; nothing is
    gathered to this process.
    """
    import dask.array as da  # imported on first use: slow to import

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
    group = zarr.open_group(store=store, mode="a", zarr_format=3)
    arr = group.create_array(name, shape=darr.shape, chunks=chunks, dtype=darr.dtype,
                             overwrite=True, config={"write_empty_chunks": True},
                             dimension_names=_dims(name, darr.ndim))
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

