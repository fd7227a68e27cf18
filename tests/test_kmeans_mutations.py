"""k-means behaviours that a changed line must not slip past, through the public entry point.

* Lloyd: when an empty cluster takes a point, the cluster that gave it no
  longer counts it in its sum (``test_an_empty_cluster_takes_a_point_from_its_donor``);
* mini-batch: a centre that is starved (a count below 1e-3 of the largest),
  not only one with no point, is re-seeded (``test_a_starved_centre_is_reseeded``).
"""

from __future__ import annotations

import numpy as np

from dkicf.kmeans import kmeans


def test_an_empty_cluster_takes_a_point_from_its_donor():
    P = np.array([[5.0], [6.0], [7.0], [20.0], [21.0]])
    # Centre 1 is nearest to no point: after the first assignment it is empty.
    init = np.array([[6.0], [1000.0], [20.5]])
    res = kmeans(P, 3, algorithm="lloyd", init=init, max_iter=1, tol=0, random_state=0)
    # By hand: cluster 0 holds 5, 6, 7; the farthest points from their centres
    # are 5 and 7 (squared distance 1), the lower index goes: 5 moves to the
    # empty cluster, and cluster 0 is left with 6 and 7.
    np.testing.assert_array_equal(res.cluster_centers, [[6.5], [5.0], [20.5]])
    assert np.bincount(np.asarray(res.labels), minlength=3).tolist() == [2, 1, 2]
    # The same fit run to convergence keeps those clusters.
    res = kmeans(P, 3, algorithm="lloyd", init=init, max_iter=20, tol=0, random_state=0)
    np.testing.assert_array_equal(res.cluster_centers, [[6.5], [5.0], [20.5]])
    assert res.inertia == 1.0  # 4 points at distance 0.5 from their centres


def test_a_starved_centre_is_reseeded():
    rng = np.random.default_rng(0)
    n, outliers = 100_000, 20
    P = rng.normal(scale=0.1, size=(n, 1))
    P[:outliers] = 100.0
    init = np.array([[0.0], [100.0]])
    # One step over a batch of n rows drawn with replacement: centre 1 gets
    # about 20 points (none with probability e**-20), far below 1e-3 of
    # centre 0's ~1e5: it is starved, and is re-seeded at a batch point drawn
    # with probability ~ its squared distance to its centre, which is 0 for
    # the points at 100, so at a point of the main blob.
    res = kmeans(P, 2, algorithm="minibatch", init=init, batch_size=n, max_iter=1, tol=0,
                 max_no_improvement=None, random_state=1)
    centers = res.cluster_centers
    assert abs(centers[0, 0]) < 0.01
    assert centers[1, 0] != 100.0
    assert abs(centers[1, 0]) < 1.0
    assert np.any(P[outliers:, 0] == centers[1, 0])
