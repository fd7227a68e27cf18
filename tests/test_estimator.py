"""KernelKMeans: the estimator contract, the paper's synthetic experiment, bad input."""

import pickle
import re

import dask.array as da
import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score
from sklearn.utils.estimator_checks import parametrize_with_checks

from dkicf import KernelKMeans, incomplete_cholesky
from dkicf.kernels import GaussianKernel
from dkicf.kmeans import kmeans
from dkicf.metrics import clustering_accuracy
from dkicf.synthetic import make_parabolic, make_ring, make_zigzag


def _exact_kernel_kmeans(K, labels, max_iter=300):
    """Lloyd in the kernel's feature space from an initial assignment (the oracle)."""
    n = K.shape[0]
    k = labels.max() + 1
    diag = np.diag(K)
    for _ in range(max_iter):
        dist = np.empty((n, k))
        for c in range(k):
            members = labels == c
            m = members.sum()
            dist[:, c] = (diag - 2 * K[:, members].sum(1) / m
                          + K[np.ix_(members, members)].sum() / m**2)
        new = dist.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
    return labels


@parametrize_with_checks(
    [KernelKMeans(n_clusters=3, rank=20, n_init=1, max_iter=30, random_state=0)]
)
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


def test_full_rank_equals_exact_kernel_kmeans_from_the_same_start(rng):
    X = np.vstack([rng.normal(loc=c, scale=0.6, size=(40, 2)) for c in ((0, 0), (3, 0), (0, 3))])
    gamma = 0.5
    K = GaussianKernel(gamma).block(X, X)
    init = rng.integers(0, 3, size=X.shape[0])
    exact = _exact_kernel_kmeans(K, init.copy())
    icf = incomplete_cholesky(X, gamma=gamma, max_rank=X.shape[0], tol=0)
    np.testing.assert_allclose(icf.P @ icf.P.T, K, atol=1e-8)
    start = np.stack([icf.P[init == c].mean(0) for c in range(3)])
    km = kmeans(icf.P, 3, algorithm="lloyd", init=start, n_init=1, max_iter=300, tol=0)
    assert adjusted_rand_score(exact, km.labels) == 1.0


@pytest.mark.parametrize(
    "make, gamma", [(make_ring, 2.0**4), (make_parabolic, 2.0**1), (make_zigzag, 2.0**3)]
)
def test_paper_synthetic_sets_are_clustered_perfectly(make, gamma):
    X, y = make(1000, random_state=0)
    model = KernelKMeans(n_clusters=2, gamma=gamma, rank=50, random_state=0).fit(X)
    assert model.rank_ == 50
    assert clustering_accuracy(y, model.labels_) == 1.0
    # ... and plain k-means does not manage it.
    plain = KMeans(2, n_init=10, random_state=0).fit_predict(X)
    assert clustering_accuracy(y, plain) < 0.9


def test_predict_on_training_points_returns_labels_and_transform_returns_P():
    X, _ = make_ring(600, random_state=1)
    model = KernelKMeans(n_clusters=2, gamma=16.0, rank=40, random_state=0).fit(X)
    np.testing.assert_array_equal(model.predict(X), model.labels_)
    icf = incomplete_cholesky(X, gamma=16.0, max_rank=40, tol=model.tol)
    np.testing.assert_allclose(model.transform(X), icf.P, atol=1e-8)
    np.testing.assert_array_equal(model.pivots_, icf.pivots)


def test_numpy_and_dask_give_the_same_clustering(client):
    X, _ = make_ring(1200, random_state=2)
    ref = KernelKMeans(n_clusters=2, gamma=16.0, rank=30, random_state=5).fit(X)
    Xd = da.from_array(X, chunks=((100, 500, 77, 523), (2,)))
    est = KernelKMeans(n_clusters=2, gamma=16.0, rank=30, random_state=5)
    labels = est.fit_predict(Xd)
    assert isinstance(labels, da.Array)
    np.testing.assert_array_equal(est.pivots_, ref.pivots_)
    np.testing.assert_array_equal(labels.compute(), ref.labels_)
    np.testing.assert_allclose(est.cluster_centers_, ref.cluster_centers_, atol=1e-8)
    pred = est.predict(Xd)
    assert isinstance(pred, da.Array)
    np.testing.assert_array_equal(pred.compute(), ref.labels_)


def test_results_are_reproducible_for_a_seed():
    X, _ = make_zigzag(500, random_state=0)
    a = KernelKMeans(n_clusters=2, gamma=8.0, rank=30, random_state=3).fit(X)
    b = KernelKMeans(n_clusters=2, gamma=8.0, rank=30, random_state=3).fit(X)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.cluster_centers_, b.cluster_centers_)


def test_fitted_model_pickles_without_lazy_state(client):
    X, _ = make_ring(400, random_state=0)
    model = KernelKMeans(n_clusters=2, gamma=16.0, rank=20, random_state=0)
    model.fit(da.from_array(X, chunks=100))
    clone = pickle.loads(pickle.dumps(model))
    for value in vars(clone).values():
        assert not isinstance(value, da.Array)
    np.testing.assert_array_equal(clone.predict(X), model.predict(X))


def test_predict_and_transform_tasks_run_where_scikit_learn_is_not_imported(client, tmp_path):
    """The tasks carry the map of new rows, not the estimator: a fresh worker process
    that runs them imports neither scikit-learn nor dkicf.estimator (2-3 s each)."""
    import subprocess
    import sys

    X, _ = make_ring(400, random_state=0)
    model = KernelKMeans(n_clusters=2, gamma=16.0, rank=20, random_state=0).fit(X)
    dX = da.from_array(X, chunks=150)
    labels, features = model.predict(dX), model.transform(dX)
    graphs = {"labels": (dict(labels.__dask_graph__()), labels.__dask_keys__()),
              "features": (dict(features.__dask_graph__()), features.__dask_keys__())}
    (tmp_path / "graphs.pkl").write_bytes(pickle.dumps(graphs))
    script = (
        "import pickle, sys, numpy as np, dask\n"
        "graphs = pickle.loads(open('graphs.pkl', 'rb').read())\n"
        "out = {name: dask.get(*g) for name, g in graphs.items()}\n"
        "np.save('labels.npy', np.concatenate(out['labels']))\n"
        "np.save('features.npy', np.concatenate([b[0] for b in out['features']]))\n"
        "print(sorted(m for m in ('sklearn', 'dkicf.estimator') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
    np.testing.assert_array_equal(np.load(tmp_path / "labels.npy"), model.labels_)
    np.testing.assert_array_equal(np.load(tmp_path / "features.npy"), model.transform(X))


def test_save_and_load_predict_identically(tmp_path, rng):
    from dkicf import load

    X, _ = make_parabolic(500, random_state=0)
    model = KernelKMeans(n_clusters=2, gamma=2.0, rank=30, random_state=0).fit(X)
    path = tmp_path / "model.zarr"
    model.save(str(path))
    loaded = load(str(path))
    X_new = rng.uniform(X.min(0), X.max(0), size=(300, 2))
    np.testing.assert_array_equal(loaded.predict(X_new), model.predict(X_new))
    np.testing.assert_array_equal(loaded.transform(X_new), model.transform(X_new))
    # An existing model is not overwritten without overwrite=True, and stays intact.
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(FileExistsError, match="overwrite"):
        model.save(str(path))
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    np.testing.assert_array_equal(load(str(path)).predict(X_new), model.predict(X_new))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"n_clusters": 0}, "n_clusters must be >= 1, got 0"),
        ({"n_clusters": 500}, "n_samples=50 should be >= n_clusters=500"),
        ({"rank": 0}, "rank must be >= 1, got 0"),
        ({"gamma": -1.0}, "gamma must be a positive finite number or 'median', got -1.0"),
        ({"gamma": 0.0}, "gamma must be a positive"),
        ({"kernel": "sigmod"}, "Unknown kernel 'sigmod'. Valid kernels are: additive_chi2, "
                               "chi2, cosine, gaussian,"),
        ({"algorithm": "elkan"},
         "algorithm must be one of 'minibatch-lloyd', 'minibatch', 'lloyd', got 'elkan'"),
        ({"init": "random"}, re.escape("init must be one of 'k-means++', 'k-means||', "
                                      "got 'random'")),
    ],
)
def test_bad_parameters_name_the_parameter(params, match, rng):
    X = rng.normal(size=(50, 2))
    with pytest.raises(ValueError, match=match):
        KernelKMeans(**params).fit(X)


@pytest.mark.parametrize(
    "X, match",
    [
        (np.array([[0.0, np.nan], [1.0, 2.0]]), "NaN"),
        (np.array([[0.0, np.inf], [1.0, 2.0]]), "infinity"),
        (np.zeros(4), "2D array|2-D"),
    ],
)
def test_bad_X_is_refused(X, match):
    with pytest.raises(ValueError, match=match):
        KernelKMeans(n_clusters=1).fit(X)


def test_non_numeric_X_is_refused():
    with pytest.raises((TypeError, ValueError), match="numeric|real|convert"):
        KernelKMeans(n_clusters=1).fit(np.array([["a", "b"], ["c", "d"]], dtype=object))


def test_predict_checks_fitted_state_and_features(rng):
    from sklearn.exceptions import NotFittedError

    X = rng.normal(size=(60, 3))
    with pytest.raises(NotFittedError):
        KernelKMeans(n_clusters=2).predict(X)
    model = KernelKMeans(n_clusters=2, gamma=0.5, rank=10, random_state=0).fit(X)
    with pytest.raises(ValueError, match="X has 2 features, but KernelKMeans is expecting 3"):
        model.predict(X[:, :2])


def _with_bad_value(X, row, value):
    bad = X.copy()
    bad[row, 1] = value
    return bad


@pytest.mark.parametrize("method", ["fit", "predict", "transform"])
def test_non_finite_numpy_X_names_X_and_its_first_bad_row(method, rng):
    X = rng.normal(size=(60, 3))
    bad = _with_bad_value(_with_bad_value(X, 10, np.nan), 40, np.inf)
    model = KernelKMeans(n_clusters=2, gamma=0.5, rank=10, random_state=0)
    if method != "fit":
        model.fit(X)
    with pytest.raises(ValueError, match=r"^X contains NaN or infinity: first at row 10\.") as exc:
        getattr(model, method)(bad)
    # The same message as the factorization on its own, not scikit-learn's generic one.
    with pytest.raises(ValueError) as ref:
        incomplete_cholesky(bad, gamma=0.5, max_rank=10)
    assert str(exc.value) == str(ref.value)


@pytest.mark.parametrize("value", [np.nan, -np.inf])
@pytest.mark.parametrize("chunks, chunk", [(250, 3), (((700, 300), (3,)), 1)])
@pytest.mark.parametrize("method", ["predict", "transform", "score"])
def test_non_finite_dask_X_names_the_global_row_and_chunk_of_X(client, method, chunks, chunk,
                                                               value, rng):
    X = rng.normal(size=(1000, 3))
    model = KernelKMeans(n_clusters=3, gamma=0.5, rank=20, random_state=0).fit(X)
    Xd = da.from_array(_with_bad_value(X, 777, value), chunks=chunks)
    expected = rf"^X contains NaN or infinity: first at row 777 \(chunk {chunk}\)\."
    with pytest.raises(ValueError, match=expected):
        out = getattr(model, method)(Xd)
        if method != "score":
            out.compute()
    # Clean dask input with the same chunks gives numpy's results.
    Xd = da.from_array(X, chunks=chunks)
    np.testing.assert_array_equal(model.predict(Xd).compute(), model.predict(X))
    np.testing.assert_allclose(model.transform(Xd).compute(), model.transform(X), atol=1e-12)


def test_median_gamma_on_non_finite_dask_X_names_X_not_gamma(client, rng):
    X = _with_bad_value(rng.normal(size=(1000, 3)), 777, np.nan)
    model = KernelKMeans(n_clusters=3, rank=20, random_state=0)
    with pytest.raises(ValueError, match=r"^X contains NaN or infinity \(in the rows sampled "
                                         r"for gamma='median'\)") as exc:
        model.fit(da.from_array(X, chunks=250))
    assert "gamma must be" not in str(exc.value)


def test_dask_input_without_a_cluster_says_how_to_start_one(monkeypatch, rng):
    """The hint names what exists: no ``client=`` argument of KernelKMeans."""
    import dask.array as da
    import distributed

    def no_client():
        raise ValueError("No clients found")

    monkeypatch.setattr(distributed, "get_client", no_client)
    X = da.from_array(rng.normal(size=(40, 2)), chunks=20)
    with pytest.raises(RuntimeError, match=r"dkicf.local_cluster\(\)") as info:
        KernelKMeans(n_clusters=2, rank=5, gamma=1.0).fit(X)
    assert "client=" not in str(info.value)
    assert "distributed.Client(address)" in str(info.value)


def test_set_output_pandas_names_the_features():
    pd = pytest.importorskip("pandas")
    X, _ = make_ring(300, random_state=0)
    model = KernelKMeans(n_clusters=2, gamma=16.0, rank=12, random_state=0).fit(X)
    names = model.get_feature_names_out()
    assert list(names) == [f"kernelkmeans{i}" for i in range(model.rank_)]
    frame = model.set_output(transform="pandas").transform(X)
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == list(names)
    np.testing.assert_allclose(frame.to_numpy(), model.set_output(transform="default")
                               .transform(X))


def test_labels_stay_a_dask_array_after_a_dask_fit(client):
    X, _ = make_ring(600, random_state=1)
    ref = KernelKMeans(n_clusters=2, gamma=16.0, rank=20, random_state=0).fit(X)
    model = KernelKMeans(n_clusters=2, gamma=16.0, rank=20, random_state=0)
    model.fit(da.from_array(X, chunks=150))
    assert isinstance(model.labels_, da.Array) and model.labels_.chunks == ((150,) * 4,)
    np.testing.assert_array_equal(model.labels_.compute(), ref.labels_)
    clone = pickle.loads(pickle.dumps(model))
    assert isinstance(clone.labels_, np.ndarray)
    np.testing.assert_array_equal(clone.labels_, ref.labels_)


@pytest.mark.parametrize("metric, params", [("cosine", None), ("chi2", {"gamma": 0.5})])
def test_kernels_of_sklearn_pairwise_by_name(metric, params):
    """A name dkicf does not define runs through sklearn.metrics.pairwise: P P^T = K."""
    from sklearn.metrics.pairwise import pairwise_kernels

    X = np.abs(np.random.default_rng(0).normal(size=(40, 3)))
    model = KernelKMeans(n_clusters=2, kernel=metric, kernel_params=params, rank=40, tol=0,
                         random_state=0).fit(X)
    K = pairwise_kernels(X, metric=metric, **(params or {}))
    P = model.transform(X)
    np.testing.assert_allclose(P @ P.T, K, atol=1e-6)
    assert model.kernel_.get_params() == {"kernel": metric, "kernel_params": params or {}}


def test_kernel_params_reach_a_callable_and_save_with_a_pairwise_kernel(tmp_path):
    from dkicf import load

    def scaled_linear(A, B, scale=1.0):
        return scale * A @ B.T

    X = np.random.default_rng(2).normal(size=(30, 2))
    model = KernelKMeans(n_clusters=2, kernel=scaled_linear, kernel_params={"scale": 3.0},
                         rank=2, tol=0, random_state=0).fit(X)
    P = model.transform(X)
    np.testing.assert_allclose(P @ P.T, 3.0 * X @ X.T, atol=1e-9)
    sig = KernelKMeans(n_clusters=2, kernel="sigmoid", gamma=0.2,
                       kernel_params={"coef0": 0.5}, rank=5, random_state=0).fit(X)
    assert sig.kernel_.params == {"gamma": 0.2, "coef0": 0.5}
    sig.save(tmp_path / "m.zarr")
    np.testing.assert_array_equal(load(tmp_path / "m.zarr").predict(X), sig.predict(X))
    with pytest.raises(ValueError, match="takes gamma, degree and coef0"):
        KernelKMeans(kernel="gaussian", kernel_params={"gamma": 1.0}).fit(X)
    with pytest.raises(ValueError, match="Unknown kernel 'nope'"):
        KernelKMeans(kernel="nope").fit(X)


def test_verbose_prints_progress(capsys):
    X, _ = make_ring(300, random_state=0)
    KernelKMeans(n_clusters=2, gamma=16.0, rank=10, n_init=2, random_state=0).fit(X)
    assert capsys.readouterr().out == ""
    KernelKMeans(n_clusters=2, gamma=16.0, rank=10, n_init=2, random_state=0,
                 verbose=1).fit(X)
    lines = capsys.readouterr().out.splitlines()
    # One line per run, when it ends (both in the shared Lloyd passes).
    assert sorted(line.split(" done at ")[0] for line in lines[:-1]) == [
        "k-means run 1/2", "k-means run 2/2"]
    assert all(" done at lloyd step " in line for line in lines[:-1])
    assert lines[-1].startswith("KernelKMeans: rank 10 (max_rank), trace error ")
    KernelKMeans(n_clusters=2, gamma=16.0, rank=10, n_init=1, random_state=0,
                 verbose=2).fit(X)
    out = capsys.readouterr().out
    assert "factorization: rank 10/10" in out and "k-means run 1/1: minibatch step 1," in out
    with pytest.raises(ValueError, match="verbose must be an integer >= 0"):
        KernelKMeans(verbose=-1).fit(X)
