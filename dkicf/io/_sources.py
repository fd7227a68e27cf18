"""Source files in row blocks: labels, .npy/.npz, Parquet, column choice."""

from __future__ import annotations

import contextlib
import math
import numbers
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._validation import check_dtype
from ..errors import DkicfError
from ._stores import DkicfIOError

_MAX_CLASSES = 65536

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
    """Any failure to parse .npy/.npz bytes as a :class:`DkicfIOError` naming the file."""
    # Reading with allow_pickle=False runs no code, so any error numpy or
    # zipfile raise (EOFError, zlib, tokenizer, ...) means damaged bytes.
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


def _parquet_source(path: Path, src: str, label_column, block_rows: int, columns=None,
                    drop_columns=None) -> _Source:
    try:
        # optional dependency (dkicf[parquet])
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

