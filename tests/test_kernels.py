import numpy as np
import pytest
from sklearn.metrics.pairwise import (
    laplacian_kernel,
    linear_kernel,
    polynomial_kernel,
    rbf_kernel,
)

from dkicf.kernels import CallableKernel, Kernel, make_kernel, median_gamma


@pytest.mark.parametrize(
    "name, params, reference",
    [
        ("gaussian", {"gamma": 0.3}, lambda A, B: rbf_kernel(A, B, gamma=0.3)),
        ("rbf", {"gamma": 2.0}, lambda A, B: rbf_kernel(A, B, gamma=2.0)),
        ("laplacian", {"gamma": 0.7}, lambda A, B: laplacian_kernel(A, B, gamma=0.7)),
        (
            "polynomial",
            {"gamma": 0.5, "degree": 2, "coef0": 1.5},
            lambda A, B: polynomial_kernel(A, B, degree=2, gamma=0.5, coef0=1.5),
        ),
        ("linear", {}, linear_kernel),
    ],
)
def test_block_and_diag_match_scikit_learn(name, params, reference, rng):
    A = rng.normal(size=(30, 4))
    B = rng.normal(size=(7, 4))
    k = make_kernel(name, **params)
    np.testing.assert_allclose(k.block(A, B), reference(A, B), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k.diag(A), np.diag(reference(A, A)), rtol=1e-12, atol=1e-12)
    # Precomputed per-row values give the same block.
    np.testing.assert_allclose(
        k.block(A, B, k.prepare(A), k.prepare(B)), reference(A, B), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    "kernel",
    [make_kernel("gaussian", gamma=0.3), make_kernel("laplacian", gamma=0.7),
     make_kernel("polynomial", gamma=0.5, degree=2, coef0=1.5), make_kernel("linear"),
     CallableKernel(lambda A, B: (A @ B.T) ** 2)],
    ids=lambda k: k.name,
)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_transposed_block_into_a_scratch_array_equals_block(kernel, dtype, rng):
    """Block updates write kernel blocks, transposed, into reused scratch arrays: the
    values of block() to rounding (bit for bit where a kernel has no transposed form)."""
    A = rng.normal(size=(40, 5)).astype(dtype)
    B = rng.normal(size=(6, 5)).astype(dtype)
    a_aux, b_aux = kernel.prepare(A), kernel.prepare(B)
    out = np.full((6, 40), np.nan)
    got = kernel._block_t_into(A, B, a_aux, b_aux, out)
    assert got is out
    want = kernel.block(A, B, a_aux, b_aux).T
    if type(kernel)._block_t_into is Kernel._block_t_into or dtype == np.float32:
        np.testing.assert_array_equal(out, want)
    else:
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())


def test_callable_kernel_block_and_diag(rng):
    def cosine_plus(A, B):
        return A @ B.T + 1.0

    A = rng.normal(size=(100, 3))
    k = make_kernel(cosine_plus)
    assert isinstance(k, CallableKernel)
    np.testing.assert_allclose(k.diag(A), np.einsum("ij,ij->i", A, A) + 1.0)
    np.testing.assert_allclose(k.block(A, A[:5]), A @ A[:5].T + 1.0)


def test_callable_kernel_wrong_shape_is_named(rng):
    k = make_kernel(lambda A, B: np.ones((len(A), 1)))
    with pytest.raises(ValueError, match="returned shape"):
        k.block(rng.normal(size=(4, 2)), rng.normal(size=(3, 2)))


def test_median_gamma_is_seeded_and_matches_definition(rng):
    X = rng.normal(size=(500, 3))
    g1 = median_gamma(X, seed=3)
    assert g1 == median_gamma(X, seed=3)
    # Against the full pairwise median: close for 20k sampled pairs.
    d2 = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)[np.triu_indices(500, 1)]
    assert abs(1.0 / g1 - np.median(d2)) / np.median(d2) < 0.05
    k = make_kernel("gaussian", gamma="median", X_sample=X, seed=3)
    assert k.gamma == g1


def test_unknown_kernel_lists_valid_names():
    with pytest.raises(ValueError, match="Valid kernels are: additive_chi2, chi2, cosine, "
                                         "gaussian, laplacian, linear, poly, polynomial, rbf, "
                                         "sigmoid, or a callable"):
        make_kernel("sigmod", gamma=1.0)


def test_pairwise_fallback_blocks_and_diagonal_equal_sklearn():
    from sklearn.metrics.pairwise import pairwise_kernels

    from dkicf.kernels import PairwiseKernel

    X = np.random.default_rng(3).normal(size=(9, 4))
    kernel = make_kernel("sigmoid", gamma=0.3, coef0=0.2)
    assert isinstance(kernel, PairwiseKernel)
    K = pairwise_kernels(X, metric="sigmoid", gamma=0.3, coef0=0.2)
    np.testing.assert_allclose(kernel.block(X, X[:4]), K[:, :4], rtol=1e-14)
    np.testing.assert_allclose(kernel.diag(X), np.diag(K), rtol=1e-14)
    np.testing.assert_allclose(kernel.column(X, X[2]), K[:, 2], rtol=1e-14)
    with pytest.raises(ValueError, match="gamma='median' is defined for the gaussian"):
        make_kernel("chi2", gamma="median")


@pytest.mark.parametrize("gamma", [0, -1.0, np.inf, np.nan])
def test_bad_gamma_is_refused(gamma):
    with pytest.raises(ValueError, match="gamma must be a positive"):
        make_kernel("gaussian", gamma=gamma)


def test_gamma_of_wrong_type_is_refused():
    with pytest.raises(TypeError, match="gamma must be a positive number"):
        make_kernel("gaussian", gamma=[1.0])
    with pytest.raises(ValueError, match="gamma must be a positive number or 'median'"):
        make_kernel("gaussian", gamma="mean")


@pytest.fixture
def cauchy():
    """A Cauchy kernel 1 / (1 + gamma |x - y|^2), registered for the test only."""
    from dkicf.kernels import KERNELS, Kernel, register_kernel

    class CauchyKernel(Kernel):
        name = "cauchy"
        aliases = ("cauchy-test",)
        hyperparameters = ("gamma",)

        def __init__(self, gamma):
            self.gamma = float(gamma)

        def diag(self, X, aux=None):
            return np.ones(X.shape[0])

        def block(self, A, B, a_aux=None, b_aux=None):
            d2 = ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)
            return 1.0 / (1.0 + self.gamma * d2)

    saved = dict(KERNELS)
    try:
        yield register_kernel(CauchyKernel)
    finally:
        KERNELS.clear()
        KERNELS.update(saved)


def test_every_registered_name_and_alias_makes_its_kernel(rng):
    from dkicf.kernels import KERNELS, kernel_names

    X = rng.normal(size=(20, 3))
    assert {"gaussian", "rbf", "laplacian", "polynomial", "poly", "linear"} <= set(kernel_names())
    for name in kernel_names():
        kernel = make_kernel(name, gamma=0.5, X_sample=X)
        assert type(kernel) is KERNELS[name]
        params = kernel.get_params()
        assert params == {"kernel": type(kernel).name,
                          **{key: getattr(kernel, key) for key in kernel.hyperparameters}}
        # What a saved model holds makes the same kernel again.
        assert make_kernel(params.pop("kernel"), **params) == kernel
    assert make_kernel("poly", gamma=0.5, degree=2).get_params() == {
        "kernel": "polynomial", "gamma": 0.5, "degree": 2, "coef0": 1.0}


def test_a_kernel_registered_elsewhere_is_made_by_name_and_fits(cauchy, rng, tmp_path):
    from dkicf import KernelKMeans, load
    from dkicf.kernels import kernel_names

    assert {"cauchy", "cauchy-test"} <= set(kernel_names())
    X = rng.normal(size=(12, 2))
    kernel = make_kernel("Cauchy-Test", gamma=2.0)
    assert type(kernel) is cauchy and kernel.get_params() == {"kernel": "cauchy", "gamma": 2.0}
    d2 = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(kernel.block(X, X), 1.0 / (1.0 + 2.0 * d2))
    model = KernelKMeans(n_clusters=2, kernel="cauchy", gamma=2.0, rank=5,
                         random_state=0).fit(X)
    assert model.kernel_ == kernel
    model.save(tmp_path / "m.zarr")
    assert load(tmp_path / "m.zarr").kernel_ == kernel


def test_register_kernel_refuses_a_taken_name_and_an_unknown_hyperparameter(cauchy):
    from dkicf.kernels import KERNELS, GaussianKernel, Kernel, register_kernel

    register_kernel(cauchy)  # again: the same class keeps its names
    assert KERNELS["cauchy"] is cauchy

    class Clash(cauchy):
        name = "clash"
        aliases = ("rbf",)

    with pytest.raises(ValueError, match="'rbf' of Clash is taken by GaussianKernel"):
        register_kernel(Clash)
    assert KERNELS["rbf"] is GaussianKernel and "clash" not in KERNELS

    class Odd(Kernel):
        name = "odd"
        hyperparameters = ("alpha",)

    with pytest.raises(ValueError, match=r"hyper-parameters \['alpha'\]; kernels take gamma, "
                                         "degree, coef0"):
        register_kernel(Odd)
    assert "odd" not in KERNELS
