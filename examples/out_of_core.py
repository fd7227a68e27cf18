"""Out of core: a Zarr dataset on disk, clustered on a LocalCluster chunk by chunk.

X is read from Zarr by the workers and never held whole by any process; the
factor P stays in chunks in the workers' memory.

    python examples/out_of_core.py [--n 200000] [--workdir /tmp/dkicf-example]
"""

import argparse
from pathlib import Path

import dask.array as da

import dkicf
from dkicf import io


def main(argv=None):
    parser = argparse.ArgumentParser(description="cluster a Zarr dataset on a LocalCluster")
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--workdir", default="dkicf-example")
    parser.add_argument("--memory-limit", default="1GiB", help="per worker")
    args = parser.parse_args(argv)

    store = Path(args.workdir) / "blobs.zarr"
    # Written chunk by chunk: the full dataset is never materialised.
    io.generate("blobs", str(store), args.n, n_features=8, centers=5, random_state=0,
                overwrite=True)

    client = dkicf.local_cluster(n_workers=2, threads_per_worker=1,
                                 memory_limit=args.memory_limit)
    try:
        X = da.from_zarr(str(store), component="X")
        y = da.from_zarr(str(store), component="y")
        model = dkicf.KernelKMeans(n_clusters=5, gamma="median", rank=40, random_state=0)
        labels = model.fit_predict(X)  # a dask array; nothing gathered
        from dkicf.metrics import clustering_accuracy

        print(f"rank {model.rank_}, {model.n_passes_} passes over X")
        print(f"accuracy: {clustering_accuracy(y.compute(), labels.compute()):.3f}")
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
