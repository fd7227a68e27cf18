"""Writing safely: destination checks, staged writes moved into place, attributes."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from ._stores import (
    DkicfIOError,
    OutputExistsError,
    _fs,
    _local_path,
    _probe,
    _settle_zarr_io,
    _StagingStore,
    _store,
    absolute_location,
)


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
            # Writes that outlive an interrupted run (zarr finishes them in its own
            # thread) must not bring the removed staging folder back.
            os.mkdir(where)
            yield _StagingStore(Path(where))


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


# --------------------------------------------------------------------------
# a group built in stages (its large arrays written from dask)


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
            # In between, the writes that zarr's IO thread still runs may end.
            _remove_quietly(fs, path)
            _settle_zarr_io(time.monotonic() + 10.0)
            time.sleep(0.5)
            _remove_quietly(fs, path)
            raise
        return
    local = local.absolute()
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.parent / f".{local.name}.dkicf-tmp-{uuid.uuid4().hex[:12]}"
    try:
        yield str(tmp)
        _publish(tmp, local, url, overwrite=overwrite)
    finally:
        _remove_staging(tmp)


def _remove_quietly(fs, path: str) -> None:
    """Remove ``path`` from ``fs`` if it is there; an error is left for the caller's own."""
    with contextlib.suppress(Exception):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _remove_staging(tmp: Path, *, patience: float = 30.0) -> None:
    """Remove a staging folder, waiting out writes that were under way.

    A write task still running (a failure or Ctrl-C does not stop it) may add
    files while the folder is being removed, so removal is repeated until the
    folder itself is gone.  From then on it stays gone: staged writes never
    re-create their root (:class:`~dkicf.io._stores._StagingStore`).  Then
    the writes that zarr's IO thread still runs are waited for
    (:func:`~dkicf.io._stores._settle_zarr_io`).
    """
    if not os.path.lexists(tmp):  # published, or never made
        return
    deadline = time.monotonic() + patience
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.lexists(tmp) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # The writes still under way fail at once now; let them end before this
    # process may exit (zarr would stop its loop with them pending).
    _settle_zarr_io(deadline)

