"""Pivot rules are plug-ins: a rule defined here, in the tests only, runs unchanged
through the numpy and dask backends, the estimator and the checks."""

import dask.array as da
import numpy as np
import pytest
from scipy.linalg import cholesky, solve_triangular

from dkicf import KernelKMeans, incomplete_cholesky
from dkicf import pivoting as _pivoting
from dkicf.kernels import GaussianKernel


class FirstRows(_pivoting.PivotRule):
    """The first rows in order: pivots 0, 1, 2, ... (up to the block cap per pass)."""

    name = "first-rows"
    description = "the rows in their order (a rule for tests)"

    def choose(self, ctx, rank, cand, b_max, trace):
        index = np.arange(rank, min(rank + b_max, 4 + rank))  # 4 per pass at most
        cand = ctx.fetch(index)
        return cand, _pivoting.ordered_block(ctx.kernel, cand), index.shape[0]


@pytest.fixture
def first_rows():
    _pivoting.register_rule(FirstRows)
    yield "first-rows"
    _pivoting.PIVOT_RULES.pop("first-rows")


def reference(X, gamma, r):
    """P of the first r rows as pivots, from the full kernel matrix: K[:, B] L^{-T}."""
    K = GaussianKernel(gamma).block(X, X)
    L = cholesky(K[:r, :r], lower=True)
    return solve_triangular(L, K[:r, :], lower=True).T


def test_a_rule_defined_in_the_tests_runs_on_numpy_and_dask(first_rows, client):
    X = np.random.default_rng(0).normal(size=(300, 3))
    ref = reference(X, 0.5, 10)
    res = incomplete_cholesky(X, gamma=0.5, max_rank=10, tol=0, pivoting=first_rows)
    np.testing.assert_array_equal(res.pivots, np.arange(10))
    np.testing.assert_allclose(res.P, ref, atol=1e-10)
    assert res.n_passes == 1 + 3  # the diagonal, then blocks of 4, 4 and 2 pivots
    np.testing.assert_allclose(res.trace_errors[-1], np.sum(1.0 - np.sum(ref**2, axis=1)),
                               atol=1e-9)
    dres = incomplete_cholesky(da.from_array(X, chunks=70), gamma=0.5, max_rank=10, tol=0,
                               pivoting=first_rows, client=client)
    np.testing.assert_array_equal(dres.pivots, np.arange(10))
    np.testing.assert_allclose(dres.P.compute(), ref, atol=1e-10)


def test_the_estimator_and_the_checks_read_the_registry(first_rows):
    X = np.random.default_rng(1).normal(size=(200, 2))
    model = KernelKMeans(n_clusters=2, rank=8, gamma=0.5, pivoting=first_rows,
                         random_state=0).fit(X)
    np.testing.assert_array_equal(model.pivots_, np.arange(8))
    with pytest.raises(ValueError, match="block_delta=0.1 applies to pivoting='block-greedy'"):
        incomplete_cholesky(X, gamma=0.5, pivoting=first_rows, block_delta=0.1)


def test_an_unknown_rule_lists_the_registered_ones(first_rows):
    X = np.random.default_rng(1).normal(size=(50, 2))
    with pytest.raises(ValueError, match="'greedy', 'block-greedy', 'rpcholesky', 'first-rows'"):
        incomplete_cholesky(X, gamma=0.5, pivoting="first-row")
    with pytest.raises(ValueError, match="pivoting must be one of"):
        KernelKMeans(n_clusters=2, pivoting="no-such-rule").fit(X)


def test_a_taken_name_or_a_class_that_is_not_a_rule_is_refused(first_rows):
    class Other(_pivoting.PivotRule):
        name = "greedy"

    with pytest.raises(ValueError, match="the pivot rule name 'greedy' is taken"):
        _pivoting.register_rule(Other)
    with pytest.raises(TypeError, match="must be a PivotRule subclass"):
        _pivoting.register_rule(object)
    assert _pivoting.register_rule(FirstRows) is FirstRows  # the same class again: no change


def test_every_backend_is_a_chunk_backend_with_its_stage_s_protocol(client):
    """One protocol under both stages: the factorization's and the k-means' backends, numpy
    and dask, are all ChunkBackends, and each has every method of its own stage's protocol."""
    import inspect

    import dask.array as da

    from dkicf._backends import DaskBackend, FactorBackend, NumpyBackend
    from dkicf._kmeans_tasks import KMeansBackend, _backend
    from dkicf._services import ChunkBackend
    from dkicf.kernels import make_kernel

    X = np.random.default_rng(0).normal(size=(400, 3))
    Xd = da.from_array(X, chunks=200)
    kernel = make_kernel("gaussian", gamma=0.5)
    made = [NumpyBackend(X, kernel, 10), DaskBackend(Xd, kernel, 10, client, True),
            _backend(X, client), _backend(Xd, client)]
    try:
        for backend, protocol in zip(made, (FactorBackend, FactorBackend, KMeansBackend,
                                            KMeansBackend)):
            assert isinstance(backend, ChunkBackend), type(backend).__name__
            wanted = {name for name, _ in inspect.getmembers(protocol, inspect.isfunction)
                      if not name.startswith("_")}
            missing = {name for name in wanted if not callable(getattr(backend, name, None))}
            assert not missing, (type(backend).__name__, missing)
            assert backend.n == 400
    finally:
        for backend in made:
            backend.close()
