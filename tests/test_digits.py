"""MNIST-like digits (dkicf.digits, dkicf.mnist8m, dkicf generate mnist8m) and uint8 fits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _tied import tied_popen
from scipy.ndimage import gaussian_filter, map_coordinates
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

from dkicf import digits, io, mnist8m, pipeline
from dkicf.cli import main

ROOT = Path(__file__).resolve().parents[1]
GAMMA = mnist8m.MNIST_GAMMA_RAW


def _base(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Digit-like base images: a stroke per class at its own angle, with a random thickness."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 10
    r, c = np.mgrid[0:28, 0:28] - 13.5
    X = np.empty((n, 784))
    for i, label in enumerate(y):
        angle = np.pi * label / 10 + rng.normal(0, 0.05)
        along = r * np.cos(angle) + c * np.sin(angle)
        across = -r * np.sin(angle) + c * np.cos(angle)
        width = rng.uniform(1.5, 2.5)
        img = 255 * np.exp(-(across / width) ** 2) * (np.abs(along) < 9 - label % 3)
        X[i] = img.ravel()
    return X.astype(np.float32), y


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "base.npz"
    X, y = _base()
    np.savez(path, X=X, y=y)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory, source) -> Path:
    path = tmp_path_factory.mktemp("digits") / "d.zarr"
    mnist8m.generate_digits(path, 3000, source=source, chunk_rows=500, random_state=7)
    return path


# --------------------------------------------------------------------------- the generator


def test_the_smoothing_and_resampling_are_scipy_s():
    rng = np.random.default_rng(1)
    U = rng.uniform(-1, 1, size=(4, 28, 28)).astype(np.float32)
    G = digits._smoothing_matrix(4.0)
    want = np.stack([gaussian_filter(u, 4.0, mode="constant") for u in U])
    np.testing.assert_allclose(G @ U @ G.T, want, atol=1e-6)
    images, _ = digits.check_source(*_base(6))
    u = digits._uniforms(3, 1, 0, 6, digits._N_DEFORM)
    rows, cols = digits._source_coordinates(u, digits.ALPHA, digits.SIGMA)
    got = digits._bilinear(images, rows, cols)
    want = np.stack([
        map_coordinates(images[i].reshape(28, 28).astype(np.float64), [rows[i], cols[i]],
                        order=1, mode="constant", cval=0.0).ravel() for i in range(6)])
    np.testing.assert_allclose(got, want, atol=1e-3)
    # The elastic part moves pixels by about alpha * sqrt(1/3 / (4 pi sigma^2)) = 1.4 px.
    shift = rows - np.arange(28)[:, None]
    assert 0.5 < np.std(shift) < 4.0


def test_rows_depend_on_seed_and_index_only(source):
    images, labels = mnist8m.load_source(source)
    X, y = digits.deform_rows(images, labels, 0, 5000, random_state=3)
    for lo, hi in [(0, 1), (1999, 2049), (4095, 4100), (2048, 5000)]:
        Xs, ys = digits.deform_rows(images, labels, lo, hi, random_state=3)
        np.testing.assert_array_equal(Xs, X[lo:hi])
        np.testing.assert_array_equal(ys, y[lo:hi])
    np.testing.assert_array_equal(digits.digit_labels(labels, 100, 200, random_state=3),
                                  y[100:200])
    other, _ = digits.deform_rows(images, labels, 0, 50, random_state=4)
    assert (other != X[:50]).any()


def test_the_store_does_not_depend_on_its_chunking(tmp_path, source, store):
    mnist8m.generate_digits(tmp_path / "a.zarr", 3000, source=source, chunk_rows=1234,
                            random_state=7)
    X, y, _ = io.open_dataset(store)
    Xa, ya, info = io.open_dataset(tmp_path / "a.zarr")
    assert info["chunks"] == [1234, 784]
    np.testing.assert_array_equal(Xa.compute(), X.compute())
    np.testing.assert_array_equal(ya.compute(), y.compute())
    images, labels = mnist8m.load_source(source)
    direct, _ = digits.deform_rows(images, labels, 2500, 3000, random_state=7)
    np.testing.assert_array_equal(X[2500:].compute(), direct)


def test_rows_are_uint8_deformed_copies_of_their_base_image(source, store):
    X, y, info = io.open_dataset(store)
    X, y = X.compute(), y.compute()
    assert X.dtype == np.uint8 and info["dtype"] == "uint8"
    assert sorted(np.unique(y)) == list(range(10)) and info["label_values"] == list(range(10))
    images, labels = mnist8m.load_source(source)
    index = digits._base_index(7, 0, 3000, len(images))
    np.testing.assert_array_equal(y, labels[index])
    base = images[index].astype(np.float64)
    diff = np.abs(X.astype(np.float64) - base).sum(axis=1)
    assert (diff > 0).all()  # no verbatim copy
    assert not (X[:, None, :] == images[None, :, :]).all(axis=2).any()
    # ...but still the base image: among the nearest of the 300 (chance: the 150th).
    d2 = ((X[:500, None, :].astype(np.float64) - images[None].astype(np.float64)) ** 2).sum(-1)
    rank = (d2 < d2[np.arange(500), index[:500]][:, None]).sum(axis=1)
    assert np.median(rank) < 45
    corr = [np.corrcoef(X[i].astype(np.float64), base[i])[0, 1] for i in range(500)]
    assert np.median(corr) > 0.5
    # Ink is moved, not made: about the base image's total grey.
    ratio = X.sum(axis=1) / np.maximum(base.sum(axis=1), 1)
    assert 0.7 < np.median(ratio) < 1.3


@pytest.mark.parametrize(
    "X, y, error, match",
    [
        (np.zeros((5, 100)), np.zeros(5), ValueError, r"shape \(5, 100\); they must be "
                                                      r"\(n_images, 784\)"),
        (np.zeros((0, 784)), np.zeros(0), ValueError, r"at least one row"),
        (np.full((2, 784), "a"), np.zeros(2), TypeError, "must hold real numbers"),
        (np.zeros((2, 784), dtype=bool), np.zeros(2), TypeError, "boolean"),
        (np.full((2, 784), 300.0), np.zeros(2), ValueError, r"values in \[300.0, 300.0\]"),
        (np.full((2, 784), np.nan), np.zeros(2), ValueError, "NaN or infinity"),
        (np.zeros((2, 784)), np.zeros(3), ValueError, r"one digit per image"),
        (np.zeros((2, 784)), np.array([0, 10]), ValueError, r"digits 0..9"),
        (np.zeros((2, 784)), np.array([0.5, 1]), ValueError, r"digits 0..9"),
    ],
)
def test_bad_base_images_are_refused(X, y, error, match):
    with pytest.raises(error, match=match):
        digits.check_source(X, y)


def test_images_on_the_unit_scale_are_put_on_0_255():
    X, y = _base(10)
    a, _ = digits.check_source(X, y)
    b, _ = digits.check_source(X / 255.0, y)
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- the command


def _run(args, capsys):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_generate_mnist8m_refuses_bad_input_before_writing(tmp_path, source, capsys):
    out = tmp_path / "d.zarr"
    bad = tmp_path / "bad.npz"
    np.savez(bad, X=np.zeros((10, 100)), y=np.zeros(10))
    nolabels = tmp_path / "nolabels.npz"
    np.savez(nolabels, X=np.zeros((10, 784)))
    cases = [
        (["--source", tmp_path / "missing.npz"], "does not exist"),
        (["--source", bad], r"shape \(10, 100\); they must be \(n_images, 784\)"),
        (["--source", nolabels], "has no array y"),
        (["--source", source, "--features", "5"], "784 features and 10 classes"),
    ]
    for extra, match in cases:
        code, err = _run(["generate", "mnist8m", out, "--n", "100", "--quiet", *extra], capsys)
        assert code != 0 and re.search(match, err), err
        assert not out.exists() and not list(tmp_path.glob(".d.zarr*"))
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "mnist8m", str(out), "--n", "0", "--source", str(source)])
    assert exit_.value.code == 2 and "expected an integer >= 1, got 0" in capsys.readouterr().err
    code, err = _run(["generate", "ring", out, "--n", "10", "--source", source], capsys)
    assert code == 2 and "--source gives the base images of mnist8m" in err
    assert _run(["generate", "mnist8m", out, "--n", "100", "--source", source, "--quiet"],
                capsys)[0] == 0
    before = io.open_dataset(out)[0].compute()
    code, err = _run(["generate", "mnist8m", out, "--n", "50", "--source", source, "--seed",
                      "1", "--quiet"], capsys)
    assert code == 2 and "already exists; pass --overwrite" in err
    np.testing.assert_array_equal(io.open_dataset(out)[0].compute(), before)


def test_generate_then_fit_through_the_cli_on_uint8(tmp_path, source, client, capsys):
    data, model = tmp_path / "d.zarr", tmp_path / "m.zarr"
    code, err = _run(["generate", "mnist8m", data, "--n", "3000", "--source", source,
                      "--chunk-rows", "700", "--seed", "2"], capsys)
    assert code == 0, err
    assert "generate: 100%" in err
    assert io.open_dataset(data)[2]["dtype"] == "uint8"
    code, err = _run(["fit", data, "--clusters", "10", "--gamma", repr(GAMMA), "--rank", "60",
                      "--out", model, "--scheduler", client.scheduler.address, "--quiet",
                      "--json"], capsys)
    assert code == 0, err
    y = io.open_dataset(data)[1].compute()
    labels = io.open_member(model, "labels").compute()
    assert normalized_mutual_info_score(y, labels) > 0.3  # chance: about 0.01
    code, err = _run(["predict", model, data, "--out", tmp_path / "p.zarr", "--scheduler",
                      client.scheduler.address, "--quiet"], capsys)
    assert code == 0, err
    predicted = io.open_member(tmp_path / "p.zarr", "labels").compute()
    assert adjusted_rand_score(labels, predicted) > 0.95


def test_uint8_with_gamma_over_255_squared_is_the_fit_on_pixels_over_255(tmp_path, store,
                                                                          client):
    X, y, _ = io.open_dataset(store)
    scaled = tmp_path / "scaled.zarr"
    group_X = (X.astype(np.float64) / 255.0).compute()
    np.save(tmp_path / "scaled.npy", group_X)
    io.convert(tmp_path / "scaled.npy", scaled, dtype="float64")
    params = {"n_clusters": 10, "rank": 40, "n_init": 1, "random_state": 0,
              "pivoting": "greedy"}
    pipeline.fit_store(str(store), str(tmp_path / "raw.zarr"), {**params, "gamma": GAMMA},
                       client=client)
    pipeline.fit_store(str(scaled), str(tmp_path / "unit.zarr"),
                       {**params, "gamma": GAMMA * 255.0**2}, client=client)
    raw, _ = io.read_group(tmp_path / "raw.zarr")
    unit, _ = io.read_group(tmp_path / "unit.zarr")
    np.testing.assert_array_equal(raw["pivots"], unit["pivots"])
    np.testing.assert_allclose(raw["trace_errors"], unit["trace_errors"], rtol=1e-9)
    a = io.open_member(tmp_path / "raw.zarr", "labels").compute()
    b = io.open_member(tmp_path / "unit.zarr", "labels").compute()
    assert adjusted_rand_score(a, b) > 0.99


# --------------------------------------------------------------------------- kill and resume


def _fit_child(address: str, cwd: Path, kill_at: int) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import os, signal
        from distributed import Client
        from dkicf import pipeline

        def progress(p):
            if getattr(p, "rank", 0) >= {kill_at}:
                os.kill(os.getpid(), signal.SIGKILL)

        with Client({address!r}) as client:
            pipeline.fit_store("d.zarr", "m.zarr", {_KILL_PARAMS!r}, client=client,
                               checkpoint="ck.zarr", checkpoint_every=4, progress=progress)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return tied_popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)


_KILL_PARAMS = {"n_clusters": 10, "gamma": GAMMA, "rank": 24, "n_init": 2, "random_state": 0,
                "pivoting": "greedy", "max_iter": 30}


@pytest.fixture
def own_client():
    """A cluster of this test's own: a killed driver leaves its event topics on the
    scheduler, where they would be seen by later tests of the session's cluster."""
    from dkicf import local_cluster

    c = local_cluster(2, 1, memory_limit="2GiB")
    yield c
    cluster = c.cluster
    c.close()
    cluster.close()


def test_a_killed_fit_of_generated_uint8_digits_resumes_to_the_same_result(
    tmp_path, store, own_client
):
    import shutil

    client = own_client
    shutil.copytree(store, tmp_path / "d.zarr")
    killed = _fit_child(client.scheduler.address, tmp_path, kill_at=13)
    _, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert not (tmp_path / "m.zarr").exists()
    data, out, ck = (str(tmp_path / name) for name in ("d.zarr", "m.zarr", "ck.zarr"))
    report = pipeline.fit_store(data, out, _KILL_PARAMS, client=client, checkpoint=ck,
                                checkpoint_every=4, resume=True)
    assert report["resumed_from_rank"] >= 8
    pipeline.fit_store(data, str(tmp_path / "alone.zarr"), _KILL_PARAMS, client=client)
    resumed, _ = io.read_group(out)
    alone, _ = io.read_group(tmp_path / "alone.zarr")
    for name in ("pivots", "cluster_centers", "cholesky_factor", "trace_errors"):
        np.testing.assert_array_equal(resumed[name], alone[name], err_msg=name)
    np.testing.assert_array_equal(io.open_member(out, "labels").compute(),
                                  io.open_member(tmp_path / "alone.zarr", "labels").compute())
