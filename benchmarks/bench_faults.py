"""What P in Zarr and checkpoints cost, and what resuming saves.

On a LocalCluster of 2 workers x 1 thread, for X of n rows and d features read
from Zarr in row chunks (held in worker memory), this prints the seconds of the factorization

* with P in worker memory (the reference),
* with P in Zarr (``p_store=``): tasks stream the flushed column blocks,
* with checkpoints every ``--every`` iterations, P in worker memory (the
  default when it fits: the commits copy its new columns),
* the same with P in the checkpoint's Zarr (``p_storage="zarr"``, for a P
  larger than the cluster's memory),
* resumed from a checkpoint committed at half the rank,

with each time against the in-memory run measured in the same process, and
checks that the pivots are the same in every mode.

Run: python benchmarks/bench_faults.py [--n 200000] [--d 8] [--rank 100] [--chunk 50000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


class DriverDied(Exception):
    """Stands for a driver that dies half-way."""


def main(argv=None) -> None:
    import dask.array as da
    import zarr

    from dkicf import incomplete_cholesky, local_cluster

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--rank", type=int, default=100)
    p.add_argument("--chunk", type=int, default=50_000)
    p.add_argument("--every", type=int, default=25)
    args = p.parse_args(argv)

    X = np.random.default_rng(0).normal(size=(args.n, args.d))
    common = {"gamma": 0.5 / args.d, "max_rank": args.rank, "tol": 0.0, "pivoting": "greedy"}
    client = local_cluster(2, 1)
    try:
        tmp = tempfile.mkdtemp(prefix="dkicf-bench-")
        zarr.create_array(f"{tmp}/X.zarr", data=X, chunks=(args.chunk, args.d))
        Xd = da.from_zarr(f"{tmp}/X.zarr")

        per_iteration = {}

        def run(label, iterations=args.rank, **kw):
            t0 = time.perf_counter()
            res = incomplete_cholesky(Xd, client=client, **common, **kw)
            res.P[:1].compute()
            seconds = time.perf_counter() - t0
            ms = 1e3 * seconds / iterations
            base = per_iteration.setdefault("reference", ms)
            print(f"{label:<40s} {seconds:8.2f} s  ({ms:7.1f} ms/iter, {ms / base:5.2f}x)")
            return res

        print(f"n={args.n} d={args.d} rank={args.rank} chunk={args.chunk} every={args.every}")
        ref = run("P in worker memory")
        zres = run("P in Zarr (p_store)", p_store=f"{tmp}/P.zarr")
        cres = run(f"checkpoint every {args.every}, P in memory", checkpoint=f"{tmp}/ck.zarr",
                   checkpoint_every=args.every)
        assert cres.info["p_storage"] == "memory"
        czres = run(f"checkpoint every {args.every}, P in Zarr", checkpoint=f"{tmp}/ckz.zarr",
                    checkpoint_every=args.every, p_storage="zarr")
        half = args.rank // 2

        def stop_at_half(progress):
            if progress.rank == half:
                raise DriverDied

        try:
            incomplete_cholesky(Xd, client=client, checkpoint=f"{tmp}/half.zarr",
                                checkpoint_every=half, progress=stop_at_half, **common)
        except DriverDied:
            pass
        rres = run(f"resumed from rank {half}", args.rank - half, checkpoint=f"{tmp}/half.zarr",
                   resume=True, checkpoint_every=half)
        for label, res in (("p_store", zres), ("checkpoint", cres),
                           ("checkpoint with P in Zarr", czres), ("resume", rres)):
            same = np.array_equal(res.pivots, ref.pivots)
            print(f"pivots of {label} equal to in-memory: {same}")
        same = np.array_equal(rres.P.compute(), cres.P.compute())
        print(f"P of the resumed run bit-identical to the checkpointed run: {same}")
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
