"""Locations and Zarr stores: absolute locations, checked stores, metadata probes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from zarr.storage import FsspecStore, LocalStore

from ..errors import DkicfError


class DkicfIOError(DkicfError, ValueError):
    """A store or file that cannot be read or written as asked; the message says why."""


class OutputExistsError(DkicfIOError, FileExistsError):
    """The destination already exists and overwriting was not asked for."""


class MissingChunkError(DkicfIOError):
    """A chunk of an array is not in its store, or the array is not there for this process.

    Raised in the dask task that reads the chunk and re-raised by the client
    (a plain :class:`DkicfIOError`, so that it pickles like one).
    """


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
    """Store mixin for an array at the store's root: no silent fill value for lost data."""

    # Zarr reads a missing chunk as the fill value.  Only a missing key costs a
    # check: the array's metadata missing too means this process does not see
    # the store (another host or directory); with every_chunk any gap is lost data.

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
    """A local store that writes into an existing folder only, never recreating it."""

    # A failed run removes its staging folder; a write task still running
    # elsewhere (the failure does not stop it) must not bring the folder back.

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
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(_put_below, self.root, key, value.as_buffer_like(), exclusive)

    async def delete_dir(self, prefix: str) -> None:
        if prefix.strip("/"):
            await super().delete_dir(prefix)
            return
        # A new group (mode "w") empties the whole store: the root itself stays.
        self._check_root()
        self._check_writable()
        for child in self.root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def _settle_zarr_io(deadline: float) -> None:
    """Wait, until the ``time.monotonic()`` ``deadline``, for the work of zarr's IO loop to end.

    An interrupted write goes on in zarr's IO thread after the caller has
    unwound (and fails once its staging folder is gone).  A process that
    exits first has zarr stop the loop with that write pending, and asyncio
    prints a "Task was destroyed but it is pending" traceback after the
    command's last line.
    """
    try:
        from zarr.core.sync import iothread, loop
    except ImportError:  # pragma: no cover - another zarr layout: nothing to wait for
        return
    running = loop[0] if loop else None
    if (running is None or running.is_closed() or not running.is_running()
            or threading.current_thread() is (iothread[0] if iothread else None)):
        return  # no loop, or called from it (which would wait on itself)

    async def busy() -> bool:
        me = asyncio.current_task()
        return any(task is not me and not task.done() for task in asyncio.all_tasks())

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            if not asyncio.run_coroutine_threadsafe(busy(), running).result(timeout=left):
                return
        except (TimeoutError, RuntimeError):  # the loop stopped or does not answer
            return
        time.sleep(0.01)


def _put_below(root: Path, key: str, data, exclusive: bool) -> None:
    """Write ``data`` to ``root/key`` without ever creating ``root`` itself.

    The folders between ``root`` and the file are made one at a time, so a
    ``root`` removed at any moment (even between the check and the write)
    makes the write fail instead of bringing the folder back.
    """
    path = root / key
    folder = root
    for part in Path(key).parts[:-1]:
        folder = folder / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder)  # FileNotFoundError once root is gone
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(partial, "xb") as out:
            out.write(data)
        if exclusive:
            os.link(partial, path)  # FileExistsError if the key is there already
            os.unlink(partial)
        else:
            os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


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

