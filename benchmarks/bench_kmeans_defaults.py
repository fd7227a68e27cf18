"""The measurements behind the k-means defaults: quality over many seeds, and the cost.

For each setting of the k-means (an algorithm, an init, a number of restarts,
and k-means||'s oversampling and rounds) this prints

* **misses**: over two rings (1,000 points, radii 1 and 3, noise 0.1,
  gamma 0.5, s = 60) and 12 blobs in 8-D (3,000 points, gamma 0.05,
  s = 100), three data seeds each and ``--seeds`` k-means seeds per data
  set, the fits whose inertia is above 1.005 times scikit-learn's
  ``KMeans(n_init=10)`` on the same P (``P = transform(X)`` of a
  ``KernelKMeans`` fit), and the worst ratio;
* **far rows**: over ``--far-seeds`` seeds, how often the fit isolates 4 far
  rows among 20,000 (10 Gaussian blobs in 8-D, k = 11): the small cluster
  that a sample of P misses;
* **time**: the k-means on a 500,000 x 150 P of 10 blobs (numpy backend),
  and its k-means|| part.

``docs/kmeans.md`` ("Why these defaults") reports its figures.

Run: python benchmarks/bench_kmeans_defaults.py [--seeds 10] [--far-seeds 32] [--quick]
     [--only 0 2 3]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

BAR = 1.005


def _rings(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 1000)
    angle = rng.uniform(0, 2 * np.pi, y.size)
    radius = np.where(y == 0, 1.0, 3.0)
    X = np.c_[radius * np.cos(angle), radius * np.sin(angle)] + rng.normal(0, 0.1, (y.size, 2))
    return X, 2, {"gamma": 0.5, "rank": 60}


def _blobs(seed):
    from sklearn.datasets import make_blobs

    X, _ = make_blobs(3000, n_features=8, centers=12, random_state=seed)
    return X, 12, {"gamma": 0.05, "rank": 100}


def _far_rows():
    rng = np.random.default_rng(0)
    centres, y = rng.normal(0, 4, (10, 8)), rng.integers(0, 10, 20000)
    return np.concatenate([centres[y] + rng.normal(0, 1, (y.size, 8)),
                           rng.normal(0, 1, (4, 8)) + 30])


def _isolates_last(labels, m):
    labels = np.asarray(labels)
    return len(set(labels[-m:])) == 1 and bool((labels[:-m] != labels[-1]).all())


def _factors():
    """P and the reference inertia of every data set (computed once)."""
    from sklearn.cluster import KMeans

    from dkicf import KernelKMeans

    out = []
    for make in (_rings, _blobs):
        for seed in range(3):
            X, k, params = make(seed)
            P = KernelKMeans(k, random_state=seed, **params).fit(X).transform(X)
            ref = KMeans(k, n_init=10, random_state=seed).fit(P).inertia_
            out.append((f"{make.__name__[1:]} {seed}", P, k, ref))
    return out


def _with(rounds, oversampling):
    """Set k-means||'s rounds and oversampling factor; returns the previous values."""
    from dkicf import _kmeans_runs

    old = _kmeans_runs._PARALLEL_ROUNDS, _kmeans_runs._PARALLEL_OVERSAMPLING
    _kmeans_runs._PARALLEL_ROUNDS, _kmeans_runs._PARALLEL_OVERSAMPLING = rounds, oversampling
    return old


def _measure(kw, rounds, oversampling, factors, seeds, far_seeds, big):
    from dkicf import _kmeans_tasks
    from dkicf.kmeans import kmeans

    old = _with(rounds, oversampling)
    try:
        misses, worst = 0, 0.0
        for _, P, k, ref in factors:
            for s in range(seeds):
                ratio = kmeans(P, k, random_state=s, **kw).inertia / ref
                misses += ratio > BAR
                worst = max(worst, ratio)
        far = _far_rows()
        found = sum(_isolates_last(kmeans(far, 11, random_state=s, **kw).labels, 4)
                    for s in range(far_seeds))
        spent = [0.0]
        real = _kmeans_tasks._NumpyBackend.parallel_candidates

        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        _kmeans_tasks._NumpyBackend.parallel_candidates = timed
        try:
            t0 = time.perf_counter()
            kmeans(big, 10, random_state=0, **kw)
            total = time.perf_counter() - t0
        finally:
            _kmeans_tasks._NumpyBackend.parallel_candidates = real
    finally:
        _with(*old)
    return misses, len(factors) * seeds, worst, found, total, spent[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="k-means seeds per data set")
    parser.add_argument("--far-seeds", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="the default and one variant")
    parser.add_argument("--only", type=int, nargs="+", help="settings by their row number")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)
    settings = [
        ("k-means|| with l = 2k, 5 rounds", {}, 5, 2),
        ("k-means|| with l = k, 5 rounds", {}, 5, 1),
        ("default: minibatch-lloyd, k-means|| (l = 2k, 3 rounds), 5", {}, 3, 2),
        ("k-means|| with l = k, 3 rounds", {}, 3, 1),
        ("k-means++ on a sample, 5", {"init": "k-means++"}, 3, 2),
        ("3 restarts", {"n_init": 3}, 3, 2),
        ("lloyd from k-means|| (no mini-batch steps), 5", {"algorithm": "lloyd"}, 3, 2),
    ]
    if args.quick:
        settings = settings[2:4]
    elif args.only:
        settings = [settings[i] for i in args.only]
    rng = np.random.default_rng(0)
    centres, y = rng.normal(0, 4, (10, 150)), rng.integers(0, 10, 500_000)
    big = centres[y] + rng.normal(0, 1, (y.size, 150))
    factors = _factors()
    print(f"{len(factors)} data sets x {args.seeds} k-means seeds; far rows over "
          f"{args.far_seeds} seeds; time on a 500,000 x 150 P (numpy backend)")
    print("| setting | fits above 1.005 x KMeans(10) | worst ratio | far rows isolated "
          "| time (s) | of which k-means|| (s) |")
    print("|---|---|---|---|---|---|")
    for label, kw, rounds, oversampling in settings:
        misses, fits, worst, found, total, kmpar = _measure(
            kw, rounds, oversampling, factors, args.seeds, args.far_seeds, big)
        print(f"| {label} | {misses} / {fits} | {worst:.4f} | {found} / {args.far_seeds} "
              f"| {total:.2f} | {kmpar:.2f} |", flush=True)


if __name__ == "__main__":
    main()
