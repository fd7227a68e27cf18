"""PNG plots of a fitted model: trace error, cluster sizes, and the clusters themselves.

matplotlib is an optional dependency (``pip install "dkicf[plot]"``); it is
imported only here, with the non-interactive Agg backend.  Each ``plot_*``
function writes one PNG; the figure it draws comes from a ``_*_figure``
function that the tests inspect.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import io
from ._saved import read_model

__all__ = [
    "plot_trace_error",
    "plot_cluster_sizes",
    "plot_clusters_2d",
    "plot_clusters_pca",
    "plot_model",
]

# At most this many points are drawn in a scatter plot (a seeded sample).
_MAX_SCATTER = 50_000
# Cluster ids get one tick each up to this many clusters.
_MAX_TICKS = 30


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


def _save(fig, path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _palette(k: int) -> list:
    """k qualitative colours: tab10 up to 10 clusters, tab20 up to 20, then repeated."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if k <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(k)]


def _trace_error_figure(trace_errors, *, initial_trace=None, tol=None,
                        title="ICF trace error"):
    plt = _pyplot()
    te = np.asarray(trace_errors, dtype=float)
    ranks = np.arange(1, te.size + 1)
    scale, ylabel = 1.0, r"trace error tr$(K - PP^\top)$"
    if initial_trace is not None and initial_trace > 0:
        ranks = np.concatenate([[0], ranks])
        te = np.concatenate([[initial_trace], te])
        scale, ylabel = float(initial_trace), r"relative trace error tr$(K - PP^\top)$ / tr $K$"
    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    positive = te > 0
    ax.semilogy(ranks[positive], te[positive] / scale, lw=1.6, label="trace error")
    if tol is not None and tol > 0:
        label = f"tol = {tol:g}" + (f" ({tol / scale:.1e} of tr K)" if scale != 1 else "")
        lowest = te[positive].min() / scale if positive.any() else tol / scale
        if tol / scale >= lowest / 100:
            ax.axhline(tol / scale, color="tab:red", ls="--", lw=1.2, label=label)
        else:  # far below the curve: named, not drawn, so the curve keeps the axis
            ax.plot([], [], color="tab:red", ls="--", lw=1.2, label=f"{label}, below the axis")
    ax.set_xlabel("rank s (columns of P)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_trace_error(trace_errors, path, *, title="ICF trace error", initial_trace=None,
                     tol=None) -> Path:
    """Trace error ``tr(K - P P^T)`` against the rank, on a log scale.

    With ``initial_trace`` (``tr K``) the error is drawn relative to it; with
    ``tol`` (absolute, as the factorization's ``tol``) a dashed line marks
    where the factorization stops.
    """
    return _save(_trace_error_figure(trace_errors, initial_trace=initial_trace, tol=tol,
                                     title=title), path)


def _cluster_sizes_figure(counts, *, title="cluster sizes"):
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(counts, dtype=np.int64)
    k = counts.size
    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    ax.bar(np.arange(k), counts, color=_palette(k))
    if k <= _MAX_TICKS:
        ax.set_xticks(np.arange(k))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("cluster")
    ax.set_ylabel("points")
    ax.set_title(f"{title} ({counts.sum():,} points)")
    return fig


def plot_cluster_sizes(labels, path, *, n_clusters=None, title="cluster sizes") -> Path:
    """Bar chart of the number of points per cluster, one integer tick per cluster."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=n_clusters or 0)
    return _save(_cluster_sizes_figure(counts, title=title), path)


def _scatter_figure(points, labels, *, counts=None, pivots=None, xlabel, ylabel, title=None,
                    equal=True):
    """Points coloured by cluster (one legend entry per cluster, with its size)."""
    plt = _pyplot()
    labels = np.asarray(labels, dtype=np.int64)
    k = int(max(labels.max(initial=-1) + 1, 0 if counts is None else len(counts)))
    if counts is None:
        counts = np.bincount(labels, minlength=k)
    colours = _palette(k)
    fig, ax = plt.subplots(figsize=(7.4, 4.8))
    for c in range(k):
        mine = labels == c
        ax.scatter(points[mine, 0], points[mine, 1], s=4, linewidths=0, color=colours[c],
                   label=f"cluster {c} ({int(counts[c]):,} points)")
    if pivots is not None and len(pivots):
        ax.scatter(pivots[:, 0], pivots[:, 1], s=60, facecolors="none", edgecolors="black",
                   linewidths=1.2, label=f"{len(pivots)} pivots")
    if equal:
        ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    # Beside the axes, so that it hides no point; cluster markers enlarged to be seen.
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                       borderaxespad=0.0)
    for handle in legend.legend_handles[:k]:
        handle.set_sizes([30])
    return fig


def _sample(n: int, seed: int) -> np.ndarray:
    if n <= _MAX_SCATTER:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, _MAX_SCATTER, replace=False))


def plot_clusters_2d(X, labels, path, *, pivot_rows=None, title=None, seed=0, counts=None,
                     feature_names=None) -> Path:
    """2-D points coloured by cluster, the factorization's pivots as black circles.

    ``counts`` (points per cluster, for the legend) defaults to the counts of
    ``labels``; pass the full counts when ``X`` is a sample.
    """
    X = np.asarray(X)
    labels = np.asarray(labels)
    if X.shape[1] != 2:
        raise ValueError(
            f"a scatter plot of the data needs 2 features, got {X.shape[1]}; "
            "plot_clusters_pca draws the first two principal components of P."
        )
    idx = _sample(X.shape[0], seed)
    if counts is None:
        counts = np.bincount(labels.astype(np.int64))
    names = list(feature_names) if feature_names is not None else ["feature 0", "feature 1"]
    fig = _scatter_figure(X[idx], labels[idx], counts=counts,
                          pivots=None if pivot_rows is None else np.asarray(pivot_rows),
                          xlabel=names[0], ylabel=names[1], title=title)
    return _save(fig, path)


def _principal_components(P: np.ndarray):
    """The first two principal axes of the rows of P, their mean and variance shares."""
    mean = P.mean(axis=0)
    _, sing, vt = np.linalg.svd(P - mean, full_matrices=False)
    var = sing**2
    share = var[:2] / var.sum() if var.sum() > 0 else np.zeros(2)
    axes = vt[:2]
    if axes.shape[0] < 2:  # rank 1: the second axis is zero
        axes = np.vstack([axes, np.zeros_like(axes)])
        share = np.append(share, 0.0)
    return mean, axes, share


def _pca_figure(P, labels, *, counts=None, pivot_features=None, title=None):
    P = np.asarray(P, dtype=np.float64)
    mean, axes, share = _principal_components(P)
    points = (P - mean) @ axes.T
    pivots = None if pivot_features is None else (np.asarray(pivot_features) - mean) @ axes.T
    return _scatter_figure(
        points, labels, counts=counts, pivots=pivots, equal=False,
        xlabel=f"principal component 1 of P ({share[0]:.0%} of variance)",
        ylabel=f"principal component 2 of P ({share[1]:.0%} of variance)", title=title,
    )


def plot_clusters_pca(P, labels, path, *, counts=None, pivot_features=None, title=None,
                      seed=0) -> Path:
    """The rows of P (the points' features) on their first two principal components.

    For data of more than 2 features: the clusters as k-means saw them.
    ``pivot_features`` (the pivots' rows of P, i.e. ``L``) are circled.
    """
    P = np.asarray(P)
    labels = np.asarray(labels)
    idx = _sample(P.shape[0], seed)
    if counts is None:
        counts = np.bincount(labels.astype(np.int64))
    return _save(_pca_figure(P[idx], labels[idx], counts=counts,
                             pivot_features=pivot_features, title=title), path)


def plot_model(model_path, out_dir, *, data=None, storage_options=None) -> list[Path]:
    """Write the PNGs of a saved model (and of its clusters when the data are at hand).

    Parameters
    ----------
    model_path : str
        Output group of ``dkicf fit`` or a model written by ``KernelKMeans.save``.
    out_dir : str
        Folder for the PNG files (created if needed).
    data : str, optional
        The dataset the model was fitted on.  For 2-D data, a scatter plot of
        the clusters with the pivots marked is written; for more features,
        the first two principal components of P (from the model's ``P``, else
        computed from ``data``).

    Returns
    -------
    list of Path
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = read_model(model_path, storage_options=storage_options)
    tol = model.params.get("tol")
    paths = [
        plot_trace_error(model.trace_errors, out / "trace_error.png",
                         initial_trace=model.initial_trace, tol=tol)
    ]
    labels = io.open_member(model_path, "labels", storage_options=storage_options)
    if labels is None:
        return paths
    k = model.cluster_centers.shape[0]
    counts = np.asarray(_bincount(labels, k))
    paths.append(_save(_cluster_sizes_figure(counts), out / "cluster_sizes.png"))
    title = f"k={k}, s={model.rank}"
    idx = _sample(labels.shape[0], 0)
    if model.n_features_in == 2 and data is not None:
        X = _check_rows(io.open_dataset(data, storage_options=storage_options)[0], labels, data,
                        model.n_features_in)
        Xs, ls = np.asarray(X[idx].compute()), np.asarray(labels[idx].compute())
        paths.append(plot_clusters_2d(Xs, ls, out / "clusters.png",
                                      pivot_rows=model.pivot_rows, counts=counts, title=title))
    elif model.n_features_in > 2:
        P = io.open_member(model_path, "P", storage_options=storage_options)
        if P is None and data is not None:
            X = _check_rows(io.open_dataset(data, storage_options=storage_options)[0], labels,
                            data, model.n_features_in)
            Ps = model.feature_map().features(np.asarray(X[idx].compute()))
        elif P is not None:
            Ps = np.asarray(P[idx].compute())
        else:
            return paths
        ls = np.asarray(labels[idx].compute())
        paths.append(plot_clusters_pca(Ps, ls, out / "clusters.png", counts=counts,
                                       pivot_features=model.cholesky_factor, title=title))
    return paths


def _check_rows(X, labels, data, n_features: int):
    if X.shape[0] != labels.shape[0] or X.shape[1] != n_features:
        raise ValueError(
            f"{data} has {X.shape[0]} rows of {X.shape[1]} features but the model's labels "
            f"have {labels.shape[0]} rows and it was fitted on {n_features} features; "
            "pass the dataset the model was fitted on."
        )
    return X


def _bincount(labels, k: int):
    """Points per cluster, counted chunk by chunk."""
    import dask.array as da

    return da.bincount(labels.astype(np.int64).ravel(), minlength=k).compute()
