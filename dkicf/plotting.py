"""PNG plots of a fitted model: trace error, cluster sizes, and 2-D clusterings.

matplotlib is an optional dependency (``pip install "dkicf[plot]"``); it is
imported only here, with the non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_trace_error", "plot_cluster_sizes", "plot_clusters_2d", "plot_model"]

# At most this many points are drawn in a scatter plot (a seeded sample).
_MAX_SCATTER = 50_000


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            'plots need matplotlib: pip install "dkicf[plot]"'
        ) from None
    return plt


def plot_trace_error(trace_errors, path, *, title="ICF trace error", initial_trace=None):
    """Trace error ``tr(K - P P^T)`` against the rank, on a log scale."""
    plt = _pyplot()
    te = np.asarray(trace_errors, dtype=float)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ranks = np.arange(1, te.size + 1)
    if initial_trace is not None:
        ranks = np.concatenate([[0], ranks])
        te = np.concatenate([[initial_trace], te])
    positive = te > 0
    ax.semilogy(ranks[positive], te[positive], lw=1.6)
    ax.set_xlabel("rank s")
    ax.set_ylabel(r"tr$(K - PP^\top)$")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_cluster_sizes(labels, path, *, n_clusters=None, title="cluster sizes"):
    """Bar chart of the number of points per cluster."""
    plt = _pyplot()
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=n_clusters or 0)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.bar(np.arange(counts.size), counts, color="tab:blue")
    ax.set_xlabel("cluster")
    ax.set_ylabel("points")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_clusters_2d(X, labels, path, *, pivots=None, pivot_rows=None, title=None, seed=0):
    """2-D points coloured by cluster, the factorization's pivots as green circles."""
    plt = _pyplot()
    X = np.asarray(X)
    labels = np.asarray(labels)
    if X.shape[1] != 2:
        raise ValueError(f"a scatter plot needs 2-D data, got {X.shape[1]} features.")
    if X.shape[0] > _MAX_SCATTER:
        idx = np.sort(np.random.default_rng(seed).choice(X.shape[0], _MAX_SCATTER, replace=False))
        X, labels = X[idx], labels[idx]
    fig, ax = plt.subplots(figsize=(4.6, 4.6))
    ax.scatter(X[:, 0], X[:, 1], c=labels, cmap="coolwarm", s=4, linewidths=0)
    if pivot_rows is not None and len(pivot_rows):
        pr = np.asarray(pivot_rows)
        ax.scatter(pr[:, 0], pr[:, 1], s=60, facecolors="none", edgecolors="green",
                   linewidths=1.4, label=f"{len(pr)} pivots")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_aspect("equal", adjustable="datalim")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_model(model_path, out_dir, *, data=None, storage_options=None) -> list[Path]:
    """Write the PNGs of a saved model (and of its 2-D data when given).

    Parameters
    ----------
    model_path : str
        Output group of ``dkicf fit`` or a model written by ``KernelKMeans.save``.
    out_dir : str
        Folder for the PNG files (created if needed).
    data : str, optional
        The dataset the model was fitted on; for 2-D data a scatter plot of
        the clusters with the pivots marked is written too.

    Returns
    -------
    list of Path
    """
    from . import io
    from .estimator import load

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load(model_path, storage_options=storage_options)
    paths = [
        plot_trace_error(model.trace_errors_, out / "trace_error.png",
                         initial_trace=model.initial_trace_)
    ]
    labels = io.open_member(model_path, "labels", storage_options=storage_options)
    if labels is not None:
        k = model.cluster_centers_.shape[0]
        counts = np.asarray(_bincount(labels, k))
        paths.append(plot_cluster_sizes(np.repeat(np.arange(k), counts), out / "cluster_sizes.png",
                                        n_clusters=k))
    if data is not None and model.n_features_in_ == 2 and labels is not None:
        X, _, _ = io.open_dataset(data, storage_options=storage_options)
        n = X.shape[0]
        if n != labels.shape[0]:
            raise ValueError(
                f"{data} has {n} rows but the model's labels have {labels.shape[0]}; "
                "pass the dataset the model was fitted on."
            )
        idx = np.arange(n)
        if n > _MAX_SCATTER:
            idx = np.sort(np.random.default_rng(0).choice(n, _MAX_SCATTER, replace=False))
        Xs, ls = np.asarray(X[idx].compute()), np.asarray(labels[idx].compute())
        paths.append(plot_clusters_2d(Xs, ls, out / "clusters.png",
                                      pivot_rows=model.pivot_rows_,
                                      title=f"k={model.cluster_centers_.shape[0]}, "
                                            f"s={model.rank_}"))
    return paths


def _bincount(labels, k: int):
    """Points per cluster, counted chunk by chunk."""
    import dask.array as da

    return da.bincount(labels.astype(np.int64).ravel(), minlength=k).compute()
