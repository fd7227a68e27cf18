"""Property tests of the k-means on random data and options (numpy backend).

Restarts that hold the same centres share their passes (``docs/kmeans.md``):
every case fits twice, sharing and with the sharing switched off, and the two
fits must be the same fit.  Each fit must also agree with direct
computations: its labels are ``assign``'s for its centres, its inertia the
squared distances to them, and the kept run the lowest.  The data include
duplicated rows and small integer grids, where rows at the same distance from
two centres are common.

The default hypothesis profile keeps the suite short; the reliability
campaign runs more cases (``benchmarks/bench_campaign.py --only fuzz``).
"""

from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

hypothesis = pytest.importorskip("hypothesis")
from _cases import KINDS, random_rows  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dkicf import _kmeans_runs, kmeans  # noqa: E402
from dkicf.kmeans import assign  # noqa: E402


@st.composite
def kmeans_cases(draw):
    """``(X, n_clusters, options)``: rows of one of :data:`KINDS`, k up to their distinct
    rows, and every option that changes the passes."""
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(KINDS))
    # Grids of few features: rows at the same distance from two centres in most passes.
    width = draw(st.integers(1, 2 if kind == "grid" else 6))
    X = random_rows(kind, draw(st.integers(2, 300)), width, np.random.default_rng(seed))
    distinct = np.unique(X, axis=0).shape[0]
    k = draw(st.integers(1, min(distinct, 10)))
    options = dict(
        algorithm=draw(st.sampled_from(["lloyd", "minibatch-lloyd", "minibatch"])),
        init=draw(st.sampled_from(["k-means||", "k-means++"])),
        n_init=draw(st.integers(1, 6)),
        batch_size=draw(st.sampled_from([8, 64, 1024])),
        tol=draw(st.sampled_from([0.0, 1e-4, 1e-2])),
        max_iter=draw(st.sampled_from([3, 20, 100])),
        random_state=seed,
    )
    return X, k, options


def _each_set_apart(centers: list) -> list:
    """:func:`dkicf._kmeans_runs._same_centers` with no two sets shared."""
    return [(i, None) for i in range(len(centers))]


# Found by the campaign: apart, the five runs' final centres share one product, and the
# kept run's inertia differs from assign's by rounding only (k = 1, rows far from 0).
_PACKED_ROUNDING = (random_rows("blobs", 111, 2, np.random.default_rng(2545413446)), 1, dict(
    algorithm="minibatch-lloyd", init="k-means++", n_init=5, batch_size=64, tol=0.01,
    max_iter=3, random_state=2545413446))


@example(case=_PACKED_ROUNDING)
@given(case=kmeans_cases())
def test_fuzz_restarts_sharing_their_passes_fit_as_apart(case):
    X, k, options = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fewer clusters found than asked
        shared = kmeans(X, k, **options)
        with mock.patch.object(_kmeans_runs, "_same_centers", _each_set_apart):
            apart = kmeans(X, k, **options)
    # Each fit on its own: the labels of its centres, its inertia, the lowest run kept.
    # The kept run's inertia may come from a pass that put its centres beside other
    # runs' in one product: assign's up to the rounding of each row's distance, about
    # eps |x|^2 (2.96e-12 on rows of |x|^2 ~ 800 whose inertia is 2.04, k = 1).
    squares = float(np.einsum("ij,ij->", X, X))
    for fit in (shared, apart):
        labels, inertia = assign(X, fit.cluster_centers)
        assert_array_equal(labels, fit.labels)
        assert fit.inertia == pytest.approx(inertia, rel=1e-12, abs=1e-14 * (squares + 1.0))
        direct = ((X - fit.cluster_centers[fit.labels]) ** 2).sum()
        assert fit.inertia == pytest.approx(direct, rel=1e-9, abs=1e-9)
        assert fit.inertia <= min(fit.inertias) * (1 + 1e-12)
    # The two fits: every run ends at the same inertia, up to the rounding of distances
    # that a run's place in the passes' products changes (about eps * |x|^2 a row).
    rounding = 1e-9 * (squares + 1.0)
    assert_allclose(shared.inertias, apart.inertias, rtol=1e-9, atol=rounding)
    assert shared.n_steps_total == apart.n_steps_total
    best = [i for i, v in enumerate(apart.inertias) if v <= apart.inertia + rounding]
    if len(best) == 1:  # the same run kept: the same clusters
        assert_array_equal(shared.labels, apart.labels)
        assert_array_equal(shared.cluster_centers, apart.cluster_centers)
        assert shared.n_iter == apart.n_iter
