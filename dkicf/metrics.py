"""Clustering quality against ground-truth classes: accuracy, NMI and ARI.

:func:`clustering_accuracy` is the measure the paper reports: the fraction of
points whose cluster, after the best one-to-one matching of clusters to
classes, is their class.  :func:`nmi` and :func:`ari` are thin wrappers over
scikit-learn so that benchmark code imports every measure from one place and
gets the same input checks.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

__all__ = ["clustering_accuracy", "contingency_matrix", "nmi", "ari"]


def _check_labels(y_true: ArrayLike, y_pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Return both label vectors as 1-D arrays of the same, non-zero length."""
    arrays = []
    for name, y in (("y_true", y_true), ("y_pred", y_pred)):
        arr = np.asarray(y)
        if arr.ndim != 1:
            hint = " Flatten it with y.ravel()." if arr.ndim == 2 and 1 in arr.shape else ""
            raise ValueError(
                f"{name} must be a 1-D array of labels, got {arr.ndim}-D with shape "
                f"{arr.shape}.{hint}"
            )
        if arr.shape[0] == 0:
            raise ValueError(f"{name} is empty; pass at least one label.")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(
                f"{name} contains NaN or infinity at position "
                f"{int(np.flatnonzero(~np.isfinite(arr))[0])}; every point needs a label."
            )
        arrays.append(arr)
    if arrays[0].shape[0] != arrays[1].shape[0]:
        raise ValueError(
            f"y_true has {arrays[0].shape[0]} labels but y_pred has {arrays[1].shape[0]}; "
            "pass one label per point in both."
        )
    return arrays[0], arrays[1]


def contingency_matrix(y_true: ArrayLike, y_pred: ArrayLike) -> np.ndarray:
    """Counts of points per (cluster, class) pair.

    Parameters
    ----------
    y_true : array-like of shape (n_samples,)
        Ground-truth classes (any sortable labels).
    y_pred : array-like of shape (n_samples,)
        Cluster labels (any sortable labels).

    Returns
    -------
    ndarray of shape (n_clusters, n_classes), dtype int64
        ``C[i, j]`` is the number of points in the ``i``-th cluster (in sorted
        label order) that belong to the ``j``-th class (in sorted order).

    Examples
    --------
    >>> from dkicf.metrics import contingency_matrix
    >>> contingency_matrix([0, 0, 1, 1], [5, 5, 5, 7]).tolist()
    [[2, 1], [0, 1]]
    """
    y_true, y_pred = _check_labels(y_true, y_pred)
    classes, t = np.unique(y_true, return_inverse=True)
    clusters, p = np.unique(y_pred, return_inverse=True)
    counts = np.zeros((clusters.size, classes.size), dtype=np.int64)
    np.add.at(counts, (p.ravel(), t.ravel()), 1)
    return counts


def clustering_accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Accuracy of a clustering under the best one-to-one matching of clusters to classes.

    The matching maximizes the number of points whose cluster is matched to
    their class (the Hungarian algorithm on the contingency matrix,
    :func:`scipy.optimize.linear_sum_assignment`).  The numbers of clusters
    and classes may differ: each cluster is matched to at most one class and
    each class to at most one cluster, and the points of unmatched clusters
    count as errors.  Label values are arbitrary; only the partition matters.

    Parameters
    ----------
    y_true : array-like of shape (n_samples,)
        Ground-truth classes.
    y_pred : array-like of shape (n_samples,)
        Cluster labels.

    Returns
    -------
    float
        In ``[0, 1]``; ``1.0`` when the clustering equals the classes up to a
        relabelling.

    Raises
    ------
    ValueError
        If an input is not 1-D, is empty or contains NaN, or the lengths differ.

    Examples
    --------
    >>> from dkicf.metrics import clustering_accuracy
    >>> clustering_accuracy([0, 0, 1, 1], [1, 1, 0, 0])
    1.0
    >>> clustering_accuracy([0, 0, 1, 1], [0, 1, 2, 2])  # cluster 1 stays unmatched
    0.75
    """
    counts = contingency_matrix(y_true, y_pred)
    rows, cols = linear_sum_assignment(counts, maximize=True)
    return float(counts[rows, cols].sum() / counts.sum())


def nmi(y_true: ArrayLike, y_pred: ArrayLike, *, average_method: str = "arithmetic") -> float:
    """Normalized mutual information between classes and clusters.

    A wrapper over :func:`sklearn.metrics.normalized_mutual_info_score` with
    this module's input checks.

    Parameters
    ----------
    y_true, y_pred : array-like of shape (n_samples,)
        Ground-truth classes and cluster labels.
    average_method : {"arithmetic", "geometric", "min", "max"}, default="arithmetic"
        How the two entropies are averaged in the normalizer.

    Returns
    -------
    float
        In ``[0, 1]``.

    Examples
    --------
    >>> from dkicf.metrics import nmi
    >>> nmi([0, 0, 1, 1], [1, 1, 0, 0])
    1.0
    """
    y_true, y_pred = _check_labels(y_true, y_pred)
    return float(normalized_mutual_info_score(y_true, y_pred, average_method=average_method))


def ari(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Adjusted Rand index between classes and clusters.

    A wrapper over :func:`sklearn.metrics.adjusted_rand_score` with this
    module's input checks.

    Parameters
    ----------
    y_true, y_pred : array-like of shape (n_samples,)
        Ground-truth classes and cluster labels.

    Returns
    -------
    float
        ``1.0`` for identical partitions, about ``0`` for random ones (it can
        be negative).

    Examples
    --------
    >>> from dkicf.metrics import ari
    >>> ari([0, 0, 1, 1], [1, 1, 0, 0])
    1.0
    """
    y_true, y_pred = _check_labels(y_true, y_pred)
    return float(adjusted_rand_score(y_true, y_pred))
