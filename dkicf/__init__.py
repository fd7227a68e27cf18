"""dkicf: kernel k-means on an incomplete Cholesky factorization, in memory or on dask."""

__version__ = "0.1.0"

from ._cluster import local_cluster
from .icf import ICFProgress, ICFResult, incomplete_cholesky
from .kernels import make_kernel, median_gamma

__all__ = [
    "ICFProgress",
    "ICFResult",
    "incomplete_cholesky",
    "local_cluster",
    "make_kernel",
    "median_gamma",
    "__version__",
]
