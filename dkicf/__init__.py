"""dkicf: kernel k-means on an incomplete Cholesky factorization, in memory or on dask."""

import importlib
import sys
import types

from ._version import __version__
from .errors import (
    CheckpointMismatchError,
    DegenerateKernelWarning,
    DkicfError,
    WorkerFailureError,
)

# The rest is imported on first use (PEP 562), so that ``import dkicf`` and
# ``dkicf --help`` do not wait for scipy and scikit-learn.
_LAZY = {
    "KernelKMeans": ".estimator",
    "load": ".estimator",
    "ICFProgress": ".icf",
    "ICFResult": ".icf",
    "incomplete_cholesky": ".icf",
    "KMeansProgress": ".kmeans",
    "KMeansResult": ".kmeans",
    "assign": ".kmeans",
    "local_cluster": ".deploy",
    "make_kernel": ".kernels",
    "median_gamma": ".kernels",
    "persist_rows": "._services",
}

__all__ = [
    "CheckpointMismatchError",
    "DegenerateKernelWarning",
    "DkicfError",
    "WorkerFailureError",
    "ICFProgress",
    "ICFResult",
    "KMeansProgress",
    "KMeansResult",
    "KernelKMeans",
    "assign",
    "incomplete_cholesky",
    "kmeans",
    "load",
    "local_cluster",
    "make_kernel",
    "median_gamma",
    "persist_rows",
    "__version__",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dkicf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``dkicf.kmeans`` is the function, although ``dkicf/kmeans.py`` is a submodule too.

    Importing a submodule sets it as an attribute of its package; imported
    lazily, the module would then replace the function.  A property keeps the
    function; the submodule stays reachable as ``sys.modules["dkicf.kmeans"]``
    and by ``import dkicf.kmeans``/``from dkicf.kmeans import ...``.
    """

    @property
    def kmeans(self):
        return importlib.import_module(".kmeans", __name__).kmeans

    @kmeans.setter
    def kmeans(self, value):
        if not isinstance(value, types.ModuleType):  # the import system's setattr is dropped
            raise AttributeError("dkicf.kmeans is read-only")


sys.modules[__name__].__class__ = _Package
