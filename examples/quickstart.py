"""Quickstart: kernel k-means on a numpy array, in this process.

    python examples/quickstart.py [--n 2000]
"""

import argparse

from sklearn.cluster import KMeans

from dkicf import KernelKMeans
from dkicf.metrics import clustering_accuracy
from dkicf.synthetic import make_ring


def main(argv=None):
    parser = argparse.ArgumentParser(description="kernel k-means on two concentric rings")
    parser.add_argument("--n", type=int, default=2000, help="number of points")
    args = parser.parse_args(argv)

    X, y = make_ring(args.n, random_state=0)
    model = KernelKMeans(n_clusters=2, kernel="gaussian", gamma=16.0, rank=50, random_state=0)
    labels = model.fit_predict(X)

    print(f"kernel k-means accuracy: {clustering_accuracy(y, labels):.3f}")
    plain = KMeans(n_clusters=2, n_init=10, random_state=0).fit_predict(X)
    print(f"plain k-means accuracy:  {clustering_accuracy(y, plain):.3f}")
    print(f"rank {model.rank_}, trace error {model.trace_errors_[-1]:.3g} "
          f"(from {model.initial_trace_:.3g})")
    # New points go through the same factor: p(x) = L^-1 k(X_B, x).
    print("first predictions:", model.predict(X[:8]))


if __name__ == "__main__":
    main()
