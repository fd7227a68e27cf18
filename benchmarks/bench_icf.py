"""ICF speed against the memory-bandwidth floor, and dask against numpy.

For n = 1e6, d = 16, s = 100 (float64) this prints

* milliseconds per ICF iteration of the numpy backend, against the
  milliseconds of one plain pass ``X @ v`` plus ``P[:, :i] @ u`` over the same
  arrays at the same ranks i = 1..s (ratio; target <= 1.3);
* milliseconds per iteration of the dask backend on a LocalCluster of
  2 workers x 1 thread, against the numpy backend (ratio; target <= 1.5).

Run: python benchmarks/bench_icf.py [--n 1000000] [--d 16] [--rank 100]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def baseline_pass(X, P, rng) -> float:
    """Seconds of X @ v + P[:, :i] @ u for i = 1..s (what one ICF iteration must read)."""
    s = P.shape[1]
    v = rng.normal(size=X.shape[1])
    us = [rng.normal(size=i) for i in range(1, s + 1)]
    t0 = time.perf_counter()
    for i in range(1, s + 1):
        X @ v
        P[:, :i] @ us[i - 1]
    return time.perf_counter() - t0


def main(argv=None) -> None:
    import dask.array as da

    from dkicf import incomplete_cholesky, local_cluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--rank", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.05)
    p.add_argument("--chunks", type=int, default=8, help="row chunks of the dask array")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(args.n, args.d))
    s = args.rank
    print(f"n={args.n} d={args.d} s={s} float64")

    best_np = np.inf
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = incomplete_cholesky(X, gamma=args.gamma, max_rank=s, tol=0)
        best_np = min(best_np, time.perf_counter() - t0)
    assert res.rank == s, res.stop_reason
    P = res.P  # Fortran-ordered view: P[:, :i] is contiguous
    best_base = min(baseline_pass(X, P, rng) for _ in range(args.repeats))
    ms_np, ms_base = 1000 * best_np / s, 1000 * best_base / s
    print(f"numpy backend : {ms_np:8.2f} ms/iteration ({best_np:.2f} s for {s} iterations)")
    print(f"plain pass    : {ms_base:8.2f} ms/iteration (X @ v + P[:, :i] @ u)")
    print(f"ratio numpy / plain pass = {ms_np / ms_base:.2f}  (target <= 1.3)")
    del P, res

    client = local_cluster(2, 1, memory_limit="8GiB")
    try:
        from distributed import wait

        # X in worker memory before timing, as a Zarr-backed array would be after its first read.
        Xd = client.persist(da.from_array(X, chunks=(-(-args.n // args.chunks), args.d)))
        wait(Xd)
        best_dk = np.inf
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rd = incomplete_cholesky(Xd, gamma=args.gamma, max_rank=s, tol=0, client=client)
            best_dk = min(best_dk, time.perf_counter() - t0)
            del rd
        ms_dk = 1000 * best_dk / s
        print(f"dask backend  : {ms_dk:8.2f} ms/iteration (2 workers x 1 thread, "
              f"{args.chunks} chunks)")
        print(f"ratio dask / numpy = {ms_dk / ms_np:.2f}  (target <= 1.5)")
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
