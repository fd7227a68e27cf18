"""The Zarr layout: dkicf's attributes under one key with a schema, dimension names, old stores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from dkicf import KernelKMeans, __version__, io, load
from dkicf.errors import CheckpointMismatchError
from dkicf.io import DkicfIOError

# What docs/zarr-layout.md promises, written out here rather than read from dkicf.
_MODEL_DIMS = {
    "cluster_centers": ["cluster", "column"],
    "pivots": ["column"],
    "pivot_rows": ["column", "feature"],
    "cholesky_factor": ["pivot", "column"],
    "trace_errors": ["column"],
    "labels": ["row"],
}
_X = np.random.default_rng(3).normal(size=(60, 3))


def _meta(path: Path) -> dict:
    return json.loads((path / "zarr.json").read_text())


def _fitted() -> KernelKMeans:
    return KernelKMeans(n_clusters=3, gamma=0.5, rank=8, n_init=1, random_state=0,
                        algorithm="lloyd").fit(_X)


def _set_schema(path: Path, schema) -> None:
    meta = _meta(path)
    meta["attributes"]["dkicf"]["schema"] = schema
    (path / "zarr.json").write_text(json.dumps(meta))


# --------------------------------------------------------------------------
# what dkicf writes


def test_a_dataset_keeps_its_attributes_under_dkicf_and_names_its_dimensions(tmp_path):
    y = np.array(["b", "a"] * 15)
    np.savez(tmp_path / "d.npz", X=_X[:30], y=y)
    io.convert(tmp_path / "d.npz", tmp_path / "d.zarr", dtype="float64", chunk_rows=8)
    meta = _meta(tmp_path / "d.zarr")
    assert list(meta["attributes"]) == ["dkicf"]
    assert meta["attributes"]["dkicf"] == {
        "schema": 2, "kind": "dataset", "source": "d.npz", "source_format": "npz",
        "dtype": "float64", "shape": [30, 3], "label_values": ["a", "b"],
        "created_by": f"dkicf {__version__}",
    }
    assert _meta(tmp_path / "d.zarr" / "X")["dimension_names"] == ["row", "feature"]
    assert _meta(tmp_path / "d.zarr" / "y")["dimension_names"] == ["row"]
    _, _, info = io.open_dataset(tmp_path / "d.zarr")
    assert info["label_values"] == ["a", "b"] and info["attrs"]["source_format"] == "npz"


def test_a_generated_dataset_has_the_same_layout(tmp_path):
    io.generate("blobs", tmp_path / "b.zarr", 50, chunk_rows=20, centers=2)
    attrs = _meta(tmp_path / "b.zarr")["attributes"]["dkicf"]
    assert (attrs["schema"], attrs["kind"]) == (2, "dataset")
    assert attrs["synthetic"]["kind"] == "blobs" and attrs["label_values"] == [0, 1]
    assert _meta(tmp_path / "b.zarr" / "X")["dimension_names"] == ["row", "feature"]


def test_a_saved_model_keeps_its_attributes_under_dkicf_and_names_its_dimensions(tmp_path):
    model = _fitted()
    model.save(tmp_path / "m.zarr")
    meta = _meta(tmp_path / "m.zarr")
    assert list(meta["attributes"]) == ["dkicf"]
    attrs = meta["attributes"]["dkicf"]
    assert (attrs["schema"], attrs["kind"], attrs["rank"]) == (2, "model", 8)
    assert "format" not in attrs and "format_version" not in attrs
    for name, dims in _MODEL_DIMS.items():
        assert _meta(tmp_path / "m.zarr" / name)["dimension_names"] == dims, name
    assert io.inspect(tmp_path / "m.zarr")[0] == "model"


def test_predicted_labels_and_p_have_the_layout(tmp_path):
    from dkicf import incomplete_cholesky
    from dkicf.pipeline import predict_store

    model = _fitted()
    model.save(tmp_path / "m.zarr")
    io.write_group(tmp_path / "d.zarr", {"X": _X}, {})
    predict_store(str(tmp_path / "m.zarr"), str(tmp_path / "d.zarr"),
                  str(tmp_path / "l.zarr"), client=None)
    attrs = _meta(tmp_path / "l.zarr")["attributes"]["dkicf"]
    assert (attrs["schema"], attrs["kind"]) == (2, "labels")
    assert attrs["model"] == str(tmp_path / "m.zarr")
    assert _meta(tmp_path / "l.zarr" / "labels")["dimension_names"] == ["row"]
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "l.zarr" / "labels")[...],
                                  model.predict(_X))
    assert io.inspect(tmp_path / "l.zarr")[0] == "labels"

    incomplete_cholesky(_X, gamma=0.5, max_rank=6, checkpoint=str(tmp_path / "ck.zarr"))
    attrs = _meta(tmp_path / "ck.zarr")["attributes"]["dkicf"]
    assert (attrs["schema"], attrs["kind"]) == (2, "icf-checkpoint")
    assert _meta(tmp_path / "ck.zarr" / "P")["dimension_names"] == ["row", "column"]


def test_write_group_keeps_the_layouts_names_for_itself(tmp_path):
    for key in ("schema", "kind"):
        with pytest.raises(DkicfIOError, match=f"the attribute '{key}' is set by dkicf"):
            io.write_group(tmp_path / "g.zarr", {}, {key: 1})
    assert not (tmp_path / "g.zarr").exists()


def test_read_group_refuses_a_group_of_another_kind(tmp_path):
    io.write_group(tmp_path / "g.zarr", {"w": np.ones(2)}, {"v": 1}, kind="labels")
    with pytest.raises(DkicfIOError, match="is not a dkicf model: its attributes say kind "
                                           "'labels'"):
        io.read_group(tmp_path / "g.zarr", kind="model")
    with pytest.raises(DkicfIOError, match="is not a dkicf model"):
        load(tmp_path / "g.zarr")
    assert io.read_group(tmp_path / "g.zarr", kind="labels")[1]["v"] == 1


# --------------------------------------------------------------------------
# stores in the layout before schema 2, written here with zarr alone


def _old_dataset(path: Path, X: np.ndarray, codes: np.ndarray, values: list) -> Path:
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    group.create_array("X", data=X, chunks=(10, X.shape[1]))
    group.create_array("y", data=codes, chunks=(10,))
    group.attrs.update({"source": "d.npz", "source_format": "npz", "dtype": str(X.dtype),
                        "shape": list(X.shape), "created_by": "dkicf 0.1.0",
                        "label_values": values})
    return path


def _old_model(path: Path, model: KernelKMeans, **changes) -> Path:
    """A model group as dkicf wrote it before schema 2: attributes at the top level."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    for name, value in (("cluster_centers", model.cluster_centers_),
                        ("pivots", model.pivots_), ("pivot_rows", model.pivot_rows_),
                        ("cholesky_factor", model.cholesky_factor_),
                        ("trace_errors", model.trace_errors_),
                        ("labels", np.asarray(model.labels_, dtype=np.int32))):
        group.create_array(name, data=np.asarray(value), chunks=value.shape or (1,))
    attrs = {
        "format": "dkicf-model", "format_version": 1,
        "kernel": {"kernel": "gaussian", "gamma": 0.5},
        "params": {"n_clusters": 3, "gamma": 0.5, "rank": 8, "random_state": 0},
        "n_features_in": 3, "rank": int(model.rank_), "inertia": float(model.inertia_),
        "n_iter": int(model.n_iter_), "initial_trace": float(model.initial_trace_),
        "stop_reason": model.stop_reason_, "n_passes": int(model.n_passes_),
        "versions": {"dkicf": "0.1.0"}, "created_by": "dkicf 0.1.0",
    }
    attrs.update(changes)
    group.attrs.update(attrs)
    return path


def test_an_old_dataset_is_read_with_its_labels(tmp_path):
    codes = np.arange(40) % 3
    store = _old_dataset(tmp_path / "old.zarr", _X[:40], codes, ["x", "y", "z"])
    X, y, info = io.open_dataset(store)
    np.testing.assert_array_equal(X.compute(), _X[:40])
    np.testing.assert_array_equal(y.compute(), codes)
    assert info["label_values"] == ["x", "y", "z"]
    assert info["attrs"]["source_format"] == "npz"
    kind, details = io.inspect(store)
    assert kind == "dataset" and details["labels"] == "y, 3 classes"


def test_old_label_values_of_the_wrong_type_are_still_refused(tmp_path):
    store = _old_dataset(tmp_path / "old.zarr", _X[:40], np.zeros(40, np.int64), [0, 1])
    zarr.open_group(str(store), mode="r+").attrs["label_values"] = {"a": 1}
    with pytest.raises(DkicfIOError, match="its attribute label_values is"):
        io.open_dataset(store)


def test_an_old_model_loads_and_predicts_as_the_model_it_was_made_from(tmp_path):
    model = _fitted()
    old = load(_old_model(tmp_path / "old.zarr", model))
    np.testing.assert_array_equal(old.predict(_X), model.predict(_X))
    np.testing.assert_array_equal(old.transform(_X), model.transform(_X))
    assert old.inertia_ == model.inertia_ and old.get_params()["n_clusters"] == 3
    kind, details = io.inspect(tmp_path / "old.zarr")
    assert kind == "model" and details["rank"] == 8
    # Saved again, it has the current layout (what docs/zarr-layout.md says to do).
    old.save(tmp_path / "new.zarr")
    assert _meta(tmp_path / "new.zarr")["attributes"]["dkicf"]["schema"] == 2
    np.testing.assert_array_equal(load(tmp_path / "new.zarr").predict(_X), model.predict(_X))


def test_an_old_model_of_a_later_format_is_refused(tmp_path):
    path = _old_model(tmp_path / "old.zarr", _fitted(), format_version=2)
    with pytest.raises(DkicfIOError, match=r"written by a newer dkicf \(dkicf-model format 2\)"
                                           r".*Upgrade dkicf"):
        load(path)
    path = _old_model(tmp_path / "bad.zarr", _fitted(), format_version="1")
    with pytest.raises(DkicfIOError, match="format_version is 1, not an integer"):
        load(path)


# --------------------------------------------------------------------------
# a later schema, or a damaged dkicf attribute


def test_a_later_schema_is_refused_with_the_fix(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=20)
    _fitted().save(tmp_path / "m.zarr")
    for path in (tmp_path / "d.zarr", tmp_path / "m.zarr"):
        _set_schema(path, 3)
    expected = (r"was written by a newer dkicf \(schema 3\); this dkicf .* reads the Zarr "
                r"layout up to schema 2\. Upgrade dkicf to read it\.")
    for call in (lambda: io.open_dataset(tmp_path / "d.zarr"),
                 lambda: load(tmp_path / "m.zarr"),
                 lambda: io.read_group(tmp_path / "m.zarr"),
                 lambda: io.inspect(tmp_path / "m.zarr")):
        with pytest.raises(DkicfIOError, match=expected):
            call()


@pytest.mark.parametrize("value, match", [
    (None, "schema None, not a version number"),
    ("2", "schema 2, not a version number"),
    (True, "schema True, not a version number"),
    (0, "schema 0, not a version number"),
])
def test_a_schema_that_is_not_a_version_is_refused(tmp_path, value, match):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=20)
    _set_schema(tmp_path / "d.zarr", value)
    with pytest.raises(DkicfIOError, match=match):
        io.open_dataset(tmp_path / "d.zarr")


def test_a_dkicf_attribute_that_is_not_a_dict_is_refused(tmp_path):
    _fitted().save(tmp_path / "m.zarr")
    meta = _meta(tmp_path / "m.zarr")
    meta["attributes"]["dkicf"] = [1, 2]
    (tmp_path / "m.zarr" / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(DkicfIOError, match=r"its attribute 'dkicf' is \[1, 2\], not the dict"):
        load(tmp_path / "m.zarr")


# --------------------------------------------------------------------------
# checkpoints: schema 1 resumes, a later one is refused


def test_a_checkpoint_of_schema_1_resumes_and_a_later_one_is_refused(tmp_path, monkeypatch):
    import dkicf._commit as ck
    from dkicf import incomplete_cholesky

    params = dict(gamma=0.5, max_rank=12, tol=0.0, pivoting="greedy", checkpoint_every=4)
    url = tmp_path / "ck.zarr"

    class Crash(Exception):
        pass

    def crash(phase, iteration):
        if (phase, iteration) == ("commit", 8):
            raise Crash

    monkeypatch.setattr(ck, "_fault_hook", crash)
    with pytest.raises(Crash):
        incomplete_cholesky(_X, checkpoint=str(url), **params)
    monkeypatch.setattr(ck, "_fault_hook", None)
    _set_schema(url, 3)
    with pytest.raises(CheckpointMismatchError, match="schema version 3; this dkicf reads "
                                                      "versions 1 to 2. Upgrade dkicf"):
        incomplete_cholesky(_X, checkpoint=str(url), resume=True, **params)
    _set_schema(url, 1)  # what dkicf wrote before schema 2, the same layout
    resumed = incomplete_cholesky(_X, checkpoint=str(url), resume=True, **params)
    assert resumed.info["resumed_from"] == 8
    ref = incomplete_cholesky(_X, gamma=0.5, max_rank=12, tol=0.0, pivoting="greedy")
    np.testing.assert_array_equal(resumed.pivots, ref.pivots)
    np.testing.assert_allclose(resumed.P, ref.P, atol=1e-12, rtol=0)
