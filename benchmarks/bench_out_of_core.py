"""A fit on a Zarr dataset several times larger than the workers' total memory.

Generates (once) a float32 dataset of ``--gb`` GB in Zarr, then on a
LocalCluster of ``--workers`` x ``--memory-limit`` runs ``dkicf fit`` with
``s = --rank`` and ``k = --clusters``, X re-read from Zarr on every pass and P
in Zarr when it does not fit.  Prints wall time, time per ICF iteration, the
peak RSS of each worker against its limit, bytes read per iteration against
the dataset's size, and the ratio of one ICF iteration to one plain dask pass
(``X.sum()``) over the same Zarr array.

Run: python benchmarks/bench_out_of_core.py [--gb 6] [--workdir /tmp/dkicf-ooc]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _rss import rss_sampler_peak, start_rss_sampler


def _rchar() -> int:
    import psutil

    return psutil.Process(os.getpid()).io_counters().read_chars


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> None:
    import dask.array as da

    from dkicf import io, local_cluster
    from dkicf._cluster import all_workers
    from dkicf.pipeline import fit_store

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=6.0, help="dataset size in GB (float32)")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--rank", type=int, default=50)
    p.add_argument("--clusters", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="1GiB")
    p.add_argument("--workdir", default="/tmp/dkicf-ooc")
    args = p.parse_args(argv)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    n = int(args.gb * 1e9 / (4 * args.features))
    data = work / f"blobs-{n}x{args.features}.zarr"
    if not data.exists():
        t0 = time.perf_counter()
        io.generate("blobs", str(data), n, n_features=args.features, centers=args.clusters,
                    dtype="float32", random_state=0)
        print(f"generated {data} in {time.perf_counter() - t0:.1f} s")
    x_bytes = n * args.features * 4
    disk = _dir_bytes(data / "X")
    print(f"X: {n} x {args.features} float32 = {x_bytes / 1e9:.2f} GB "
          f"({disk / 1e9:.2f} GB on disk)")

    client = local_cluster(args.workers, 1, memory_limit=args.memory_limit)
    try:
        info = all_workers(client)
        limit = min(w["memory_limit"] for w in info.values())
        total = limit * len(info)
        print(f"cluster: {len(info)} workers x {limit / 2**30:.2f} GiB = "
              f"{total / 2**30:.2f} GiB; dataset / memory = {x_bytes / total:.1f}x")

        X = da.from_zarr(str(data), component="X")
        r0 = sum(client.run(_rchar).values())
        t0 = time.perf_counter()
        X.sum().compute()
        t_pass = time.perf_counter() - t0
        read_pass = sum(client.run(_rchar).values()) - r0
        print(f"plain pass X.sum(): {t_pass:.2f} s, {read_pass / 1e9:.2f} GB read")

        out = work / "model.zarr"
        client.run(start_rss_sampler)
        r0 = sum(client.run(_rchar).values())
        icf_read = []

        def progress(event):
            # After each factorization pass: the bytes the workers read so far.
            if type(event).__name__ == "ICFProgress":
                icf_read.append(sum(client.run(_rchar).values()) - r0)

        t0 = time.perf_counter()
        report = fit_store(
            str(data), str(out),
            dict(n_clusters=args.clusters, gamma="median", rank=args.rank, random_state=0),
            client=client, overwrite=True, persist="no", progress=progress,
        )
        wall = time.perf_counter() - t0
        read = sum(client.run(_rchar).values()) - r0
        peaks = client.run(rss_sampler_peak)
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()

    passes = report["n_passes"]
    it = report["icf_s"] / max(report["rank"], 1)
    per_pass = report["icf_s"] / max(passes, 1)
    print(f"fit wall time: {wall:.1f} s (ICF {report['icf_s']:.1f} s, k-means "
          f"{report['kmeans_s']:.1f} s, writing {report['write_s']:.1f} s)")
    print(f"P kept in: {report.get('p_storage', '?')}; accuracy {report.get('accuracy')}")
    print(f"ICF: rank {report['rank']} in {passes} passes over X (the first computes the "
          f"diagonal); {per_pass:.2f} s per pass = {per_pass / t_pass:.2f} plain passes")
    print(f"time per ICF iteration (one pivot): {it:.2f} s; ratio to a plain pass = "
          f"{it / t_pass:.2f} (target <= 1.5)")
    if icf_read:
        icf_bytes = icf_read[-1]
        print(f"bytes read by the factorization: {icf_bytes / 1e9:.2f} GB over {passes} passes "
              f"= {icf_bytes / passes / 1e9:.2f} GB per pass ({icf_bytes / passes / disk:.2f}x "
              "X on disk; the rest is P's flushed columns read back from Zarr)")
    print(f"bytes read by the whole fit: {read / 1e9:.2f} GB (k-means reads P, "
          f"{report['rank'] * n * 8 / 1e9:.2f} GB, besides)")
    for addr, peak in sorted(peaks.items()):
        print(f"worker {addr}: peak RSS {peak / 2**20:.0f} MiB = {peak / limit:.2f} of its limit "
              "(must stay < 0.95)")


if __name__ == "__main__":
    main()
