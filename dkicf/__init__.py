"""dkicf: kernel k-means on an incomplete Cholesky factorization, in memory or on dask."""

__version__ = "0.1.0"

from ._cluster import local_cluster
from .errors import (
    CheckpointMismatchError,
    DegenerateKernelWarning,
    DkicfError,
    WorkerFailureError,
)
from .estimator import KernelKMeans, load
from .icf import ICFProgress, ICFResult, incomplete_cholesky
from .kernels import make_kernel, median_gamma
from .kmeans import KMeansProgress, KMeansResult, assign, kmeans

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
    "__version__",
]
