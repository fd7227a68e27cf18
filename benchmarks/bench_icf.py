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
more than the whole factorization.  The backends take turns (numpy, dask
with each chunking, numpy, ...), all with the cluster up, and each reports
its best of ``--repeats`` runs.

Pairing has a bias in dask's favour: what the scheduler and the workers
still do after an iteration's summaries have arrived overlaps the plain
pass and is subtracted with it.  So the same runs are also made without
the plain pass (a callback that only notes the time): the median
iteration of each backend, a user's view, against the median of a plain
pass repeated at each rank in turns with them.

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


class Stamps:
    """Progress callback that only notes when each iteration ends."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, progress) -> None:
        self.times.append(time.perf_counter())

    def ms(self) -> float:
        """Median milliseconds per iteration, the first (with the set-up) left out."""
        return 1000 * float(np.median(np.diff(self.times)))


def plain_alone(timer: PairedTimer, s: int) -> float:
    """Median milliseconds of the plain pass at ranks 2..s, with nothing in between."""

    from types import SimpleNamespace

    timer.begin()
    for i in range(1, s + 1):
        timer(SimpleNamespace(rank=i))  # what the timer reads of a progress report
    return 1000 * float(np.median(timer.plain))


def best(times: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The run with the lowest ICF / plain-pass ratio: (ICF ms, plain ms, set-up s)."""
    return min(times, key=lambda t: t[0] / t[1])


def timed(timer: PairedTimer, factorize) -> tuple[float, float, float]:
    """One factorization: ICF ms/iteration, its paired plain-pass ms and the set-up s."""
    timer.begin()
    factorize(timer)
    ms_icf, ms_plain = timer.ms()
    return ms_icf, ms_plain, timer.setup


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
    p.add_argument("--processes-only", action="store_true",
                   help="skip the LocalCluster of in-process workers")
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

    clusters = {"worker processes": local_cluster(2, 1, memory_limit="8GiB")}
    try:
        from distributed import wait

        if not args.processes_only:
            clusters["in-process workers"] = in_process_cluster()
        # X in worker memory before timing, as a Zarr-backed array would be
        # after its first read.
        Xds = {}
        for name, client in clusters.items():
            for nch in args.chunks:
                Xds[name, nch] = client.persist(
                    da.from_array(X, chunks=(-(-args.n // nch), args.d))
                )
                wait(Xds[name, nch])

        def dask_fit(cb, name, nch):
            res = incomplete_cholesky(Xds[name, nch], gamma=args.gamma, max_rank=s, tol=0,
                                      pivoting="greedy", client=clusters[name], progress=cb)
            assert res.rank == s, res.stop_reason

        # The backends take turns (numpy, dask on each cluster with each
        # chunking, numpy, ...), so that a slow phase of the machine hits them alike.
        runs = {"numpy": [], **{key: [] for key in Xds}}
        for _ in range(args.repeats):
            runs["numpy"].append(timed(timer, numpy_fit))
            for key in Xds:
                runs[key].append(timed(timer, lambda cb, key=key: dask_fit(cb, *key)))
        ms_np, base_np, setup_np = best(runs["numpy"])
        print(f"numpy backend : {ms_np:8.2f} ms/iteration, plain pass {base_np:6.2f} ms, "
              f"set-up {setup_np:.2f} s")
        print(f"ratio numpy / plain pass = {ms_np / base_np:.2f}  (target <= 1.3)")
        for name, nch in Xds:
            ms_dk, base_dk, setup_dk = best(runs[name, nch])
            # The numpy figure is normalised by its own paired baseline, so that a
            # slower phase of the machine during one run does not bias the ratio.
            ratio = (ms_dk / base_dk) / (ms_np / base_np)
            print(f"dask backend  : {ms_dk:8.2f} ms/iteration, plain pass {base_dk:6.2f} ms, "
                  f"set-up {setup_dk:.2f} s (LocalCluster, 2 {name} x 1 thread, {nch} chunks)")
            print(f"ratio dask / numpy = {ratio:.2f} ({ms_dk / ms_np:.2f} unpaired)  "
                  "(target <= 1.5)")
        # The same factorizations without the plain pass in between.
        alone = {"plain": [], "numpy": [], **{key: [] for key in Xds}}
        for _ in range(args.repeats):
            alone["plain"].append(plain_alone(timer, s))
            stamps = Stamps()
            numpy_fit(stamps)
            alone["numpy"].append(stamps.ms())
            for key in Xds:
                stamps = Stamps()
                dask_fit(stamps, *key)
                alone[key].append(stamps.ms())
        med = {key: float(np.median(v)) for key, v in alone.items()}
        print(f"without the plain pass in between (medians of {args.repeats} runs in turns): "
              f"plain pass {med['plain']:.2f} ms, numpy {med['numpy']:.2f} ms/iteration, "
              f"ratio {med['numpy'] / med['plain']:.2f}")
        for name, nch in Xds:
            print(f"  dask, 2 {name} x 1 thread ({nch} chunks): {med[name, nch]:.2f} ms/iteration, "
                  f"ratio dask / numpy = {med[name, nch] / med['numpy']:.2f}")
        nch = args.chunks[0]
        whole = {"numpy": [], **{name: [] for name in clusters}}
        for _ in range(args.repeats):  # interleaved: a slow phase hits all alike
            t0 = time.perf_counter()
            incomplete_cholesky(X, gamma=args.gamma, max_rank=s, tol=0)
            whole["numpy"].append(time.perf_counter() - t0)
            for name, client in clusters.items():
                t0 = time.perf_counter()
                incomplete_cholesky(Xds[name, nch], gamma=args.gamma, max_rank=s, tol=0,
                                    client=client)
                whole[name].append(time.perf_counter() - t0)
        best_np = min(whole["numpy"])
        print(f"default pivoting (block-greedy), whole factorization to rank {s} "
              f"with its set-up: numpy {best_np:.2f} s")
        for name in clusters:
            best_dk = min(whole[name])
            print(f"  dask, 2 {name} x 1 thread ({nch} chunks): {best_dk:.2f} s, "
                  f"ratio dask / numpy = {best_dk / best_np:.2f}")
        Xds.clear()
    finally:
        for client in clusters.values():
            cluster = client.cluster
            client.close()
            cluster.close()


def in_process_cluster():
    """A LocalCluster of 2 workers x 1 thread in this process (no network: in-process comms).

    Its workers share this process's memory, so they run without memory
    limits (a limit would be checked against the whole process).
    """
    import logging

    from distributed import Client, LocalCluster

    from dkicf._connect import scheduler_http

    logging.getLogger("distributed").setLevel(logging.WARNING)  # its closing messages too
    with scheduler_http(False):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, memory_limit=0,
            dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False},
            silence_logs=logging.WARNING,
        )
    return Client(cluster)

if __name__ == "__main__":
    main()
