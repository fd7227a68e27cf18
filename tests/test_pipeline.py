"""The pipeline module: a Zarr dataset to a model group, through the estimator and one plan."""

from __future__ import annotations

import numpy as np
import pytest

from dkicf import KernelKMeans, _memory, _plan, estimator, icf, io, load, pipeline
from dkicf.metrics import clustering_accuracy

PARAMS = dict(n_clusters=4, gamma=0.05, rank=30, random_state=0)


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    """A labelled dataset store of 4 blobs in 2-D, in row chunks of 256."""
    path = str(tmp_path_factory.mktemp("pipeline") / "blobs.zarr")
    io.generate("blobs", path, 1000, chunk_rows=256, centers=4, random_state=3)
    X, y, _ = io.open_dataset(path)
    return path, X.compute(), y.compute()


def test_an_in_process_fit_is_the_estimator_s_and_its_output_reloads(blobs, tmp_path):
    path, X, y = blobs
    out = str(tmp_path / "model.zarr")
    report = pipeline.fit_store(path, out, PARAMS, client=None)
    reference = KernelKMeans(**PARAMS).fit(X)
    labels = io.open_member(out, "labels").compute()
    np.testing.assert_array_equal(labels, reference.labels_)
    P = io.open_member(out, "P").compute()
    np.testing.assert_allclose(P, reference.transform(X), atol=1e-10)
    assert report["accuracy"] == pytest.approx(clustering_accuracy(y, reference.labels_))
    assert report["rank"] == reference.rank_ and report["p_storage"] == "memory"
    model = load(out)
    np.testing.assert_array_equal(model.predict(X), reference.predict(X))


def test_the_output_records_the_plan_without_the_workers_measurement(blobs, tmp_path):
    path, X, _ = blobs
    out = str(tmp_path / "model.zarr")
    pipeline.fit_store(path, out, PARAMS, client=None)
    stored = io.read_group(out)[1]["plan"]
    expected = pipeline.plan_fit(X.shape, 256, X.dtype.itemsize, PARAMS["rank"]).attrs()
    assert stored == expected and "workers" not in stored
    assert describe_lines_match(path)


def describe_lines_match(path) -> bool:
    """``describe`` of a dataset ends with the plan's own lines for that dataset."""
    lines = pipeline.describe(path, rank=30)
    plan = pipeline.plan_fit((1000, 2), 256, 8, 30)
    return lines[0] == f"{path}: dataset" and lines[-len(plan.lines()):] == plan.lines()


def test_a_fit_on_the_cluster_measures_the_workers_once_for_both_stages(blobs, tmp_path,
                                                                         client, monkeypatch):
    path, X, _ = blobs
    calls = []
    measure = _memory.measure_workers

    def counting(c):
        calls.append(c)
        return measure(c)

    for module in (_memory, _plan, icf):
        monkeypatch.setattr(module, "measure_workers", counting)
    handed = {}
    original = estimator.kmeans

    def kmeans(*args, **kw):
        handed["kmeans"] = kw.get("plan")
        return original(*args, **kw)

    monkeypatch.setattr(estimator, "kmeans", kmeans)
    out = str(tmp_path / "model.zarr")
    report = pipeline.fit_store(path, out, PARAMS, client=client)
    assert len(calls) == 1
    plan = handed["kmeans"]
    assert plan.workers.count == 2 and plan.persist_x == report["x_in_memory"]
    in_process = KernelKMeans(**PARAMS).fit(X)
    assert clustering_accuracy(io.open_member(out, "labels").compute(), in_process.labels_) == 1


def test_storage_args_put_p_where_the_plan_says():
    def plan(where):
        return pipeline.plan_fit((1000, 2), 256, 8, 30, p_storage=where)

    assert pipeline._storage_args(plan("memory"), "out.zarr", None, 25, False, None) == {}
    zarr_args = pipeline._storage_args(plan("zarr"), "out.zarr", None, 25, False, {"a": 1})
    assert zarr_args == {"p_store": "out.zarr/P", "storage_options": {"a": 1}}
    ck = pipeline._storage_args(plan("zarr"), "out.zarr", "ck.zarr", 5, False, None)
    assert ck["checkpoint"] == "ck.zarr" and ck["p_storage"] == "zarr" and "p_store" not in ck
    # A resumed fit keeps the choice its checkpoint recorded, unless the caller names one.
    assert pipeline._storage_args(plan("zarr"), "o", "ck", 5, True, None)["p_storage"] == "auto"
    resumed = pipeline._storage_args(plan("zarr"), "o", "ck", 5, True, None, "zarr")
    assert resumed["p_storage"] == "zarr"


def test_a_checkpoint_without_a_cluster_is_refused_before_anything_is_written(blobs, tmp_path):
    path, _, _ = blobs
    out, ck = tmp_path / "model.zarr", tmp_path / "ck.zarr"
    with pytest.raises(ValueError, match=r"needs a dask cluster: pass client= .*--scheduler"):
        pipeline.fit_store(path, str(out), PARAMS, client=None, checkpoint=str(ck))
    assert not out.exists() and not ck.exists()


def test_predict_store_writes_the_model_s_labels_and_refuses_other_features(blobs, tmp_path):
    path, X, y = blobs
    model_path = str(tmp_path / "model.zarr")
    pipeline.fit_store(path, model_path, PARAMS, client=None)
    out = str(tmp_path / "labels.zarr")
    report = pipeline.predict_store(model_path, path, out, client=None)
    expected = load(model_path).predict(X)
    np.testing.assert_array_equal(io.open_member(out, "labels").compute(), expected)
    assert report["accuracy"] == pytest.approx(clustering_accuracy(y, expected))
    wide = str(tmp_path / "wide.zarr")
    io.generate("blobs", wide, 100, chunk_rows=50, centers=2, n_features=3)
    with pytest.raises(ValueError, match=r"has 3 features but the model was fitted on 2"):
        pipeline.predict_store(model_path, wide, str(tmp_path / "l2.zarr"), client=None)


def test_the_estimator_and_the_pipeline_fit_through_the_one_composition(blobs, tmp_path,
                                                                         monkeypatch):
    path, X, _ = blobs
    seen = []
    original = estimator.fit_stages

    def fit_stages(model, X, **kw):
        seen.append((type(model).__name__, X.shape, sorted(kw.get("factor_options") or {})))
        return original(model, X, **kw)

    monkeypatch.setattr(estimator, "fit_stages", fit_stages)
    KernelKMeans(**PARAMS).fit(X)
    pipeline.fit_store(path, str(tmp_path / "model.zarr"), PARAMS, client=None)
    assert seen == [("KernelKMeans", (1000, 2), []),
                    ("KernelKMeans", (1000, 2), ["persist"])]


def test_kernel_params_reach_the_factorization_of_a_store(tmp_path):
    """A kernel of sklearn.metrics.pairwise with its own parameter: P P^T = K of the store's X."""
    from sklearn.metrics.pairwise import pairwise_kernels

    path = str(tmp_path / "pos.zarr")
    X = np.abs(np.random.default_rng(0).normal(size=(60, 3)))
    np.save(tmp_path / "pos.npy", X)
    io.convert(str(tmp_path / "pos.npy"), path, dtype="float64", chunk_rows=25)
    out = str(tmp_path / "model.zarr")
    params = dict(n_clusters=2, kernel="chi2", kernel_params={"gamma": 0.5}, rank=60, tol=0,
                  random_state=0)
    pipeline.fit_store(path, out, params, client=None)
    P = io.open_member(out, "P").compute()
    np.testing.assert_allclose(P @ P.T, pairwise_kernels(X, metric="chi2", gamma=0.5),
                               atol=1e-6)
    assert load(out).kernel_.get_params() == {"kernel": "chi2", "kernel_params": {"gamma": 0.5}}
