"""Property tests of the factorization against the full kernel matrix (numpy backend).

Whatever the pivots, an incomplete Cholesky factorization is a partial
Cholesky factorization of K, so on random, often degenerate data (the rows of
``_cases.random_rows``: duplicated rows, tight blobs, integer grids; scaled by
0.01 to 100; ranks past the numerical one) it
must keep the theorems that hold for every pivot order:

* ``L = P[pivots]`` is lower triangular with a positive diagonal;
* ``P P^T`` reproduces the pivots' rows of K, and ``K - P P^T`` (the Schur
  complement) is positive semi-definite;
* the residual is ``diag(K - P P^T)`` and the trace error its sum, never
  increasing from pass to pass;
* ``transform`` maps the training rows to their rows of P;
* with the greedy rules, each pivot holds the largest residual of its
  iteration (Algorithm 1's choice, within rounding).

K comes from scikit-learn's ``pairwise_kernels``, not from dkicf.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from _cases import KINDS, random_rows  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sklearn.metrics.pairwise import pairwise_kernels  # noqa: E402

from dkicf import incomplete_cholesky  # noqa: E402

EPS = np.finfo(np.float64).eps


@st.composite
def cases(draw, max_rows: int = 120):
    kind = draw(st.sampled_from(KINDS))
    n, d = draw(st.integers(2, max_rows)), draw(st.integers(1, 6))
    scale = 10.0 ** draw(st.integers(-2, 2))
    X = random_rows(kind, n, d, np.random.default_rng(draw(st.integers(0, 2**32 - 1)))) * scale
    kernel = draw(st.sampled_from(["gaussian", "laplacian", "polynomial", "linear"]))
    options = {"kernel": kernel, "max_rank": draw(st.integers(1, n + 3)),
               "tol": draw(st.sampled_from([0.0, 1e-9, 1e-3, 0.5])),
               "pivoting": draw(st.sampled_from(["block-greedy", "greedy", "rpcholesky"]))}
    if kernel != "linear":
        options["gamma"] = 10.0 ** draw(st.floats(-3, 1)) / scale ** 2
    if kernel == "polynomial":
        options["degree"] = draw(st.integers(1, 4))
    return X, options


def reference_kernel(X: np.ndarray, options: dict) -> np.ndarray:
    """The full kernel matrix, by scikit-learn."""
    metric = {"gaussian": "rbf"}.get(options["kernel"], options["kernel"])
    params = {key: options[key] for key in ("gamma", "degree") if key in options}
    if metric == "polynomial":
        params["coef0"] = 1.0
    return pairwise_kernels(X, metric=metric, **params)


def check_theorems(X: np.ndarray, options: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank capped at n, numerical rank reached
        res = incomplete_cholesky(X, random_state=0, **options)
    K = reference_kernel(X, options)
    n, r = X.shape[0], res.rank
    P = np.asarray(res.P)
    # Rounding of one kernel entry and of the r-term sums that form P P^T.
    size = float(np.abs(np.diag(K)).max())
    atol = 64 * EPS * size * (r + 1) * max(1.0, float(np.abs(X).max()) ** 2
                                           * options.get("gamma", 1.0)) + 1e-300

    assert P.shape == (n, r) and r <= min(options["max_rank"], n)
    if r == 0:  # only when the whole trace is within tol already
        assert res.stop_reason == "tol" and np.trace(K) <= options["tol"]
        return
    assert np.isfinite(P).all()
    assert len(set(res.pivots.tolist())) == r
    np.testing.assert_array_equal(res.L, P[res.pivots])
    assert np.allclose(np.triu(res.L, 1), 0.0) and (np.diag(res.L) > 0).all()

    approx = P @ P.T
    np.testing.assert_allclose(approx[res.pivots], K[res.pivots], rtol=0, atol=atol)
    smallest = np.linalg.eigvalsh(K - approx).min()
    assert smallest >= -atol * n, (smallest, atol)

    residual = np.asarray(res.residual)
    np.testing.assert_allclose(residual, np.maximum(np.diag(K) - (P**2).sum(1), 0.0),
                               rtol=0, atol=atol)
    assert (residual >= 0).all()
    assert res.trace_errors[-1] == pytest.approx(residual.sum(), rel=1e-9, abs=atol * n)
    assert (np.diff(res.trace_errors) <= atol * n).all()
    assert res.initial_trace == pytest.approx(np.trace(K), rel=1e-12)
    if res.stop_reason == "tol":
        assert res.trace_errors[-1] <= options["tol"]

    np.testing.assert_allclose(res.transform(X), P, rtol=0, atol=1e-6 * max(1.0, size))

    if options["pivoting"] != "rpcholesky":
        # Algorithm 1: the j-th pivot holds the largest residual once j columns are in.
        held = np.diag(K).copy()
        for j, t in enumerate(res.pivots):
            assert held[t] >= held.max() - 4 * atol, (j, t, held[t], held.max())
            held -= P[:, j] ** 2


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cases())
def test_the_factor_keeps_the_theorems_of_a_partial_cholesky_factorization(case):
    check_theorems(*case)
