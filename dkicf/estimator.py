"""`KernelKMeans`: the paper's Algorithm 2 as a scikit-learn estimator."""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from sklearn.base import (
    BaseEstimator,
    ClassNamePrefixFeaturesOutMixin,
    ClusterMixin,
    TransformerMixin,
)
from sklearn.utils.validation import check_is_fitted, validate_data

from . import io
from ._cluster import get_client
from ._factor import ICFResult
from ._mapping import FeatureMap
from ._plan import plan_for_cluster
from ._saved import read_model
from ._validation import check_array_2d, check_positive_int, is_dask_array
from ._version import __version__
from .icf import incomplete_cholesky
from .kernels import KERNELS, Kernel, make_kernel
from .kmeans import ALGORITHMS, INITS, KMeansResult, assign, kmeans
from .pivoting import check_pivoting

__all__ = ["FitStages", "KernelKMeans", "check_fit_params", "fit_stages", "load"]

class KernelKMeans(ClassNamePrefixFeaturesOutMixin, ClusterMixin, TransformerMixin,
                   BaseEstimator):
    """Kernel k-means on an incomplete Cholesky factorization of the kernel matrix.

    ``fit`` runs the paper's Algorithm 2: the incomplete Cholesky factorization
    (Algorithm 1, :func:`dkicf.incomplete_cholesky`) gives ``K ~ P P^T`` with
    ``P`` of ``n x s``, then k-means clusters the rows of ``P``.  The kernel
    matrix is never formed.  Numpy input runs in this process; a dask array
    runs on the current ``distributed`` cluster, with ``P`` kept in chunks on
    the workers.

    Parameters
    ----------
    n_clusters : int, default=8
        Number of clusters.
    kernel : str, callable or Kernel, default="gaussian"
        ``"gaussian"`` (``exp(-gamma ||x - y||^2)``; the paper's sigma is
        ``gamma``), ``"laplacian"``, ``"polynomial"``, ``"linear"``, a callable
        ``f(A, B)`` returning a kernel block, or a :class:`dkicf.kernels.Kernel`.
        Other names of :func:`sklearn.metrics.pairwise.pairwise_kernels`
        (``"sigmoid"``, ``"cosine"``, ``"chi2"``, ``"additive_chi2"``) run
        through that function (:class:`dkicf.kernels.PairwiseKernel`): its
        diagonal costs one Python call per row.
    gamma : float or "median", default=None
        Kernel width; ``None`` is the median heuristic for the Gaussian and
        Laplacian kernels (:func:`dkicf.kernels.median_gamma` on a seeded
        sample) and ``1 / n_features`` for the polynomial kernel.
    degree : int, default=3
        Degree of the polynomial kernel.
    coef0 : float, default=1.0
        Constant of the polynomial kernel (and of ``"sigmoid"``).
    kernel_params : dict, default=None
        Keyword arguments of a callable kernel, or of a kernel of
        :mod:`sklearn.metrics.pairwise` by name; dkicf's own kernels take
        ``gamma``, ``degree`` and ``coef0`` instead.
    rank : int, default=100
        Largest rank ``s`` of the factorization (columns of P).
    tol : float, default=1e-3
        The factorization stops once ``tr(K - P P^T) <= tol`` (absolute, the
        paper's epsilon).
    pivoting : str, default="block-greedy"
        Pivot rule of the factorization, a name of
        :data:`dkicf.pivoting.PIVOT_RULES`: ``"block-greedy"`` (the paper's
        greedy pivots chosen in blocks: the same pivots in far fewer passes
        over X), ``"greedy"`` (the paper's sequential loop itself) or
        ``"rpcholesky"`` (randomly pivoted Cholesky); see
        :func:`dkicf.incomplete_cholesky` and ``docs/pivoting.md``.
    algorithm : {"minibatch-lloyd", "minibatch", "lloyd"}, default="minibatch-lloyd"
        k-means on the rows of P: mini-batch steps (Sculley 2010) then
        full-batch Lloyd iterations to Lloyd's fixed point (the default),
        mini-batch alone (fastest, stops short of the optimum), or Lloyd alone
        (see :func:`dkicf.kmeans.kmeans`).
    init : {"k-means||", "k-means++"}, default="k-means||"
        Initial centres: k-means|| over all rows of P (4 passes over P that
        the restarts share; finds small clusters), or k-means++ on a sample
        of rows.
    batch_size : int, default=1024
        Rows per mini-batch step.
    n_init : int, default=5
        k-means restarts; the one with the lowest inertia (full pass) is kept.
    max_iter : int, default=100
        Mini-batch steps and Lloyd iterations (each phase) per restart.
    kmeans_tol : float, default=1e-4
        k-means tolerance: on the centres' movement, relative to the
        features' variance, and, in the Lloyd phase of ``"minibatch-lloyd"``,
        on the relative decrease of the inertia per iteration (see
        :func:`dkicf.kmeans.kmeans`).
    persist : bool, default=True
        Dask input only: hold X's chunks in worker memory, or re-read them on
        every pass (data larger than the cluster's memory).
    random_state : int, numpy.random.Generator or None, default=None
        Seeds the median heuristic and k-means: the same seed gives the same
        clusters whatever the number of workers and the chunking.
    verbose : int, default=0
        0: silent; 1: lines on stdout with each k-means run's inertia and a
        summary at the end (rank, trace error, inertia); 2: also a line after
        every pivot block and every k-means step.

    Attributes
    ----------
    labels_ : ndarray or dask array of shape (n_samples,)
        Cluster of every training point: a dask array, not gathered to this
        process, after a fit on a dask array (computed when the model is
        pickled).
    cluster_centers_ : ndarray of shape (n_clusters, rank_)
        Centres in the factor's feature space.
    inertia_ : float
        Sum of squared distances of the rows of P to their centres.
    n_iter_ : int
        k-means steps (or iterations) of the kept run.
    pivots_ : ndarray of shape (rank_,)
        Rows chosen by the factorization, in order.
    pivot_rows_ : ndarray of shape (rank_, n_features_in_)
        ``X[pivots_]``.
    cholesky_factor_ : ndarray of shape (rank_, rank_)
        ``L = P[pivots_]``, lower triangular: ``L L^T = K[pivots_, pivots_]``.
    trace_errors_ : ndarray of shape (rank_,)
        ``tr(K - P P^T)`` after each iteration of the factorization.
    rank_ : int
        Rank reached (``<= rank``; less when ``tol`` or the numerical rank of K
        stopped the factorization).
    kernel_ : Kernel
        The kernel with its resolved parameters (for example the median gamma).
    n_features_in_ : int
        Number of features seen in ``fit``.
    feature_names_in_ : ndarray of str
        Names of the features, when X has them.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf import KernelKMeans
    >>> from dkicf.synthetic import make_ring
    >>> X, y = make_ring(400, random_state=0)
    >>> model = KernelKMeans(n_clusters=2, gamma=16.0, rank=50, random_state=0).fit(X)
    >>> from dkicf.metrics import clustering_accuracy
    >>> clustering_accuracy(y, model.labels_)
    1.0
    """

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        kernel: str | Callable | Kernel = "gaussian",
        gamma: float | str | None = None,
        degree: int = 3,
        coef0: float = 1.0,
        rank: int = 100,
        tol: float = 1e-3,
        pivoting: str = "block-greedy",
        algorithm: str = "minibatch-lloyd",
        init: str = "k-means||",
        batch_size: int = 1024,
        n_init: int = 5,
        max_iter: int = 100,
        kmeans_tol: float = 1e-4,
        persist: bool = True,
        random_state=None,
        kernel_params: dict | None = None,
        verbose: int = 0,
    ):
        self.n_clusters = n_clusters
        self.kernel = kernel
        self.gamma = gamma
        self.degree = degree
        self.coef0 = coef0
        self.rank = rank
        self.tol = tol
        self.pivoting = pivoting
        self.algorithm = algorithm
        self.init = init
        self.batch_size = batch_size
        self.n_init = n_init
        self.max_iter = max_iter
        self.kmeans_tol = kmeans_tol
        self.persist = persist
        self.random_state = random_state
        self.kernel_params = kernel_params
        self.verbose = verbose

    # ------------------------------------------------------------------ fitting

    def _check_params(self, n_samples: int) -> None:
        check_positive_int(self.n_clusters, "n_clusters")
        if self.n_clusters > n_samples:
            raise ValueError(
                f"n_samples={n_samples} should be >= n_clusters={self.n_clusters}."
            )
        check_positive_int(self.rank, "rank")
        check_pivoting(self.pivoting, None, 0.0)  # a name of the rule registry
        check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.n_init, "n_init")
        check_positive_int(self.max_iter, "max_iter")
        for name in ("tol", "kmeans_tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                f"got {self.algorithm!r}."
            )
        if not isinstance(self.init, str) or self.init not in INITS:
            raise ValueError(
                f"init must be one of {', '.join(map(repr, INITS))}, got {self.init!r}."
            )
        if self.kernel_params is not None and not isinstance(self.kernel_params, dict):
            raise TypeError(
                f"kernel_params must be a dict or None, got {type(self.kernel_params).__name__}."
            )
        if isinstance(self.verbose, bool) or not isinstance(self.verbose, numbers.Integral) \
                or self.verbose < 0:
            raise ValueError(f"verbose must be an integer >= 0, got {self.verbose!r}.")
        if isinstance(self.kernel, str):
            make_kernel(self.kernel, gamma=self._gamma_for_check(), degree=self.degree,
                        coef0=self.coef0, X_sample=np.zeros((2, 1)),
                        kernel_params=self.kernel_params)

    def _gamma_for_check(self):
        # Validate gamma's type and sign without running the median heuristic.
        if self.gamma is None or (isinstance(self.gamma, str) and self.gamma == "median"):
            cls = KERNELS.get(self.kernel.lower()) if isinstance(self.kernel, str) else None
            return 1.0 if cls is not None and cls.median_width else None
        return self.gamma

    def _kernel_arg(self):
        """The kernel for the factorization: built here when kernel_params apply to it."""
        if self.kernel_params is None and (not isinstance(self.kernel, str)
                                           or self.kernel.lower() in KERNELS):
            return self.kernel
        return make_kernel(self.kernel, gamma=self.gamma, degree=self.degree, coef0=self.coef0,
                           kernel_params=self.kernel_params)

    def _seeds(self):
        rng = (
            self.random_state
            if isinstance(self.random_state, np.random.Generator)
            else np.random.default_rng(self.random_state)
        )
        icf_seed, km_seed = rng.integers(0, 2**31 - 1, size=2)
        return int(icf_seed), int(km_seed)

    def fit(self, X, y=None, *, progress=None):
        """Factorize the kernel matrix of X and cluster the rows of the factor.

        Parameters
        ----------
        X : array-like or dask array of shape (n_samples, n_features)
        y : ignored
        progress : callable, optional
            Called with :class:`dkicf.ICFProgress` during the factorization and
            with k-means progress records afterwards.

        Returns
        -------
        self
        """
        labels = self._fit(X, progress=progress)
        self.labels_ = labels if is_dask_array(labels) else np.asarray(labels)
        return self

    def fit_predict(self, X, y=None, *, progress=None):
        """Fit and return the labels (a dask array, not gathered, for dask input)."""
        return self.fit(X, progress=progress).labels_

    def _fit(self, X, progress=None):
        dask_input = is_dask_array(X)
        if dask_input:
            X = check_array_2d(X, "X")
            self.n_features_in_ = X.shape[1]
        else:
            # NaN and infinity are refused by check_array_2d, which names the first bad row.
            X = validate_data(self, X, dtype=[np.float64, np.float32], ensure_min_samples=1,
                              ensure_all_finite=False)
            X = check_array_2d(X, "X")
        self._check_params(X.shape[0])
        client = plan = None
        if dask_input:  # the workers measured once, for both stages
            client = get_client()
            plan = plan_for_cluster(client, X.shape, X.chunks[0][0], X.dtype.itemsize,
                                    self.rank, p_storage="memory",
                                    persist="yes" if self.persist else "no", decide=False,
                                    n_init=self.n_init, init=self.init,
                                    algorithm=self.algorithm)
        stages = fit_stages(self, X, client=client, plan=plan, progress=progress)
        icf, km = stages.factor, stages.clustering
        if self.verbose:
            print(f"KernelKMeans: rank {icf.rank} ({icf.stop_reason}), trace error "
                  f"{float(icf.trace_errors[-1]) if icf.rank else icf.initial_trace:.4g}; "
                  f"k-means inertia {km.inertia:.6g} after {km.n_iter} steps")
        return km.labels

    def _feature_map(self) -> FeatureMap:
        """What the tasks of predict/transform carry: the map of new rows alone.

        Not the estimator: a dask ``labels_`` would travel with every task
        (pickling it there would compute it), and unpickling an estimator
        imports scikit-learn in every worker.
        """
        return FeatureMap(self.kernel_, self.pivot_rows_, self.cholesky_factor_,
                          getattr(self, "_pivot_aux", None), self.cluster_centers_)

    @property
    def _n_features_out(self) -> int:
        """Columns of :meth:`transform`: the rank reached (for ``get_feature_names_out``)."""
        return self.rank_

    def _set_fitted(self, icf: ICFResult, centers, inertia, n_iter) -> None:
        self.kernel_ = icf.kernel
        self.pivots_ = icf.pivots
        self.pivot_rows_ = icf.pivot_rows
        self.cholesky_factor_ = icf.L
        self.trace_errors_ = icf.trace_errors
        self.initial_trace_ = icf.initial_trace
        self.rank_ = icf.rank
        self.stop_reason_ = icf.stop_reason
        self.n_passes_ = icf.n_passes
        self.cluster_centers_ = np.asarray(centers, dtype=np.float64)
        self.inertia_ = float(inertia)
        self.n_iter_ = int(n_iter)
        self._pivot_aux = icf.kernel.prepare(icf.pivot_rows)

    # --------------------------------------------------------------- prediction

    def _check_X_predict(self, X):
        """Validated X for predict, transform and score.

        Numpy input is checked for NaN and infinity here; a dask array is
        checked chunk by chunk inside the tasks that use it (see
        :func:`dkicf._mapping.checked_features`), so X is never gathered.
        """
        check_is_fitted(self, "cluster_centers_")
        if is_dask_array(X):
            X = check_array_2d(X, "X")
            if X.shape[1] != self.n_features_in_:
                raise ValueError(
                    f"X has {X.shape[1]} features, but {type(self).__name__} is expecting "
                    f"{self.n_features_in_} features as input."
                )
            return X
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False,
                          ensure_all_finite=False)
        return check_array_2d(X, "X")

    def transform(self, X):
        """The factor's features of X: ``p(x) = L^{-1} k(X_B, x)``.

        On a training point this is its row of P.

        Returns
        -------
        ndarray or dask array of shape (n_samples, rank_)

        Raises
        ------
        ValueError
            If X contains NaN or infinity, naming X's first bad row (and, for a
            dask array, its chunk: raised when that chunk is computed).
        """
        return self._transform_checked(self._check_X_predict(X))

    def _transform_checked(self, X):
        """Features of an X from :meth:`_check_X_predict`; dask chunks are checked in tasks."""
        if is_dask_array(X):
            return self._feature_map().dask_features(X)
        return self._feature_map().features(X)

    def predict(self, X):
        """Nearest centre in the factor's feature space for every row of X.

        Returns
        -------
        ndarray or dask array of shape (n_samples,)

        Raises
        ------
        ValueError
            If X contains NaN or infinity, naming X's first bad row (and, for a
            dask array, its chunk: raised when that chunk is computed).
        """
        X = self._check_X_predict(X)
        if is_dask_array(X):
            return self._feature_map().dask_labels(X)
        return self._feature_map().labels(X)

    def score(self, X, y=None):
        """Opposite of the inertia of X's features with respect to the centres."""
        P = self._transform_checked(self._check_X_predict(X))
        _, inertia = assign(P, self.cluster_centers_)
        return -float(inertia)

    # ------------------------------------------------------------- persistence

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_pivot_aux", None)
        if is_dask_array(state.get("labels_")):
            # A pickle holds values, not a graph tied to a cluster.
            state["labels_"] = np.asarray(state["labels_"].compute())
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "kernel_" in state:
            self._pivot_aux = self.kernel_.prepare(self.pivot_rows_)

    def save(self, path, *, overwrite: bool = False, storage_options=None) -> None:
        """Write the fitted model to a Zarr group (arrays and JSON attributes, no pickle).

        Parameters
        ----------
        path : str
            Local path or fsspec URL of the group to create.
        overwrite : bool, default=False
            Replace an existing group; without it an existing path is refused
            and left untouched.
        storage_options : dict, optional
            Passed to fsspec for remote URLs.
        """
        path = io.absolute_location(path)
        arrays, attrs = _model_arrays_attrs(self)
        if getattr(self, "labels_", None) is not None:
            arrays["labels"] = np.asarray(self.labels_, dtype=np.int32)
        io.write_group(path, arrays, attrs, kind="model", overwrite=overwrite,
                       storage_options=storage_options)


@dataclass(frozen=True)
class FitStages:
    """What the two stages of one fit gave (see :func:`fit_stages`)."""

    factor: ICFResult
    clustering: KMeansResult
    factor_seconds: float
    kmeans_seconds: float


def check_fit_params(model: KernelKMeans, n_samples: int) -> None:
    """Refuse a model's parameters that cannot fit ``n_samples`` rows, naming the parameter.

    :func:`fit_stages` does it first; a caller with work to do before the
    fit (planning, claiming outputs) calls it before that work.
    """
    model._check_params(n_samples)


def fit_stages(model: KernelKMeans, X, *, client=None, plan=None, progress=None,
               factor_options: dict | None = None,
               kmeans_options: dict | None = None) -> FitStages:
    """The one composition of a fit: Algorithm 1, then k-means on the rows of P.

    :meth:`KernelKMeans.fit` and :func:`dkicf.pipeline.fit_store` both fit
    through it.  It checks ``model``'s parameters against X, draws both
    stages' seeds from its ``random_state``, factorizes the kernel matrix of
    X (:func:`dkicf.incomplete_cholesky`), clusters the rows of P
    (:func:`dkicf.kmeans.kmeans`; P read from Zarr in every pass where the
    factorization kept it there) and sets the model's fitted attributes
    (``labels_`` is the caller's: the clustering's labels are returned).

    Parameters
    ----------
    model : KernelKMeans
    X : ndarray or dask array of shape (n_samples, n_features), checked
    client, plan : optional
        The dask cluster and the fit's plan (:func:`dkicf.pipeline.plan_fit`),
        handed to both stages.
    progress : callable, optional
        As for :meth:`KernelKMeans.fit`, plus the lines of ``model.verbose``.
    factor_options, kmeans_options : dict, optional
        Further keyword arguments of each stage: X held or re-read, where P
        is kept, checkpoints.

    Returns
    -------
    FitStages
    """
    model._check_params(X.shape[0])
    icf_seed, km_seed = model._seeds()
    progress = _verbose_progress(model.verbose, progress)
    t0 = time.perf_counter()
    icf = incomplete_cholesky(
        X, kernel=model._kernel_arg(), gamma=model.gamma, degree=model.degree,
        coef0=model.coef0, max_rank=model.rank, tol=model.tol, pivoting=model.pivoting,
        random_state=icf_seed, progress=progress, client=client, plan=plan,
        **{"persist": model.persist, **(factor_options or {})},
    )
    t_icf = time.perf_counter() - t0
    # A P kept in Zarr is larger than the cluster's memory: read, not held.
    p_where = icf.info.get("p_storage", "memory" if plan is None else plan.p_storage)
    t0 = time.perf_counter()
    km = kmeans(
        icf.P, model.n_clusters, algorithm=model.algorithm, init=model.init,
        batch_size=model.batch_size, n_init=model.n_init, max_iter=model.max_iter,
        tol=model.kmeans_tol, random_state=km_seed, progress=progress, client=client,
        plan=plan, persist=p_where != "zarr", **(kmeans_options or {}),
    )
    model.n_features_in_ = X.shape[1]
    model._set_fitted(icf, km.cluster_centers, km.inertia, km.n_iter)
    return FitStages(icf, km, t_icf, time.perf_counter() - t0)


def _verbose_progress(verbose: int, progress):
    """``progress``, plus the lines of ``verbose`` on stdout."""
    if verbose < 1:
        return progress

    def report(info) -> None:
        if progress is not None:
            progress(info)
        kind = type(info).__name__
        if kind == "ICFProgress":
            if verbose >= 2:
                print(f"factorization: rank {info.rank}/{info.max_rank}, trace error "
                      f"{info.trace_error:.4g} of {info.initial_trace:.4g}, "
                      f"{info.n_passes} passes")
            return
        run = f"k-means run {info.restart + 1}/{info.n_init}"
        if verbose >= 2:
            print(f"{run}: {info.phase} step {info.step}, inertia {info.inertia:.6g}")
        elif info.done:
            print(f"{run} done at {info.phase} step {info.step}: inertia {info.inertia:.6g}")

    return report


def _model_arrays_attrs(model: KernelKMeans) -> tuple[dict, dict]:
    """The fitted model as arrays and JSON attributes (the saved format, of kind "model")."""
    check_is_fitted(model, "cluster_centers_")
    kparams = model.kernel_.get_params()
    if kparams["kernel"] == "callable":
        raise ValueError(
            "a model with a callable kernel cannot be saved without pickle; "
            "subclass dkicf.kernels.Kernel with JSON parameters, or pickle the estimator."
        )
    arrays = {
        "cluster_centers": model.cluster_centers_,
        "pivots": model.pivots_,
        "pivot_rows": model.pivot_rows_,
        "cholesky_factor": model.cholesky_factor_,
        "trace_errors": model.trace_errors_,
    }
    params = {k: v for k, v in model.get_params().items() if _is_json(v)}
    attrs = {
        "kernel": kparams,
        "params": params,
        "n_features_in": int(model.n_features_in_),
        "rank": int(model.rank_),
        "inertia": model.inertia_,
        "n_iter": model.n_iter_,
        "initial_trace": float(model.initial_trace_),
        "stop_reason": model.stop_reason_,
        "n_passes": int(model.n_passes_),
        "versions": _versions(),
    }
    if hasattr(model, "feature_names_in_"):
        attrs["feature_names_in"] = [str(f) for f in model.feature_names_in_]
    return arrays, attrs


def _is_json(v) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


def _versions() -> dict:
    import dask
    import distributed
    import scipy
    import sklearn
    import zarr

    return {
        "dkicf": __version__,
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "scikit-learn": sklearn.__version__,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "zarr": zarr.__version__,
    }


def load(path, *, storage_options=None) -> KernelKMeans:
    """Load a model written by :meth:`KernelKMeans.save`.

    Parameters
    ----------
    path : str
        Local path or fsspec URL of the model group.
    storage_options : dict, optional

    Returns
    -------
    KernelKMeans
        Fitted, predicting exactly as the saved model.

    Raises
    ------
    DkicfIOError
        The group is not a dkicf model, is damaged, or was written by a newer
        dkicf (a later Zarr layout schema).  Models of earlier schemas are read.
    """
    saved = read_model(path, storage_options=storage_options)
    params = {k: v for k, v in saved.params.items() if k in KernelKMeans().get_params()}
    model = KernelKMeans(**params)
    # A SavedModel's fields are the fitted attributes' names without their underscore.
    for field in dataclasses.fields(saved):
        value = getattr(saved, field.name)
        if field.name != "params" and value is not None:
            setattr(model, f"{field.name}_", value)
    model._pivot_aux = model.kernel_.prepare(model.pivot_rows_)
    return model
