"""A saved model, read and checked without scikit-learn.

:func:`read_model` gives the arrays and attributes that
:meth:`KernelKMeans.save <dkicf.KernelKMeans.save>` wrote, checked, and
their :class:`~dkicf._mapping.FeatureMap`.  :func:`dkicf.load` builds the
estimator from it; ``dkicf predict`` and ``dkicf plot`` use it alone, so
they do not import scikit-learn (1.5-3 s of a command that takes a few).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import io
from ._mapping import FeatureMap
from .kernels import Kernel, make_kernel

#: The arrays of a saved model's group (``P`` and ``labels`` are read on their own).
MODEL_ARRAYS = ("cluster_centers", "pivots", "pivot_rows", "cholesky_factor", "trace_errors")


@dataclass(frozen=True, eq=False)
class SavedModel:
    """A saved model's contents, as the fitted estimator's attributes hold them.

    The names are those of :class:`~dkicf.KernelKMeans`'s fitted attributes
    without their trailing underscore; ``params`` are the estimator's
    parameters that were saved.
    """

    params: dict
    kernel: Kernel
    pivots: np.ndarray
    pivot_rows: np.ndarray
    cholesky_factor: np.ndarray
    trace_errors: np.ndarray
    cluster_centers: np.ndarray
    n_features_in: int
    feature_names_in: np.ndarray | None
    rank: int
    inertia: float
    n_iter: int
    initial_trace: float
    stop_reason: str
    n_passes: int

    def feature_map(self) -> FeatureMap:
        """The map of new rows: ``p(x)`` and the nearest centre."""
        return FeatureMap(self.kernel, self.pivot_rows, self.cholesky_factor,
                          self.kernel.prepare(self.pivot_rows), self.cluster_centers)


def read_model(path, *, storage_options=None) -> SavedModel:
    """Read and check a model written by :meth:`KernelKMeans.save <dkicf.KernelKMeans.save>`.

    Raises
    ------
    DkicfIOError
        The group is not a dkicf model, is damaged, or was written by a newer
        dkicf (a later Zarr layout schema).  Models of earlier schemas are read.
    """
    path = io.absolute_location(path)
    arrays, attrs = io.read_group(path, storage_options=storage_options, names=MODEL_ARRAYS,
                                  kind="model")
    kernel = _check_saved_model(path, arrays, attrs)
    names = attrs.get("feature_names_in")
    return SavedModel(
        params=dict(attrs["params"]),
        kernel=kernel,
        pivots=np.asarray(arrays["pivots"], dtype=np.int64),
        pivot_rows=np.asarray(arrays["pivot_rows"], dtype=np.float64),
        cholesky_factor=np.asarray(arrays["cholesky_factor"], dtype=np.float64),
        trace_errors=np.asarray(arrays["trace_errors"], dtype=np.float64),
        cluster_centers=np.asarray(arrays["cluster_centers"], dtype=np.float64),
        n_features_in=int(attrs["n_features_in"]),
        feature_names_in=None if names is None else np.asarray(names, dtype=object),
        rank=int(attrs["rank"]),
        inertia=float(attrs["inertia"]),
        n_iter=int(attrs["n_iter"]),
        initial_trace=float(attrs["initial_trace"]),
        stop_reason=attrs["stop_reason"],
        n_passes=int(attrs["n_passes"]),
    )


def _check_saved_model(path: str, arrays: dict, attrs: dict) -> Kernel:
    """Refuse a model group whose arrays or attributes a fit cannot have written.

    Models are input too: a damaged or tampered group must fail here, naming
    what is wrong, not deep inside a prediction (or, worse, predict labels).
    Returns the model's kernel.
    """
    def refuse(what: str):
        raise io.DkicfIOError(
            f"{path} is not a valid dkicf model: {what}. The model group is damaged or was "
            "changed: restore it, or fit and save the model again."
        )

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key, check, kind in [
        ("params", lambda v: isinstance(v, dict), "a dict"),
        ("kernel", lambda v: isinstance(v, dict) and isinstance(v.get("kernel"), str),
         "a dict naming the kernel"),
        ("n_features_in", lambda v: integer(v) and v >= 1, "a positive integer"),
        ("rank", lambda v: integer(v) and v >= 0, "a non-negative integer"),
        ("inertia", lambda v: number(v) and np.isfinite(v) and v >= 0, "a finite number >= 0"),
        ("n_iter", lambda v: integer(v) and v >= 0, "a non-negative integer"),
        ("initial_trace", lambda v: number(v) and np.isfinite(v), "a finite number"),
        ("stop_reason", lambda v: isinstance(v, str), "a string"),
        ("n_passes", lambda v: integer(v) and v >= 0, "a non-negative integer"),
    ]:
        if key not in attrs:
            refuse(f"the attribute {key!r} is missing")
        if not check(attrs[key]):
            refuse(f"the attribute {key!r} is {str(attrs[key])[:60]}, not {kind}")
    missing = [name for name in MODEL_ARRAYS if name not in arrays]
    if missing:
        refuse(f"the array(s) {', '.join(missing)} are missing")
    r, d = attrs["rank"], attrs["n_features_in"]
    pivots, rows = arrays["pivots"], arrays["pivot_rows"]
    L, centers = arrays["cholesky_factor"], arrays["cluster_centers"]
    trace_errors = arrays["trace_errors"]
    if pivots.shape != (r,) or pivots.dtype.kind not in "iu":
        refuse(f"pivots has shape {pivots.shape} and dtype {pivots.dtype}, not ({r},) "
               "integers (one training row per rank)")
    shape = attrs["input"].get("shape") if isinstance(attrs.get("input"), dict) else None
    n_train = shape[0] if isinstance(shape, list) and shape and integer(shape[0]) else None
    if r and (pivots.min() < 0 or (n_train is not None and pivots.max() >= n_train)):
        within = f"0..{n_train - 1}, the training rows" if n_train is not None else "0.."
        refuse(f"pivots range over {pivots.min()}..{pivots.max()}, outside {within}")
    if np.unique(pivots).size != pivots.size:
        refuse("pivots holds the same row twice")
    if rows.shape != (r, d):
        refuse(f"pivot_rows has shape {rows.shape}, not ({r}, {d}) (rank, n_features_in)")
    if L.shape != (r, r):
        refuse(f"cholesky_factor has shape {L.shape}, not ({r}, {r})")
    if np.any(np.triu(L, 1)):
        refuse("cholesky_factor is not lower triangular")
    if r and not np.all(np.diag(L) > 0):
        refuse("cholesky_factor has a diagonal entry that is not positive")
    if centers.ndim != 2 or centers.shape[1] != r or centers.shape[0] < 1:
        refuse(f"cluster_centers has shape {centers.shape}, not (n_clusters, {r})")
    k = attrs["params"].get("n_clusters")
    if integer(k) and centers.shape[0] != k:
        refuse(f"cluster_centers has {centers.shape[0]} rows for n_clusters={k}")
    if trace_errors.ndim != 1:
        refuse(f"trace_errors has shape {trace_errors.shape}, not 1-D")
    for name, value in (("pivot_rows", rows), ("cholesky_factor", L),
                        ("cluster_centers", centers), ("trace_errors", trace_errors)):
        if not np.isfinite(value).all():
            refuse(f"{name} holds NaN or infinity")
    names = attrs.get("feature_names_in")
    if names is not None and (not isinstance(names, list) or len(names) != d
                              or not all(isinstance(n, str) for n in names)):
        refuse(f"feature_names_in is not a list of {d} strings")
    kparams = dict(attrs["kernel"])
    name = kparams.pop("kernel")
    try:
        return make_kernel(name, **kparams)
    except (TypeError, ValueError) as exc:
        refuse(f"its kernel {attrs['kernel']} cannot be made ({exc})")
