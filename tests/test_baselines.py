"""Baseline estimators: exactness of the factorizations, agreement with references, contracts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from sklearn.datasets import make_blobs
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import adjusted_rand_score
from sklearn.utils.estimator_checks import parametrize_with_checks

from dkicf import baselines
from dkicf.baselines import (
    ApproxKernelKMeans,
    ExactKernelKMeans,
    KernelCholKMeans,
    NystromKernelKMeans,
    RFFKernelKMeans,
)
from dkicf.kernels import GaussianKernel, LinearKernel, make_kernel

ALL = [
    ExactKernelKMeans,
    KernelCholKMeans,
    ApproxKernelKMeans,
    RFFKernelKMeans,
    NystromKernelKMeans,
]
SUBSET = [ApproxKernelKMeans, NystromKernelKMeans]


@pytest.fixture(scope="module")
def blobs():
    X, y = make_blobs(n_samples=120, centers=3, n_features=2, cluster_std=0.6, random_state=3)
    return X, y


def _gram(X, kernel="gaussian", gamma=0.5):
    return make_kernel(kernel, gamma=gamma).block(X, X)


def _kernel_objective(K, labels):
    """sum_i ||phi_i - mean of its cluster||^2 from the kernel matrix alone."""
    total = np.trace(K)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        total -= K[np.ix_(idx, idx)].sum() / idx.size
    return total


def _lloyd_reference(X, labels, k, max_iter=100):
    """Plain Lloyd k-means in input space from a given partition."""
    labels = labels.copy()
    for it in range(1, max_iter + 1):
        assert all((labels == c).any() for c in range(k)), "reference hit an empty cluster"
        centres = np.stack([X[labels == c].mean(axis=0) for c in range(k)])
        d2 = ((X[:, None, :] - centres[None, :, :]) ** 2).sum(axis=-1)
        new = d2.argmin(axis=1)
        if np.array_equal(new, labels):
            return labels, it, d2[np.arange(len(X)), labels].sum()
        labels = new
    raise AssertionError("reference did not converge")


# --------------------------------------------------------------------------- factorizations


@pytest.mark.parametrize(
    "kernel, gamma",
    [("gaussian", 0.5), ("gaussian", 0.005), ("laplacian", 0.3), ("linear", None)],
)
def test_cholesky_factor_reproduces_the_kernel(blobs, kernel, gamma):
    X = np.vstack([blobs[0], blobs[0][:15]])  # duplicated rows: K is singular
    est = KernelCholKMeans(n_clusters=3, kernel=kernel, gamma=gamma, random_state=0).fit(X)
    F = est.embed(X)
    K = _gram(X, kernel, gamma)
    np.testing.assert_allclose(F @ F.T, K, rtol=0, atol=1e-8)
    assert est.rank_ <= len(blobs[0])
    assert F.shape == (len(X), est.rank_)
    if kernel == "linear":
        assert est.rank_ == X.shape[1]


def test_cholesky_kmeans_solves_the_kernel_kmeans_problem(blobs):
    X, y = blobs
    exact = ExactKernelKMeans(n_clusters=3, gamma=0.2, n_init=3, random_state=0).fit(X)
    chol = KernelCholKMeans(n_clusters=3, gamma=0.2, n_init=3, random_state=0).fit(X)
    assert adjusted_rand_score(exact.labels_, chol.labels_) == 1.0
    assert adjusted_rand_score(y, chol.labels_) == 1.0
    # inertia_ is the same quantity: squared feature-space distances to the means
    np.testing.assert_allclose(chol.inertia_, exact.inertia_, rtol=1e-6)
    np.testing.assert_allclose(
        exact.inertia_, _kernel_objective(_gram(X, gamma=0.2), exact.labels_), rtol=1e-10
    )


@pytest.mark.parametrize("kernel, gamma", [("gaussian", 0.5), ("gaussian", 0.01), ("linear", None)])
def test_nystrom_with_all_points_reproduces_the_kernel(blobs, kernel, gamma):
    X = blobs[0]
    est = NystromKernelKMeans(
        n_clusters=3, n_components=len(X), kernel=kernel, gamma=gamma, random_state=0
    ).fit(X)
    F = est.embed(X)
    np.testing.assert_allclose(F @ F.T, _gram(X, kernel, gamma), rtol=0, atol=1e-6)


def test_nystrom_subset_is_interpolated_exactly(blobs):
    X = blobs[0]
    est = NystromKernelKMeans(n_clusters=3, n_components=20, gamma=0.5, random_state=1).fit(X)
    B = est.subset_indices_
    assert B.shape == (20,) and len(np.unique(B)) == 20
    F = est.embed(X)
    K = _gram(X)
    # K_MB K_BB^+ K_BM equals K on the rows and columns of B, not elsewhere
    np.testing.assert_allclose((F @ F.T)[np.ix_(B, B)], K[np.ix_(B, B)], atol=1e-8)
    np.testing.assert_allclose(F[B] @ F.T, K[B], atol=1e-8)
    assert np.abs(F @ F.T - K).max() > 1e-4


def test_rff_features_approximate_the_gaussian_kernel_better_with_more_components(blobs):
    X = blobs[0][:60]
    K = _gram(X, gamma=0.3)
    errors = []
    for D in (30, 300, 3000):
        est = RFFKernelKMeans(n_clusters=3, n_components=D, gamma=0.3, random_state=0).fit(X)
        Z = est.embed(X)
        assert Z.shape == (60, D)
        assert est.random_weights_.shape == (2, D)
        errors.append(np.abs(Z @ Z.T - K).mean())
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.03
    assert errors[0] / errors[2] > 3  # error ~ 1/sqrt(D): about 10 here


def test_rff_weights_have_variance_two_gamma():
    X = np.random.default_rng(0).normal(size=(10, 4))
    est = RFFKernelKMeans(n_clusters=2, n_components=20000, gamma=0.125, random_state=0).fit(X)
    np.testing.assert_allclose(est.random_weights_.var(), 2 * 0.125, rtol=0.02)
    assert est.random_offset_.min() >= 0 and est.random_offset_.max() < 2 * np.pi


@pytest.mark.parametrize("kernel", ["laplacian", "linear", "polynomial", LinearKernel()])
def test_rff_refuses_other_kernels(kernel):
    with pytest.raises(ValueError, match="only the Gaussian kernel.*NystromKernelKMeans"):
        RFFKernelKMeans(n_clusters=2, kernel=kernel, gamma=1.0).fit(np.eye(4))


def test_rff_accepts_a_gaussian_kernel_object_and_more_components_than_points():
    X = np.random.default_rng(0).normal(size=(8, 2))
    est = RFFKernelKMeans(n_clusters=2, n_components=50, kernel=GaussianKernel(0.5)).fit(X)
    assert est.kernel_.gamma == 0.5 and est.embed(X).shape == (8, 50)


# --------------------------------------------------------------------------- Lloyd estimators


def test_exact_kernel_kmeans_with_linear_kernel_is_lloyd_kmeans():
    rng = np.random.default_rng(7)
    X = np.vstack([rng.normal(loc, 1.0, size=(50, 3)) for loc in (0.0, 2.5, 5.0)])
    init = rng.integers(0, 4, len(X))
    ref_labels, ref_iter, ref_inertia = _lloyd_reference(X, init, 4)
    est = ExactKernelKMeans(n_clusters=4, kernel="linear", max_iter=100).fit(X, init_labels=init)
    np.testing.assert_array_equal(est.labels_, ref_labels)
    assert est.n_iter_ == ref_iter > 2
    np.testing.assert_allclose(est.inertia_, ref_inertia, rtol=1e-10)


def test_approx_kernel_kmeans_with_all_points_is_exact_kernel_kmeans(blobs):
    # With B = all points the span contains the cluster means: alpha = K^+ K U = U,
    # so every iteration equals exact kernel k-means (Chitta et al. 2011 with m = n).
    X = blobs[0]
    init = np.random.default_rng(0).integers(0, 3, len(X))
    for gamma in (0.05, 0.5, 2.0):
        exact = ExactKernelKMeans(n_clusters=3, gamma=gamma).fit(X, init_labels=init)
        approx = ApproxKernelKMeans(n_clusters=3, n_components=len(X), gamma=gamma)
        approx.fit(X, init_labels=init)
        assert adjusted_rand_score(exact.labels_, approx.labels_) == 1.0
        np.testing.assert_array_equal(exact.labels_, approx.labels_)
        assert approx.n_iter_ == exact.n_iter_
        np.testing.assert_allclose(approx.inertia_, exact.inertia_, rtol=1e-8)


def test_approx_kernel_kmeans_objective_bounds_the_exact_one(blobs):
    # Centres restricted to a subspace cannot beat the cluster means: for the
    # returned partition, inertia_ >= the exact kernel k-means objective.
    X = blobs[0]
    K = _gram(X, gamma=0.5)
    for m in (3, 10, 40):
        est = ApproxKernelKMeans(n_clusters=3, n_components=m, gamma=0.5, random_state=m).fit(X)
        exact_obj = _kernel_objective(K, est.labels_)
        assert est.inertia_ >= exact_obj - 1e-9
        assert est.dual_coef_.shape == (m, 3)
        # the centres phi(B) alpha give exactly the reported distances
        B = est.subset_indices_
        alpha = est.dual_coef_
        d2 = 1 - 2 * K[:, B] @ alpha + np.einsum("jk,jk->k", alpha, K[np.ix_(B, B)] @ alpha)
        np.testing.assert_allclose(est.inertia_, d2[np.arange(len(X)), est.labels_].sum())


def test_approx_assignments_are_lloyd_on_nystrom_features(blobs):
    # alpha = K_BB^+ K_BN U makes ||phi(x_i) - c||^2 differ from the squared
    # distance of Nystrom features to their cluster means by a per-point constant,
    # so both give the same Lloyd iterations from the same start and subset.
    X = blobs[0]
    init = np.random.default_rng(5).integers(0, 3, len(X))
    approx = ApproxKernelKMeans(n_clusters=3, n_components=15, gamma=0.5, random_state=4)
    approx.fit(X, init_labels=init)
    nys = NystromKernelKMeans(n_clusters=3, n_components=15, gamma=0.5, random_state=4).fit(X)
    np.testing.assert_array_equal(approx.subset_indices_, nys.subset_indices_)
    ref_labels, ref_iter, _ = _lloyd_reference(nys.embed(X), init, 3)
    np.testing.assert_array_equal(approx.labels_, ref_labels)
    assert approx.n_iter_ == ref_iter


def test_callable_and_kernel_object_match_the_named_kernel(blobs):
    X = blobs[0]
    init = np.arange(len(X)) % 3

    def gauss(A, B):
        return np.exp(-0.5 * ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1))

    named = ExactKernelKMeans(n_clusters=3, gamma=0.5).fit(X, init_labels=init)
    for kernel in (gauss, GaussianKernel(0.5)):
        other = ExactKernelKMeans(n_clusters=3, kernel=kernel).fit(X, init_labels=init)
        np.testing.assert_array_equal(other.labels_, named.labels_)
        np.testing.assert_allclose(other.inertia_, named.inertia_, rtol=1e-10)


@pytest.mark.parametrize("cls", [ExactKernelKMeans, ApproxKernelKMeans])
def test_empty_initial_cluster_is_reseeded(blobs, cls):
    X = blobs[0]
    init = np.zeros(len(X), dtype=int)  # clusters 1 and 2 start empty
    params = {"n_components": 30} if cls is ApproxKernelKMeans else {}
    est = cls(n_clusters=3, gamma=0.5, random_state=0, **params).fit(X, init_labels=init)
    assert np.bincount(est.labels_, minlength=3).min() > 0


@pytest.mark.filterwarnings("error::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("cls", [ExactKernelKMeans, ApproxKernelKMeans])
def test_duplicate_points_neither_empty_clusters_nor_cycle(cls):
    # Two distinct points, four clusters: two clusters must share a point's copies,
    # and their coinciding centres must not make points hop between them forever.
    X = np.repeat(np.array([[0.0, 0.0], [3.0, 3.0]]), 10, axis=0)
    params = {"n_components": 6} if cls is ApproxKernelKMeans else {}
    est = cls(n_clusters=4, gamma=1.0, random_state=0, **params).fit(X)
    assert sorted(np.unique(est.labels_).tolist()) == [0, 1, 2, 3]
    assert est.n_iter_ < 10


@pytest.mark.parametrize("cls", [ExactKernelKMeans, ApproxKernelKMeans])
def test_predict_on_training_rows_returns_the_labels(blobs, cls):
    X = blobs[0]
    params = {"n_components": 40} if cls is ApproxKernelKMeans else {}
    est = cls(n_clusters=3, gamma=0.5, n_init=2, random_state=0, **params).fit(X)
    np.testing.assert_array_equal(est.predict(X), est.labels_)


def test_init_labels_are_validated(blobs):
    X = blobs[0]
    est = ExactKernelKMeans(n_clusters=3, gamma=0.5)
    with pytest.raises(ValueError, match=r"shape \(120,\)"):
        est.fit(X, init_labels=np.zeros(5, dtype=int))
    with pytest.raises(ValueError, match=r"0\.\.2 for n_clusters=3"):
        est.fit(X, init_labels=np.full(len(X), 3))
    with pytest.raises(TypeError, match="integers"):
        est.fit(X, init_labels=np.zeros(len(X)))


def test_init_labels_with_several_inits_warns(blobs):
    X = blobs[0]
    with pytest.warns(RuntimeWarning, match="one run instead of n_init=3"):
        ExactKernelKMeans(n_clusters=3, gamma=0.5, n_init=3).fit(X, init_labels=np.arange(120) % 3)


def test_not_converging_warns(blobs):
    X = blobs[0]
    init = np.random.default_rng(0).integers(0, 3, len(X))
    with pytest.warns(ConvergenceWarning, match="max_iter=1"):
        est = ExactKernelKMeans(n_clusters=3, gamma=0.5, max_iter=1).fit(X, init_labels=init)
    assert est.n_iter_ == 1


# --------------------------------------------------------------------------- shared contract


@pytest.mark.parametrize("cls", SUBSET)
def test_subset_larger_than_data_is_refused(cls):
    X = np.random.default_rng(0).normal(size=(10, 2))
    with pytest.raises(ValueError, match="n_components=11 is larger than n_samples=10"):
        cls(n_clusters=2, n_components=11, gamma=1.0).fit(X)


@pytest.mark.parametrize("cls", ALL)
def test_more_clusters_than_points_is_refused(cls):
    with pytest.raises(ValueError, match="n_samples=3 should be >= n_clusters=4"):
        cls(n_clusters=4, gamma=1.0).fit(np.eye(3))


@pytest.mark.parametrize("cls", ALL)
def test_estimators_cluster_blobs_reproducibly(blobs, cls):
    X, y = blobs
    params = {"n_components": 60} if cls in SUBSET + [RFFKernelKMeans] else {}
    est = cls(n_clusters=3, gamma=0.2, n_init=3, random_state=0, **params)
    labels = est.fit_predict(X)
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, est.labels_)
    assert adjusted_rand_score(y, labels) == 1.0
    again = cls(n_clusters=3, gamma=0.2, n_init=3, random_state=0, **params).fit(X)
    np.testing.assert_array_equal(again.labels_, labels)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(est)).predict(X[:7]), labels[:7])
    assert est.n_features_in_ == 2 and est.n_iter_ >= 1 and est.inertia_ > 0
    assert est.get_params()["gamma"] == 0.2  # the public parameter is left untouched


@pytest.mark.parametrize("cls", [ExactKernelKMeans, KernelCholKMeans])
def test_full_kernel_estimators_refuse_data_that_cannot_fit_in_memory(monkeypatch, cls):
    class _Tiny:
        available = 1000

    monkeypatch.setattr(baselines.psutil, "virtual_memory", lambda: _Tiny())
    with pytest.raises(MemoryError, match=r"full 40 x 40 kernel.*NystromKernelKMeans"):
        cls(n_clusters=2, gamma=1.0).fit(np.random.default_rng(0).normal(size=(40, 2)))


def test_median_heuristic_is_used_without_gamma(blobs):
    est = NystromKernelKMeans(n_clusters=3, n_components=30, random_state=0).fit(blobs[0])
    assert isinstance(est.kernel_, GaussianKernel) and est.kernel_.gamma > 0
    assert est.gamma is None


# Common scikit-learn estimator checks on small settings (the check data have 10 to 100 rows).
_CHECKED = [
    ExactKernelKMeans(n_clusters=3, random_state=0),
    KernelCholKMeans(n_clusters=3, random_state=0),
    ApproxKernelKMeans(n_clusters=3, n_components=8, random_state=0),
    RFFKernelKMeans(n_clusters=3, n_components=50, random_state=0),
    NystromKernelKMeans(n_clusters=3, n_components=8, random_state=0),
]


@parametrize_with_checks(_CHECKED)
def test_sklearn_compatible(estimator, check):
    check(estimator)


def test_rff_features_equal_scikit_learns_rbfsampler():
    """Same draws, same map: sqrt(2/D) cos(x W + b) with W ~ N(0, 2 gamma), b ~ U[0, 2 pi)."""
    from sklearn.kernel_approximation import RBFSampler

    X = np.random.default_rng(0).normal(size=(50, 3))
    ref = RBFSampler(gamma=0.7, n_components=64, random_state=0).fit(X)
    ours = RFFKernelKMeans(n_clusters=2, n_components=64, gamma=0.7, random_state=0).fit(X)
    ours.random_weights_ = ref.random_weights_
    ours.random_offset_ = ref.random_offset_
    np.testing.assert_allclose(ours.embed(X), ref.transform(X), rtol=1e-12, atol=1e-12)
    # The draws themselves have the distribution RBFSampler uses.
    big = RFFKernelKMeans(n_clusters=2, n_components=20000, gamma=0.7, random_state=1).fit(X)
    assert abs(big.random_weights_.std() - np.sqrt(2 * 0.7)) < 0.02
    assert abs(big.random_offset_.mean() - np.pi) < 0.05


def test_nystrom_features_equal_scikit_learns_nystroem():
    """On the same subset, K_nB K_BB^(-1/2) is what sklearn's Nystroem computes."""
    from sklearn.kernel_approximation import Nystroem

    from dkicf.kernels import GaussianKernel

    X = np.random.default_rng(1).normal(size=(80, 3))
    ref = Nystroem(kernel="rbf", gamma=0.3, n_components=20, random_state=0).fit(X)
    subset = np.asarray(ref.component_indices_)

    class Draw:  # the subset sklearn drew, in place of our own draw
        def choice(self, n, size, replace):
            return subset

    ours = NystromKernelKMeans(n_clusters=2, n_components=20, gamma=0.3)
    ours.kernel_ = GaussianKernel(0.3)
    F = ours._fit_map(X, ours.kernel_, Draw())
    order = np.argsort(subset)  # our subset is sorted: sklearn's columns in that order
    expected = ref.transform(X)
    np.testing.assert_allclose(F @ F.T, expected @ expected.T, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(F, expected[:, order], rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(ours._map(X[:7]), ref.transform(X[:7])[:, order], atol=1e-8)
