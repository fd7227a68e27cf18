"""Property tests of the pivot rules on random, often degenerate data (numpy backend).

Block greedy takes the sequential rule's pivots (``docs/pivoting.md``) up to
what rounding decides: two rows whose residuals are equal in exact arithmetic
(mirror images on a grid, duplicated rows, residuals at the numerical rank's
noise) may come in either order, and a run may stop a pivot earlier on a
residual or trace error at the stopping value.  Every case here must give
identical pivots or differ only so, which :func:`why_they_differ` checks
against the residuals the sequential rule holds and the block rule's own
rounding margin.  ``benchmarks/bench_pivoting.py --random-cases`` runs the
same cases in thousands, and between the numpy and dask backends.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from _cases import KINDS, random_rows  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dkicf import incomplete_cholesky  # noqa: E402


def random_case(rng: np.random.Generator):
    """Rows, kernel options and a rank for one of ``--random-cases``: normal rows,
    duplicated rows, blobs or a small integer grid (ties between mirror images);
    a Gaussian, Laplacian or polynomial kernel; a rank up to past the numerical one."""
    kind = str(rng.choice(KINDS))
    n = int(rng.integers(2, 3000))
    d = int(rng.integers(1, 3 if kind == "grid" else 10))
    X = random_rows(kind, n, d, rng)
    options = {"kernel": str(rng.choice(["gaussian", "gaussian", "laplacian", "polynomial"])),
               "gamma": float(10 ** rng.uniform(-3, 1.5)),
               "max_rank": int(rng.integers(1, min(n, 200) + 1)),
               "tol": float(rng.choice([0.0, 1e-8, 1e-3]))}
    return kind, X, options


def why_they_differ(X, options, g, b) -> str:
    """How two factorizations' pivots compare: ``"identical"``; ``"copies"`` (other
    copies of the same rows); or where they first differ, ``"tie"`` (the two rows'
    residuals, as the sequential rule holds them, within the block rule's rounding
    margin), ``"stop"`` (the same pivots, one run stopping a pivot earlier on a
    residual or trace at the stopping value, within that margin) or
    ``"unexplained"``."""
    from dkicf.pivoting import rounding_margin

    g_piv, b_piv = np.asarray(g.pivots), np.asarray(b.pivots)
    if g_piv.shape == b_piv.shape and np.array_equal(g_piv, b_piv):
        return "identical"
    if g_piv.shape == b_piv.shape and np.array_equal(X[g_piv], X[b_piv]):
        return "copies"
    m = min(g.rank, b.rank)
    diff = np.flatnonzero(g_piv[:m] != b_piv[:m])
    k = int(diff[0]) if diff.size else m
    diag = g.kernel.diag(X)
    # The residual the sequential run holds after k pivots.
    e = diag if k == 0 else incomplete_cholesky(
        X, pivoting="greedy", **dict(options, max_rank=k)).residual
    margin = rounding_margin(float(diag.max()), g.kernel.roundoff(
        float(np.einsum("ij,ij->i", X, X).max()), X.shape[1]), k, X.shape[0])
    if diff.size:
        # The first pivot is the largest of K's diagonal, which both runs hold exactly.
        gap = abs(e[g_piv[k]] - e[b_piv[k]])
        return "tie" if k > 0 and gap <= margin else "unexplained"
    residual = e[(g_piv if g.rank > b.rank else b_piv)[m]]
    at_rank_stop = abs(residual - g.info["rank_tol"]) <= margin or residual <= margin
    at_trace_stop = abs(float(e.sum()) - options["tol"]) <= X.shape[0] * margin
    return "stop" if at_rank_stop or at_trace_stop else "unexplained"


@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_block_greedy_takes_the_greedy_pivots_up_to_rounding(seed):
    kind, X, options = random_case(np.random.default_rng(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank-deficient kernels warn
        g, b = (incomplete_cholesky(X, pivoting=rule, **options)
                for rule in ("greedy", "block-greedy"))
    why = why_they_differ(X, options, g, b)
    assert why != "unexplained", (kind, X.shape, options, g.pivots, b.pivots)
    if why == "identical":
        scale = max(1.0, float(np.abs(g.P).max()))
        np.testing.assert_allclose(b.P, g.P, rtol=0, atol=1e-6 * scale)
