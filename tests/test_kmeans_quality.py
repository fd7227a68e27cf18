"""The default k-means reaches what Lloyd reaches on the same P.

Each case factorizes a data set with :class:`dkicf.KernelKMeans` (default
k-means settings), takes ``P = transform(X)`` and compares the fit's inertia
with scikit-learn's ``KMeans(n_init=10)`` on that same P: the reference
optimum.  The rings' true partition is that optimum, so the labels must match
it exactly.
"""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from numpy.testing import assert_array_equal
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits, make_blobs

from dkicf import KernelKMeans
from dkicf.kmeans import kmeans
from dkicf.metrics import clustering_accuracy

BAR = 1.005  # dkicf's inertia / KMeans(n_init=10)'s, at most


def rings(seed):
    """1,000 points on two concentric rings (radii 1 and 3), noise 0.1."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 1000)
    angle = rng.uniform(0, 2 * np.pi, y.size)
    radius = np.where(y == 0, 1.0, 3.0)
    X = np.c_[radius * np.cos(angle), radius * np.sin(angle)] + rng.normal(0, 0.1, (y.size, 2))
    return X, y, 2, {"gamma": 0.5, "rank": 60}


def blobs(seed):
    X, y = make_blobs(3000, n_features=8, centers=12, random_state=seed)
    return X, y, 12, {"gamma": 0.05, "rank": 100}


def digits(seed):
    X, y = load_digits(return_X_y=True)
    return X / 16.0, y, 10, {"gamma": 0.05, "rank": 100}


def fit_and_reference(make, seed):
    X, y, k, params = make(seed)
    est = KernelKMeans(k, random_state=seed, **params).fit(X)
    P = est.transform(X)
    ref = KMeans(k, n_init=10, random_state=seed).fit(P)
    return est, P, ref, y


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rings_default_settings_find_the_optimal_partition(seed):
    est, P, ref, y = fit_and_reference(rings, seed)
    assert clustering_accuracy(y, est.labels_) == 1.0
    assert clustering_accuracy(y, ref.labels_) == 1.0  # the true partition is the optimum
    assert est.inertia_ <= BAR * ref.inertia_


@pytest.mark.parametrize("make, seed", [(blobs, 0), (blobs, 2), (digits, 0)])
def test_default_inertia_is_within_half_a_percent_of_lloyd(make, seed):
    est, P, ref, _ = fit_and_reference(make, seed)
    assert est.inertia_ <= BAR * ref.inertia_


def isolates_last(labels, m):
    """Whether the last ``m`` rows form a cluster of their own."""
    labels = np.asarray(labels)
    return len(set(labels[-m:])) == 1 and bool((labels[:-m] != labels[-1]).all())


def test_kmeans_parallel_finds_a_small_far_cluster_that_a_sample_can_miss():
    """Four far rows among 20,000: k-means|| reaches them through the squared distances."""
    rng = np.random.default_rng(0)
    centres, y = rng.normal(0, 4, (10, 8)), rng.integers(0, 10, 20000)
    P = np.concatenate([centres[y] + rng.normal(0, 1, (y.size, 8)),
                        rng.normal(0, 1, (4, 8)) + 30])
    seeds = range(16)
    parallel = sum(isolates_last(kmeans(P, 11, random_state=s).labels, 4) for s in seeds)
    # The 3,072-row init sample of k-means++ often holds none of the 4 rows.
    sample = sum(isolates_last(kmeans(P, 11, init="k-means++", random_state=s).labels, 4)
                 for s in seeds)
    assert parallel >= 14 and sample <= 11, (parallel, sample)


def test_starved_centres_are_kept_for_the_lloyd_phase():
    """Mini-batch alone re-seeds a centre that few batch points reach; the default keeps it."""
    rng = np.random.default_rng(0)
    centres, y = rng.normal(0, 4, (10, 8)), rng.integers(0, 10, 20000)
    P = np.concatenate([centres[y] + rng.normal(0, 1, (y.size, 8)),
                        rng.normal(0, 1, (4, 8)) + 30])
    init = np.concatenate([centres, P[-1:]])  # one centre on the far rows
    # Batches of 64 rows: the far centre gets no point in the first batch.
    refined = kmeans(P, 11, init=init, batch_size=64, random_state=0)
    assert isolates_last(refined.labels, 4)
    alone = kmeans(P, 11, init=init, batch_size=64, algorithm="minibatch", random_state=0)
    assert not isolates_last(alone.labels, 4)


def test_minibatch_alone_stops_short_where_the_refinement_does_not():
    _, P, ref, y = fit_and_reference(rings, 1)
    alone = kmeans(P, 2, algorithm="minibatch", random_state=1)
    refined = kmeans(P, 2, random_state=1)
    assert alone.inertia > 1.02 * ref.inertia_
    assert refined.inertia <= BAR * ref.inertia_ and refined.stop_reason == "converged"
    assert clustering_accuracy(y, refined.labels) == 1.0


def test_numpy_and_dask_P_give_the_same_default_fit(client):
    _, P, _, _ = fit_and_reference(rings, 0)
    chunks = (113, 250, 7, 330, 300)  # uneven
    a = kmeans(P, 2, random_state=3)
    b = kmeans(da.from_array(P, chunks=(chunks, -1)), 2, random_state=3, client=client)
    assert_array_equal(a.labels, b.labels.compute())
    np.testing.assert_allclose(b.inertia, a.inertia, rtol=1e-12)
    np.testing.assert_allclose(b.cluster_centers, a.cluster_centers, rtol=1e-10, atol=1e-12)
    assert (a.n_iter, a.n_steps_total, a.stop_reason) == (b.n_iter, b.n_steps_total,
                                                         b.stop_reason)
