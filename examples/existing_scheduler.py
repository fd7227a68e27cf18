"""Run on an existing dask scheduler (started elsewhere with `dask scheduler`).

    dask scheduler --host 127.0.0.1 --port 8786 &
    dask worker tcp://127.0.0.1:8786 --nthreads 1 &
    python examples/existing_scheduler.py tcp://127.0.0.1:8786
"""

import argparse

import dask.array as da
from distributed import Client

import dkicf
from dkicf.synthetic import make_parabolic


def main(argv=None):
    parser = argparse.ArgumentParser(description="kernel k-means on an existing scheduler")
    parser.add_argument("scheduler", help="scheduler address, e.g. tcp://127.0.0.1:8786")
    parser.add_argument("--n", type=int, default=20_000)
    args = parser.parse_args(argv)

    with Client(args.scheduler, timeout=20) as client:
        X, y = make_parabolic(args.n, random_state=0)
        Xd = da.from_array(X, chunks=(max(args.n // 4, 1), 2))
        model = dkicf.KernelKMeans(n_clusters=2, gamma=2.0, rank=50, random_state=0)
        labels = model.fit_predict(Xd)
        from dkicf.metrics import clustering_accuracy

        workers = len(client.nthreads())
        print(f"{workers} workers; accuracy {clustering_accuracy(y, labels.compute()):.3f}")


if __name__ == "__main__":
    main()
