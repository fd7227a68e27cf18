"""ICF speed against the memory-bandwidth floor, and dask against numpy.

For n = 1e6, d = 16, s = 100 (float64) this prints

* milliseconds per ICF iteration of the numpy backend, against the
  milliseconds of one plain pass ``X @ v`` plus ``P[:, :i] @ u`` over arrays of
  the same shapes at the same rank i, on one thread per core (ratio; target
  <= 1.3);
* milliseconds per iteration of the dask backend on a LocalCluster of
  2 workers x 1 thread, against the numpy backend (ratio; target <= 1.5);
* the whole factorization to rank s with the default pivot rule
  (block greedy: the same pivots, a block of them per pass), numpy against
  dask: what a user of either backend waits for.

The plain pass runs inside the factorization's progress callback, right after
each iteration, on arrays already in memory: every iteration is paired with
its own baseline, measured moments apart on the same machine, so a noisy
machine slows both alike.  The time an iteration takes is the time between
two callbacks minus the baseline run in between.  The one-off set-up (kernel
diagonal, allocating and faulting in P's memory, first summary) is printed
separately: on a virtual machine the first touch of fresh memory can cost
more than the whole factorization.

Run: python benchmarks/bench_icf.py [--n 1000000] [--d 16] [--rank 100]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


class PairedTimer:
    """Progress callback timing each ICF iteration and a plain pass right after it."""

    def __init__(self, X: np.ndarray, s: int, seed: int = 0):
        import os
        from concurrent.futures import ThreadPoolExecutor

        from threadpoolctl import ThreadpoolController

        rng = np.random.default_rng(seed)
        # The plain pass runs on every core: one thread per core over its share
        # of the rows, each with one BLAS thread (OpenBLAS's own threads would
        # keep spinning after the pass and slow the factorization down).
        self.blas = ThreadpoolController()
        n_threads = len(os.sched_getaffinity(0))
        self.pool = ThreadPoolExecutor(n_threads)
        n = X.shape[0]
        self.bounds = [(k * n // n_threads, (k + 1) * n // n_threads) for k in range(n_threads)]
        self.X = X
        self.P = np.asfortranarray(rng.normal(size=(X.shape[0], s)))  # touched, like a real P
        self.v = rng.normal(size=X.shape[1])
        self.us = [rng.normal(size=i) for i in range(1, s + 1)]
        self.icf: list[float] = []
        self.plain: list[float] = []
        self.start = self.last = None

    def begin(self) -> None:
        self.icf.clear()
        self.plain.clear()
        self.start = self.last = time.perf_counter()

    def __call__(self, progress) -> None:
        now = time.perf_counter()
        if progress.rank > 1:  # the first iteration carries the set-up
            self.icf.append(now - self.last)
        else:
            self.setup = now - self.start
        i = progress.rank
        u = self.us[i - 1]

        def part(lo, hi):
            self.X[lo:hi] @ self.v
            self.P[lo:hi, :i] @ u

        with self.blas.limit(limits=1, user_api="blas"):
            t0 = time.perf_counter()
            for f in [self.pool.submit(part, lo, hi) for lo, hi in self.bounds]:
                f.result()
            t1 = time.perf_counter()
        if progress.rank > 1:
            self.plain.append(t1 - t0)
        self.last = time.perf_counter()

    def ms(self) -> tuple[float, float]:
        return 1000 * float(np.mean(self.icf)), 1000 * float(np.mean(self.plain))


def run(timer: PairedTimer, repeats: int, factorize) -> tuple[float, float, float]:
    """Best ICF ms/iteration over ``repeats`` runs, its paired plain ms and the set-up s."""
    best = None
    for _ in range(repeats):
        timer.begin()
        factorize(timer)
        ms_icf, ms_plain = timer.ms()
        if best is None or ms_icf / ms_plain < best[0] / best[1]:
            best = (ms_icf, ms_plain, timer.setup)
    return best


def main(argv=None) -> None:
    import dask.array as da

    from dkicf import incomplete_cholesky, local_cluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=16)
    p.add_argument("--rank", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.05)
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 8],
                   help="row chunks of the dask array (one run per value)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(args.n, args.d))
    s = args.rank
    timer = PairedTimer(X, s)
    print(f"n={args.n} d={args.d} s={s} float64; plain pass = X @ v + P[:, :i] @ u, "
          "run after each iteration")

    def numpy_fit(cb):
        res = incomplete_cholesky(X, gamma=args.gamma, max_rank=s, tol=0, progress=cb,
                                  pivoting="greedy")
        assert res.rank == s, res.stop_reason

    ms_np, base_np, setup_np = run(timer, args.repeats, numpy_fit)
    print(f"numpy backend : {ms_np:8.2f} ms/iteration, plain pass {base_np:6.2f} ms, "
          f"set-up {setup_np:.2f} s")
    print(f"ratio numpy / plain pass = {ms_np / base_np:.2f}  (target <= 1.3)")

    client = local_cluster(2, 1, memory_limit="8GiB")
    try:
        from distributed import wait

        for nch in args.chunks:
            # X in worker memory before timing, as a Zarr-backed array would be
            # after its first read.
            Xd = da.from_array(X, chunks=(-(-args.n // nch), args.d))
            Xd = client.persist(Xd)
            wait(Xd)

            def dask_fit(cb, Xd=Xd):
                res = incomplete_cholesky(Xd, gamma=args.gamma, max_rank=s, tol=0,
                                          pivoting="greedy",
                                          client=client, progress=cb)
                assert res.rank == s, res.stop_reason

            ms_dk, base_dk, setup_dk = run(timer, args.repeats, dask_fit)
            # The numpy figure is normalised by its own paired baseline, so that a
            # slower phase of the machine during one run does not bias the ratio.
            ratio = (ms_dk / base_dk) / (ms_np / base_np)
            print(f"dask backend  : {ms_dk:8.2f} ms/iteration, plain pass {base_dk:6.2f} ms, "
                  f"set-up {setup_dk:.2f} s (2 workers x 1 thread, {nch} chunks)")
            print(f"ratio dask / numpy = {ratio:.2f} ({ms_dk / ms_np:.2f} unpaired)  "
                  "(target <= 1.5)")
            if nch == args.chunks[0]:
                default_np, default_dk = [], []
                for _ in range(args.repeats):  # interleaved: a slow phase hits both
                    t0 = time.perf_counter()
                    incomplete_cholesky(X, gamma=args.gamma, max_rank=s, tol=0)
                    t1 = time.perf_counter()
                    incomplete_cholesky(Xd, gamma=args.gamma, max_rank=s, tol=0, client=client)
                    t2 = time.perf_counter()
                    default_np.append(t1 - t0)
                    default_dk.append(t2 - t1)
                best_np, best_dk = min(default_np), min(default_dk)
                print(f"default pivoting (block-greedy), whole factorization to rank {s} "
                      f"with its set-up: numpy {best_np:.2f} s, dask {best_dk:.2f} s "
                      f"({nch} chunks), ratio dask / numpy = {best_dk / best_np:.2f}")
            del Xd
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
