"""Delimited text (via pyarrow.csv or numpy.loadtxt) and svmlight text in row blocks."""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from ._sources import _feature_columns, _LabelCoder, _name_or_index, _Source
from ._stores import DkicfIOError

MiB = 1 << 20

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
    """A delimited text file read by ``pyarrow.csv``, in record batches."""
    # Blank and "#" lines are skipped (a "#" line further down when its field
    # count differs).  On a value pyarrow cannot read, the lines are scanned
    # once to name the line and column.
    try:
        # optional dependency (dkicf[parquet])
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
    """svmlight text read by :func:`sklearn.datasets.load_svmlight_file`, a byte range at a time."""
    # Two passes: the first finds n, the index range and the labels; the second
    # gives dense rows, 0-based only if the file uses index 0 anywhere.
    if label_column is not None:
        raise DkicfIOError(
            f"label_column does not apply to svmlight files ({src}); their first field is the "
            "label."
        )
    # scikit-learn: imported on first use (slow to import); looked up at each call
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


def _is_svmlight(path: Path, lines: int = 100) -> bool:
    """Whether a ``.txt`` file is svmlight text: ``index:value`` fields in its first lines.

    Otherwise it is read as delimited numbers (whitespace, comma, tab or
    semicolon), as :func:`numpy.loadtxt` would.
    """
    for _, text in islice(_text_lines(path), lines):
        if any(":" in token for token in text.split("#", 1)[0].split()[1:]):
            return True
    return False

