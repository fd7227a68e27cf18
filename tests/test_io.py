"""Zarr in/out: conversion round trips, streaming, safe writes, refusing unsafe stores."""

from __future__ import annotations

import json
import pickle
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zarr

from dkicf import __version__, io, synthetic
from dkicf.errors import DkicfError
from dkicf.io import DkicfIOError


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes, for byte-exact comparisons."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".dkicf-" in p.name]


def _read(url, **kw):
    X, y, info = io.open_dataset(url, **kw)
    return X.compute(), (None if y is None else y.compute()), info


class _Boom:
    """Unpickling this creates ``marker``: a stand-in for a malicious payload."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _pickle_store_v2(root: Path, marker: Path) -> Path:
    """A Zarr v2 array whose metadata declares a pickle filter, with a live pickle chunk."""
    root.mkdir()
    zarray = {
        "zarr_format": 2,
        "shape": [1, 1],
        "chunks": [1, 1],
        "dtype": "<f8",
        "compressor": None,
        "fill_value": 0.0,
        "filters": [{"id": "pickle", "protocol": 4}],
        "order": "C",
        "dimension_separator": ".",
    }
    (root / ".zarray").write_text(json.dumps(zarray))
    (root / "0.0").write_bytes(pickle.dumps(_Boom(marker), protocol=4))
    return root


# --------------------------------------------------------------------------
# chunk size rule


def test_default_chunks_follow_dasks_chunk_size_setting(tmp_path):
    """Without chunk_rows, dask's "auto" rule sizes the row chunks, from array.chunk-size."""
    import dask

    np.save(tmp_path / "x.npy", np.zeros((5000, 10), dtype=np.float32))
    for size, rows in (("8KiB", 8192 // 80), ("40KiB", 40960 // 80), ("128MiB", 5000)):
        with dask.config.set({"array.chunk-size": size}):
            info = io.convert(tmp_path / "x.npy", tmp_path / f"{size}.zarr", dtype="float64")
            generated = io.generate("blobs", tmp_path / f"g{size}.zarr", 5000, n_features=10)
        assert info["chunk_rows"] == rows, size
        assert generated["chunk_rows"] == rows, size

def test_convert_npy_round_trip(tmp_path):
    X = np.random.default_rng(0).normal(size=(103, 3))
    np.save(tmp_path / "x.npy", X)
    info = io.convert(tmp_path / "x.npy", tmp_path / "x.zarr", dtype="float64", chunk_rows=10)
    assert info["n_samples"] == 103 and info["n_features"] == 3 and not info["labels"]
    assert info["shape"] == [103, 3] and info["chunks"] == [10, 3]
    got, y, meta = _read(tmp_path / "x.zarr")
    np.testing.assert_array_equal(got, X)
    assert y is None
    group = zarr.open_group(tmp_path / "x.zarr", mode="r")
    assert group["X"].chunks == (10, 3)
    attrs = meta["attrs"]
    assert attrs["source"] == "x.npy" and attrs["dtype"] == "float64"
    assert attrs["shape"] == [103, 3] and attrs["created_by"] == f"dkicf {__version__}"


def test_convert_npy_to_float32(tmp_path):
    X = np.arange(40, dtype=np.int16).reshape(20, 2)
    np.save(tmp_path / "x.npy", X)
    io.convert(tmp_path / "x.npy", tmp_path / "x.zarr")
    got, _, info = _read(tmp_path / "x.zarr")
    assert got.dtype == np.float32 and info["dtype"] == "float32"
    np.testing.assert_array_equal(got, X.astype(np.float32))


@pytest.mark.parametrize("compress", [False, True])
def test_convert_npz_round_trip_with_labels(tmp_path, compress):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(57, 4))
    y = rng.choice([7, -3, 12], size=57)
    (np.savez_compressed if compress else np.savez)(tmp_path / "d.npz", X=X, y=y)
    info = io.convert(tmp_path / "d.npz", tmp_path / "d.zarr", dtype="float64", chunk_rows=8)
    assert info["label_values"] == [-3, 7, 12] and info["n_classes"] == 3
    got, labels, meta = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, X)
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(np.array(meta["label_values"])[labels], y)
    assert meta["attrs"]["label_values"] == [-3, 7, 12]


def test_convert_npz_fortran_order(tmp_path):
    X = np.asfortranarray(np.arange(30.0).reshape(10, 3))
    np.savez(tmp_path / "f.npz", X=X)
    io.convert(tmp_path / "f.npz", tmp_path / "f.zarr", dtype="float64", chunk_rows=4)
    np.testing.assert_array_equal(_read(tmp_path / "f.zarr")[0], X)


def test_convert_csv_with_header_and_text_labels(tmp_path):
    rng = np.random.default_rng(2)
    X = np.round(rng.normal(size=(31, 3)), 6)
    names = np.array(["setosa", "virginica", "versicolor"])[np.arange(31) % 3]
    lines = ["a,b,species,c"] + [
        f"{r[0]},{r[1]},{s},{r[2]}" for r, s in zip(X, names)
    ]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    info = io.convert(tmp_path / "d.csv", tmp_path / "d.zarr", dtype="float64",
                      chunk_rows=5, label_column="species")
    assert info["label_values"] == ["setosa", "versicolor", "virginica"]
    got, labels, meta = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, X)
    np.testing.assert_array_equal(np.array(meta["label_values"])[labels], names)


def test_convert_csv_without_header_index_label_and_plain(tmp_path):
    X = np.arange(24.0).reshape(8, 3) / 4
    labels = np.array([2, 1, 2, 1, 2, 1, 2, 1])
    rows = [";".join([f"{v}" for v in x] + [str(c)]) for x, c in zip(X, labels)]
    (tmp_path / "d.csv").write_text("# a comment line\n" + "\n".join(rows) + "\n\n")
    io.convert(tmp_path / "d.csv", tmp_path / "a.zarr", dtype="float64", label_column=-1)
    got, y, meta = _read(tmp_path / "a.zarr")
    np.testing.assert_array_equal(got, X)
    np.testing.assert_array_equal(np.array(meta["label_values"])[y], labels)
    # Without label_column every column is a feature and there is no y.
    io.convert(tmp_path / "d.csv", tmp_path / "b.zarr", dtype="float64")
    got, y, _ = _read(tmp_path / "b.zarr")
    np.testing.assert_array_equal(got, np.column_stack([X, labels]))
    assert y is None


def test_convert_svmlight_round_trip(tmp_path):
    text = (
        "# header comment\n"
        "+1 1:0.5 3:2.0 # trailing comment\n"
        "-1 qid:4 2:-1.5\n"
        "+1 5:7\n"
        "-1\n"
        "1 1:1 2:2 3:3 4:4 5:5\n"
    )
    (tmp_path / "d.svm").write_text(text)
    info = io.convert(tmp_path / "d.svm", tmp_path / "d.zarr", dtype="float64", chunk_rows=2)
    expected = np.array(
        [[0.5, 0, 2, 0, 0], [0, -1.5, 0, 0, 0], [0, 0, 0, 0, 7], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]]
    )
    assert info["n_samples"] == 5 and info["n_features"] == 5
    assert info["label_values"] == [-1, 1]
    got, y, meta = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(y, [1, 0, 1, 0, 1])
    assert meta["attrs"]["source_format"] == "svmlight"


@pytest.mark.parametrize("suffix", [".libsvm", ".txt"])
def test_convert_svmlight_zero_based(tmp_path, suffix):
    (tmp_path / f"d{suffix}").write_text("0 0:1 2:3\n1 1:2\n")
    io.convert(tmp_path / f"d{suffix}", tmp_path / "d.zarr", dtype="float64")
    got, y, _ = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, [[1, 0, 3], [0, 2, 0]])
    np.testing.assert_array_equal(y, [0, 1])


@pytest.mark.parametrize("sep", [" ", "  ", "\t", ","])
def test_convert_txt_of_delimited_numbers(tmp_path, sep):
    """A .txt without index:value fields is a table of numbers, as numpy.loadtxt reads it."""
    rng = np.random.default_rng(4)
    data = np.round(rng.normal(size=(9, 3)), 6)
    labels = np.array([2, 0, 1] * 3)
    table = np.column_stack([data, labels])
    delimiter = None if sep.strip() == "" else sep
    np.savetxt(tmp_path / "d.txt", table, delimiter=sep, fmt="%.6f")
    info = io.convert(tmp_path / "d.txt", tmp_path / "d.zarr", dtype="float64",
                      label_column=-1)
    reference = np.loadtxt(tmp_path / "d.txt", delimiter=delimiter)
    got, y, meta = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, reference[:, :3])
    np.testing.assert_array_equal(y, labels)
    assert info["n_features"] == 3 and meta["attrs"]["source_format"] == "csv"
    # Without a label column, every column is a feature.
    io.convert(tmp_path / "d.txt", tmp_path / "all.zarr", dtype="float64")
    np.testing.assert_array_equal(_read(tmp_path / "all.zarr")[0], reference)


def test_convert_txt_is_svmlight_when_a_later_line_says_so(tmp_path):
    """A first row of zeros is a bare label in svmlight: the next lines decide."""
    (tmp_path / "d.txt").write_text("# comment\n1\n2 1:0.5 3:2\n")
    io.convert(tmp_path / "d.txt", tmp_path / "d.zarr", dtype="float64")
    got, y, meta = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(got, [[0, 0, 0], [0.5, 0, 2]])
    np.testing.assert_array_equal(y, [0, 1])
    assert meta["attrs"]["source_format"] == "svmlight"


def test_convert_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(3)
    n = 45
    table = pa.table({
        "f0": rng.normal(size=n),
        "label": np.array(["b", "a", "c"])[np.arange(n) % 3],
        "f1": rng.integers(0, 10, size=n).astype(np.int32),
        "f2": rng.normal(size=n).astype(np.float32),
    })
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=10)
    info = io.convert(tmp_path / "d.parquet", tmp_path / "d.zarr", dtype="float64",
                      chunk_rows=7, label_column="label")
    assert info["n_features"] == 3 and info["label_values"] == ["a", "b", "c"]
    got, y, meta = _read(tmp_path / "d.zarr")
    expected = np.column_stack([table[c].to_numpy().astype(np.float64) for c in ("f0", "f1", "f2")])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.array(meta["label_values"])[y], table["label"].to_numpy())
    with pytest.raises(DkicfIOError, match=r"columns label \(string\) are not numeric"):
        io.convert(tmp_path / "d.parquet", tmp_path / "e.zarr")
    assert not (tmp_path / "e.zarr").exists()


# --------------------------------------------------------------------------
# streaming


def test_npy_is_read_through_a_memmap_in_row_blocks(tmp_path, monkeypatch):
    X = np.random.default_rng(4).normal(size=(95, 2))
    np.save(tmp_path / "x.npy", X)
    calls, slices = [], []
    real_load = np.load

    class _Recorder:
        def __init__(self, arr):
            self._arr = arr
            self.shape, self.dtype, self.ndim = arr.shape, arr.dtype, arr.ndim

        def __getitem__(self, key):
            slices.append(key)
            return self._arr[key]

    def spy(*args, **kwargs):
        arr = real_load(*args, **kwargs)
        calls.append((kwargs.get("mmap_mode"), isinstance(arr, np.memmap)))
        return _Recorder(arr)

    monkeypatch.setattr(np, "load", spy)
    io.convert(tmp_path / "x.npy", tmp_path / "x.zarr", dtype="float64", chunk_rows=20)
    monkeypatch.undo()
    assert calls == [("r", True)]
    assert [(s.start, s.stop) for s in slices] == [(0, 20), (20, 40), (40, 60), (60, 80), (80, 100)]
    np.testing.assert_array_equal(_read(tmp_path / "x.zarr")[0], X)


def test_large_npy_and_npz_are_never_loaded_whole(tmp_path):
    X = np.random.default_rng(5).random((50_000, 10))  # 4 MB
    np.save(tmp_path / "x.npy", X)
    np.savez_compressed(tmp_path / "x.npz", X=X)
    del X
    for name in ("x.npy", "x.npz"):
        tracemalloc.start()
        try:
            io.convert(tmp_path / name, tmp_path / f"{name}.zarr", dtype="float64",
                       chunk_rows=1000)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1_000_000, (name, peak)


def test_text_sources_are_parsed_block_by_block(tmp_path, monkeypatch):
    X = np.arange(46.0).reshape(23, 2)
    (tmp_path / "d.csv").write_text("\n".join(f"{a},{b}" for a, b in X) + "\n")
    (tmp_path / "d.svmlight").write_text(
        "\n".join(f"{i % 2} 1:{a} 2:{b}" for i, (a, b) in enumerate(X)) + "\n"
    )
    # Delimited text: pyarrow's record batches, never the whole file at once.
    import pyarrow.csv as pacsv

    big = np.random.default_rng(0).normal(size=(120_000, 2))
    np.savetxt(tmp_path / "big.csv", big, delimiter=",", fmt="%.17g")
    batches = []
    real_open = pacsv.open_csv

    def open_spy(*args, **kwargs):
        for batch in real_open(*args, **kwargs):
            batches.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pacsv, "open_csv", open_spy)
    io.convert(tmp_path / "big.csv", tmp_path / "big.zarr", dtype="float64", chunk_rows=5000)
    io.convert(tmp_path / "d.csv", tmp_path / "c.zarr", dtype="float64", chunk_rows=5)
    monkeypatch.undo()
    assert sum(batches) == 2 * 120_000 + 2 * 23  # two passes over each file
    assert max(batches) < 120_000 / 2
    np.testing.assert_array_equal(_read(tmp_path / "big.zarr")[0], big)
    # svmlight: scikit-learn's reader on byte ranges of about chunk_rows lines.
    import sklearn.datasets
    from sklearn.datasets import dump_svmlight_file

    labels = np.arange(120_000) % 3
    dump_svmlight_file(big, labels, str(tmp_path / "big.svm"))
    rows = []
    real_load = sklearn.datasets.load_svmlight_file

    def load_spy(*args, **kwargs):
        assert "offset" in kwargs and "length" in kwargs
        X, y = real_load(*args, **kwargs)
        rows.append(X.shape[0])
        return X, y

    monkeypatch.setattr(sklearn.datasets, "load_svmlight_file", load_spy)
    io.convert(tmp_path / "big.svm", tmp_path / "bs.zarr", dtype="float64", chunk_rows=5000)
    io.convert(tmp_path / "d.svmlight", tmp_path / "s.zarr", dtype="float64", chunk_rows=4)
    monkeypatch.undo()
    assert sum(rows) == 2 * 120_000 + 2 * 23  # two passes over each file
    # The first pass reads 16 MiB at a time (this file: once), the second about 5000 lines.
    assert rows[0] == 120_000 and len(rows) > 20 and max(rows[1:]) < 5500
    got, y, _ = _read(tmp_path / "bs.zarr")
    whole, _ = real_load(str(tmp_path / "big.svm"))  # read at once: the reference
    np.testing.assert_array_equal(got, whole.toarray())
    np.testing.assert_array_equal(y, labels)
    np.testing.assert_array_equal(_read(tmp_path / "c.zarr")[0], X)
    np.testing.assert_array_equal(_read(tmp_path / "s.zarr")[0], X)


def test_progress_reports_every_chunk(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((25, 2)))
    seen = []
    io.convert(tmp_path / "x.npy", tmp_path / "x.zarr", chunk_rows=10,
               progress=lambda done, total: seen.append((done, total)))
    assert seen == [(10, 25), (20, 25), (25, 25)]


# --------------------------------------------------------------------------
# generate


def test_generate_is_independent_of_chunk_size(tmp_path):
    a = io.generate("blobs", tmp_path / "a.zarr", 1000, chunk_rows=64, centers=5, n_features=3)
    b = io.generate("blobs", tmp_path / "b.zarr", 1000, chunk_rows=333, centers=5, n_features=3)
    assert a["chunks"] == [64, 3] and b["chunks"] == [333, 3]
    Xa, ya, info = _read(tmp_path / "a.zarr")
    Xb, yb, _ = _read(tmp_path / "b.zarr")
    np.testing.assert_array_equal(Xa, Xb)
    np.testing.assert_array_equal(ya, yb)
    X, y = synthetic.make_blobs(1000, centers=5, n_features=3)
    np.testing.assert_array_equal(Xa, X)
    np.testing.assert_array_equal(ya, y)
    assert zarr.open_array(tmp_path / "a.zarr" / "X", mode="r").chunks == (64, 3)
    assert info["label_values"] == [0, 1, 2, 3, 4]
    assert info["attrs"]["synthetic"] == {
        "kind": "blobs",
        "random_state": 0,
        "params": {"n_features": 3, "centers": 5, "cluster_std": 1.0,
                   "center_box": [-10.0, 10.0]},
    }


def test_generate_never_holds_more_than_a_chunk(tmp_path, monkeypatch):
    spans = []
    real = synthetic.generate_rows

    def spy(kind, start, stop, **kwargs):
        spans.append(stop - start)
        return real(kind, start, stop, **kwargs)

    monkeypatch.setattr(synthetic, "generate_rows", spy)
    io.generate("ring", tmp_path / "r.zarr", 1000, chunk_rows=128, dtype="float32")
    assert max(spans) == 128 and sum(spans) == 1000
    monkeypatch.undo()
    X, _, _ = _read(tmp_path / "r.zarr")
    assert X.dtype == np.float32
    np.testing.assert_array_equal(X, synthetic.make_ring(1000)[0].astype(np.float32))


def test_generate_checks_parameters_before_writing(tmp_path):
    with pytest.raises(ValueError, match="unknown synthetic dataset kind"):
        io.generate("moons", tmp_path / "m.zarr", 10)
    with pytest.raises(TypeError, match="unknown parameter"):
        io.generate("ring", tmp_path / "m.zarr", 10, shells=3)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------
# safe writes


def test_existing_store_is_refused_and_left_intact(tmp_path):
    dst = tmp_path / "d.zarr"
    io.generate("ring", dst, 300, chunk_rows=100)
    before = _tree(dst)
    np.save(tmp_path / "x.npy", np.zeros((5, 2)))
    with pytest.raises(DkicfIOError, match="already exists; pass overwrite=True"):
        io.convert(tmp_path / "x.npy", dst)
    with pytest.raises(DkicfIOError, match="already exists"):
        io.generate("ring", dst, 10)
    with pytest.raises(DkicfIOError, match="already exists"):
        io.write_group(dst, {"a": np.ones(2)}, {})
    with pytest.raises(DkicfIOError, match="already exists"):
        io.check_writable(dst)
    assert _tree(dst) == before
    # With overwrite the store is replaced, and nothing is left beside it.
    io.convert(tmp_path / "x.npy", dst, overwrite=True)
    assert _read(dst)[0].shape == (5, 2)
    assert _leftovers(tmp_path) == []


def test_failed_convert_leaves_no_store(tmp_path):
    rows = [f"{i},{i + 1}" for i in range(40)]
    rows[33] = "1,nan"
    (tmp_path / "bad.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(DkicfIOError, match=r"bad.csv, line 34, column 2: NaN or infinity"):
        io.convert(tmp_path / "bad.csv", tmp_path / "d.zarr", chunk_rows=10)
    assert not (tmp_path / "d.zarr").exists()
    assert _leftovers(tmp_path) == []
    rows[33] = "1,x"
    (tmp_path / "bad.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(DkicfIOError, match=r"bad.csv, line 34, column 2: 'x' is not a number"):
        io.convert(tmp_path / "bad.csv", tmp_path / "d.zarr", chunk_rows=10)
    assert not (tmp_path / "d.zarr").exists()
    assert _leftovers(tmp_path) == []


def test_failed_overwrite_keeps_the_old_store(tmp_path):
    dst = tmp_path / "d.zarr"
    io.generate("zigzag", dst, 200, chunk_rows=50)
    before = _tree(dst)

    def interrupt(done, total):
        if done >= 20:
            raise KeyboardInterrupt

    np.save(tmp_path / "x.npy", np.ones((50, 2)))
    with pytest.raises(KeyboardInterrupt):
        io.convert(tmp_path / "x.npy", dst, chunk_rows=10, overwrite=True, progress=interrupt)
    assert _tree(dst) == before
    assert _leftovers(tmp_path) == []


def test_labels_of_another_length_are_refused(tmp_path):
    np.savez(tmp_path / "d.npz", X=np.ones((10, 2)), y=np.arange(9))
    with pytest.raises(DkicfIOError, match=r"y has shape \(9,\) but X has 10 rows"):
        io.convert(tmp_path / "d.npz", tmp_path / "d.zarr")
    assert not (tmp_path / "d.zarr").exists()


def test_check_writable(tmp_path):
    io.check_writable(tmp_path / "new" / "deeper" / "d.zarr")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "keep.txt").write_text("mine")
    with pytest.raises(DkicfIOError, match="is not a Zarr store; refusing to replace it"):
        io.check_writable(plain, overwrite=True)
    np.save(tmp_path / "x.npy", np.ones((3, 2)))
    with pytest.raises(DkicfIOError, match="is not a Zarr store"):
        io.convert(tmp_path / "x.npy", plain, overwrite=True)
    assert (plain / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DkicfIOError, match="is not a directory"):
        io.check_writable(tmp_path / "file" / "d.zarr")
    with pytest.raises(DkicfIOError, match="already exists"):
        io.check_writable(f"file://{tmp_path / 'file'}")


def test_convert_refuses_bad_sources(tmp_path):
    with pytest.raises(DkicfIOError, match="no such file"):
        io.convert(tmp_path / "missing.npy", tmp_path / "d.zarr")
    (tmp_path / "d.xlsx").write_text("")
    with pytest.raises(DkicfIOError, match=r"unknown file type '.xlsx'; supported: .npy, .npz"):
        io.convert(tmp_path / "d.xlsx", tmp_path / "d.zarr")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(DkicfIOError, match="numeric .npy"):
        io.convert(tmp_path / "obj.npy", tmp_path / "d.zarr")
    np.save(tmp_path / "c.npy", np.ones((3, 2), dtype=complex))
    with pytest.raises(DkicfIOError, match="complex"):
        io.convert(tmp_path / "c.npy", tmp_path / "d.zarr")
    np.save(tmp_path / "v.npy", np.ones(3))
    with pytest.raises(DkicfIOError, match=r"1-D array.*Reshape"):
        io.convert(tmp_path / "v.npy", tmp_path / "d.zarr")
    np.savez(tmp_path / "noX.npz", A=np.ones((2, 2)))
    with pytest.raises(DkicfIOError, match="no array X"):
        io.convert(tmp_path / "noX.npz", tmp_path / "d.zarr")
    with pytest.raises(DkicfIOError, match="dtype must be 'float32' or 'float64'"):
        io.convert(tmp_path / "v.npy", tmp_path / "d.zarr", dtype="int8")
    (tmp_path / "m.svm").write_text("1,2 1:3\n")
    with pytest.raises(DkicfIOError, match="line 1: multi-label"):
        io.convert(tmp_path / "m.svm", tmp_path / "d.zarr")
    (tmp_path / "h.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DkicfIOError, match="no column named 'z'"):
        io.convert(tmp_path / "h.csv", tmp_path / "d.zarr", label_column="z")
    assert not (tmp_path / "d.zarr").exists()


# --------------------------------------------------------------------------
# refusing unsafe or wrong stores


def test_pickle_filter_store_is_refused_without_unpickling(tmp_path):
    marker = tmp_path / "pwned"
    store = _pickle_store_v2(tmp_path / "evil.zarr", marker)
    # The payload is live: unpickling it elsewhere does create its marker.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Boom(probe)))
    assert probe.exists()
    for call in (io.open_array, io.as_dask, io.open_dataset, io.fingerprint):
        with pytest.raises(DkicfIOError, match=r"evil.zarr.*codec 'pickle'"):
            call(store)
        with pytest.raises(DkicfIOError, match="codec 'pickle'"):
            call(f"file://{store}")
    assert not marker.exists()


def test_pickle_codec_in_v3_metadata_and_in_groups_is_refused(tmp_path):
    io.write_group(tmp_path / "g.zarr", {"X": np.ones((4, 2))}, {})
    meta_path = tmp_path / "g.zarr" / "X" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}] + meta["codecs"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DkicfIOError, match="codec 'numcodecs.pickle'"):
        io.open_array(tmp_path / "g.zarr" / "X")
    with pytest.raises(DkicfIOError, match="codec 'numcodecs.pickle'"):
        io.read_group(tmp_path / "g.zarr")
    with pytest.raises(DkicfIOError, match="codec 'numcodecs.pickle'"):
        io.open_dataset(tmp_path / "g.zarr")


def test_object_and_text_dtypes_are_refused(tmp_path):
    zarr.create_array(tmp_path / "s.zarr", shape=(3, 2), dtype=str)
    with pytest.raises(DkicfIOError, match="data type 'string' is not a real number type"):
        io.open_array(tmp_path / "s.zarr")
    v2 = tmp_path / "o.zarr"
    v2.mkdir()
    (v2 / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [2, 2], "chunks": [2, 2], "dtype": "|O",
        "compressor": None, "fill_value": None, "filters": None, "order": "C",
    }))
    with pytest.raises(DkicfIOError, match="dtype '|O' is not a real number type"):
        io.open_array(v2)
    zarr.create_array(tmp_path / "c.zarr", shape=(3, 2), dtype="complex128")
    with pytest.raises(DkicfIOError, match="complex128"):
        io.as_dask(tmp_path / "c.zarr")
    with pytest.raises(DkicfIOError, match="complex"):
        io.as_dask(zarr.open_array(tmp_path / "c.zarr", mode="r"))
    with pytest.raises(DkicfIOError, match="must hold real numbers"):
        io.write_group(tmp_path / "w.zarr", {"o": np.array(["a", "b"])}, {})
    assert not (tmp_path / "w.zarr").exists()


def test_zarr_v2_and_sharded_v3_arrays_are_read(tmp_path):
    X = np.arange(60.0).reshape(20, 3)
    v2 = zarr.create_array(tmp_path / "v2.zarr", shape=X.shape, chunks=(8, 3), dtype="f8",
                           zarr_format=2)
    v2[:] = X
    np.testing.assert_array_equal(io.as_dask(tmp_path / "v2.zarr").compute(), X)
    assert io.fingerprint(tmp_path / "v2.zarr")["zarr_format"] == 2
    sharded = zarr.create_array(tmp_path / "sh.zarr", shape=X.shape, chunks=(2, 3),
                                shards=(10, 3), dtype="f8")
    sharded[:] = X
    darr = io.as_dask(tmp_path / "sh.zarr")
    assert darr.chunks == ((10, 10), (3,))
    np.testing.assert_array_equal(darr.compute(), X)


def test_group_where_an_array_is_expected(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 20)
    url = str(tmp_path / "d.zarr")
    with pytest.raises(DkicfIOError) as err:
        io.open_array(url)
    assert str(err.value).startswith(
        f"{url} is a Zarr group, not an array; pass {url}/X (its arrays: X, y)"
    )
    with pytest.raises(DkicfIOError, match="is a Zarr group, not an array"):
        io.as_dask(url)
    with pytest.raises(DkicfIOError, match="is a Zarr array, not a group"):
        io.read_group(f"{url}/X")


def test_missing_wrong_shaped_and_empty_arrays(tmp_path):
    with pytest.raises(DkicfIOError, match=f"no Zarr store at {tmp_path / 'nope.zarr'}"):
        io.open_array(tmp_path / "nope.zarr")
    with pytest.raises(DkicfIOError, match="no Zarr store at memory://nothing/here"):
        io.open_array("memory://nothing/here")
    (tmp_path / "x.txt").write_text("not zarr")
    with pytest.raises(DkicfIOError, match="exists but is not a Zarr store"):
        io.open_array(tmp_path / "x.txt")
    zarr.create_array(tmp_path / "v.zarr", shape=(5,), dtype="f8")
    with pytest.raises(DkicfIOError, match=r"1-D with shape \(5,\); a data array must be 2-D"):
        io.open_array(tmp_path / "v.zarr")
    zarr.create_array(tmp_path / "e.zarr", shape=(0, 3), chunks=(1, 3), dtype="f8")
    with pytest.raises(DkicfIOError, match=r"is empty: shape \(0, 3\)"):
        io.as_dask(tmp_path / "e.zarr")
    io.write_group(tmp_path / "g.zarr", {"Z": np.ones((2, 2))}, {})
    with pytest.raises(DkicfIOError, match="without an array X"):
        io.open_dataset(tmp_path / "g.zarr")


# --------------------------------------------------------------------------
# URLs, groups, datasets, fingerprints


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_group_round_trip_over_urls(tmp_path, scheme):
    url = f"memory://{tmp_path.name}/model.zarr" if scheme == "memory" else (
        f"file://{tmp_path / 'model.zarr'}"
    )
    arrays = {"centers": np.arange(6.0).reshape(3, 2), "pivots": np.array([4, 1, 9]),
              "scalar": np.float64(2.5)}
    attrs = {"kernel": "gaussian", "gamma": np.float32(0.5), "trace": np.array([3.0, 1.0]),
             "nested": {"k": 3, "ok": True, "none": None}}
    io.write_group(url, arrays, attrs)
    got, got_attrs = io.read_group(url)
    assert sorted(got) == ["centers", "pivots", "scalar"]
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name], value)
        assert got[name].dtype == np.asarray(value).dtype
    assert got_attrs == {"kernel": "gaussian", "gamma": 0.5, "trace": [3.0, 1.0],
                         "nested": {"k": 3, "ok": True, "none": None},
                         "created_by": f"dkicf {__version__}"}
    arr = io.open_array(f"{url}/centers")
    np.testing.assert_array_equal(arr[...], arrays["centers"])
    # memory:// lives in this process only: compute here, not on a cluster another test started.
    np.testing.assert_array_equal(io.as_dask(f"{url}/centers").compute(scheduler="sync"),
                                  arrays["centers"])
    with pytest.raises(DkicfIOError, match="already exists"):
        io.write_group(url, {}, {})
    io.write_group(url, {"w": np.ones(2)}, {"v": 2}, overwrite=True)
    got, got_attrs = io.read_group(url)
    assert list(got) == ["w"] and got_attrs["v"] == 2
    if scheme == "file":
        assert _leftovers(tmp_path) == []


def test_dataset_over_memory_url():
    url = "memory://dkicf-test/ring.zarr"
    io.generate("ring", url, 500, chunk_rows=128, overwrite=True)
    X, y, info = io.open_dataset(url)
    assert X.chunks[0] == (128, 128, 128, 116) and y.chunks == X.chunks[:1]
    np.testing.assert_array_equal(X.compute(scheduler="sync"), synthetic.make_ring(500)[0])
    assert info["url"] == url and info["chunk_rows"] == 128


def test_open_dataset_accepts_a_bare_array(tmp_path):
    io.write_group(tmp_path / "g.zarr", {"X": np.arange(8.0).reshape(4, 2)}, {})
    X, y, info = io.open_dataset(tmp_path / "g.zarr" / "X")
    assert y is None and info["n_samples"] == 4 and info["label_values"] is None
    np.testing.assert_array_equal(X.compute(), np.arange(8.0).reshape(4, 2))


def test_write_group_refuses_bad_names_and_attributes(tmp_path):
    with pytest.raises(DkicfIOError, match="array name 'a/b'"):
        io.write_group(tmp_path / "g.zarr", {"a/b": np.ones(2)}, {})
    with pytest.raises(DkicfIOError, match="attribute attrs.model has type object"):
        io.write_group(tmp_path / "g.zarr", {}, {"model": object()})
    with pytest.raises(DkicfIOError, match="attribute attrs.tol is nan"):
        io.write_group(tmp_path / "g.zarr", {}, {"tol": float("nan")})
    assert not (tmp_path / "g.zarr").exists()
    # Nothing in a written group is a pickle: every file is JSON or a numeric chunk.
    io.write_group(tmp_path / "g.zarr", {"a": np.ones(3)}, {"x": [1, 2]})
    for path in (tmp_path / "g.zarr").rglob("zarr.json"):
        assert "pickle" not in path.read_text()


def test_fingerprint_sees_first_and_last_chunk(tmp_path):
    io.generate("blobs", tmp_path / "a.zarr", 1000, chunk_rows=100)
    io.generate("blobs", tmp_path / "b.zarr", 1000, chunk_rows=100)
    fa = io.fingerprint(tmp_path / "a.zarr" / "X")
    fb = io.fingerprint(tmp_path / "b.zarr" / "X")
    assert fa["shape"] == [1000, 2] and fa["chunks"] == [100, 2] and fa["dtype"] == "float64"
    assert fa["content_sha256"] == fb["content_sha256"]
    assert json.loads(json.dumps(fa)) == fa
    arr = zarr.open_array(tmp_path / "b.zarr" / "X", mode="r+")
    arr[999, 0] = arr[999, 0] + 1.0
    assert io.fingerprint(arr)["content_sha256"] != fa["content_sha256"]
    io.generate("blobs", tmp_path / "c.zarr", 1000, chunk_rows=100, random_state=1)
    assert io.fingerprint(tmp_path / "c.zarr" / "X")["content_sha256"] != fa["content_sha256"]


def test_error_type():
    assert issubclass(DkicfIOError, ValueError) and issubclass(DkicfIOError, DkicfError)


def test_label_column_given_as_text_names_a_column_else_counts(tmp_path):
    from dkicf import io

    (tmp_path / "plain.csv").write_text("1.0,2.0,0\n3.0,4.0,1\n5.0,6.0,1\n")
    io.convert(tmp_path / "plain.csv", tmp_path / "a.zarr", label_column="2")  # as the CLI does
    X, y, _ = io.open_dataset(tmp_path / "a.zarr")
    np.testing.assert_array_equal(X.compute(), [[1, 2], [3, 4], [5, 6]])
    assert y.compute().tolist() == [0, 1, 1]
    # A header that has a column called "0": the name wins over the index.
    (tmp_path / "named.csv").write_text("a,0,b\n1.0,7,2.0\n3.0,8,4.0\n")
    io.convert(tmp_path / "named.csv", tmp_path / "b.zarr", label_column="0")
    X, y, _ = io.open_dataset(tmp_path / "b.zarr")
    np.testing.assert_array_equal(X.compute(), [[1, 2], [3, 4]])
    assert y.compute().tolist() == [0, 1]  # labels 7, 8 coded as classes 0, 1


def test_a_late_write_does_not_bring_back_an_abandoned_staging_folder(tmp_path):
    import dask.array as da

    url = tmp_path / "out.zarr"
    with pytest.raises(RuntimeError, match="the run failed"):
        with io.staged_group(url) as target:
            io.write_dask(target, "labels", da.arange(100, chunks=25))
            # What a write task still under way elsewhere holds: the array as write_dask
            # opened it, shipped to the worker.
            late = pickle.loads(pickle.dumps(zarr.open_array(
                store=io._stores._StagingStore(Path(target)), path="labels", mode="a")))
            raise RuntimeError("the run failed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="abandoned"):
        late[0:25] = np.arange(25)
    assert list(tmp_path.iterdir()) == []  # not recreated


def test_a_write_past_its_check_when_the_folder_goes_does_not_recreate_it(tmp_path,
                                                                            monkeypatch):
    # The folder is removed between a write's check of its root and the write itself
    # (a thread descheduled there while Ctrl-C or SIGTERM cleans up).
    root = tmp_path / ".out.zarr.staging"
    root.mkdir()
    store = io._stores._StagingStore(root)
    arr = zarr.create_array(store=store, name="X", shape=(4,), chunks=(2,), dtype="f8")
    monkeypatch.setattr(io._stores._StagingStore, "_check_root", lambda self: None)
    shutil.rmtree(root)
    with pytest.raises(FileNotFoundError):
        arr[0:2] = [1.0, 2.0]
    assert list(tmp_path.iterdir()) == []  # neither the root nor a chunk folder came back
    # A write into a folder that is there lands whole, with no partial file beside it.
    root.mkdir()
    arr = zarr.create_array(store=io._stores._StagingStore(root), name="X", shape=(4,),
                            chunks=(2,), dtype="f8")
    arr[:] = [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_array_equal(zarr.open_array(root / "X")[:], [1.0, 2.0, 3.0, 4.0])
    assert not list(root.rglob("*.partial"))


def test_removing_a_staging_folder_waits_for_the_writes_zarr_still_runs(tmp_path):
    """An interrupted write goes on in zarr's IO thread; a process that exits before it
    ends has zarr stop its loop with the write pending (asyncio then prints a traceback
    after the command's last line)."""
    import asyncio

    from zarr.core.sync import _get_loop

    root = tmp_path / ".out.zarr.staging"
    (root / "X").mkdir(parents=True)
    under_way = asyncio.run_coroutine_threadsafe(asyncio.sleep(0.5), _get_loop())
    io._staging._remove_staging(root)
    assert under_way.done()
    assert list(tmp_path.iterdir()) == []


def test_info_on_a_checkpoint_says_how_far_the_fit_got(tmp_path, monkeypatch):
    """`dkicf info` on a fit's checkpoint: the factorization's commit, where P lives,
    k-means, and how to resume."""
    import dkicf._commit as ck
    from dkicf import incomplete_cholesky
    from dkicf.kmeans import kmeans
    from dkicf.pipeline import describe

    X = np.random.default_rng(5).normal(size=(300, 3))
    params = dict(gamma=0.5, max_rank=20, tol=0.0, pivoting="greedy", checkpoint_every=5)

    class Crash(Exception):
        pass

    def crash_at(phase, at):
        def hook(name, iteration):
            if (name, iteration) == (phase, at):
                raise Crash
        return hook

    url = str(tmp_path / "ck.zarr")
    monkeypatch.setattr(ck, "_fault_hook", crash_at("P", 5))  # before the first commit
    with pytest.raises(Crash):
        incomplete_cholesky(X, checkpoint=url, **params)
    kind, details = io.inspect(url)
    assert kind == "checkpoint"
    assert details["factorization"] == "started, nothing committed yet (rank up to 20)"
    assert details["k-means"] == "not started" and "--resume" in details["resume"]

    monkeypatch.setattr(ck, "_fault_hook", crash_at("commit", 15))  # just after a commit
    with pytest.raises(Crash):
        incomplete_cholesky(X, checkpoint=url, resume=True, **params)
    kind, details = io.inspect(url)
    ref = incomplete_cholesky(X, gamma=0.5, max_rank=15, tol=0.0, pivoting="greedy")
    assert details["factorization"] == (
        f"in progress: iteration 15, rank 15 of at most 20, trace error "
        f"{ref.trace_errors[-1]:.6g}"
    )
    assert details["P"] == "in worker memory, its columns copied here at each commit"
    assert details["kernel"] == {"kernel": "gaussian", "gamma": 0.5}
    assert details["input"] == "shape [300, 3], row chunks [300]"

    monkeypatch.setattr(ck, "_fault_hook", None)
    res = incomplete_cholesky(X, checkpoint=url, resume=True, **params)
    km = kmeans(res.P, 3, n_init=2, random_state=0, checkpoint=io._join(url, "kmeans"))
    lines = describe(url)
    assert lines[0] == f"{url}: checkpoint"
    assert "  factorization: finished: iteration 20, rank 20 of at most 20, stopped by " \
           "max_rank, trace error " in "\n".join(lines)
    assert f"  k-means: finished: 2 run(s), best inertia {km.inertia:.6g}" in lines
    assert not any(line.startswith("  resume:") for line in lines)  # nothing left to do


def test_csv_errors_count_lines_and_columns_from_one(tmp_path):
    """As a spreadsheet shows them: the header is line 1, the first column is column 1."""
    (tmp_path / "h.csv").write_text("a,b,c,d\n1,2,3,4\n5,6,x,8\n")
    with pytest.raises(DkicfIOError) as info:
        io.convert(tmp_path / "h.csv", tmp_path / "h.zarr")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'h.csv'}, line 3, column 3 (c): 'x' is not a "
                              "number (lines and columns counted from 1")
    assert ".." not in message
    (tmp_path / "s.csv").write_text("1,2,3\n4,5\n")
    with pytest.raises(DkicfIOError, match=r"s.csv, line 2 has 2 fields, not 3"):
        io.convert(tmp_path / "s.csv", tmp_path / "s.zarr")
    assert not (tmp_path / "h.zarr").exists() and not (tmp_path / "s.zarr").exists()


def test_convert_keeps_or_drops_columns_by_name_or_index(tmp_path):
    (tmp_path / "t.csv").write_text("id,a,name,b,class\n7,1.5,x,2,u\n8,3,y,4.5,v\n")
    info = io.convert(tmp_path / "t.csv", tmp_path / "d.zarr", dtype="float64",
                      drop_columns=["id", "name"], label_column="class")
    X, y, _ = _read(tmp_path / "d.zarr")
    np.testing.assert_array_equal(X, [[1.5, 2], [3, 4.5]])
    np.testing.assert_array_equal(y, [0, 1])
    assert info["label_values"] == ["u", "v"]
    io.convert(tmp_path / "t.csv", tmp_path / "e.zarr", dtype="float64", columns=["3", "a"])
    np.testing.assert_array_equal(_read(tmp_path / "e.zarr")[0], [[2, 1.5], [4.5, 3]])
    with pytest.raises(DkicfIOError, match=r"no column named 'nope' \(id, a, name, b, class\)"):
        io.convert(tmp_path / "t.csv", tmp_path / "f.zarr", drop_columns=["nope"])
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    with pytest.raises(DkicfIOError, match="apply to .csv and .parquet sources"):
        io.convert(tmp_path / "x.npy", tmp_path / "g.zarr", columns=[0])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["p", "q"], "a": [1.0, 2.0], "b": [3, 4]}),
                   tmp_path / "t.parquet")
    io.convert(tmp_path / "t.parquet", tmp_path / "p.zarr", dtype="float64",
               drop_columns=["id"])
    np.testing.assert_array_equal(_read(tmp_path / "p.zarr")[0], [[1, 3], [2, 4]])


def test_convert_a_directory_of_parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parts = tmp_path / "table"
    parts.mkdir()
    rng = np.random.default_rng(0)
    frames = [rng.normal(size=(7, 2)), rng.normal(size=(5, 2))]
    for i, X in enumerate(frames):
        pq.write_table(pa.table({"a": X[:, 0], "b": X[:, 1], "y": [i] * len(X)}),
                       parts / f"part-{i}.parquet")
    info = io.convert(parts, tmp_path / "d.zarr", dtype="float64", label_column="y")
    X, y, _ = _read(tmp_path / "d.zarr")
    assert info["format"] == "parquet" and info["n_samples"] == 12
    np.testing.assert_array_equal(X, np.vstack(frames))
    np.testing.assert_array_equal(y, [0] * 7 + [1] * 5)


def test_svmlight_index_beyond_int32_is_refused_by_name(tmp_path):
    src = tmp_path / "wide.svm"
    src.write_text("1 1:0.5 3000000000:1.0\n0 2:1\n")
    with pytest.raises(DkicfIOError, match=r"wide\.svm has a feature index beyond "
                       r"2,147,483,647"):
        io.convert(str(src), str(tmp_path / "out.zarr"))
    assert not (tmp_path / "out.zarr").exists()


def test_parquet_label_column_of_lists_is_refused_by_name(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"a": [1.0, 2.0, 3.0], "lab": [[1], [2, 3], []]}), src)
    with pytest.raises(DkicfIOError, match="the label column holds lists or records"):
        io.convert(str(src), str(tmp_path / "out.zarr"), label_column="lab")
    assert not (tmp_path / "out.zarr").exists()


def test_a_group_of_zeros_written_by_dkicf_reads_back(tmp_path):
    """Zarr leaves out chunks equal to the fill value by default; dkicf writes them all."""
    io.write_group(str(tmp_path / "z.zarr"), {"X": np.zeros((50, 2))}, {})
    X, y, _ = io.open_dataset(str(tmp_path / "z.zarr"))
    assert X.shape == (50, 2) and y is None
    assert not np.asarray(X.compute()).any()
