"""The paper's experiment grid, and the ``dkicf bench`` parser that offers it.

Kept apart from :mod:`dkicf.bench`, which imports every baseline (and
scikit-learn): the command line's parser imports this module only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .datasets import DATASETS
from .synthetic import make_parabolic, make_ring, make_zigzag

__all__ = [
    "METHODS",
    "FULL_METHODS",
    "METHOD_LABELS",
    "SYNTHETIC",
    "SYNTHETIC_RANK",
    "DISPLAY",
    "DEFAULT_DATASETS",
    "DEFAULT_SIZES",
    "DEFAULT_TRACE_DATASETS",
    "PAPER_TOL",
    "PAPER_MAX_ITER",
    "known_datasets",
    "add_parser",
]

#: Method keys in the order of the tables; ``"kernel"`` and ``"kernel+chol"``
#: use the full kernel matrix and have no subset size.
METHODS: tuple[str, ...] = ("icf", "kernel", "kernel+chol", "approx", "rff", "nystrom")

#: The methods on the full kernel matrix (no subset size).
FULL_METHODS: tuple[str, ...] = ("kernel", "kernel+chol")

METHOD_LABELS: dict[str, str] = {
    "icf": "ICF",
    "kernel": "Kernel",
    "kernel+chol": "Kernel+Chol",
    "approx": "Approx",
    "rff": "RFF",
    "nystrom": "Nyström",
}

#: The paper's 2-D sets: generator and Gaussian width (2 clusters x 500 points, s = 50).
SYNTHETIC: dict[str, tuple[Callable, float]] = {
    "ring": (make_ring, 2.0**4),
    "parabolic": (make_parabolic, 2.0**1),
    "zigzag": (make_zigzag, 2.0**3),
}
SYNTHETIC_RANK = 50

#: How tables and figures name the datasets.
DISPLAY: dict[str, str] = {
    "pendigits": "PenDigits",
    "satimage": "Satimage",
    "shuttle": "Shuttle",
    "mnist": "MNIST",
    "usps": "USPS",
    "ring": "Ring",
    "parabolic": "Parabolic",
    "zigzag": "Zigzag",
}

#: The real datasets the paper clusters, and its grid of subset sizes.
DEFAULT_DATASETS: tuple[str, ...] = ("pendigits", "satimage", "shuttle", "mnist")
DEFAULT_SIZES: tuple[int, ...] = (25, 50, 100, 200, 500, 1000)
DEFAULT_TRACE_DATASETS: tuple[str, ...] = ("usps", "mnist")

PAPER_TOL = 1e-3  # the paper's epsilon for the ICF trace error
PAPER_MAX_ITER = 1000  # the paper's cap on k-means and kernel k-means iterations


def known_datasets() -> tuple[str, ...]:
    """Names :func:`dkicf.bench.run_paper` accepts: the paper's real datasets and its 2-D sets."""
    return DATASETS + tuple(SYNTHETIC)


def _key_value(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not sep or not key or number < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=COUNT with COUNT >= 1, got {text!r}")
    return key, number


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` with its ``paper`` subcommand to the CLI's subparsers.

    Parameters
    ----------
    subparsers : argparse._SubParsersAction
        The top-level ``add_subparsers()`` object of ``dkicf``.

    Returns
    -------
    argparse.ArgumentParser
        The ``bench`` parser.
    """
    bench = subparsers.add_parser("bench", help="benchmarks: reproduce the paper's experiments")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    p = sub.add_parser(
        "paper",
        help="every method on the paper's grid: results.csv, results.md and PNG figures",
        description="Run ICF kernel k-means and the paper's baselines over datasets x subset "
                    "sizes x repeats; write results.csv, results.md and the figures.",
    )
    p.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS), metavar="NAME",
                   help=f"from {', '.join(known_datasets())}; NAME:N for a seeded subsample "
                        f"(default: {' '.join(DEFAULT_DATASETS)})")
    p.add_argument("--sizes", nargs="+", type=_positive, default=list(DEFAULT_SIZES),
                   metavar="S", help="subset sizes (default: 25 50 100 200 500 1000)")
    p.add_argument("--repeats", type=_positive, default=10, help="runs per cell (default: 10)")
    p.add_argument("--out-dir", default="docs/results",
                   help="output folder (default: docs/results)")
    p.add_argument("--data-home", help="folder holding the <name>.npz files")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help=f"subset of {', '.join(METHODS)} (default: all)")
    p.add_argument("--max-exact-n", type=_positive, default=12000,
                   help="largest n for Kernel and Kernel+Chol (default: 12000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-datasets", nargs="*", default=list(DEFAULT_TRACE_DATASETS),
                   metavar="NAME", help="datasets of the trace-error figure (default: usps mnist)")
    p.add_argument("--trace-rank", type=_positive, default=1000,
                   help="largest rank of the trace-error curves (default: 1000)")
    p.add_argument("--no-synthetic", dest="synthetic", action="store_false",
                   help="skip the Ring / Parabolic / Zigzag figure")
    p.add_argument("--n-init", type=_positive, default=1,
                   help="k-means restarts in every fit (default: 1)")
    p.add_argument("--max-iter", type=_positive, default=PAPER_MAX_ITER,
                   help="k-means iteration cap (default: 1000)")
    p.add_argument("--dataset-repeats", nargs="+", type=_key_value, default=[],
                   metavar="NAME=R", help="fewer (or more) repeats for some datasets")
    p.add_argument("--method-repeats", nargs="+", type=_key_value, default=[],
                   metavar="METHOD=R", help="at most R repeats for some methods")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUT_DIR/results.csv and do only the missing "
                        "ones (same seed and data; checked)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in OUT_DIR")
    p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="no progress bar")
    return bench
