"""A fitted model's map of new points, as the tasks of predict and transform get it.

``p(x) = L^{-1} k(X_B, x)`` and the nearest of the centres, with nothing of
the estimator around them: the tasks of :meth:`KernelKMeans.predict` and
:meth:`KernelKMeans.transform` on a dask X carry a :class:`FeatureMap`, so a
worker unpickling them imports this module, the kernels and the k-means
(no scikit-learn: its import took 2–3 s in each fresh worker process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._chunk import check_finite
from ._factor import _transform_block
from .kernels import Kernel
from .kmeans import assign


@dataclass(frozen=True, eq=False)
class FeatureMap:
    """The pieces of a fitted model that map new rows.

    Parameters
    ----------
    kernel : Kernel
        The fitted kernel.
    pivot_rows : ndarray of shape (rank, n_features)
        The rows of X at the pivots, ``X_B``.
    cholesky_factor : ndarray of shape (rank, rank)
        ``L = P[pivots]``, lower triangular.
    pivot_aux : object or None
        ``kernel.prepare(pivot_rows)`` (the squared norms of a Gaussian kernel),
        or None to have the kernel compute it for each block.
    centers : ndarray of shape (n_clusters, rank)
        The cluster centres in the factor's feature space.
    """

    kernel: Kernel
    pivot_rows: np.ndarray
    cholesky_factor: np.ndarray
    pivot_aux: Any
    centers: np.ndarray

    def features(self, x) -> np.ndarray:
        """``p(x)`` for every row of ``x``: shape (rows, rank)."""
        return _transform_block(np.ascontiguousarray(x, dtype=np.float64), self.kernel,
                                self.pivot_rows, self.cholesky_factor, self.pivot_aux)

    def labels(self, x) -> np.ndarray:
        """The nearest centre of every row's ``p(x)``, as int64."""
        labels, _ = assign(self.features(x), self.centers)
        return np.asarray(labels, dtype=np.int64)

    def dask_features(self, X):
        """``p(x)`` of a dask X, one task per row chunk, each chunk checked for NaN first."""
        return X.map_blocks(checked_features, self, dtype=np.float64,
                            chunks=(X.chunks[0], (self.cholesky_factor.shape[0],)),
                            meta=np.empty((0, 0), dtype=np.float64))

    def dask_labels(self, X):
        """:meth:`labels` of a dask X, one task per row chunk, each chunk checked first."""
        return X.map_blocks(checked_labels, self, dtype=np.int64, drop_axis=1,
                            chunks=(X.chunks[0],), meta=np.empty((0,), dtype=np.int64))


def _check_chunk(x, block_info) -> None:
    """Refuse NaN or infinity in one row chunk of a dask X, naming its global row and chunk.

    ``block_info`` is what :meth:`dask.array.Array.map_blocks` passes: the
    chunk's place in X (absent when dask calls the function outside a task).
    """
    info = (block_info or {}).get(0)
    if info is None:
        check_finite(x)
        return
    check_finite(x, int(info["array-location"][0][0]), int(info["chunk-location"][0]))


def checked_features(x, fmap: FeatureMap, block_info=None) -> np.ndarray:
    """One chunk of ``transform`` on a dask X, checked first."""
    _check_chunk(x, block_info)
    return fmap.features(x)


def checked_labels(x, fmap: FeatureMap, block_info=None) -> np.ndarray:
    """One chunk of ``predict`` on a dask X, checked first."""
    _check_chunk(x, block_info)
    return fmap.labels(x)
