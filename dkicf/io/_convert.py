"""Dataset stores written from files (:func:`convert`) and from :mod:`dkicf.synthetic`."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zarr

from .. import synthetic
from .._validation import check_seed
from ._layout import _dims, _layout_attrs
from ._sources import _npy_source, _npz_source, _parquet_source, _Source
from ._staging import _jsonable, _staged, check_writable
from ._stores import DkicfIOError
from ._text import _csv_source, _is_svmlight, _svmlight_source

# svmlight text: .txt files with index:value fields are svmlight too.
_SVMLIGHT_SUFFIXES = (".svm", ".libsvm", ".svmlight", ".txt")
_SUFFIXES = (".npy", ".npz", ".csv", ".parquet") + _SVMLIGHT_SUFFIXES


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
        from dask.array.core import normalize_chunks  # dask.array: imported on first use

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
                               config=every, dimension_names=_dims("X", 2))
        y = None
        if labelled:
            y = group.create_array("y", shape=(n,), chunks=(chunk_rows,), dtype=np.int64,
                                   config=every, dimension_names=_dims("y", 1))
        sink = _RowSink(X, y, chunk_rows, n, url, progress)
        for Xb, yb in blocks:
            sink.push(Xb, yb)
        sink.close()
        group.attrs.update(_layout_attrs("dataset", _jsonable(attrs, "attrs")))


def _finite_block(block, dtype: np.dtype, start: int, src: str) -> np.ndarray:
    out = np.asarray(block).astype(dtype, copy=False)
    if not np.isfinite(out).all():
        row = start + int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
        raise DkicfIOError(
            f"{src}: row {row} contains NaN or infinity (after conversion to {dtype}); "
            "remove or impute such rows before converting."
        )
    return out


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
    src_name = os.fspath(src)
    dst = os.fspath(dst)
    target = _target_dtype(dtype)
    path = _source_path(src)
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
    attrs = {
        "source": path.name,
        "source_format": source.fmt,
        "dtype": str(target),
        "shape": [source.n, source.d],
    }
    if label_values is not None:
        attrs["label_values"] = label_values
    _write_dataset(
        dst, n=source.n, d=source.d, dtype=target, chunk_rows=rows,
        labelled=label_values is not None,
        blocks=_checked_blocks(source, rows, target, src_name), attrs=attrs,
        overwrite=overwrite, storage_options=storage_options, progress=progress,
    )
    return _dataset_info(dst, source.n, source.d, rows, target, label_values,
                         source=path.name, format=source.fmt)


def _source_path(src) -> Path:
    """The file (or directory of Parquet files) to convert, refused if missing or unknown."""
    path = Path(os.fspath(src)).expanduser()
    src_name = os.fspath(src)
    parquet_dir = path.is_dir() and any(path.rglob("*.parquet"))
    if path.suffix.lower() not in _SUFFIXES and not parquet_dir:
        raise DkicfIOError(
            f"cannot convert {src_name}: unknown file type {path.suffix!r}; supported: "
            f"{', '.join(_SUFFIXES)}."
        )
    if not path.is_file() and not parquet_dir:
        raise DkicfIOError(f"cannot convert {src_name}: no such file.")
    return path


def _checked_blocks(source: _Source, rows: int, target: np.dtype, src_name: str):
    """The source's rows in blocks: X as ``target`` and finite, labels as class indices."""
    start = 0
    for Xb, yb in source.read(rows):
        Xb = _finite_block(Xb, target, start, src_name)
        start += Xb.shape[0]
        yield Xb, (None if source.labels is None else source.labels.encode(yb))


def _dataset_info(url: str, n: int, d: int, rows: int, target: np.dtype, label_values,
                  **described) -> dict[str, Any]:
    """What :func:`convert` and :func:`generate` return about the store they wrote."""
    return {
        "url": url,
        **described,
        "shape": [n, d],
        "chunks": [rows, d],
        "n_samples": n,
        "n_features": d,
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
    seed = check_seed(random_state)
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
        "label_values": label_values,
    }
    _write_dataset(
        dst, n=n, d=d, dtype=target, chunk_rows=rows, labelled=True, blocks=blocks(),
        attrs=attrs, overwrite=overwrite, storage_options=storage_options, progress=progress,
    )
    return _dataset_info(dst, n, d, rows, target, label_values, kind=kind)
