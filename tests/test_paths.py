"""Locations mean the same in the driver and on workers, and lost data is an error, not zeros.

Relative local paths are taken in the user's working directory and made
absolute before anything is sent to dask workers, which may run in another
one (checked against a scheduler and workers started as separate processes in
a directory of their own).  A chunk of X that a worker cannot read fails the
task with an error naming the store instead of being read as the fill value.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
import zarr
from test_deploy import START_TIMEOUT, _Processes, _start_dask, _wait_for_workers

from dkicf import KernelKMeans, cli, incomplete_cholesky, io
from dkicf._commit import _location
from dkicf.deploy import connect
from dkicf.estimator import load
from dkicf.io import MissingChunkError, absolute_location
from dkicf.pipeline import fit_store, predict_store

# ------------------------------------------------------------------ the helper


def test_absolute_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = str(tmp_path)
    assert absolute_location("d.zarr") == os.path.join(here, "d.zarr")
    assert absolute_location(Path("a") / ".." / "d.zarr/X/") == os.path.join(here, "d.zarr", "X")
    assert absolute_location("~/d.zarr") == os.path.join(os.path.expanduser("~"), "d.zarr")
    assert absolute_location("file://d.zarr") == "file://" + os.path.join(here, "d.zarr")
    assert absolute_location("file:///data/./d.zarr") == "file:///data/d.zarr"
    for url in ("s3://bucket/d.zarr", "gs://b/d", "memory://d.zarr", "simplecache::s3://b/d"):
        assert absolute_location(url) == url
    assert absolute_location(None) is None
    # The locations of P stores and checkpoints (factorization and k-means) go through it.
    assert _location("ck.zarr", "checkpoint") == os.path.join(here, "ck.zarr")
    assert _location(Path("ck.zarr"), "checkpoint") == os.path.join(here, "ck.zarr")


def test_an_opened_dataset_reads_the_same_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "user").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "user")
    io.generate("ring", "data.zarr", 300, chunk_rows=100)
    X, y, info = io.open_dataset("data.zarr")
    assert info["url"] == str(tmp_path / "user" / "data.zarr")
    expected = X.compute(), y.compute()
    shipped = pickle.dumps((X, y))  # what a worker receives
    monkeypatch.chdir(tmp_path / "elsewhere")
    X2, y2 = pickle.loads(shipped)
    np.testing.assert_array_equal(X2.compute(), expected[0])
    np.testing.assert_array_equal(y2.compute(), expected[1])
    assert not list((tmp_path / "elsewhere").iterdir())


def test_model_save_and_load_with_a_relative_path(tmp_path, monkeypatch):
    X = np.random.default_rng(0).normal(size=(60, 2))
    model = KernelKMeans(n_clusters=2, gamma=0.5, rank=10, random_state=0).fit(X)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    model.save("m.zarr")
    assert (tmp_path / "a" / "m.zarr" / "zarr.json").is_file()
    np.testing.assert_array_equal(load("m.zarr").predict(X), model.predict(X))
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(io.DkicfIOError, match=re.escape(str(tmp_path / "b" / "m.zarr"))):
        load("m.zarr")


# ----------------------------------------------------------------- lost data


def _store(tmp_path, name="d.zarr"):
    io.generate("blobs", tmp_path / name, 400, chunk_rows=100, centers=2, random_state=0)
    return tmp_path / name


def test_a_deleted_chunk_of_x_is_an_error_naming_it(tmp_path):
    store = _store(tmp_path)
    X, _, _ = io.open_dataset(store)
    expected = io.open_dataset(store)[0][:200].compute()
    (store / "X" / "c" / "2" / "0").unlink()
    # Gone after opening: the read that needs it fails.
    with pytest.raises(MissingChunkError, match=r"chunk 'c/2/0' of the Zarr array .*d\.zarr/X"):
        X.compute()
    np.testing.assert_array_equal(X[:200].compute(), expected)
    # Gone before opening: refused at once.
    for call in (io.open_dataset, lambda s: io.as_dask(s / "X")):
        with pytest.raises(MissingChunkError, match=r"chunk 'c/2/0' of the Zarr array "
                                                    r".*d\.zarr/X is missing.*write_empty_chunks"):
            call(store)


def test_a_store_gone_for_the_reader_is_an_error_for_x_and_y(tmp_path):
    store = _store(tmp_path)
    X, y, _ = io.open_dataset(store)
    shutil.move(store, tmp_path / "moved.zarr")
    for arr, name in ((X, "X"), (y, "y")):
        with pytest.raises(MissingChunkError, match=rf"d\.zarr/{name} is not there .* "
                                                    "working directory"):
            arr.compute()


def test_a_missing_label_chunk_is_class_zero_as_zarr_leaves_it_out(tmp_path):
    store = _store(tmp_path)
    (store / "y" / "c" / "0").unlink()
    _, y, _ = io.open_dataset(store)
    assert not y[:100].compute().any()


def test_writers_keep_chunks_equal_to_the_fill_value(tmp_path):
    X = np.zeros((300, 2))
    X[200:] = 1.0
    np.savez(tmp_path / "z.npz", X=X, y=np.zeros(300, dtype=int))
    io.convert(tmp_path / "z.npz", tmp_path / "z.zarr", chunk_rows=100)
    assert sorted(os.listdir(tmp_path / "z.zarr" / "X" / "c")) == ["0", "1", "2"]
    assert sorted(os.listdir(tmp_path / "z.zarr" / "y" / "c")) == ["0", "1", "2"]
    np.testing.assert_array_equal(io.open_dataset(tmp_path / "z.zarr")[0].compute(), X)


# ------------------------------------- a scheduler and workers in their own directory


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A client of a scheduler and two worker processes started in a directory of their own.

    Yields the client and that directory; the tests run in others.
    """
    directory = tmp_path_factory.mktemp("workers")
    procs = _Processes(directory)
    try:
        scheduler_file, _ = _start_dask(procs, directory)
        with connect(scheduler_file=scheduler_file, timeout=START_TIMEOUT) as client:
            _wait_for_workers(client, 2, procs)
            assert set(client.run(os.getcwd).values()) == {str(directory)}
            yield client, directory
    finally:
        procs.stop()


def test_relative_p_store_is_where_the_caller_is(remote, tmp_path, monkeypatch):
    client, workdir = remote
    monkeypatch.chdir(tmp_path)
    dX = da.from_array(np.random.default_rng(1).normal(size=(400, 2)), chunks=(100, 2))
    res = incomplete_cholesky(dX, gamma=0.5, max_rank=6, client=client, p_store="P.zarr")
    arr = zarr.open_array(str(tmp_path / "P.zarr"), mode="r")
    np.testing.assert_allclose(arr[:, :6], client.compute(res.P, sync=True))
    assert float(np.abs(arr[:, :6]).sum()) > 0
    assert not (workdir / "P.zarr").exists()


def test_fit_on_a_store_with_a_deleted_chunk_fails(remote, tmp_path):
    client, _ = remote
    store = _store(tmp_path)
    (store / "X" / "c" / "3" / "0").unlink()
    params = {"n_clusters": 2, "gamma": 0.5, "rank": 5, "n_init": 1}
    with pytest.raises(MissingChunkError, match=r"c/3/0.*d\.zarr/X"):
        fit_store(str(store), str(tmp_path / "out.zarr"), params, client=client)
    assert not (tmp_path / "out.zarr").exists()


def _fit(address, capsys, *extra):
    """``dkicf fit data.zarr --out model.zarr`` in this process; exit code, stdout, stderr."""
    code = cli.main(["fit", "data.zarr", "--clusters", "2", "--gamma", "0.01", "--rank", "10",
                     "--n-init", "1", "--max-iter", "20", "--pivoting", "block-greedy",
                     "--out", "model.zarr", "--scheduler", address, "--quiet", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_fit_and_predict_with_relative_paths_on_an_existing_scheduler(
    remote, tmp_path, monkeypatch, capsys
):
    client, workdir = remote
    address = client.scheduler.address
    monkeypatch.chdir(tmp_path)
    io.generate("blobs", "data.zarr", 1000, chunk_rows=250, centers=2)
    code, out, err = _fit(address, capsys, "--checkpoint", "ck.zarr")
    assert code == 0, err
    report = dict(line.split(": ", 1) for line in out.splitlines())
    # Not the answer of a fit on zeros (a kernel of rank 1, half the points right).
    assert report["rank"] == "10" and float(report["accuracy"]) > 0.9
    assert f"out: {tmp_path / 'model.zarr'}" in out
    group = zarr.open_group(str(tmp_path / "model.zarr"), mode="r")
    assert group.attrs["dkicf"]["input"]["url"] == str(tmp_path / "data.zarr" / "X")
    assert (tmp_path / "ck.zarr" / "P" / "zarr.json").is_file()
    assert (tmp_path / "ck.zarr" / "kmeans" / "zarr.json").is_file()
    # Nothing went to the workers' own directory.
    assert {p.name for p in workdir.iterdir() if p.suffix == ".zarr"} == set()

    report = predict_store("model.zarr", "data.zarr", "pred.zarr", client=client)
    assert report["accuracy"] > 0.9
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "pred.zarr" / "labels"))[...],
                                  group["labels"][...])


def test_cli_fit_on_a_store_with_a_deleted_chunk_fails_with_the_path(
    remote, tmp_path, monkeypatch, capsys
):
    address = remote[0].scheduler.address
    monkeypatch.chdir(tmp_path)
    io.generate("blobs", "data.zarr", 1000, chunk_rows=250, centers=2)
    (tmp_path / "data.zarr" / "X" / "c" / "1" / "0").unlink()
    code, out, err = _fit(address, capsys)
    assert code == 1, (out, err)
    assert f"chunk 'c/1/0' of the Zarr array {tmp_path / 'data.zarr' / 'X'}" in err
    assert "Traceback" not in err and "accuracy" not in out
    assert not (tmp_path / "model.zarr").exists()
