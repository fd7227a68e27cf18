"""Fuzzing the inputs dkicf reads: files to convert, Zarr stores, model groups.

Every case must end in one of two ways: a clean error (a ``DkicfError``, or a
``ValueError`` raised by dkicf itself, never one from deep inside a library)
or a correct result; never a hang (each case runs under a time limit), a
partial output, or a change to the input.  Each case also runs under a limit
on new memory, so that a size taken from the input cannot exhaust the machine.

The default hypothesis profile keeps the suite short; the benchmark runs
``--hypothesis-profile=long`` (see ``benchmarks/bench_campaign.py``).
"""

from __future__ import annotations

import contextlib
import io as _bytes_io
import json
import os
import resource
import shutil
import signal
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dkicf  # noqa: E402
from dkicf import io  # noqa: E402
from dkicf.errors import DkicfError  # noqa: E402

PACKAGE = Path(dkicf.__file__).resolve().parent
CASE_SECONDS = 30  # a case that takes longer is a hang
CASE_MEMORY = 2 << 30  # address space a case may add to the process


class CaseHung(Exception):
    """A fuzz case ran past its time limit."""


@contextlib.contextmanager
def case_limits(seconds: float = CASE_SECONDS, memory: int = CASE_MEMORY):
    """Run a case under a time limit (SIGALRM) and a limit on new address space."""
    import psutil

    def hung(*_):
        raise CaseHung(f"the case ran past {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + memory
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def raised_by_dkicf(exc: BaseException) -> bool:
    """A DkicfError, or a ValueError whose innermost frame is in dkicf's own code."""
    if isinstance(exc, DkicfError):
        return True
    if not isinstance(exc, ValueError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file (and link target) under ``path``, to check that the input was not changed."""
    if path.is_file() or path.is_symlink():
        return {"": path.read_bytes() if path.is_file() else os.readlink(path).encode()}
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(path))] = b"->" + os.readlink(p).encode()
        elif p.is_file():
            out[str(p.relative_to(path))] = p.read_bytes()
    return out


# When a list: each case appends (outcome, seconds) to it (benchmarks/bench_campaign.py).
CASE_TIMES: list | None = None


def run_case(call, *, inputs: list[Path], output: Path | None = None):
    """Run ``call``; return ("ok", result) or ("refused", error), checking the invariants.

    Fails the test on an error that is not clean, on a hang, on an input that
    changed ("data lost"), and on an output left behind by a refused call
    ("partial output").
    """
    import time

    before = [snapshot(p) for p in inputs]
    outcome = None
    t0 = time.perf_counter()
    try:
        with case_limits():
            outcome = ("ok", call())
    except CaseHung as exc:
        pytest.fail(f"hang: {exc}")
    except Exception as exc:  # noqa: BLE001 - classified below
        if not raised_by_dkicf(exc):
            pytest.fail("not a clean error: " + "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:])
        outcome = ("refused", exc)
    if CASE_TIMES is not None:
        CASE_TIMES.append((outcome[0], time.perf_counter() - t0))
    for path, seen in zip(inputs, before):
        assert snapshot(path) == seen, f"data lost: the input {path} was changed"
    if output is not None:
        leftovers = [p.name for p in output.parent.iterdir() if ".dkicf-tmp" in p.name]
        assert not leftovers, f"partial output: {leftovers}"
        if outcome[0] == "refused":
            assert not os.path.lexists(output), "partial output: a refused call left it"
    return outcome


# --------------------------------------------------------------------------
# files given to convert

_NUMBER_TEXT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["1e999", "-0", "0x10", "1_000", "NaN", "inf", ".5", "5."]),
)
_FIELD = st.one_of(_NUMBER_TEXT, st.sampled_from(["", " ", "a", "b", '"1"', "True", "#"]),
                   st.text(max_size=4))
_ROWS = st.lists(st.lists(_FIELD, max_size=5), max_size=8)


@st.composite
def csv_texts(draw):
    sep = draw(st.sampled_from([",", "\t", ";", " "]))
    lines = [sep.join(row) for row in draw(_ROWS)]
    if draw(st.booleans()):
        lines.insert(0, sep.join(draw(st.lists(st.sampled_from(["a", "b", "c", "label", "1"]),
                                                max_size=5))))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), "# a comment")
    text = "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))
    return text.encode("utf-8", "surrogatepass") if draw(st.booleans()) else \
        text.encode("utf-8", "replace")


@st.composite
def numeric_csvs(draw):
    """A rectangular table of finite numbers: converts to exactly these values."""
    rows = draw(st.integers(1, 12))
    cols = draw(st.integers(1, 5))
    values = draw(st.lists(st.floats(-1e300, 1e300, allow_nan=False), min_size=rows * cols,
                           max_size=rows * cols))
    X = np.array(values, dtype=np.float64).reshape(rows, cols)
    sep = draw(st.sampled_from([",", "\t", ";"]))
    text = "\n".join(sep.join(repr(float(v)) for v in row) for row in X) + "\n"
    return text.encode(), X


@st.composite
def svmlight_texts(draw):
    index = st.one_of(st.integers(0, 8), st.integers(-3, 10**13), st.sampled_from(["x", "",
                                                                                 "1.5"]))
    pair = st.tuples(index, _NUMBER_TEXT).map(lambda p: f"{p[0]}:{p[1]}")
    line = st.tuples(st.one_of(_NUMBER_TEXT, st.sampled_from(["a", "", "+1", "-1"])),
                     st.lists(st.one_of(pair, _FIELD), max_size=5))
    lines = [" ".join([label, *pairs]) for label, pairs in draw(st.lists(line, max_size=8))]
    if draw(st.booleans()):
        lines.append("# comment")
    return ("\n".join(lines) + "\n").encode("utf-8", "replace")


_NPY_DTYPES = ["<f8", "<f4", ">f8", "<i8", "|u1", "|b1", "<c16", "<U3", "|O",
               [("a", "<f8"), ("b", "<i4")], "<f2", "<m8[s]"]


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(_NPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    size = int(np.prod(shape))
    if dtype.kind == "O":
        arr = np.empty(shape, dtype=object)
        arr.reshape(-1)[:] = [draw(st.sampled_from([1.0, "x", None]))
                              for _ in range(size)]
        return arr
    raw = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy() if size else \
        np.zeros(shape, dtype=dtype)
    if draw(st.booleans()) and arr.ndim == 2:
        arr = np.asfortranarray(arr)
    return arr


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = _bytes_io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


@st.composite
def npy_files(draw):
    arr = draw(arrays())
    data = _npy_bytes(arr)
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif damage == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    return data, arr, damage


@st.composite
def npz_files(draw):
    members = draw(st.dictionaries(st.sampled_from(["X", "y", "Z"]), arrays(), max_size=3))
    buf = _bytes_io.BytesIO()
    (np.savez_compressed if draw(st.booleans()) else np.savez)(buf, **members)
    data = buf.getvalue()
    damage = draw(st.sampled_from(["none", "none", "truncate"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    return data, members, damage


@st.composite
def parquet_files(draw):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = draw(st.integers(0, 6))
    columns = {}
    for name in draw(st.lists(st.sampled_from(["a", "b", "c", "label"]), unique=True,
                              max_size=4)):
        kind = draw(st.sampled_from(["f8", "i8", "str", "bool", "null", "list", "f8nan"]))
        if kind == "f8":
            col = pa.array(draw(st.lists(st.one_of(st.none(), st.floats()), min_size=rows,
                                         max_size=rows)), type=pa.float64())
        elif kind == "f8nan":
            col = pa.array([float("nan")] * rows, type=pa.float64())
        elif kind == "i8":
            col = pa.array(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=rows,
                                         max_size=rows)), type=pa.int64())
        elif kind == "str":
            col = pa.array(draw(st.lists(st.text(max_size=3), min_size=rows, max_size=rows)))
        elif kind == "bool":
            col = pa.array(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
        elif kind == "null":
            col = pa.nulls(rows)
        else:
            col = pa.array([[1, 2]] * rows)
        columns[name] = col
    buf = _bytes_io.BytesIO()
    pq.write_table(pa.table(columns) if columns else pa.table({}), buf)
    data = buf.getvalue()
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


_LABEL_COLUMNS = st.one_of(st.none(), st.integers(-3, 6), st.sampled_from(["a", "label", "z"]))


def _convert_case(data: bytes, suffix: str, label_column=None):
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / f"in{suffix}"
        src.write_bytes(data)
        dst = Path(d) / "out.zarr"
        kind, value = run_case(
            lambda: io.convert(src, dst, dtype="float64", chunk_rows=4,
                               label_column=label_column),
            inputs=[src], output=dst)
        if kind == "ok":
            X, y, info = io.open_dataset(dst)
            X = X.compute()
            assert np.isfinite(X).all() and X.shape == tuple(info["shape"])
            if y is not None:
                y = y.compute()
                assert y.shape == (X.shape[0],)
                assert 0 <= y.min() and y.max() < len(info["label_values"])
            return X, y, value
        return None, None, value


@given(data=csv_texts(), label_column=_LABEL_COLUMNS)
def test_fuzz_convert_csv(data, label_column):
    _convert_case(data, ".csv", label_column)


@given(case=numeric_csvs())
def test_fuzz_convert_numeric_csv_is_exact(case):
    data, expected = case
    X, _, err = _convert_case(data, ".csv")
    assert X is not None, err
    np.testing.assert_array_equal(X, expected)


@given(data=svmlight_texts())
def test_fuzz_convert_svmlight(data):
    _convert_case(data, ".svm")


@given(case=npy_files())
def test_fuzz_convert_npy(case):
    data, arr, damage = case
    X, _, err = _convert_case(data, ".npy")
    if X is not None and damage == "none":
        np.testing.assert_array_equal(X, arr.astype(np.float64))


@given(case=npz_files())
def test_fuzz_convert_npz(case):
    data, members, damage = case
    X, _, err = _convert_case(data, ".npz")
    if X is not None and damage == "none":
        np.testing.assert_array_equal(X, members["X"].astype(np.float64))


@given(data=parquet_files(), label_column=_LABEL_COLUMNS)
def test_fuzz_convert_parquet(data, label_column):
    _convert_case(data, ".parquet", label_column)


# --------------------------------------------------------------------------
# Zarr stores given to fit, predict and info

_ROWS_, _COLS_, _CHUNK_ = 40, 3, 10
_STORE_X = np.arange(_ROWS_ * _COLS_, dtype=np.float64).reshape(_ROWS_, _COLS_) / 7.0
_HUGE = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 10**13, 2**63, 2**64]))
_DIM = st.one_of(st.integers(0, 100), _HUGE, st.sampled_from([1.5, "4", None, [4], True]))
_CODECS = [
    {"name": "numcodecs.pickle", "configuration": {}},
    {"name": "pickle"},
    {"name": "vlen-utf8"},
    {"name": "no-such-codec"},
    {"name": "bytes", "configuration": {"endian": "big"}},
    {"name": "zstd", "configuration": {"level": 0, "checksum": False}},
    {"name": 5},
    "bytes",
    None,
]


def _sharded(inner) -> dict:
    return {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [_CHUNK_, _COLS_], "codecs": inner,
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "index_location": "end"}}


_MUTATIONS = st.one_of(
    st.tuples(st.just("shape"), st.lists(_DIM, min_size=0, max_size=3)),
    st.tuples(st.just("rows"), _DIM),
    st.tuples(st.just("chunk_shape"), st.lists(_DIM, min_size=0, max_size=3)),
    st.tuples(st.just("data_type"), st.sampled_from(
        ["float32", "int64", "uint8", "bool", "complex128", "string", "object", "|O", "foo",
         5, None, "float16", {"name": "float64"}])),
    st.tuples(st.just("codecs"), st.lists(st.sampled_from(_CODECS), max_size=3)),
    st.tuples(st.just("sharded"), st.lists(st.sampled_from(_CODECS), max_size=2)),
    st.tuples(st.just("fill_value"), st.sampled_from([None, "NaN", "abc", 1e308, [1], {}])),
    st.tuples(st.just("delete_chunk"), st.integers(0, _ROWS_ // _CHUNK_ - 1)),
    st.tuples(st.just("corrupt_chunk"), st.tuples(st.integers(0, 3), st.binary(max_size=64))),
    st.tuples(st.just("symlink_out"), st.integers(0, _ROWS_ // _CHUNK_ - 1)),
    st.tuples(st.just("symlink_store"), st.just(None)),
    st.tuples(st.just("node_type"), st.sampled_from(["group", "array", "foo", None, 3])),
    st.tuples(st.just("json"), st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe"])),
    st.tuples(st.just("label_values"), st.sampled_from([5, "abc", {"a": 1}, [1, [2]], None,
                                                        list(range(70000))])),
    st.tuples(st.just("y_shape"), st.lists(_DIM, min_size=0, max_size=2)),
    st.tuples(st.just("y_dtype"), st.sampled_from(["float64", "bool", "string", "int8"])),
    st.tuples(st.just("remove"), st.sampled_from(["X", "y", "X/zarr.json", "zarr.json"])),
)


def _build_store(root: Path) -> Path:
    import zarr

    group = zarr.open_group(str(root), mode="w")
    group.create_array("X", data=_STORE_X, chunks=(_CHUNK_, _COLS_))
    group.create_array("y", data=np.arange(_ROWS_) % 2, chunks=(_CHUNK_,))
    group.attrs["label_values"] = [0, 1]
    return root


def _edit_json(path: Path, edit) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _mutate(store: Path, outside: Path, mutation) -> None:
    kind, arg = mutation
    xmeta = store / "X" / "zarr.json"
    if kind == "shape":
        _edit_json(xmeta, lambda m: m.__setitem__("shape", arg))
    elif kind == "rows":
        _edit_json(xmeta, lambda m: m["shape"].__setitem__(0, arg))
    elif kind == "chunk_shape":
        _edit_json(xmeta, lambda m: m["chunk_grid"]["configuration"].__setitem__(
            "chunk_shape", arg))
    elif kind == "data_type":
        _edit_json(xmeta, lambda m: m.__setitem__("data_type", arg))
    elif kind == "codecs":
        _edit_json(xmeta, lambda m: m.__setitem__("codecs", arg))
    elif kind == "sharded":
        _edit_json(xmeta, lambda m: m.__setitem__("codecs", [_sharded(arg)]))
    elif kind == "fill_value":
        _edit_json(xmeta, lambda m: m.__setitem__("fill_value", arg))
    elif kind == "delete_chunk":
        (store / "X" / "c" / str(arg) / "0").unlink()
    elif kind == "corrupt_chunk":
        (store / "X" / "c" / str(arg[0]) / "0").write_bytes(arg[1])
    elif kind == "symlink_out":
        # A chunk replaced by a link to a valid chunk outside the store: data
        # that is not the store's would be read (and could end up in a model).
        chunk = store / "X" / "c" / str(arg) / "0"
        target = outside / f"chunk{arg}"
        shutil.copyfile(chunk, target)
        chunk.unlink()
        chunk.symlink_to(target)
    elif kind == "symlink_store":
        shutil.copytree(store / "X", outside / "X")
        shutil.rmtree(store / "X")
        (store / "X").symlink_to(outside / "X")
    elif kind == "node_type":
        _edit_json(xmeta, lambda m: m.__setitem__("node_type", arg))
    elif kind == "json":
        xmeta.write_bytes(arg)
    elif kind == "label_values":
        _edit_json(store / "zarr.json", lambda m: m["attributes"].__setitem__("label_values",
                                                                              arg))
    elif kind == "y_shape":
        _edit_json(store / "y" / "zarr.json", lambda m: m.__setitem__("shape", arg))
    elif kind == "y_dtype":
        _edit_json(store / "y" / "zarr.json", lambda m: m.__setitem__("data_type", arg))
    elif kind == "remove":
        target = store / arg
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def _read_store(url: str):
    """What fit and predict read of a dataset store, computed here; and what info prints."""
    from dkicf import pipeline

    lines = pipeline.describe(url)
    X, y, info = io.open_dataset(url)
    X = X.compute(scheduler="synchronous")
    y = None if y is None else y.compute(scheduler="synchronous")
    io.fingerprint(f"{url}/X") if (Path(url) / "X").exists() else None
    return lines, X, y, info


@given(mutations=st.lists(_MUTATIONS, min_size=1, max_size=3))
def test_fuzz_dataset_stores(mutations):
    with tempfile.TemporaryDirectory() as d:
        store = _build_store(Path(d) / "data.zarr")
        outside = Path(d) / "outside"
        outside.mkdir()
        for mutation in mutations:
            # A mutation that does not apply to what earlier ones left is skipped.
            with contextlib.suppress(OSError, KeyError, TypeError, IndexError,
                                     AttributeError, ValueError):
                _mutate(store, outside, mutation)
        kind, value = run_case(lambda: _read_store(str(store)), inputs=[store, outside])
        if kind == "ok":
            lines, X, y, info = value
            # A correct result: what the store holds, with the shape it declares.
            assert X.shape == tuple(info["shape"])
            assert not any(m[0] in ("symlink_out", "symlink_store", "delete_chunk")
                           for m in mutations), "a damaged store was read"
            rows, cols = X.shape
            # Other codecs or a fill value may read the same bytes as other numbers.
            recoded = any(m[0] in ("codecs", "sharded", "fill_value") for m in mutations)
            if cols == _COLS_ and X.dtype == np.float64 and not recoded:
                np.testing.assert_array_equal(X, _STORE_X[:rows])


# --------------------------------------------------------------------------
# model groups given to predict

_MODEL_X = np.random.default_rng(5).normal(size=(60, 3))
_MODEL_CACHE: dict[str, Path] = {}


def _saved_model() -> Path:
    """A small fitted model, saved once per session (copied for each case)."""
    if "path" not in _MODEL_CACHE:
        from dkicf import KernelKMeans

        model = KernelKMeans(n_clusters=3, gamma=0.5, rank=8, n_init=1, random_state=0,
                             algorithm="lloyd").fit(_MODEL_X)
        root = Path(tempfile.mkdtemp(prefix="dkicf-fuzz-model-"))
        model.save(root / "model.zarr")
        group_meta = root / "model.zarr" / "zarr.json"
        # As fit_store records it: the training data's shape bounds the pivots.
        _edit_json(group_meta, lambda m: m["attributes"]["dkicf"].__setitem__(
            "input", {"shape": list(_MODEL_X.shape)}))
        _MODEL_CACHE["path"] = root / "model.zarr"
    return _MODEL_CACHE["path"]


_MODEL_ARRAY_NAMES = ["cluster_centers", "pivots", "pivot_rows", "cholesky_factor",
                      "trace_errors"]
_ATTR_VALUES = st.sampled_from([None, -1, 0, 99, 1.5, float("nan"), "x", [], {}, True,
                                {"kernel": "nope"}, {"kernel": "linear"},
                                {"kernel": "gaussian", "gamma": -1.0},
                                {"kernel": "gaussian", "gamma": 2.0}, "dkicf-model",
                                "labels", 1, 3])
_MODEL_MUTATIONS = st.one_of(
    st.tuples(st.just("drop_array"), st.sampled_from(_MODEL_ARRAY_NAMES)),
    st.tuples(st.just("pivot"), st.tuples(st.integers(0, 7),
                                          st.sampled_from([-1, 60, 10**12, 0, 5]))),
    st.tuples(st.just("L_upper"), st.just(None)),
    st.tuples(st.just("L_entry"), st.tuples(st.integers(0, 7), st.integers(0, 7),
                                            st.sampled_from([0.0, -1.0, np.nan, 1e300, 2.0]))),
    st.tuples(st.just("center"), st.tuples(st.integers(0, 2), st.integers(0, 7),
                                           st.sampled_from([np.nan, np.inf, 0.0, 3.0]))),
    st.tuples(st.just("row"), st.tuples(st.integers(0, 7), st.integers(0, 2),
                                        st.sampled_from([np.nan, 0.0, 1e10]))),
    st.tuples(st.just("reshape"), st.tuples(st.sampled_from(_MODEL_ARRAY_NAMES),
                                            st.sampled_from([(0,), (8,), (3, 3), (8, 8, 1),
                                                             (2, 8), (9, 8)]))),
    st.tuples(st.just("dtype"), st.tuples(st.sampled_from(_MODEL_ARRAY_NAMES),
                                          st.sampled_from(["float32", "int64", "bool"]))),
    st.tuples(st.just("attr"), st.tuples(st.sampled_from(
        ["kind", "schema", "kernel", "params", "n_features_in", "rank", "inertia",
         "n_iter", "initial_trace", "stop_reason", "n_passes", "feature_names_in", "input"]),
        st.one_of(st.just("<delete>"), _ATTR_VALUES))),
    # The one attribute that holds all of dkicf's, replaced or removed.
    st.tuples(st.just("dkicf_attr"), st.one_of(st.just("<delete>"), _ATTR_VALUES)),
)


def _rewrite(group_path: Path, name: str, value: np.ndarray) -> None:
    import zarr

    group = zarr.open_group(str(group_path), mode="r+")
    group.create_array(name, shape=value.shape, dtype=value.dtype,
                       chunks=tuple(max(1, s) for s in value.shape), overwrite=True)
    if value.size:
        group[name][...] = value


def _tamper(model: Path, mutation) -> None:
    import zarr

    kind, arg = mutation
    group = zarr.open_group(str(model), mode="r")
    arrays = {name: group[name][...] for name in _MODEL_ARRAY_NAMES if name in group}
    if kind == "drop_array":
        shutil.rmtree(model / arg)
    elif kind == "pivot":
        pivots = arrays["pivots"].copy()
        if pivots.size:  # an earlier mutation may have left none to change
            pivots[arg[0] % pivots.size] = arg[1]
            _rewrite(model, "pivots", pivots)
    elif kind == "L_upper":
        _rewrite(model, "cholesky_factor", arrays["cholesky_factor"].T.copy())
    elif kind == "L_entry":
        L = arrays["cholesky_factor"].copy()
        L[arg[0], arg[1]] = arg[2]
        _rewrite(model, "cholesky_factor", L)
    elif kind == "center":
        C = arrays["cluster_centers"].copy()
        C[arg[0], arg[1]] = arg[2]
        _rewrite(model, "cluster_centers", C)
    elif kind == "row":
        R = arrays["pivot_rows"].copy()
        R[arg[0], arg[1]] = arg[2]
        _rewrite(model, "pivot_rows", R)
    elif kind == "reshape":
        _rewrite(model, arg[0], np.ones(arg[1]))
    elif kind == "dtype":
        _rewrite(model, arg[0], arrays[arg[0]].astype(arg[1]))
    elif kind == "attr":
        key, value = arg

        def edit(meta):
            attrs = meta["attributes"].get("dkicf")
            if not isinstance(attrs, dict):
                return  # replaced by an earlier mutation
            if value == "<delete>":
                attrs.pop(key, None)
            else:
                attrs[key] = value

        _edit_json(model / "zarr.json", edit)
    elif kind == "dkicf_attr":

        def replace(meta):
            if arg == "<delete>":
                meta["attributes"].pop("dkicf")
            else:
                meta["attributes"]["dkicf"] = arg

        _edit_json(model / "zarr.json", replace)


def _reference_labels(model: Path, X: np.ndarray) -> np.ndarray:
    """Labels computed from the saved arrays by an independent route (scikit-learn kernels)."""
    from scipy.linalg import solve_triangular
    from sklearn.metrics import pairwise

    arrays, attrs = io.read_group(model)
    kp = dict(attrs["kernel"])
    name = kp.pop("kernel")
    rows = arrays["pivot_rows"]
    if name in ("gaussian", "rbf"):
        K = pairwise.rbf_kernel(rows, X, gamma=kp["gamma"])
    elif name == "laplacian":
        K = pairwise.laplacian_kernel(rows, X, gamma=kp["gamma"])
    elif name in ("polynomial", "poly"):
        K = pairwise.polynomial_kernel(rows, X, degree=kp["degree"], gamma=kp["gamma"],
                                       coef0=kp["coef0"])
    else:
        K = pairwise.linear_kernel(rows, X)
    F = solve_triangular(arrays["cholesky_factor"], K, lower=True).T
    d2 = ((F[:, None, :] - arrays["cluster_centers"][None]) ** 2).sum(-1)
    return np.argmin(d2, axis=1)


# Found by the campaign: the pivots emptied, then one of them changed (the mutation's own
# modulo by zero, before any of dkicf ran).
@example(mutations=[("drop_array", "trace_errors"), ("reshape", ("pivots", (0,))),
                    ("pivot", (3, 5))])
@given(mutations=st.lists(_MODEL_MUTATIONS, min_size=1, max_size=3))
def test_fuzz_model_groups(mutations):
    from dkicf import load

    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model.zarr"
        shutil.copytree(_saved_model(), model)
        for mutation in mutations:
            with contextlib.suppress(OSError, KeyError, IndexError, ValueError, TypeError,
                                     OverflowError):
                _tamper(model, mutation)
        X = _MODEL_X[:20]
        kind, value = run_case(lambda: load(model).predict(X), inputs=[model])
        if kind == "ok":
            np.testing.assert_array_equal(value, _reference_labels(model, X))
