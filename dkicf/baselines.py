"""The paper's baseline algorithms as in-memory scikit-learn estimators.

Two estimators run Lloyd iterations on the kernel directly:

* :class:`ExactKernelKMeans`, kernel k-means on the full kernel matrix;
* :class:`ApproxKernelKMeans`, approximate kernel k-means (Chitta et al.
  2011): cluster centres restricted to the span of ``m`` random points.

Three map the data to features whose inner products approximate (or equal)
the kernel, then run :class:`sklearn.cluster.KMeans` on them:

* :class:`KernelCholKMeans` ("Kernel+Chol"): full kernel matrix, pivoted
  complete Cholesky factor ``K = F F^T``;
* :class:`NystromKernelKMeans`: ``F = K_MB K_BB^{-1/2}`` for ``m`` random
  points ``B``;
* :class:`RFFKernelKMeans` (Chitta et al. 2012): random Fourier features of
  the Gaussian kernel.

All take ``n_clusters``, ``kernel``, ``gamma``, ``max_iter``, ``n_init`` and
``random_state``; the approximations also take ``n_components``, the paper's
"subset size".  Kernels come from :func:`dkicf.kernels.make_kernel`.
Randomness flows from one :class:`numpy.random.Generator` built from
``random_state`` at the start of ``fit``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import psutil
from scipy.linalg import lapack, solve_triangular
from sklearn.base import BaseEstimator, ClusterMixin
from sklearn.cluster import KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_is_fitted, validate_data

from ._validation import check_positive_int
from .kernels import GaussianKernel, Kernel, make_kernel

__all__ = [
    "ExactKernelKMeans",
    "KernelCholKMeans",
    "ApproxKernelKMeans",
    "RFFKernelKMeans",
    "NystromKernelKMeans",
]

_EPS = np.finfo(np.float64).eps
# Rows of a predicted block so that one kernel block stays near 32 MB.
_BLOCK_ENTRIES = 1 << 22
_MEDIAN_SAMPLE = 2000
# Distance differences below this fraction of max k(x, x) are rounding: no reassignment.
_TIE = 1e-12

KernelSpec = str | Callable | Kernel


# --------------------------------------------------------------------------- helpers


def _make_rng(random_state) -> np.random.Generator:
    if isinstance(random_state, np.random.RandomState):
        return np.random.default_rng(random_state.randint(np.iinfo(np.int32).max))
    return np.random.default_rng(random_state)


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(np.iinfo(np.int32).max))


def _resolve_kernel(X: np.ndarray, kernel, gamma, rng: np.random.Generator) -> Kernel:
    """The Kernel object; the median heuristic sees a seeded sample of at most 2000 rows."""
    if isinstance(kernel, Kernel) or (callable(kernel) and not isinstance(kernel, str)):
        return make_kernel(kernel)
    sample, seed = None, 0
    if gamma is None or isinstance(gamma, str):
        n = X.shape[0]
        if n < 2 and not (
            isinstance(kernel, str) and kernel.lower() in ("linear", "polynomial", "poly")
        ):
            raise ValueError(
                f"gamma={gamma!r} means the median heuristic, which needs pairs of rows, "
                f"but n_samples={n}; pass gamma as a number."
            )
        sample = X[np.sort(rng.choice(n, size=min(n, _MEDIAN_SAMPLE), replace=False))]
        seed = _seed(rng)
    return make_kernel(kernel, gamma=gamma, X_sample=sample, seed=seed)


def _check_full_kernel_fits(n: int, n_matrices: int, name: str) -> None:
    need = n_matrices * 8.0 * n * n
    available = psutil.virtual_memory().available
    if need > available:
        raise MemoryError(
            f"{name} needs {n_matrices} full {n} x {n} kernel-sized matrices "
            f"({need / 2**30:.1f} GiB) but {available / 2**30:.1f} GiB of memory is available; "
            "fit it on a subsample, or use NystromKernelKMeans, ApproxKernelKMeans, "
            "RFFKernelKMeans or dkicf.incomplete_cholesky, which never form the full matrix."
        )


def _check_init_labels(init_labels, n: int, k: int) -> np.ndarray | None:
    if init_labels is None:
        return None
    arr = np.asarray(init_labels)
    if arr.shape != (n,):
        raise ValueError(
            f"init_labels must have shape ({n},), one label per sample, got shape {arr.shape}."
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"init_labels must hold integers 0..{k - 1}, got dtype {arr.dtype}.")
    if arr.min() < 0 or arr.max() >= k:
        raise ValueError(
            f"init_labels must lie in 0..{k - 1} for n_clusters={k}, got values "
            f"{arr.min()}..{arr.max()}."
        )
    return arr.astype(np.intp)


def _psd_eig(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenpairs of a symmetric PSD matrix, without those at the rounding level.

    Eigenvalues ``<= size * eps * max eigenvalue`` are numerically zero (and
    may come out negative); dropping them gives the pseudo-inverse.
    """
    w, V = np.linalg.eigh(0.5 * (A + A.T))
    top = w[-1] if w.size else 0.0
    keep = w > A.shape[0] * _EPS * top if top > 0 else np.zeros(w.shape, dtype=bool)
    return w[keep], V[:, keep]


def _one_hot_means(labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``U[i, c] = 1 / n_c`` if ``labels[i] == c``: ``K @ U`` averages kernel columns."""
    counts = np.bincount(labels, minlength=k)
    U = np.zeros((labels.shape[0], k))
    U[np.arange(labels.shape[0]), labels] = 1.0 / counts[labels]
    return U, counts


def _reseed_empty(labels: np.ndarray, D: np.ndarray, k: int) -> None:
    """Give each empty cluster the point farthest from its centre, in place.

    Only points of clusters with at least two members move, so no cluster
    empties in turn; ``n_samples >= n_clusters`` guarantees there are enough.
    """
    counts = np.bincount(labels, minlength=k)
    empty = np.flatnonzero(counts == 0)
    if empty.size == 0:
        return
    dist = D[np.arange(labels.shape[0]), labels]
    order = iter(np.argsort(-dist, kind="stable"))
    for c in empty:
        for i in order:
            if counts[labels[i]] > 1:
                counts[labels[i]] -= 1
                labels[i] = c
                counts[c] = 1
                break


def _lloyd(distances, labels: np.ndarray, k: int, max_iter: int, tie: float):
    """Lloyd iterations on a partition until it stops changing.

    ``distances(labels)`` returns the ``(n, k)`` squared feature-space
    distances of every point to the centre of every cluster of ``labels``
    (``inf`` for empty clusters).  A point changes cluster only when another
    centre is closer by more than ``tie`` (rounding), so coinciding centres,
    e.g. of duplicated points, cannot make the partition cycle.  Returns the
    final labels, their distance matrix, the number of assignment steps and
    whether the partition converged.
    """
    labels = labels.copy()
    rows = np.arange(labels.shape[0])
    for n_iter in range(1, max_iter + 1):
        D = distances(labels)
        new = np.argmin(D, axis=1)
        stay = D[rows, labels] <= D[rows, new] + tie
        new[stay] = labels[stay]
        _reseed_empty(new, D, k)
        if np.array_equal(new, labels):
            return labels, D, n_iter, True
        labels = new
    return labels, distances(labels), max_iter, False


def _kmeanspp_labels(diag: np.ndarray, column, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding in feature space; returns the partition around the seeds.

    ``column(i)`` is the kernel column ``K[:, i]`` and ``diag`` is ``diag(K)``,
    so ``||phi(x_j) - phi(x_i)||^2 = K_jj + K_ii - 2 K_ji``.
    """
    n = diag.shape[0]
    chosen = [int(rng.integers(n))]
    cols = [column(chosen[0])]
    d2 = np.maximum(diag + diag[chosen[0]] - 2.0 * cols[0], 0.0)
    for _ in range(1, k):
        weights = d2.copy()
        weights[chosen] = 0.0
        total = weights.sum()
        if total > 0 and np.isfinite(total):
            nxt = int(rng.choice(n, p=weights / total))
        else:  # every remaining point coincides with a seed: pick any other
            nxt = int(rng.choice(np.setdiff1d(np.arange(n), chosen)))
        chosen.append(nxt)
        cols.append(column(nxt))
        np.minimum(d2, np.maximum(diag + diag[nxt] - 2.0 * cols[-1], 0.0), out=d2)
    D = diag[:, None] + diag[chosen][None, :] - 2.0 * np.column_stack(cols)
    labels = np.argmin(D, axis=1)
    _reseed_empty(labels, D, k)
    return labels


def _blockwise_distances(kernel: Kernel, X, reference, coef, center_sq) -> np.ndarray:
    """``k(x, x) - 2 k(x, R) @ coef + center_sq`` for every row, a block of rows at a time."""
    step = max(1, _BLOCK_ENTRIES // max(reference.shape[0], 1))
    ref_aux = kernel.prepare(reference)
    out = np.empty((X.shape[0], coef.shape[1]))
    for lo in range(0, X.shape[0], step):
        x = X[lo : lo + step]
        aux = kernel.prepare(x)
        out[lo : lo + step] = (
            kernel.diag(x, aux)[:, None]
            - 2.0 * (kernel.block(x, reference, aux, ref_aux) @ coef)
            + center_sq[None, :]
        )
    return np.maximum(out, 0.0, out=out)


# --------------------------------------------------------------------------- bases


class _KernelClusteringBase(ClusterMixin, BaseEstimator):
    """Parameter checks shared by the baselines (no public API of its own)."""

    def _check_common(self, n: int) -> tuple[int, int, int]:
        k = check_positive_int(self.n_clusters, "n_clusters")
        if n < k:
            raise ValueError(f"n_samples={n} should be >= n_clusters={k}.")
        max_iter = check_positive_int(self.max_iter, "max_iter")
        n_init = check_positive_int(self.n_init, "n_init")
        return k, max_iter, n_init

    def _check_subset_size(self, n: int) -> int:
        m = check_positive_int(self.n_components, "n_components")
        if m > n:
            raise ValueError(
                f"n_components={m} is larger than n_samples={n}: the subset is drawn from "
                f"the data without replacement; use n_components <= {n}."
            )
        return m


class _LloydKernelKMeans(_KernelClusteringBase):
    """Kernel k-means by Lloyd iterations on kernel values (exact or subset centres).

    Subclasses implement ``_prepare(X, kernel, rng)``, returning an object with
    ``distances(labels)`` and ``centres(labels) -> (reference_rows, coef,
    center_sq)`` so that ``||phi(x) - c||^2 = k(x, x) - 2 k(x, R) coef + center_sq``.
    """

    def fit(self, X, y=None, init_labels=None):
        """Cluster X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : ignored
        init_labels : array-like of shape (n_samples,), optional
            Initial partition (integers ``0..n_clusters-1``; empty clusters are
            re-seeded).  Replaces the k-means++ seeding; then a single run is
            made whatever ``n_init`` is.

        Returns
        -------
        self
        """
        X = validate_data(self, X, dtype=np.float64)
        n = X.shape[0]
        k, max_iter, n_init = self._check_common(n)
        start = _check_init_labels(init_labels, n, k)
        if start is not None and n_init > 1:
            warnings.warn(
                f"init_labels was given: making one run instead of n_init={n_init}.",
                RuntimeWarning,
                stacklevel=2,
            )
        rng = _make_rng(self.random_state)
        kernel = _resolve_kernel(X, self.kernel, self.gamma, rng)
        model = self._prepare(X, kernel, rng)
        tie = _TIE * max(1.0, float(np.abs(model.diag).max()))
        best = None
        for _ in range(1 if start is not None else n_init):
            labels0 = (
                start if start is not None else _kmeanspp_labels(model.diag, model.column, k, rng)
            )
            labels, D, n_iter, converged = _lloyd(model.distances, labels0, k, max_iter, tie)
            inertia = float(D[np.arange(n), labels].sum())
            if best is None or inertia < best[1]:
                best = (labels, inertia, n_iter, converged)
        labels, inertia, n_iter, converged = best
        if not converged:
            warnings.warn(
                f"{type(self).__name__} did not converge in max_iter={max_iter} iterations; "
                "increase max_iter.",
                ConvergenceWarning,
                stacklevel=2,
            )
        self.kernel_ = kernel
        self.labels_ = labels.astype(np.int64)
        self.inertia_ = inertia
        self.n_iter_ = n_iter
        self._reference, self._coef, self._center_sq = model.centres(labels)
        return self

    def predict(self, X) -> np.ndarray:
        """Index of the nearest cluster centre in feature space for each row of X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        labels : ndarray of shape (n_samples,), dtype int64
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        D = _blockwise_distances(self.kernel_, X, self._reference, self._coef, self._center_sq)
        return np.argmin(D, axis=1).astype(np.int64)


class _FullKernel:
    """Exact feature-space distances from the full kernel matrix."""

    def __init__(self, X: np.ndarray, K: np.ndarray, diag: np.ndarray, k: int):
        self.X, self.K, self.diag, self.k = X, K, diag, k

    def column(self, i: int) -> np.ndarray:
        return self.K[:, i]

    def _terms(self, labels):
        U, counts = _one_hot_means(labels, self.k)
        KU = self.K @ U  # mean kernel value of each point to each cluster
        center_sq = np.einsum("ik,ik->k", U, KU)  # mean kernel value within each cluster
        return U, counts, KU, center_sq

    def distances(self, labels):
        _, counts, KU, center_sq = self._terms(labels)
        D = self.diag[:, None] - 2.0 * KU + center_sq[None, :]
        np.maximum(D, 0.0, out=D)
        D[:, counts == 0] = np.inf
        return D

    def centres(self, labels):
        U, _, _, center_sq = self._terms(labels)
        return self.X, U, center_sq


class _SubsetKernel:
    """Distances to centres restricted to the span of the subset rows ``B``.

    For a partition with normalized indicator ``U``, the best centres in the
    span are ``c = phi(B) alpha`` with ``alpha = K_BB^+ K_BN U`` (least squares
    in feature space), so ``||phi(x_i) - c||^2 = K_ii - 2 (K_NB alpha)_i +
    alpha^T K_BB alpha``: only ``K_NB`` and ``K_BB`` are needed.
    """

    def __init__(self, X, kernel: Kernel, subset: np.ndarray, diag: np.ndarray, k: int):
        self.X, self.kernel, self.subset, self.diag, self.k = X, kernel, subset, diag, k
        aux = kernel.prepare(X)
        self.X_sub = X[subset]
        self.K_nm = kernel.block(X, self.X_sub, aux, aux[subset] if aux is not None else None)
        self.K_mm = self.K_nm[subset]
        self.w, self.V = _psd_eig(self.K_mm)
        self._aux = aux

    def column(self, i: int) -> np.ndarray:
        aux = self._aux
        return self.kernel.block(
            self.X, self.X[i : i + 1], aux, aux[i : i + 1] if aux is not None else None
        )[:, 0]

    def _terms(self, labels):
        U, counts = _one_hot_means(labels, self.k)
        rhs = self.K_nm.T @ U
        alpha = self.V @ ((self.V.T @ rhs) / self.w[:, None])  # K_BB^+ K_BN U
        center_sq = np.einsum("jk,jk->k", alpha, self.K_mm @ alpha)
        return counts, alpha, center_sq

    def distances(self, labels):
        counts, alpha, center_sq = self._terms(labels)
        D = self.diag[:, None] - 2.0 * (self.K_nm @ alpha) + center_sq[None, :]
        np.maximum(D, 0.0, out=D)
        D[:, counts == 0] = np.inf
        return D

    def centres(self, labels):
        _, alpha, center_sq = self._terms(labels)
        return self.X_sub, alpha, center_sq


# --------------------------------------------------------------------------- Lloyd estimators


class ExactKernelKMeans(_LloydKernelKMeans):
    """Kernel k-means on the full kernel matrix (the paper's "kernel k-means").

    Lloyd iterations in the kernel's feature space with the kernel trick,
    ``||phi(x_i) - mu_c||^2 = K_ii - 2 mean_{j in c} K_ij + mean_{j,l in c} K_jl``,
    until the partition stops changing (a point moves only when another
    centre is closer by more than rounding).  Each run starts from k-means++
    seeding in feature space (or from ``init_labels`` given to :meth:`fit`);
    an empty cluster is re-seeded with the point farthest from its centre.
    Memory is ``O(n^2)`` and each iteration costs ``O(n^2 k)``.

    Parameters
    ----------
    n_clusters : int, default=8
    kernel : str, callable or Kernel, default="gaussian"
        See :func:`dkicf.kernels.make_kernel`.
    gamma : float or "median", default=None
        Kernel width; ``None`` means the median heuristic on a seeded sample
        of at most 2000 rows (``1 / n_features`` for the polynomial kernel).
        Ignored when ``kernel`` is a :class:`~dkicf.kernels.Kernel`.
    max_iter : int, default=300
        Largest number of assignment steps per run.
    n_init : int, default=1
        Runs from different seedings; the lowest inertia wins.
    random_state : int, Generator or None, default=None

    Attributes
    ----------
    labels_ : ndarray of shape (n_samples,)
    inertia_ : float
        Sum of squared feature-space distances of the points to their centres.
    n_iter_ : int
        Assignment steps of the best run.
    kernel_ : Kernel
        The kernel used (``gamma`` resolved).
    n_features_in_ : int

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.baselines import ExactKernelKMeans
    >>> X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]])
    >>> km = ExactKernelKMeans(n_clusters=2, gamma=0.5, random_state=0).fit(X)
    >>> len(set(km.labels_[:3].tolist())), bool(km.labels_[0] != km.labels_[3])
    (1, True)
    >>> int(km.predict([[5.05]])[0]) == int(km.labels_[3])
    True
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        kernel: KernelSpec = "gaussian",
        gamma: float | str | None = None,
        max_iter: int = 300,
        n_init: int = 1,
        random_state=None,
    ):
        self.n_clusters = n_clusters
        self.kernel = kernel
        self.gamma = gamma
        self.max_iter = max_iter
        self.n_init = n_init
        self.random_state = random_state

    def _prepare(self, X, kernel, rng):
        n = X.shape[0]
        _check_full_kernel_fits(n, 1, type(self).__name__)
        aux = kernel.prepare(X)
        K = kernel.block(X, X, aux, aux)
        return _FullKernel(X, K, kernel.diag(X, aux), self.n_clusters)


class ApproxKernelKMeans(_LloydKernelKMeans):
    """Approximate kernel k-means (Chitta et al. 2011).

    Cluster centres are restricted to the span of ``n_components`` points
    ``B`` drawn at random without replacement, ``c_k = sum_j alpha_jk
    phi(b_j)``.  Each iteration sets ``alpha = K_BB^+ K_BN U`` (``U`` the
    cluster indicator normalized by cluster sizes; the pseudo-inverse drops
    eigenvalues at the rounding level) and assigns every point to the nearest
    centre, ``K_ii - 2 (K_NB alpha)_ik + (alpha^T K_BB alpha)_kk``.  Only the
    ``n x m`` block ``K_NB`` is formed: memory ``O(nm)``, time ``O(nmk)`` per
    iteration.  Seeding is k-means++ in feature space (kernel columns of the
    chosen seeds only), or ``init_labels`` given to :meth:`fit`.

    With ``n_components = n_samples`` the span holds the exact cluster means,
    and the iterations are those of :class:`ExactKernelKMeans`.

    Parameters
    ----------
    n_clusters : int, default=8
    n_components : int, default=100
        Subset size ``m`` (at most ``n_samples``).
    kernel, gamma, max_iter, n_init, random_state
        As in :class:`ExactKernelKMeans`.

    Attributes
    ----------
    labels_, inertia_, n_iter_, kernel_, n_features_in_
        As in :class:`ExactKernelKMeans` (``inertia_`` measured to the
        restricted centres).
    subset_indices_ : ndarray of shape (n_components,)
        Training rows forming ``B`` (sorted).
    dual_coef_ : ndarray of shape (n_components, n_clusters)
        ``alpha``: the centres are ``phi(X[subset_indices_]) @ dual_coef_``.

    Notes
    -----
    The assignment step equals that of k-means on the Nyström features
    ``K_NB K_BB^{+1/2}`` (the two distances differ by a per-point constant),
    so this estimator and :class:`NystromKernelKMeans` differ in the seeding
    and the k-means driver, not in the approximation.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.baselines import ApproxKernelKMeans
    >>> X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]])
    >>> km = ApproxKernelKMeans(n_clusters=2, n_components=4, gamma=0.5, random_state=0)
    >>> labels = km.fit_predict(X)
    >>> len(set(labels[:3].tolist())), len(set(labels.tolist()))
    (1, 2)
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        n_components: int = 100,
        kernel: KernelSpec = "gaussian",
        gamma: float | str | None = None,
        max_iter: int = 300,
        n_init: int = 1,
        random_state=None,
    ):
        self.n_clusters = n_clusters
        self.n_components = n_components
        self.kernel = kernel
        self.gamma = gamma
        self.max_iter = max_iter
        self.n_init = n_init
        self.random_state = random_state

    def _prepare(self, X, kernel, rng):
        n = X.shape[0]
        m = self._check_subset_size(n)
        subset = np.sort(rng.choice(n, size=m, replace=False))
        self.subset_indices_ = subset
        return _SubsetKernel(X, kernel, subset, kernel.diag(X), self.n_clusters)

    def fit(self, X, y=None, init_labels=None):
        """Cluster X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : ignored
        init_labels : array-like of shape (n_samples,), optional
            Initial partition (integers ``0..n_clusters-1``); replaces the
            k-means++ seeding, and a single run is made.

        Returns
        -------
        self
        """
        super().fit(X, y, init_labels=init_labels)
        self.dual_coef_ = self._coef
        return self


# --------------------------------------------------------------------------- feature maps


class _FeatureMapKMeans(_KernelClusteringBase):
    """k-means (scikit-learn) on an explicit feature map of the data.

    Subclasses implement ``_fit_map(X, kernel, rng) -> features of X`` (storing
    what ``_map`` needs) and ``_map(X)`` for new rows.
    """

    def fit(self, X, y=None):
        """Cluster X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : ignored

        Returns
        -------
        self
        """
        X = validate_data(self, X, dtype=np.float64)
        n = X.shape[0]
        k, max_iter, n_init = self._check_common(n)
        rng = _make_rng(self.random_state)
        kernel = self._kernel(X, rng)
        features = self._fit_map(X, kernel, rng)
        km = KMeans(n_clusters=k, n_init=n_init, max_iter=max_iter, random_state=_seed(rng)).fit(
            features
        )
        self.kernel_ = kernel
        self.kmeans_ = km
        self.labels_ = km.labels_.astype(np.int64)
        self.cluster_centers_ = km.cluster_centers_
        self.inertia_ = float(km.inertia_)
        self.n_iter_ = int(km.n_iter_)
        return self

    def _kernel(self, X, rng) -> Kernel:
        return _resolve_kernel(X, self.kernel, self.gamma, rng)

    def embed(self, X) -> np.ndarray:
        """Features of X under the fitted map (the space the k-means step runs in).

        Inner products of these rows approximate (or, for Kernel+Chol on the
        training rows, equal) the kernel values.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ndarray of shape (n_samples, n_embedding)
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return self._map(X)

    def predict(self, X) -> np.ndarray:
        """Index of the nearest cluster centre of the embedded rows of X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        labels : ndarray of shape (n_samples,), dtype int64
        """
        check_is_fitted(self)
        features = self.embed(X)
        return self.kmeans_.predict(features).astype(np.int64)


class KernelCholKMeans(_FeatureMapKMeans):
    """Kernel k-means as k-means on the rows of a complete Cholesky factor ("Kernel+Chol").

    Forms the full kernel matrix ``K`` and factors it with pivoted Cholesky
    (LAPACK ``dpstrf``, which stops at the numerical rank ``r``, so a
    positive semi-definite, rank-deficient ``K`` needs no jitter):
    ``K = F F^T`` up to rounding, ``F`` of shape ``(n, r)``.  Since
    ``||F_i - F_j||^2`` is the feature-space distance, k-means on the rows
    of ``F`` solves the kernel k-means problem (the paper's equivalence of its
    two formulations).  A new point ``x`` maps to ``L^{-1} k(X_P, x)`` with
    ``P`` the ``r`` pivots and ``L`` their triangular block of ``F``.

    Parameters
    ----------
    n_clusters : int, default=8
    kernel, gamma, max_iter, n_init, random_state
        As in :class:`ExactKernelKMeans`; ``max_iter`` and ``n_init`` go to
        :class:`sklearn.cluster.KMeans`.

    Attributes
    ----------
    labels_, inertia_, n_iter_, kernel_, n_features_in_
    cluster_centers_ : ndarray of shape (n_clusters, rank_)
        Centres in the factor's coordinates (not in input space).
    rank_ : int
        Numerical rank of the kernel matrix (columns of ``F``).
    pivots_ : ndarray of shape (rank_,)
        Training rows chosen as pivots, in order.
    kmeans_ : sklearn.cluster.KMeans
        The fitted k-means step.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.baselines import KernelCholKMeans
    >>> X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]])
    >>> km = KernelCholKMeans(n_clusters=2, gamma=0.5, random_state=0).fit(X)
    >>> F = km.embed(X)
    >>> bool(np.allclose(F @ F.T, km.kernel_.block(X, X)))
    True
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        kernel: KernelSpec = "gaussian",
        gamma: float | str | None = None,
        max_iter: int = 300,
        n_init: int = 1,
        random_state=None,
    ):
        self.n_clusters = n_clusters
        self.kernel = kernel
        self.gamma = gamma
        self.max_iter = max_iter
        self.n_init = n_init
        self.random_state = random_state

    def _fit_map(self, X, kernel, rng):
        n = X.shape[0]
        _check_full_kernel_fits(n, 2, type(self).__name__)
        aux = kernel.prepare(X)
        K = kernel.block(X, X, aux, aux)
        # K is symmetric, so its transpose is the Fortran-ordered array LAPACK can overwrite.
        c, piv, rank, info = lapack.dpstrf(K.T, lower=1, overwrite_a=1)
        if info < 0:  # pragma: no cover - argument error inside LAPACK
            raise RuntimeError(f"LAPACK dpstrf failed with info={info}.")
        piv = piv.astype(np.intp) - 1  # row i of the factor belongs to training row piv[i]
        self.rank_ = int(rank)
        self.pivots_ = piv[:rank]
        self._pivot_rows = X[self.pivots_]
        if rank == 0:  # the zero matrix: every point maps to the origin
            self._pivot_block = None
            return np.zeros((n, 1))
        L = np.tril(c[:, :rank])
        self._pivot_block = L[:rank]
        factor = np.empty((n, rank))
        factor[piv] = L
        return factor

    def _map(self, X):
        if self._pivot_block is None:
            return np.zeros((X.shape[0], 1))
        Kp = self.kernel_.block(self._pivot_rows, X)
        return solve_triangular(self._pivot_block, Kp, lower=True, check_finite=False).T


class NystromKernelKMeans(_FeatureMapKMeans):
    """k-means on Nyström features ``K_MB K_BB^{-1/2}`` of a random subset B.

    ``B`` is ``n_components`` rows drawn at random without replacement;
    ``K_BB^{-1/2}`` is the symmetric inverse square root from the
    eigendecomposition of ``K_BB``, with eigenvalues at the rounding level
    (``<= m * eps * max eigenvalue``) dropped, i.e. the pseudo-inverse, so
    that ``F F^T = K_MB K_BB^+ K_BM``, the Nyström approximation of ``K``.

    Parameters
    ----------
    n_clusters : int, default=8
    n_components : int, default=100
        Subset size ``m`` (at most ``n_samples``).
    kernel, gamma, max_iter, n_init, random_state
        As in :class:`ExactKernelKMeans`; ``max_iter`` and ``n_init`` go to
        :class:`sklearn.cluster.KMeans`.

    Attributes
    ----------
    labels_, inertia_, n_iter_, kernel_, n_features_in_
    cluster_centers_ : ndarray of shape (n_clusters, n_components)
        Centres in the Nyström feature space.
    subset_indices_ : ndarray of shape (n_components,)
        Training rows forming ``B`` (sorted).
    kmeans_ : sklearn.cluster.KMeans

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.baselines import NystromKernelKMeans
    >>> X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]])
    >>> km = NystromKernelKMeans(n_clusters=2, n_components=6, gamma=0.5, random_state=0)
    >>> F = km.fit(X).embed(X)
    >>> bool(np.allclose(F @ F.T, km.kernel_.block(X, X)))
    True
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        n_components: int = 100,
        kernel: KernelSpec = "gaussian",
        gamma: float | str | None = None,
        max_iter: int = 300,
        n_init: int = 1,
        random_state=None,
    ):
        self.n_clusters = n_clusters
        self.n_components = n_components
        self.kernel = kernel
        self.gamma = gamma
        self.max_iter = max_iter
        self.n_init = n_init
        self.random_state = random_state

    def _fit_map(self, X, kernel, rng):
        n = X.shape[0]
        m = self._check_subset_size(n)
        subset = np.sort(rng.choice(n, size=m, replace=False))
        aux = kernel.prepare(X)
        K_nm = kernel.block(X, X[subset], aux, aux[subset] if aux is not None else None)
        w, V = _psd_eig(K_nm[subset])
        self._inv_sqrt = (V / np.sqrt(w)) @ V.T
        self._subset_rows = X[subset]
        self.subset_indices_ = subset
        return K_nm @ self._inv_sqrt

    def _map(self, X):
        return self.kernel_.block(X, self._subset_rows) @ self._inv_sqrt


class RFFKernelKMeans(_FeatureMapKMeans):
    """k-means on random Fourier features of the Gaussian kernel (Chitta et al. 2012).

    For ``k(x, y) = exp(-gamma ||x - y||^2)``, draws ``W ~ N(0, 2 gamma I)``
    of shape ``(n_features, D)`` and ``b ~ U[0, 2 pi)`` and maps
    ``z(x) = sqrt(2 / D) cos(x W + b)``, so that ``E[z(x) . z(y)] = k(x, y)``
    with an error of order ``1 / sqrt(D)``.  Only the Gaussian kernel is
    supported.  ``D`` is not a subset of the data and may exceed
    ``n_samples``.

    Parameters
    ----------
    n_clusters : int, default=8
    n_components : int, default=100
        Number of Fourier components ``D`` (the paper's "subset size").
    kernel : "gaussian", "rbf" or GaussianKernel, default="gaussian"
    gamma, max_iter, n_init, random_state
        As in :class:`ExactKernelKMeans`; ``max_iter`` and ``n_init`` go to
        :class:`sklearn.cluster.KMeans`.

    Attributes
    ----------
    labels_, inertia_, n_iter_, kernel_, n_features_in_
    cluster_centers_ : ndarray of shape (n_clusters, n_components)
        Centres in the random feature space.
    random_weights_ : ndarray of shape (n_features, n_components)
    random_offset_ : ndarray of shape (n_components,)
    kmeans_ : sklearn.cluster.KMeans

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.baselines import RFFKernelKMeans
    >>> X = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2]])
    >>> km = RFFKernelKMeans(n_clusters=2, n_components=500, gamma=0.5, random_state=0)
    >>> Z = km.fit(X).embed(X)
    >>> bool(np.abs(Z @ Z.T - km.kernel_.block(X, X)).max() < 0.3)
    True
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        n_components: int = 100,
        kernel: str | GaussianKernel = "gaussian",
        gamma: float | str | None = None,
        max_iter: int = 300,
        n_init: int = 1,
        random_state=None,
    ):
        self.n_clusters = n_clusters
        self.n_components = n_components
        self.kernel = kernel
        self.gamma = gamma
        self.max_iter = max_iter
        self.n_init = n_init
        self.random_state = random_state

    def _kernel(self, X, rng) -> Kernel:
        spec = self.kernel
        gaussian = isinstance(spec, GaussianKernel) or (
            isinstance(spec, str) and spec.lower() in ("gaussian", "rbf")
        )
        if not gaussian:
            raise ValueError(
                f"RFFKernelKMeans supports only the Gaussian kernel (kernel='gaussian' or "
                f"'rbf'), got kernel={spec!r}. Use NystromKernelKMeans or ApproxKernelKMeans "
                "for other kernels."
            )
        return super()._kernel(X, rng)

    def _fit_map(self, X, kernel, rng):
        D = check_positive_int(self.n_components, "n_components")
        d = X.shape[1]
        self.random_weights_ = rng.normal(0.0, np.sqrt(2.0 * kernel.gamma), size=(d, D))
        self.random_offset_ = rng.uniform(0.0, 2.0 * np.pi, size=D)
        return self._features(X)

    def _features(self, X):
        Z = X @ self.random_weights_
        Z += self.random_offset_
        np.cos(Z, out=Z)
        Z *= np.sqrt(2.0 / self.random_weights_.shape[1])
        return Z

    def _map(self, X):
        return self._features(X)
