"""Kernel functions: a registry looked up by name, diagonals and kernel blocks.

Every kernel here works on row blocks of the data and never forms the full
``n x n`` matrix.  A kernel gives

* ``prepare(X)``: per-row auxiliary values computed once per chunk (squared
  row norms for the Gaussian kernel), so that kernel columns cost one
  matrix-vector product;
* ``diag(X, aux)``: the diagonal ``k(x_i, x_i)`` without any pairwise work;
* ``block(A, B, a_aux, b_aux)``: the block ``k(A_i, B_j)`` as a float64 array;
* ``column(A, b, a_aux, b_aux)``: one column ``k(A_i, b)`` as a 1-D float64
  array (one pivot of the factorization: a matrix-vector product).

Kernels are small, picklable objects whose parameters are plain JSON values
(:meth:`Kernel.get_params`), so they can be shipped to dask workers and saved
with a model.

The registry :data:`KERNELS` maps every name and alias to its class.  A
kernel class declares them, and the hyper-parameters it takes (names in
:data:`HYPERPARAMETERS`), where it is defined; :func:`register_kernel` adds
it, and :func:`make_kernel`, the estimator and the ``dkicf`` command read the
registry from there.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Kernel",
    "GaussianKernel",
    "LaplacianKernel",
    "PolynomialKernel",
    "LinearKernel",
    "CallableKernel",
    "PairwiseKernel",
    "HyperParameter",
    "HYPERPARAMETERS",
    "KERNELS",
    "kernel_names",
    "make_kernel",
    "median_gamma",
    "register_kernel",
]


@dataclass(frozen=True)
class HyperParameter:
    """A hyper-parameter of kernels: a keyword of their constructor and of :func:`make_kernel`.

    Attributes
    ----------
    name : str
        The keyword, and the ``dkicf`` command's flag ``--<name>``.
    help : str
        What the flag's help says.
    default : object
        The flag's default.
    from_text : callable
        Reads the flag's value from its text; raises ValueError with a
        message that says what is expected.
    """

    name: str
    help: str
    default: Any
    from_text: Callable[[str], Any]


def _gamma_from_text(text: str):
    """A positive number, a power such as the paper's ``2^-6``, or ``"median"``."""
    if text == "median":
        return "median"
    if "^" in text:
        base, _, exp = text.partition("^")
        try:
            return float(base) ** float(exp)
        except ValueError:
            pass
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"expected a positive number, a power like 2^-6, or 'median', got {text!r}"
        ) from None
    if not value > 0:
        raise ValueError(f"gamma must be > 0, got {text}")
    return value


def _degree_from_text(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {value}")
    return value


#: Every hyper-parameter a registered kernel may take, by name.
HYPERPARAMETERS: dict[str, HyperParameter] = {
    hp.name: hp for hp in (
        HyperParameter("gamma", "kernel width (number, 2^e, or 'median'; default: median)",
                       "median", _gamma_from_text),
        HyperParameter("degree", "degree of the polynomial kernel (default: 3)", 3,
                       _degree_from_text),
        HyperParameter("coef0", "constant term of the polynomial kernel (default: 1.0)", 1.0,
                       float),
    )
}


class Kernel(abc.ABC):
    """Base class of the kernels.

    Subclasses implement :meth:`block` and :meth:`diag`; :meth:`prepare` is
    optional.  All arrays returned are float64.  A subclass that
    :func:`register_kernel` adds declares its :attr:`name`, :attr:`aliases`
    and :attr:`hyperparameters`.
    """

    #: The name that :func:`make_kernel` takes and :meth:`get_params` saves.
    name = "kernel"
    #: Other names :func:`make_kernel` takes for the kernel.
    aliases: tuple[str, ...] = ()
    #: Names in :data:`HYPERPARAMETERS` that the constructor takes, as keywords.
    hyperparameters: tuple[str, ...] = ()
    #: Whether ``gamma="median"`` (:func:`median_gamma`) sets its width.
    median_width = False

    @classmethod
    def _from_hyperparameters(cls, values: dict, *, X_sample=None, seed: int = 0) -> Kernel:
        """The kernel for :func:`make_kernel`'s value of each of :attr:`hyperparameters`.

        Kernels whose defaults depend on the data (``X_sample``) or that check
        their values override it.
        """
        return cls(**values)

    def prepare(self, X: np.ndarray) -> np.ndarray | None:
        """Per-row values that :meth:`block` and :meth:`diag` reuse (or None)."""
        return None

    @abc.abstractmethod
    def diag(self, X: np.ndarray, aux: np.ndarray | None = None) -> np.ndarray:
        """Return ``k(x_i, x_i)`` for every row of ``X``."""

    @abc.abstractmethod
    def block(
        self,
        A: np.ndarray,
        B: np.ndarray,
        a_aux: np.ndarray | None = None,
        b_aux: np.ndarray | None = None,
    ) -> np.ndarray:
        """Return the kernel block ``K[i, j] = k(A[i], B[j])`` of shape (len(A), len(B))."""

    def _block_t_into(self, A, B, a_aux, b_aux, out: np.ndarray) -> np.ndarray:
        """The transposed block ``block(A, B).T`` written into ``out`` (float64,
        C-ordered, ``(len(B), len(A))``).

        Block updates call this on every slice of rows (``A``, many) against a
        block's pivots (``B``, few), with the same scratch array, so that the
        kernel values need no fresh memory each time (processes with a small
        mmap threshold, such as dask workers under a nanny, would otherwise
        fault in new pages for every slice).  Transposed, the values are laid
        out as P's Fortran-ordered columns, and the products that form them
        are short and wide, which BLAS runs faster than tall and skinny ones.
        """
        out[...] = self.block(A, B, a_aux, b_aux).T
        return out

    def column(
        self,
        A: np.ndarray,
        b: np.ndarray,
        a_aux: np.ndarray | None = None,
        b_aux: float | None = None,
    ) -> np.ndarray:
        """Return the kernel column ``k(A[i], b)`` for one row ``b``, shape (len(A),).

        The default evaluates a one-column :meth:`block`; kernels override it
        with a matrix-vector product.
        """
        B = np.asarray(b)[None, :]
        aux = None if b_aux is None else np.array([b_aux], dtype=np.float64)
        return self.block(A, B, a_aux, aux)[:, 0]

    def roundoff(self, max_sqnorm: float, n_features: int) -> float:
        """Relative size of the rounding error of one kernel entry, in units of eps.

        Used to tell a residual that is pure rounding noise from a real one
        (the numerical-rank stop of the factorization).
        """
        return 4.0

    def get_params(self) -> dict[str, Any]:
        """Kernel name and parameters as JSON-compatible values."""
        return {"kernel": self.name, **{key: getattr(self, key) for key in self.hyperparameters}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if k != "kernel")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_params() == other.get_params()

    def __hash__(self) -> int:
        return hash(repr(self))


def _sqnorms(X: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", X, X, dtype=np.float64)


# Up to this many rows of B, ``B @ A.T`` runs as one matrix-vector product per
# row where A has at least ``gemv_columns`` columns: OpenBLAS's matrix product
# of so few rows took 1.1-2x longer there.  For a slice of X (C-ordered) that
# holds from _GEMV_FEATURES features (8,192 rows, 64 and 784 features, one
# thread; faster with fewer); for P's Fortran-ordered columns at every rank.
_GEMV_ROWS = 3
_GEMV_FEATURES = 32


def _dot_t(B: np.ndarray, A: np.ndarray, out: np.ndarray,
           gemv_columns: int = _GEMV_FEATURES) -> np.ndarray:
    """``B @ A.T`` into ``out`` (float64, C-ordered ``(len(B), len(A))``), B few rows."""
    if B.shape[0] <= _GEMV_ROWS and A.shape[1] >= gemv_columns:
        for j in range(B.shape[0]):
            np.dot(A, B[j], out=out[j])
        return out
    return np.dot(B, A.T, out=out)


class _WidthKernel(Kernel):
    """A kernel of one width ``gamma``, by default the median heuristic's."""

    hyperparameters = ("gamma",)
    median_width = True

    def __init__(self, gamma: float):
        self.gamma = float(gamma)

    @classmethod
    def _from_hyperparameters(cls, values, *, X_sample=None, seed=0):
        gamma = values["gamma"]
        if gamma is None or (isinstance(gamma, str) and gamma == "median"):
            if X_sample is None:
                raise ValueError("gamma='median' needs a sample of the data (X_sample).")
            gamma = median_gamma(X_sample, cls.name, seed=seed)
        elif isinstance(gamma, str):
            raise ValueError(f"gamma must be a positive number or 'median', got {gamma!r}.")
        return cls(_check_gamma(gamma))

    def diag(self, X, aux=None):
        return np.ones(X.shape[0], dtype=np.float64)


class GaussianKernel(_WidthKernel):
    """Gaussian kernel ``exp(-gamma * ||x - y||^2)`` (the paper's sigma is ``gamma``)."""

    name = "gaussian"
    aliases = ("rbf",)
    _aux_is_sqnorms = True  # prepare() returns the squared row norms

    def prepare(self, X):
        return _sqnorms(X)

    def block(self, A, B, a_aux=None, b_aux=None):
        a_sq = _sqnorms(A) if a_aux is None else a_aux
        b_sq = _sqnorms(B) if b_aux is None else b_aux
        out = np.dot(A, 2.0 * B.T)
        if out.dtype != np.float64:
            out = out.astype(np.float64)
        out -= a_sq[:, None]
        out -= b_sq[None, :]
        return self._finish(out)

    def _block_t_into(self, A, B, a_aux, b_aux, out):
        if A.dtype != np.float64 or B.dtype != np.float64:
            return super()._block_t_into(A, B, a_aux, b_aux, out)
        a_sq = _sqnorms(A) if a_aux is None else a_aux
        b_sq = _sqnorms(B) if b_aux is None else b_aux
        _dot_t(2.0 * B, A, out)
        out -= b_sq[:, None]
        out -= a_sq[None, :]
        return self._finish(out)

    def column(self, A, b, a_aux=None, b_aux=None):
        a_sq = _sqnorms(A) if a_aux is None else a_aux
        b_sq = float(np.dot(b, b)) if b_aux is None else float(b_aux)
        out = np.dot(A, 2.0 * b)
        if out.dtype != np.float64:
            out = out.astype(np.float64)
        out -= a_sq
        out -= b_sq
        return self._finish(out)

    def _finish(self, out):
        # out = -||a - b||^2 = 2 a.b - |a|^2 - |b|^2, in place: no temporaries.
        np.minimum(out, 0.0, out=out)  # squared distances cannot be negative
        out *= self.gamma
        np.exp(out, out=out)
        return out

    def roundoff(self, max_sqnorm, n_features):
        # |a|^2 + |b|^2 - 2 a.b loses about 4 * eps * max|x|^2 absolutely.
        return 8.0 * self.gamma * max(max_sqnorm, 1.0) * max(n_features, 1) ** 0.5 + 4.0


class LaplacianKernel(_WidthKernel):
    """Laplacian kernel ``exp(-gamma * ||x - y||_1)``."""

    name = "laplacian"

    def block(self, A, B, a_aux=None, b_aux=None):
        # Imported here: scipy.spatial would double what the command line's
        # parser, which reads the registry, takes to start.
        from scipy.spatial.distance import cdist

        out = cdist(np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64), "cityblock")
        out *= -self.gamma
        np.exp(out, out=out)
        return out


class PolynomialKernel(Kernel):
    """Polynomial kernel ``(gamma * <x, y> + coef0) ** degree``."""

    name = "polynomial"
    aliases = ("poly",)
    hyperparameters = ("gamma", "degree", "coef0")
    _aux_is_sqnorms = True  # prepare() returns the squared row norms

    def __init__(self, gamma: float, degree: int = 3, coef0: float = 1.0):
        self.gamma = float(gamma)
        self.degree = int(degree)
        self.coef0 = float(coef0)

    @classmethod
    def _from_hyperparameters(cls, values, *, X_sample=None, seed=0):
        gamma, degree = values["gamma"], values["degree"]
        if gamma is None:
            if X_sample is None:
                raise ValueError("the polynomial kernel needs gamma or X_sample for 1/n_features.")
            gamma = 1.0 / max(X_sample.shape[1], 1)
        elif isinstance(gamma, str):
            raise ValueError(
                f"gamma={gamma!r} is only defined for the gaussian and laplacian kernels; "
                "give the polynomial kernel a number."
            )
        if isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or degree < 1:
            raise ValueError(f"degree must be an integer >= 1, got {degree!r}.")
        return cls(_check_gamma(gamma), degree=int(degree), coef0=float(values["coef0"]))

    def prepare(self, X):
        return _sqnorms(X)

    def diag(self, X, aux=None):
        sq = _sqnorms(X) if aux is None else aux
        return (self.gamma * sq + self.coef0) ** self.degree

    def block(self, A, B, a_aux=None, b_aux=None):
        return self._finish(np.dot(A, B.T).astype(np.float64, copy=False))

    def _block_t_into(self, A, B, a_aux, b_aux, out):
        if A.dtype != np.float64 or B.dtype != np.float64:
            return super()._block_t_into(A, B, a_aux, b_aux, out)
        return self._finish(_dot_t(B, A, out))

    def column(self, A, b, a_aux=None, b_aux=None):
        return self._finish(np.dot(A, b).astype(np.float64, copy=False))

    def _finish(self, out):
        out *= self.gamma
        out += self.coef0
        return np.power(out, self.degree, out=out)

    def roundoff(self, max_sqnorm, n_features):
        return 4.0 * self.degree * max(n_features, 1)


class LinearKernel(Kernel):
    """Linear kernel ``<x, y>``: kernel k-means then equals ordinary k-means."""

    name = "linear"
    _aux_is_sqnorms = True  # prepare() returns the squared row norms

    def prepare(self, X):
        return _sqnorms(X)

    def diag(self, X, aux=None):
        return _sqnorms(X) if aux is None else aux.copy()

    def block(self, A, B, a_aux=None, b_aux=None):
        return np.dot(A, B.T).astype(np.float64, copy=False)

    def _block_t_into(self, A, B, a_aux, b_aux, out):
        if A.dtype != np.float64 or B.dtype != np.float64:
            return super()._block_t_into(A, B, a_aux, b_aux, out)
        return _dot_t(B, A, out)

    def column(self, A, b, a_aux=None, b_aux=None):
        return np.dot(A, b).astype(np.float64, copy=False)

    def roundoff(self, max_sqnorm, n_features):
        return 4.0 * max(n_features, 1)


class CallableKernel(Kernel):
    """A kernel given by a user function that computes a block.

    Parameters
    ----------
    func : callable
        ``func(A, B) -> ndarray`` of shape ``(len(A), len(B))``.  It must be a
        positive semi-definite kernel and must be picklable to run on dask
        workers (a module-level function, not a lambda, for distributed use).
    diag : callable, optional
        ``diag(X) -> ndarray`` of shape ``(len(X),)``.  Without it the diagonal
        is evaluated from small diagonal blocks of ``func``, which costs
        ``batch`` kernel evaluations per row.
    """

    name = "callable"

    def __init__(self, func: Callable, diag: Callable | None = None):
        if not callable(func):
            raise TypeError(f"kernel must be a name or a callable, got {type(func).__name__}.")
        self.func = func
        self.diag_func = diag

    def _call(self, A, B):
        out = np.asarray(self.func(A, B), dtype=np.float64)
        if out.shape != (A.shape[0], B.shape[0]):
            raise ValueError(
                f"the kernel callable returned shape {out.shape} for inputs of "
                f"{A.shape[0]} and {B.shape[0]} rows; it must return "
                f"({A.shape[0]}, {B.shape[0]})."
            )
        return out

    def diag(self, X, aux=None):
        if self.diag_func is not None:
            out = np.asarray(self.diag_func(X), dtype=np.float64).reshape(-1)
            if out.shape[0] != X.shape[0]:
                raise ValueError(
                    f"the kernel's diag callable returned {out.shape[0]} values for "
                    f"{X.shape[0]} rows."
                )
            return out
        batch = 64
        parts = [np.diagonal(self._call(X[i : i + batch], X[i : i + batch])).copy()
                 for i in range(0, X.shape[0], batch)]
        return np.concatenate(parts) if parts else np.empty(0)

    def block(self, A, B, a_aux=None, b_aux=None):
        return self._call(A, B)

    def get_params(self):
        name = getattr(self.func, "__qualname__", repr(self.func))
        return {"kernel": self.name, "function": f"{getattr(self.func, '__module__', '')}.{name}"}

    def __eq__(self, other):
        return isinstance(other, CallableKernel) and self.func is other.func

    def __hash__(self):
        return hash(self.func)


class PairwiseKernel(Kernel):
    """A kernel of :func:`sklearn.metrics.pairwise.pairwise_kernels`, by its metric name.

    The fallback for the names that dkicf does not define itself
    (``"sigmoid"``, ``"cosine"``, ``"chi2"``, ``"additive_chi2"``).  Blocks
    are one call of ``pairwise_kernels``; the diagonal calls it on each row
    alone, one Python call per row (about 20 to 50 µs each: some seconds per
    million rows and pass, so several times slower than a kernel of dkicf's
    own, whose diagonal is a closed form).  Not every such kernel is
    positive semi-definite: ``"sigmoid"`` is not, and the factorization then
    stops where its residual diagonal turns negative.

    Parameters
    ----------
    metric : str
        A name in ``sklearn.metrics.pairwise.PAIRWISE_KERNEL_FUNCTIONS``.
    params : dict, optional
        Keyword arguments of the kernel function (JSON values), e.g.
        ``{"gamma": 0.5, "coef0": 1.0}`` for ``"sigmoid"``.
    """

    def __init__(self, metric: str, params: dict | None = None):
        from sklearn.metrics.pairwise import PAIRWISE_KERNEL_FUNCTIONS

        if metric not in PAIRWISE_KERNEL_FUNCTIONS:
            valid = ", ".join(sorted(PAIRWISE_KERNEL_FUNCTIONS))
            raise ValueError(f"Unknown pairwise kernel {metric!r}. Valid: {valid}.")
        self.name = metric
        self.params = dict(params or {})

    def block(self, A, B, a_aux=None, b_aux=None):
        from sklearn.metrics.pairwise import pairwise_kernels

        return np.asarray(pairwise_kernels(np.asarray(A, dtype=np.float64),
                                           np.asarray(B, dtype=np.float64),
                                           metric=self.name, **self.params), dtype=np.float64)

    def diag(self, X, aux=None):
        X = np.asarray(X, dtype=np.float64)
        return np.array([self.block(row[None, :], row[None, :])[0, 0] for row in X],
                        dtype=np.float64)

    def get_params(self):
        return {"kernel": self.name, "kernel_params": dict(self.params)}

    def __repr__(self) -> str:
        return f"PairwiseKernel({self.name!r}, {self.params!r})"


#: Every registered kernel class, by its name and by each alias (lower case).
KERNELS: dict[str, type[Kernel]] = {}


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Make a :class:`Kernel` subclass known by its name and aliases, and return it.

    :func:`make_kernel`, :class:`dkicf.KernelKMeans`, :func:`dkicf.load` and
    the ``dkicf`` command (``--kernel``, and a flag per hyper-parameter) then
    take it.  Usable as a class decorator.

    Raises
    ------
    ValueError
        If a name is taken by another kernel, or a hyper-parameter is not one
        of :data:`HYPERPARAMETERS`.

    Examples
    --------
    >>> from dkicf.kernels import KERNELS, PolynomialKernel
    >>> KERNELS["poly"] is PolynomialKernel
    True
    """
    if not (isinstance(cls, type) and issubclass(cls, Kernel)):
        raise TypeError(f"register_kernel takes a subclass of Kernel, got {cls!r}.")
    unknown = [key for key in cls.hyperparameters if key not in HYPERPARAMETERS]
    if unknown:
        raise ValueError(
            f"{cls.__name__} declares hyper-parameters {unknown}; kernels take "
            f"{', '.join(HYPERPARAMETERS)}: rename them, or pass the kernel as an instance."
        )
    names = [name.lower() for name in (cls.name, *cls.aliases)]
    for name in names:
        if KERNELS.get(name, cls) is not cls:
            raise ValueError(
                f"the kernel name {name!r} of {cls.__name__} is taken by "
                f"{KERNELS[name].__name__}; give the kernel another name or alias."
            )
    for name in names:
        KERNELS[name] = cls
    return cls


for _cls in (GaussianKernel, LaplacianKernel, PolynomialKernel, LinearKernel):
    register_kernel(_cls)
del _cls


def kernel_names() -> list[str]:
    """Every name and alias :func:`make_kernel` takes for a registered kernel.

    Examples
    --------
    >>> from dkicf.kernels import kernel_names
    >>> kernel_names()
    ['gaussian', 'rbf', 'laplacian', 'polynomial', 'poly', 'linear']
    """
    return list(KERNELS)


def _check_gamma(gamma, name="gamma"):
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(
            f"{name} must be a positive number or 'median', got {gamma!r} "
            f"of type {type(gamma).__name__}."
        )
    if not np.isfinite(gamma) or gamma <= 0:
        raise ValueError(f"{name} must be a positive finite number or 'median', got {gamma!r}.")
    return float(gamma)


def median_gamma(
    X_sample: np.ndarray, kernel: str = "gaussian", *, n_pairs: int = 20_000, seed: int = 0
) -> float:
    """The median heuristic for the kernel width.

    ``gamma = 1 / median(dist(x_i, x_j))`` over ``n_pairs`` random pairs of
    distinct rows of ``X_sample``, where ``dist`` is the squared Euclidean
    distance for the Gaussian kernel and the L1 distance for the Laplacian
    kernel, so that a typical pair has ``k(x, y) = exp(-1)``.  The pairs are
    drawn from ``numpy.random.default_rng(seed)``: the same sample and seed give
    the same gamma.

    Parameters
    ----------
    X_sample : ndarray of shape (m, d)
        Rows to draw pairs from (a seeded sample of the data).
    kernel : {"gaussian", "laplacian"}
    n_pairs : int
    seed : int

    Returns
    -------
    gamma : float

    Raises
    ------
    ValueError
        If the sample holds NaN or infinity, has fewer than 2 rows, or all its
        sampled pairs are identical.

    Examples
    --------
    >>> import numpy as np
    >>> from dkicf.kernels import median_gamma
    >>> X = np.array([[0.0], [1.0], [2.0]])
    >>> median_gamma(X, seed=0) in (1.0, 0.25)
    True
    """
    X_sample = np.asarray(X_sample, dtype=np.float64)
    if not np.isfinite(X_sample).all():
        raise ValueError(
            "X contains NaN or infinity (in the rows sampled for gamma='median'), so no "
            "kernel width can be inferred. Remove or impute those rows before clustering; "
            "with gamma given as a number, the first pass over X names the first bad row."
        )
    m = X_sample.shape[0]
    if m < 2:
        raise ValueError(
            f"gamma='median' needs at least 2 samples, got n_samples={m}; pass gamma as a number."
        )
    rng = np.random.default_rng(seed)
    i = rng.integers(0, m, size=n_pairs)
    j = rng.integers(0, m - 1, size=n_pairs)
    j = j + (j >= i)  # distinct pairs
    diff = X_sample[i] - X_sample[j]
    if KERNELS.get(kernel, GaussianKernel) is LaplacianKernel:
        dist = np.abs(diff).sum(axis=1)
    else:
        dist = np.einsum("ij,ij->i", diff, diff)
    med = float(np.median(dist))
    if med <= 0:
        positive = dist[dist > 0]
        if positive.size == 0:
            raise ValueError(
                "gamma='median' failed: every sampled pair of rows is identical, "
                "so no kernel width can be inferred; pass gamma as a number."
            )
        med = float(np.median(positive))
    return 1.0 / med


def make_kernel(
    kernel: str | Callable | Kernel = "gaussian",
    *,
    gamma: float | str | None = None,
    degree: int = 3,
    coef0: float = 1.0,
    X_sample: np.ndarray | None = None,
    seed: int = 0,
    kernel_params: dict | None = None,
) -> Kernel:
    """Build a :class:`Kernel` from a name (or callable) and its parameters.

    Parameters
    ----------
    kernel : str, callable or Kernel
        A name or alias in :data:`KERNELS` (case-insensitive): ``"gaussian"``
        (alias ``"rbf"``), ``"laplacian"``, ``"polynomial"`` (alias
        ``"poly"``), ``"linear"``, or one that :func:`register_kernel` added;
        a callable ``f(A, B)`` returning the kernel block; or a
        :class:`Kernel`.
    gamma : float, "median" or None
        Width of the Gaussian/Laplacian kernels (default ``"median"``) and
        scale of the polynomial kernel (default ``1 / n_features``).
        ``"median"`` applies :func:`median_gamma` to ``X_sample``.
    degree, coef0 : polynomial kernel parameters.
    X_sample : ndarray, optional
        Seeded sample of the data, needed for ``gamma="median"`` and for the
        polynomial default.
    seed : int
        Seed of the median heuristic.
    kernel_params : dict, optional
        Keyword arguments of a callable kernel, or of a kernel that
        :func:`sklearn.metrics.pairwise.pairwise_kernels` defines and dkicf
        does not (``"sigmoid"``, ``"cosine"``, ``"chi2"``, ``"additive_chi2"``:
        a :class:`PairwiseKernel`, which also takes ``gamma``, ``degree`` and
        ``coef0`` where the function has them).  dkicf's own kernels take
        ``gamma``, ``degree`` and ``coef0`` instead.

    Returns
    -------
    Kernel

    Examples
    --------
    >>> from dkicf.kernels import make_kernel
    >>> make_kernel("sigmoid", gamma=0.5, kernel_params={"coef0": 0.0})
    PairwiseKernel('sigmoid', {'gamma': 0.5, 'coef0': 0.0})
    """
    if isinstance(kernel, Kernel):
        return kernel
    if callable(kernel):
        if kernel_params:
            import functools

            return CallableKernel(functools.partial(kernel, **kernel_params))
        return CallableKernel(kernel)
    if not isinstance(kernel, str):
        raise TypeError(
            f"kernel must be a name, a callable or a Kernel, got {type(kernel).__name__}."
        )
    try:
        cls = KERNELS[kernel.lower()]
    except KeyError:
        return _pairwise_kernel(kernel, gamma, degree, coef0, kernel_params)
    if kernel_params:
        raise ValueError(
            f"kernel_params={kernel_params!r} applies to callable kernels and to those of "
            f"sklearn.metrics.pairwise that dkicf does not define; the {cls.name} kernel "
            "takes gamma, degree and coef0."
        )
    given = {"gamma": gamma, "degree": degree, "coef0": coef0}
    return cls._from_hyperparameters({key: given[key] for key in cls.hyperparameters},
                                     X_sample=X_sample, seed=seed)


def _pairwise_kernel(name: str, gamma, degree, coef0, kernel_params) -> PairwiseKernel:
    """The :class:`PairwiseKernel` fallback for a name dkicf does not define."""
    from sklearn.metrics.pairwise import KERNEL_PARAMS, PAIRWISE_KERNEL_FUNCTIONS

    if name not in PAIRWISE_KERNEL_FUNCTIONS:
        valid = ", ".join(sorted(set(KERNELS) | set(PAIRWISE_KERNEL_FUNCTIONS)))
        raise ValueError(f"Unknown kernel {name!r}. Valid kernels are: {valid}, or a callable.")
    accepted = KERNEL_PARAMS[name]
    params = {}
    if isinstance(gamma, str):
        raise ValueError(
            f"gamma={gamma!r} is defined for the gaussian and laplacian kernels; give the "
            f"{name} kernel a number, or None for the default of sklearn.metrics.pairwise."
        )
    if "gamma" in accepted and gamma is not None:
        params["gamma"] = _check_gamma(gamma)
    if "degree" in accepted:
        params["degree"] = degree
    if "coef0" in accepted:
        params["coef0"] = float(coef0)
    params.update(kernel_params or {})
    return PairwiseKernel(name, params)
