"""Synthetic datasets: slices equal the whole, geometry of the paper's three sets."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.sparse.csgraph import minimum_spanning_tree
from scipy.spatial.distance import cdist
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

from dkicf import synthetic
from dkicf.synthetic import (
    generate_rows,
    kind_info,
    make_blobs,
    make_parabolic,
    make_ring,
    make_spheres,
    make_zigzag,
)

PAPER_SETS = [(make_ring, 2.0**4), (make_parabolic, 2.0**1), (make_zigzag, 2.0**3)]
KIND_PARAMS = {
    "ring": {},
    "parabolic": {"noise": 0.2},
    "zigzag": {},
    "blobs": {"n_features": 5, "centers": 4, "cluster_std": [0.5, 1.0, 1.5, 2.0]},
    "spheres": {"n_features": 4, "shells": 3},
}


# --------------------------------------------------------------------------
# a reference exact kernel k-means on the full kernel matrix


def _kernel_kmeans(K: np.ndarray, k: int, *, n_init: int, seed: int, max_iter: int = 200):
    """Lloyd iterations in feature space from kernel k-means++ starts; best objective wins.

    The squared feature-space distance of point i to the mean of cluster c is
    ``K_ii - 2 mean_{j in c} K_ij + mean_{j, l in c} K_jl``; the objective is
    the sum over points of that distance to their own cluster.
    """
    rng = np.random.default_rng(seed)
    n = K.shape[0]
    diag = np.diag(K)
    best_obj, best_labels = np.inf, None
    for _ in range(n_init):
        first = rng.integers(n)
        seeds = [first]
        closest = diag - 2 * K[:, first] + K[first, first]
        for _ in range(1, k):
            p = np.maximum(closest, 0)
            nxt = rng.choice(n, p=p / p.sum())
            seeds.append(nxt)
            closest = np.minimum(closest, diag - 2 * K[:, nxt] + K[nxt, nxt])
        dist = np.stack([diag - 2 * K[:, s] + K[s, s] for s in seeds], axis=1)
        labels = dist.argmin(axis=1)
        for _ in range(max_iter):
            dist = np.full((n, k), np.inf)
            for c in range(k):
                member = labels == c
                m = member.sum()
                if m:
                    spread = K[np.ix_(member, member)].sum() / m**2
                    dist[:, c] = diag - 2 * K[:, member].sum(axis=1) / m + spread
            new = dist.argmin(axis=1)
            if np.array_equal(new, labels):
                break
            labels = new
        obj = dist[np.arange(n), labels].sum()
        if obj < best_obj:
            best_obj, best_labels = obj, labels
    return best_labels, best_obj


def _objective(K: np.ndarray, labels: np.ndarray) -> float:
    within = sum(K[np.ix_(labels == c, labels == c)].sum() / (labels == c).sum()
                 for c in np.unique(labels))
    return float(np.trace(K) - within)


def _accuracy(y, labels) -> float:
    """Best two-class matching accuracy."""
    agree = float(np.mean(y == labels))
    return max(agree, 1 - agree)


def test_reference_kernel_kmeans_matches_kmeans_with_a_linear_kernel():
    X, y = make_blobs(300, centers=[[0, 0], [6, 0], [0, 6]], cluster_std=0.7, random_state=3)
    labels, obj = _kernel_kmeans(X @ X.T, 3, n_init=5, seed=0)
    km = KMeans(3, n_init=5, random_state=0).fit(X)
    assert adjusted_rand_score(y, labels) == 1.0
    assert adjusted_rand_score(km.labels_, labels) == 1.0
    np.testing.assert_allclose(obj, km.inertia_, rtol=1e-9)
    np.testing.assert_allclose(_objective(X @ X.T, labels), obj, rtol=1e-9)


# --------------------------------------------------------------------------
# the paper's sets


@pytest.mark.parametrize("make, gamma", PAPER_SETS)
def test_paper_sets_need_the_kernel(make, gamma):
    X, y = make(1000, random_state=0)
    assert X.shape == (1000, 2) and X.dtype == np.float64 and y.dtype == np.int64
    K = np.exp(-gamma * cdist(X, X, "sqeuclidean"))
    labels, obj = _kernel_kmeans(K, 2, n_init=10, seed=0)
    assert adjusted_rand_score(y, labels) == 1.0
    # The true partition is the best one the reference finds, not a lucky tie.
    assert obj == pytest.approx(_objective(K, y), rel=1e-12)
    plain = KMeans(2, n_init=10, random_state=0).fit(X).labels_
    assert _accuracy(y, plain) <= 0.9


@pytest.mark.parametrize("make, gamma", PAPER_SETS)
def test_paper_sets_have_a_wide_gap_and_connected_classes(make, gamma):
    X, y = make(1000, random_state=1)
    scale = 1 / np.sqrt(gamma)
    D = cdist(X, X)
    gap = D[np.ix_(y == 0, y == 1)].min()
    assert gap >= 3 * scale
    for c in (0, 1):
        # The longest edge of a spanning tree of the class: the class is one
        # piece at any scale above it.
        longest = minimum_spanning_tree(D[np.ix_(y == c, y == c)]).max()
        assert longest < gap / 5
        assert longest < scale


@pytest.mark.parametrize("make, gamma", PAPER_SETS)
def test_paper_set_gap_holds_for_any_noise_draw(make, gamma):
    # Noise is bounded: the noise-free gap minus 2 * sqrt(2) * noise.
    noise = {make_ring: 0.05, make_parabolic: 0.1, make_zigzag: 0.05}[make]
    X0, y0 = make(4000, random_state=0, noise=0.0)
    X, y = make(4000, random_state=0)
    assert np.abs(X - X0).max() <= noise
    gap0 = cdist(X0[y0 == 0], X0[y0 == 1]).min()
    assert gap0 - 2 * np.sqrt(2) * noise >= 3 / np.sqrt(gamma)


# --------------------------------------------------------------------------
# determinism and chunking


@pytest.mark.parametrize("kind", sorted(KIND_PARAMS))
def test_slices_equal_the_whole(kind):
    params = KIND_PARAMS[kind]
    n = 1001
    X, y = generate_rows(kind, 0, n, n_total=n, random_state=7, **params)
    for bounds in ([0, 1, 2, 500, 1001], [0, 333, 334, 999, 1001], [0, 1001]):
        parts = [generate_rows(kind, a, b, n_total=n, random_state=7, **params)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), X)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    make = getattr(synthetic, f"make_{kind}")
    Xm, ym = make(n, random_state=7, **params)
    np.testing.assert_array_equal(Xm, X)
    np.testing.assert_array_equal(ym, y)


def test_slices_across_internal_blocks_equal_the_whole():
    block = synthetic._BLOCK_ROWS
    n = 2 * block + 10
    X, y = make_blobs(n, n_features=3, random_state=1)
    cuts = [0, 5, block - 1, block + 3, 2 * block, n]
    parts = [generate_rows("blobs", a, b, n_total=n, random_state=1, n_features=3)
             for a, b in zip(cuts[:-1], cuts[1:])]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), X)
    # Rows do not depend on n_total: a shorter dataset is a prefix.
    np.testing.assert_array_equal(make_blobs(100, n_features=3, random_state=1)[0], X[:100])
    # Each block draws from its own stream: no block repeats the numbers of another.
    first = synthetic._row_uniforms(1, 0, 100, 4)
    for start in (block, 2 * block):
        assert not np.isin(synthetic._row_uniforms(1, start, start + 100, 4), first).any()


def test_labels_interleaved_and_balanced_in_every_run():
    _, y = make_blobs(103, centers=4)
    np.testing.assert_array_equal(y, np.arange(103) % 4)
    _, y = generate_rows("spheres", 17, 40, n_total=40, shells=3)
    np.testing.assert_array_equal(y, np.arange(17, 40) % 3)


def test_random_state_changes_data_and_generators_are_accepted():
    a, _ = make_ring(200, random_state=0)
    b, _ = make_ring(200, random_state=1)
    assert not np.allclose(a, b)
    c, _ = make_ring(200, random_state=np.random.default_rng(5))
    d, _ = make_ring(200, random_state=np.random.default_rng(5))
    np.testing.assert_array_equal(c, d)
    e, _ = make_ring(50, random_state=None)
    assert e.shape == (50, 2)


def test_curves_are_covered_evenly_by_any_run_of_rows():
    # A run of 200 rows from the middle already reaches all around the ring.
    X, y = generate_rows("ring", 5000, 5200, n_total=10000, noise=0.0)
    angles = np.sort(np.arctan2(X[y == 1, 1], X[y == 1, 0]))
    gaps = np.diff(np.concatenate([angles, [angles[0] + 2 * np.pi]]))
    assert gaps.max() < 3 * 2 * np.pi / 100


# --------------------------------------------------------------------------
# blobs and spheres


def test_blobs_centres_and_spread():
    centers = [[0, 0, 0], [10, 0, 0]]
    X, y = make_blobs(4000, centers=centers, cluster_std=[0.5, 2.0], random_state=2)
    assert X.shape == (4000, 3)
    for c, std in enumerate([0.5, 2.0]):
        np.testing.assert_allclose(X[y == c].mean(axis=0), centers[c], atol=0.15)
        np.testing.assert_allclose(X[y == c].std(axis=0), std, rtol=0.1)
    # Random centres lie in the box and are the same for every slice.
    Xr, yr = make_blobs(30, n_features=4, centers=3, center_box=(5.0, 6.0), cluster_std=1e-9)
    assert ((Xr > 5.0 - 1e-6) & (Xr < 6.0 + 1e-6)).all()
    np.testing.assert_allclose(Xr[yr == 0], Xr[yr == 0][0][None, :].repeat(10, 0), atol=1e-6)


def test_spheres_radii_and_bounded_noise():
    X, y = make_spheres(3000, n_features=6, shells=3, noise=0.2, random_state=4)
    radius = np.linalg.norm(X, axis=1)
    assert np.abs(radius - (1 + y)).max() <= 0.2
    # Directions are uniform: the mean direction is near zero.
    assert np.abs((X / radius[:, None]).mean(axis=0)).max() < 0.1
    X1, y1 = make_spheres(10, n_features=1, shells=2, noise=0.0)
    np.testing.assert_allclose(np.abs(X1[:, 0]), 1 + y1)


def test_kind_info():
    info = kind_info("blobs", centers=[[0, 0, 0], [1, 1, 1]])
    assert info["n_features"] == 3 and info["n_classes"] == 2
    assert info["params"]["center_box"] == [-10.0, 10.0]
    assert kind_info("ring") == {"n_features": 2, "n_classes": 2, "params": {"noise": 0.05}}
    assert kind_info("spheres", shells=5)["n_classes"] == 5


# --------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: generate_rows("moons", 0, 1, n_total=1), ValueError,
         "unknown synthetic dataset kind 'moons'; valid kinds: blobs, parabolic, ring, spheres"),
        (lambda: generate_rows("ring", 0, 1, n_total=1, centers=3), TypeError,
         "unknown parameter.*centers.*valid: noise"),
        (lambda: generate_rows("ring", 5, 3, n_total=10), ValueError, "start <= stop"),
        (lambda: generate_rows("ring", 0, 11, n_total=10), ValueError, "stop <= n_total"),
        (lambda: generate_rows("ring", 0, 1, n_total=1, random_state=-1), ValueError,
         "random_state must be >= 0"),
        (lambda: generate_rows("ring", 0, 1, n_total=1, random_state=1.5), TypeError,
         "random_state must be a non-negative integer"),
        (lambda: make_ring(10, noise=-1), ValueError, "noise must be a number >= 0"),
        (lambda: make_blobs(10, centers=0), ValueError, "centers must be >= 1"),
        (lambda: make_blobs(10, n_features=3, centers=[[0, 0]]), ValueError,
         r"shape \(k, n_features=3\)"),
        (lambda: make_blobs(10, centers=2, cluster_std=[1, 2, 3]), ValueError,
         "cluster_std must be a number or a sequence of 2"),
        (lambda: make_blobs(10, cluster_std=0), ValueError, "cluster_std must be > 0"),
        (lambda: make_spheres(10, shells=0), ValueError, "shells must be >= 1"),
        (lambda: make_ring(-1), ValueError, "n must be >= 0"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
