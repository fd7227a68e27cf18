"""Pivot rules compared: passes over X, wall time, trace error and clustering accuracy.

For each rank s this runs, on the same data, the paper's sequential greedy
rule (one pass over X per pivot), block greedy (the same pivots, a block per
pass) and blocked RPCholesky, and prints for each

* the passes over X (``n_passes``, counting the pass for the diagonal),
* the wall time of the factorization,
* the final trace error ``tr(K - P P^T)``,
* the clustering accuracy of k-means on P (scikit-learn ``KMeans(10,
  n_init=3)``, accuracy by Hungarian matching of clusters to labels),

then the ratios greedy / block greedy of passes and time and whether block
greedy's pivots are identical to greedy's (target at s = 500 on MNIST, numpy
backend: identical pivots, >= 10x fewer passes, >= 5x less time).

``--repeats R`` runs the rules R times, interleaved (greedy, block greedy,
RPCholesky, greedy, ...), and reports the median wall time with the range,
and the time ratio of the medians with the range and the median of the
per-round ratios (each round's rules run moments apart): on a shared machine
one run of each can be off by a third either way.

Default data: MNIST (``/work/shared/data/mnist.npz`` or ``--data``), X / 255,
Gaussian kernel with gamma = 2**-6.  ``--zarr`` instead writes a random dask
array to a temporary Zarr store and factorizes it on a LocalCluster of
2 workers with ``persist=False``, so every pass re-reads X from Zarr.
``--zarr-mnist C`` writes C copies of MNIST (/ 255) to the Zarr store
instead: the images as they are, then shifted by one pixel (right, left,
down, up, then diagonally), with their labels, so that the clustering
accuracy means something on data larger than the workers' memory.  The
accuracy on a Zarr P comes from dkicf's distributed k-means (10 clusters,
3 restarts), which never gathers P.

Run: python benchmarks/bench_pivoting.py [--n 60000] [--sizes 100 500 1000] [--repeats 5]
     python benchmarks/bench_pivoting.py --zarr [--zarr-n 400000] [--zarr-d 32] [--sizes 100]
     python benchmarks/bench_pivoting.py --zarr --zarr-n 1500000 --zarr-d 512 \
         --zarr-dtype float32 --chunks 64 --memory-limit 1GiB --sizes 100
         (X 3.07 GB, 1.43x the workers' memory; add --p-store when P does not fit either)
     python benchmarks/bench_pivoting.py --zarr --zarr-mnist 7 --zarr-dtype float32 \
         --chunks 64 --memory-limit 512MiB --p-store --sizes 100 500 1000
         (MNIST and 6 shifted copies, 420,000 x 784, 1.32 GB: 1.23x the workers' memory)
     python benchmarks/bench_pivoting.py ... --rules block-greedy rpcholesky
         (skip the sequential rule where its one pass per pivot would take hours)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

RULES = ("greedy", "block-greedy", "rpcholesky")
MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist.npz"


def load_mnist(path: Path, n: int | None, seed: int):
    data = np.load(path)
    X, y = data["X"], data["y"]
    if n is not None and n < X.shape[0]:
        idx = np.sort(np.random.default_rng(seed).choice(X.shape[0], size=n, replace=False))
        X, y = X[idx], y[idx]
    return np.asarray(X, dtype=np.float64) / 255.0, y


SHIFTS = ((0, 0), (0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (-1, -1), (1, -1), (-1, 1))


def shifted(images: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """28 x 28 images (one per row) moved by (dy, dx) pixels, zeros coming in."""
    img = images.reshape(-1, 28, 28)
    out = np.zeros_like(img)
    ys, yd = (slice(0, 28 - dy), slice(dy, 28)) if dy >= 0 else (slice(-dy, 28), slice(0, 28 + dy))
    xs, xd = (slice(0, 28 - dx), slice(dx, 28)) if dx >= 0 else (slice(-dx, 28), slice(0, 28 + dx))
    out[:, yd, xd] = img[:, ys, xs]
    return out.reshape(images.shape)


def write_mnist_copies(path: str, data: Path, copies: int, chunks: int, dtype: str):
    """MNIST / 255 and ``copies - 1`` shifted copies in one Zarr array; returns the labels."""
    import zarr

    if not 1 <= copies <= len(SHIFTS):
        raise SystemExit(f"--zarr-mnist takes 1 to {len(SHIFTS)} copies, got {copies}")
    X, y = load_mnist(data, None, 0)
    X = X.astype(dtype)
    n = copies * X.shape[0]
    z = zarr.create_array(store=path, shape=(n, X.shape[1]), chunks=(-(-n // chunks), X.shape[1]),
                          dtype=dtype)
    for c, (dy, dx) in enumerate(SHIFTS[:copies]):
        z[c * X.shape[0]:(c + 1) * X.shape[0]] = shifted(X, dy, dx)
    return np.tile(y, copies)


def accuracy(P, y, seed: int, client=None) -> float:
    """Clustering accuracy of 10-means on P: scikit-learn for numpy, dkicf's k-means for dask."""
    from dkicf.metrics import clustering_accuracy

    if isinstance(P, np.ndarray):
        from sklearn.cluster import KMeans

        labels = KMeans(10, n_init=3, random_state=seed).fit_predict(P)
    else:
        from dkicf import kmeans

        # P may be larger than the workers' memory (it is in Zarr): read per pass.
        labels = np.asarray(
            kmeans(P, 10, n_init=3, random_state=seed, client=client, persist=False).labels
        )
    return clustering_accuracy(y, labels)


def run_rules(X, s: int, repeats: int, rules=RULES, **kwargs):
    """Each rule ``repeats`` times, interleaved: ``{rule: (result, [seconds, ...])}``.

    Only the last round's results are kept (the rules are deterministic for a
    seed).  Earlier results are dropped before the next run starts, so that no
    run is timed while the harness still holds the previous run's P: each
    run's P then reuses memory freed moments before, as in a process that
    fits again.  On a virtual machine whose balloon driver reports free pages
    to the host, memory freed more than about two seconds earlier costs
    ~1.6 ms/MB to touch again (0.4 s for P at s = 500 on MNIST); held
    results made every run pay that, by a varying amount.
    """
    secs: dict[str, list[float]] = {rule: [] for rule in rules}
    kept = {}
    for r in range(repeats):
        for rule in rules:
            res, sec = run(X, s, rule, **kwargs)
            secs[rule].append(sec)
            if r == repeats - 1:
                kept[rule] = res
            del res
    return {rule: (kept[rule], secs[rule]) for rule in rules}


def run(X, s: int, rule: str, p_store_dir: str | None = None, **kwargs):
    """One factorization and its wall time; with ``p_store_dir``, P goes to a new Zarr there."""
    from dkicf import incomplete_cholesky

    if p_store_dir is not None:
        kwargs["p_store"] = tempfile.mkdtemp(dir=p_store_dir, suffix=".zarr")
    t0 = time.perf_counter()
    res = incomplete_cholesky(X, max_rank=s, tol=0, pivoting=rule, **kwargs)
    return res, time.perf_counter() - t0


def report(s, results, y, seed, client=None):
    print(f"\ns = {s}")
    print(f"  {'rule':<13}{'rank':>6}{'passes':>8}{'time (s)':>10}{'range':>14}"
          f"{'trace error':>14}{'ACC':>8}   blocks")
    for rule, (res, secs) in results.items():
        acc = f"{accuracy(res.P, y, seed, client):8.4f}" if y is not None else f"{'-':>8}"
        sizes = res.info.get("block_sizes")
        blocks = "" if sizes is None else f"{len(sizes)} (largest {max(sizes, default=0)})"
        spread = f"{min(secs):.2f}-{max(secs):.2f}" if len(secs) > 1 else ""
        print(f"  {rule:<13}{res.rank:>6}{res.n_passes:>8}{np.median(secs):>10.2f}{spread:>14}"
              f"{res.trace_errors[-1]:>14.6g}{acc}   {blocks}")
    if "greedy" not in results or "block-greedy" not in results:
        return
    g, g_secs = results["greedy"]
    b, b_secs = results["block-greedy"]
    g_sec, b_sec = float(np.median(g_secs)), float(np.median(b_secs))
    rounds = [gs / bs for gs, bs in zip(g_secs, b_secs)]
    same = g.pivots.shape == b.pivots.shape and bool(np.array_equal(g.pivots, b.pivots))
    k = min(g.rank, b.rank)
    trace_gap = float(np.max(np.abs(g.trace_errors[:k] - b.trace_errors[:k]))) if k else 0.0
    print(f"  greedy / block-greedy: passes {g.n_passes / b.n_passes:.1f}x, "
          f"time {g_sec / b_sec:.2f}x (medians of {len(g_secs)} runs"
          + (f"; per round {min(rounds):.2f}-{max(rounds):.2f}x, median "
             f"{float(np.median(rounds)):.2f}x" if len(rounds) > 1 else "")
          + f"); pivots identical: {same} (max |trace error difference| {trace_gap:.1e})")


def _random_chunks(rng: np.random.Generator, n: int) -> tuple:
    """1 to 6 row chunks of random lengths."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(int(rng.integers(0, 6)), n - 1),
                              replace=False)) if n > 1 else np.array([], dtype=int)
    return tuple(int(v) for v in np.diff(np.concatenate([[0], cuts, [n]])))


def random_cases(count: int, seed: int, on_dask: bool = False) -> None:
    """``--random-cases``: block greedy against greedy on random, often degenerate data
    (numpy backend); the pivots identical, or where they differ, why.

    ``on_dask``: instead, each case's rule (greedy or block greedy, drawn) on
    the numpy backend against the dask backend, X in 1 to 6 row chunks of
    random lengths on a local cluster of 2 workers.  A difference there may
    also be another copy of the same row: duplicated rows whose residuals
    the products' rounding separates by their place in a chunk.
    """
    import sys
    import warnings

    from dkicf import incomplete_cholesky

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_pivot_properties import random_case, why_they_differ

    rng = np.random.default_rng(seed)
    found = {"identical": 0, "copies": 0, "tie": 0, "stop": 0, "unexplained": 0}
    p_gap, started = 0.0, time.perf_counter()
    client = None
    if on_dask:
        import dask.array as da

        from dkicf.deploy import local_cluster

        client = local_cluster(2, 1)
    try:
        for case in range(count):
            kind, X, options = random_case(rng)
            rules = ("greedy", "block-greedy")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # rank-deficient kernels warn
                if on_dask:
                    rule = rules[int(rng.integers(0, 2))]
                    chunks = _random_chunks(rng, X.shape[0])
                    g = incomplete_cholesky(X, pivoting=rule, **options)
                    b = incomplete_cholesky(da.from_array(X, chunks=(chunks, X.shape[1])),
                                            pivoting=rule, client=client, **options)
                    b.pivots, b.P = np.asarray(b.pivots), np.asarray(b.P)
                else:
                    g, b = (incomplete_cholesky(X, pivoting=r, **options) for r in rules)
            why = why_they_differ(X, options, g, b)
            found[why] += 1
            if why == "identical" and g.rank:
                scale = max(1.0, float(np.abs(g.P).max()))
                p_gap = max(p_gap, float(np.abs(g.P - b.P).max()) / scale)
            if why in ("identical", "copies"):
                continue
            first = next((i for i, (u, v) in enumerate(zip(g.pivots, b.pivots)) if u != v),
                         min(g.rank, b.rank))
            print(f"  case {case}: {kind} {X.shape[0]} x {X.shape[1]}, {options}"
                  + (f", {rule}, chunks {chunks}" if on_dask else "")
                  + f": ranks {g.rank} and {b.rank}, first difference at pivot {first}: {why}")
    finally:
        if client is not None:
            cluster = client.cluster
            client.close()
            cluster.close()
    what = "numpy against dask" if on_dask else "greedy against block greedy"
    print(f"{count} random cases, {what} (seed {seed}, {time.perf_counter() - started:.0f} s): "
          f"pivots identical in {found['identical']} (P within {p_gap:.1e} of the largest "
          f"entry); other copies of the same rows in {found['copies']}; different at a tie "
          f"within rounding in {found['tie']}, at a stop within rounding in "
          f"{found['stop']}; unexplained in {found['unexplained']}")


def bench_numpy(args) -> None:
    X, y = load_mnist(args.data, args.n, args.seed)
    print(f"MNIST n={X.shape[0]} d={X.shape[1]} gamma=2**-6, numpy backend, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for s in args.sizes:
        results = run_rules(X, s, args.repeats, args.rules, gamma=2.0**-6,
                            random_state=args.seed)
        report(s, results, y, args.seed)


def bench_zarr(args) -> None:
    import dask.array as da
    from dask.utils import parse_bytes

    from dkicf import local_cluster

    client = local_cluster(2, 1, memory_limit=args.memory_limit)
    try:
        with tempfile.TemporaryDirectory(prefix="dkicf-bench-") as tmp:
            path = os.path.join(tmp, "X.zarr")
            if args.zarr_mnist:
                y = write_mnist_copies(path, args.data, args.zarr_mnist, args.chunks,
                                       args.zarr_dtype)
                gamma, what = 2.0**-6, f"MNIST / 255 in {args.zarr_mnist} shifted copies"
            else:
                y = None
                rs = da.random.RandomState(args.seed)
                chunk = -(-args.zarr_n // args.chunks)
                X = rs.normal(size=(args.zarr_n, args.zarr_d), chunks=(chunk, args.zarr_d))
                da.to_zarr(X.astype(args.zarr_dtype), path)
                gamma, what = 1.0 / (2 * args.zarr_d), "random normal"
            Xz = da.from_zarr(path)
            memory = 2 * parse_bytes(args.memory_limit)
            print(f"Zarr {what} n={Xz.shape[0]} d={Xz.shape[1]} {args.zarr_dtype} in "
                  f"{Xz.numblocks[0]} chunks ({Xz.nbytes / 1e9:.2f} GB, "
                  f"{Xz.nbytes / memory:.2f}x the workers' memory), gamma={gamma:g}, "
                  f"LocalCluster 2 workers x 1 thread x {args.memory_limit}, persist=False "
                  f"(X re-read every pass)" + (", P in Zarr" if args.p_store else ""))
            for s in args.sizes:
                # With --p-store each run writes its own P, and every pass streams
                # P's flushed columns back.
                results = run_rules(Xz, s, args.repeats, args.rules, gamma=gamma,
                                    client=client,
                                    persist=False, random_state=args.seed,
                                    p_store_dir=tmp if args.p_store else None)
                report(s, results, y, args.seed, client)
                results.clear()  # release P's chunks on the workers before the next run
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=MNIST, help="MNIST .npz with X and y")
    p.add_argument("--n", type=int, default=None, help="subsample this many MNIST rows")
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 1000])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each rule, interleaved; medians are reported")
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES),
                   help="pivot rules to run (the comparison needs greedy and block-greedy)")
    p.add_argument("--zarr", action="store_true",
                   help="random data in Zarr on a LocalCluster, persist=False")
    p.add_argument("--zarr-n", type=int, default=400_000)
    p.add_argument("--zarr-mnist", type=int, default=0, metavar="C",
                   help="--zarr with C copies of MNIST (1-9; shifted by one pixel) instead of "
                        "random data, so that ACC is measured")
    p.add_argument("--zarr-d", type=int, default=32)
    p.add_argument("--zarr-dtype", default="float64", choices=["float32", "float64"])
    p.add_argument("--p-store", action="store_true",
                   help="--zarr only: keep P in Zarr (for data larger than the workers' memory)")
    p.add_argument("--chunks", type=int, default=8, help="row chunks of the Zarr array")
    p.add_argument("--memory-limit", default="4GiB", help="per worker, --zarr only")
    p.add_argument("--random-cases", type=int, default=0, metavar="N",
                   help="instead: block greedy against greedy on N random cases (normal and "
                        "duplicated rows, blobs, integer grids; three kernels)")
    p.add_argument("--on-dask", action="store_true",
                   help="with --random-cases: the numpy backend against dask, X in random "
                        "row chunks on 2 local workers")
    args = p.parse_args(argv)
    if args.random_cases:
        random_cases(args.random_cases, args.seed, args.on_dask)
    elif args.zarr:
        bench_zarr(args)
    else:
        bench_numpy(args)


if __name__ == "__main__":
    main()
