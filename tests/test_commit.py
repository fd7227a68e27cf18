"""The commit layer on its own: claims, fingerprints and double-buffered commits."""

import numpy as np
import pytest
import zarr

from dkicf import _commit
from dkicf._commit import StateCheckpoint, _check_compatible, _claim
from dkicf.errors import CheckpointMismatchError
from dkicf.io import DkicfIOError


def test_a_claim_takes_a_free_location_and_never_someone_elses(tmp_path):
    assert _claim(str(tmp_path / "new"), "state-kmeans", overwrite=False, resume=False,
                  what="thing") is None
    (tmp_path / "empty").mkdir()  # an empty folder counts as free
    assert _claim(str(tmp_path / "empty"), "state-kmeans", overwrite=True, resume=False,
                  what="thing") is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("precious")
    for flags in ({"overwrite": True, "resume": False}, {"overwrite": False, "resume": True}):
        with pytest.raises(FileExistsError, match="not a dkicf thing; it is left untouched"):
            _claim(str(other), "state-kmeans", what="thing", **flags)
    assert (other / "data.txt").read_text() == "precious"


def test_a_claim_on_a_dkicf_node_resumes_refuses_or_replaces_it(tmp_path):
    url = str(tmp_path / "ck")
    StateCheckpoint(url, "kmeans", {"k": 2})
    with pytest.raises(FileExistsError, match="Pass resume=True to continue it, overwrite=True"):
        _claim(url, "state-kmeans", overwrite=False, resume=False, what="k-means checkpoint")
    meta = _claim(url, "state-kmeans", overwrite=False, resume=True, what="k-means checkpoint")
    assert meta["kind"] == "state-kmeans" and meta["fingerprint"]["params"] == {"k": 2}
    with pytest.raises(FileExistsError, match="not a dkicf model"):  # another kind of node
        _claim(url, "model", overwrite=True, resume=False, what="model")
    assert _claim(url, "state-kmeans", overwrite=True, resume=False, what="x") is None
    assert not (tmp_path / "ck").exists()


def test_a_commit_is_double_buffered_and_a_crash_keeps_the_last_one(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    ck = StateCheckpoint(url, "kmeans", {"k": 2})
    assert ck.load() is None
    ck.save(1, {"centers": np.zeros((2, 3))}, {"run": 0})
    ck.save(2, {"centers": np.ones((2, 3))}, {"run": 0})
    group = zarr.open_group(url, mode="r")
    assert sorted(group.array_keys()) == ["centers_0", "centers_1"]

    def crash(phase, step):
        if phase == "arrays":  # the spare buffer is written, the commit is not
            raise KeyboardInterrupt

    monkeypatch.setattr(_commit, "_fault_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save(3, {"centers": np.full((2, 3), 7.0)}, {"run": 1})
    monkeypatch.setattr(_commit, "_fault_hook", None)
    step, arrays, state = StateCheckpoint(url, "kmeans", {"k": 2}, resume=True).load()
    assert step == 2 and state == {"run": 0}
    np.testing.assert_array_equal(arrays["centers"], np.ones((2, 3)))


def test_an_array_not_given_keeps_its_committed_value(tmp_path):
    url = str(tmp_path / "ck")
    ck = StateCheckpoint(url, "kmeans", {})
    ck.save(1, {"a": np.arange(3), "b": np.eye(2)}, {})
    ck.save(2, {"a": np.arange(3) + 10}, {}, finished=True)
    reopened = StateCheckpoint(url, "kmeans", {}, resume=True)
    step, arrays, _ = reopened.load()
    assert reopened.finished and step == 2
    np.testing.assert_array_equal(arrays["a"], np.arange(3) + 10)
    np.testing.assert_array_equal(arrays["b"], np.eye(2))


def test_fingerprints_name_what_differs(tmp_path):
    meta = {"schema": 2, "fingerprint": {
        "params": {"k": 2, "tol": 0.1},
        "input": {"shape": [6, 2], "digests": ["a", "b", "c"]}}}
    _check_compatible("u", meta, {"k": 2, "tol": 0.1}, {"shape": [6, 2]}, (2, 2, 2))
    with pytest.raises(CheckpointMismatchError, match=r"k: checkpoint 2, this call 3"):
        _check_compatible("u", meta, {"k": 3, "tol": 0.1}, {"shape": [6, 2]}, (2, 2, 2))
    with pytest.raises(CheckpointMismatchError,
                       match=r"the data differ in 1 row chunk\(s\), first chunk 1 \(rows 2-3\)"):
        _check_compatible("u", meta, {"k": 2, "tol": 0.1},
                          {"shape": [6, 2], "digests": ["a", "x", "c"]}, (2, 2, 2))
    with pytest.raises(CheckpointMismatchError, match="schema version 9.*Upgrade dkicf"):
        _check_compatible("u", dict(meta, schema=9), {}, {}, ())


def test_a_checkpoint_removed_while_the_fit_runs_is_not_written_again(tmp_path):
    import shutil

    url = str(tmp_path / "ck")
    ck = StateCheckpoint(url, "kmeans", {})
    ck.save(1, {"c": np.zeros(2)}, {})
    shutil.rmtree(url)
    with pytest.raises(DkicfIOError, match="was removed or replaced while the fit ran"):
        ck.save(2, {"c": np.ones(2)}, {})
    assert not (tmp_path / "ck").exists()


def test_parameters_are_recorded_as_json_values():
    rec = _commit._jsonable({"a": np.int64(3), "b": (np.float32(0.5), None), 1: True,
                             "c": object})
    assert rec == {"a": 3, "b": [0.5, None], "1": True, "c": repr(object)}
    assert type(rec["a"]) is int and type(rec["b"][0]) is float
