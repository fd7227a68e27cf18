"""The k-means stage on P: quality and time against scikit-learn, on the same P in one run.

For each input P this prints

* the inertia of dkicf's default k-means (``minibatch-lloyd``, k-means||,
  5 restarts) and of its other options, as a ratio to scikit-learn's
  ``KMeans(n_init=10)`` on the same P (target <= 1.005), and to
  ``MiniBatchKMeans(n_init=3)``;
* their times, as ratios to ``KMeans(n_init=10)`` (target: no slower at equal
  quality) and to ``MiniBatchKMeans(n_init=3)``, on the numpy backend and on
  a dask LocalCluster of 2 workers x 1 thread (P persisted on the workers);
* the passes over P each option made, and the default's time as a share of
  the factorization's (target <= 30%).

Inputs: P of PenDigits (s = 50, gamma 2^-16 on the raw features) and of MNIST
(s = 100, gamma 2^-6 on pixels / 255) from the paper's data files (skipped when
absent), and P of 10 Gaussian blobs in 16-D (gamma 0.02, s = 150, ``--n`` rows,
default 2e6).  Every method runs on the same P, one after the other.

``--restarts`` times the default with 1, 2, 3, 5 and 10 restarts instead
(numpy backend): what restarts cost now that they share their passes.

``--equal-runs`` times the default against itself computing every restart's
centres in each Lloyd pass even where two restarts hold the same centres
(as before such restarts shared one product), taking turns, twice: the sets
of centres each Lloyd pass computed, the Lloyd passes' time and the ratio.

Run: python benchmarks/bench_kmeans.py [--n 2000000] [--skip-dask] [--quick] [--restarts]
     [--equal-runs] [--only pendigits mnist synthetic]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np


def _factor(X, gamma, rank):
    from dkicf import incomplete_cholesky

    t0 = time.perf_counter()
    icf = incomplete_cholesky(X, gamma=gamma, max_rank=rank, tol=0.0)
    return np.ascontiguousarray(icf.P), time.perf_counter() - t0


def _inputs(names, n):
    from dkicf.datasets import load_dataset

    for key, label, gamma, rank in (("pendigits", "PenDigits s=50", 2.0**-16, 50),
                                    ("mnist", "MNIST s=100", 2.0**-6, 100)):
        if key not in names:
            continue
        try:  # scaled as the paper's gamma assumes (MNIST / 255)
            X, _ = load_dataset(key, download=False)
        except (OSError, ValueError) as exc:
            print(f"{label} skipped: {exc}")
            continue
        yield label, *_factor(np.asarray(X, np.float64), gamma, rank), 10
    if "synthetic" in names:
        rng = np.random.default_rng(0)
        centres, y = rng.normal(0, 4, (10, 16)), rng.integers(0, 10, n)
        X = centres[y] + rng.normal(0, 1, (n, 16))
        yield f"blobs n={n:.0e} s=150", *_factor(X, 0.02, 150), 10


class _Passes:
    """Counts the passes over P that dkicf's k-means makes (both backends)."""

    def __init__(self):
        km = sys.modules["dkicf._kmeans_tasks"]  # the numpy and dask k-means backends
        self.count = 0
        for backend in (km._NumpyBackend, km._DaskBackend):
            for name in ("lloyd_pass", "full_pass"):
                self._wrap(backend, name)
        self._wrap(km._NumpyBackend, "nearest_update")
        # The dask backend sends k-means|| as one graph: a pass per round and the first.
        self._wrap(km._DaskBackend, "parallel_candidates", lambda a: len(a[2]) + 1)

    def _wrap(self, cls, name, passes=lambda args: 1):
        original = getattr(cls, name, None)
        if original is None:  # an earlier dkicf, run for a comparison: its own methods count
            return

        def counted(obj, *args, **kwargs):
            self.count += passes(args)
            return original(obj, *args, **kwargs)

        setattr(cls, name, counted)


def _held(client, P):
    """P held on the workers (8 chunks) before a clock starts, in chunks the workers
    allocated (as the factorization leaves it), not buffers of the transfer that
    brought it."""
    import dask.array as da
    from distributed import wait

    held = client.persist(da.from_array(P, chunks=(-(-P.shape[0] // 8), -1))
                          .map_blocks(np.array, copy=True))
    wait(held)
    return held


def _equal_runs(kmeans, P, k, client, seed) -> None:
    """The default with and without equal restarts sharing one product, taking turns."""
    runs_mod = sys.modules["dkicf._kmeans_runs"]
    tasks = sys.modules["dkicf._kmeans_tasks"]
    shared = runs_mod._same_centers
    timed: list[tuple[int, float]] = []
    for cls in (tasks._NumpyBackend, tasks._DaskBackend):
        def lloyd_pass(obj, centers, n_far, real=cls.lloyd_pass):
            t0 = time.perf_counter()
            out = real(obj, centers, n_far)
            timed.append((len(centers), time.perf_counter() - t0))
            return out

        cls.lloyd_pass = lloyd_pass
    data = {"numpy": P}
    if client is not None:
        data["dask 2x1"] = _held(client, P)
    print("| backend | equal restarts | time (s) | Lloyd passes (s) | centre sets a pass "
          "| inertia |")
    print("|---|---|---|---|---|---|")
    lloyd: dict = {}
    for _ in range(2):
        for mode in ("share one product", "apart"):
            runs_mod._same_centers = shared if mode != "apart" else (
                lambda centers: [(i, None) for i in range(len(centers))])
            for backend, x in data.items():
                timed.clear()
                res, t = _time(kmeans, x, k, random_state=seed,
                               client=None if backend == "numpy" else client)
                spent = sum(dt for _, dt in timed)
                lloyd.setdefault((backend, mode), []).append(spent)
                print(f"| {backend} | {mode} | {t:.2f} | {spent:.2f} "
                      f"| {[n for n, _ in timed]} | {res.inertia:.10g} |", flush=True)
    runs_mod._same_centers = shared
    for backend in data:
        ratio = min(lloyd[backend, "apart"]) / min(lloyd[backend, "share one product"])
        print(f"{backend}: Lloyd passes apart / shared, best of two: {ratio:.2f}")


def _time(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=float, default=2e6, help="rows of the synthetic P")
    parser.add_argument("--only", nargs="+", default=["pendigits", "mnist", "synthetic"],
                        choices=["pendigits", "mnist", "synthetic"])
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="the default and the former default only (no other options)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarts", action="store_true",
                        help="the default with n_init = 1, 2, 3, 5, 10 (numpy backend only)")
    parser.add_argument("--equal-runs", action="store_true",
                        help="the default against itself computing equal restarts apart")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)
    warnings.filterwarnings("ignore", message="Sending large graph")

    from sklearn.cluster import KMeans, MiniBatchKMeans

    from dkicf import local_cluster
    from dkicf.kmeans import kmeans

    passes = _Passes()
    client = None if args.skip_dask else local_cluster(2, 1)
    if args.equal_runs:
        try:
            for name, P, _, k in _inputs(args.only, int(args.n)):
                print(f"\n## {name}: P {P.shape[0]} x {P.shape[1]}, k = {k}")
                _equal_runs(kmeans, P, k, client, args.seed)
        finally:
            if client is not None:
                cluster = client.cluster
                client.close()
                cluster.close()
        return
    options = [
        ("default (minibatch-lloyd, k-means||, 5)", {}),
        ("minibatch-lloyd, k-means++, 5", {"init": "k-means++"}),
        ("minibatch-lloyd, k-means||, 3", {"n_init": 3}),
        ("minibatch, k-means||, 5", {"algorithm": "minibatch"}),
        ("minibatch, k-means++, 3 (the old default)",
         {"algorithm": "minibatch", "init": "k-means++", "n_init": 3}),
        ("lloyd, k-means||, 5", {"algorithm": "lloyd"}),
    ]
    if args.quick:
        options = [options[0], options[4]]
    if args.restarts:  # what restarts cost: the default with 1 to 10 of them, numpy only
        options = [(f"default, n_init={r}", {"n_init": r}) for r in (1, 2, 3, 5, 10)]
    try:
        for name, P, t_icf, k in _inputs(args.only, int(args.n)):
            print(f"\n## {name}: P {P.shape[0]} x {P.shape[1]}, k = {k}; "
                  f"factorization {t_icf:.2f} s (numpy backend)")
            ref, t_ref = _time(KMeans(k, n_init=10, random_state=args.seed).fit, P)
            mbk, t_mbk = _time(MiniBatchKMeans(k, n_init=3, random_state=args.seed).fit, P)
            mbk_inertia = float(((P - mbk.cluster_centers_[mbk.predict(P)]) ** 2).sum())
            print(f"scikit-learn KMeans(n_init=10): {t_ref:.2f} s, inertia {ref.inertia_:.6g}")
            print(f"scikit-learn MiniBatchKMeans(n_init=3): {t_mbk:.2f} s, inertia ratio "
                  f"{mbk_inertia / ref.inertia_:.4f}")
            print("| k-means | backend | inertia / KMeans(10) | time (s) | / KMeans(10) "
                  "| / MiniBatchKMeans(3) | passes over P | share of ICF |")
            print("|---|---|---|---|---|---|---|---|")
            runs = [(label, kw, "numpy") for label, kw in options]
            if client is not None and not args.restarts:
                runs.insert(1, (options[0][0], {}, "dask 2x1"))
            Pd = None
            for label, kw, backend in runs:
                data = P
                if backend != "numpy":
                    if Pd is None:
                        Pd = _held(client, P)
                    data = Pd
                before = passes.count
                res, t = _time(kmeans, data, k, random_state=args.seed,
                               client=client if backend != "numpy" else None, **kw)
                print(f"| {label} | {backend} | {res.inertia / ref.inertia_:.4f} | {t:.2f} "
                      f"| {t / t_ref:.2f} | {t / t_mbk:.2f} | {passes.count - before} "
                      f"| {t / t_icf:.0%} |", flush=True)
            del Pd
    finally:
        if client is not None:
            cluster = client.cluster
            client.close()
            cluster.close()


if __name__ == "__main__":
    main()
