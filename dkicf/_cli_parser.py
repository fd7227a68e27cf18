"""The ``dkicf`` command line's parser: its commands, flags and their defaults.

It imports no more than the names the flags offer (kernels, k-means
algorithms, dkicf's dask settings), so that ``dkicf --help`` and a usage
error answer at once; :mod:`dkicf._cli_commands` runs what it parsed.
"""

from __future__ import annotations

import argparse

from . import __version__
from ._bench_grid import add_parser as _add_bench_parser
from ._config import get
from ._kmeans_config import ALGORITHMS, INITS  # names only: numpy, no cluster code
from .kernels import HYPERPARAMETERS, KERNELS, HyperParameter, kernel_names
from .pivoting import PIVOT_RULES

__all__ = ["UsageError", "build_parser", "kernel_hyperparameters"]


class UsageError(Exception):
    """A problem with the command's input that the user can fix (exit status 2)."""


def _add_storage(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("storage")
    g.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec option for remote stores (repeatable; values parsed as JSON)")
    g.add_argument("--storage-options-file", metavar="JSON",
                   help="JSON file of fsspec storage options")


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--scheduler", metavar="ADDRESS",
                   help="connect to an existing scheduler (tcp://host:port or tls://host:port)")
    g.add_argument("--scheduler-file", metavar="FILE",
                   help="connect to the scheduler described by this file")
    g.add_argument("--cluster", choices=["local", "kubernetes", "slurm", "pbs"], default=None,
                   help="cluster to start when no scheduler is given (default: none for data "
                        "that fit in memory, which run in this process on numpy; else local). "
                        "--cluster local, or any of --workers, --threads, --memory-limit and "
                        "--dashboard, starts a local cluster whatever the size")
    g.add_argument("--workers", type=_positive_int, default=None,
                   help=f"local or kubernetes workers (default: {get('cluster.workers')}, "
                        "dask config dkicf.cluster.workers; auto: one a core of this "
                        "machine, 2 kubernetes pods)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help=f"threads per worker (default: {get('cluster.threads')}, "
                        "dask config dkicf.cluster.threads)")
    g.add_argument("--memory-limit", default=None,
                   help="memory limit per worker, e.g. 4GiB (local default: "
                        f"{get('cluster.memory-limit')}, dask config dkicf.cluster.memory-limit; "
                        "auto: the machine's memory shared among the workers; kubernetes "
                        "default: 4GiB)")
    g.add_argument("--dashboard", action="store_true",
                   help="serve the dask dashboard (on 127.0.0.1 only)")
    g.add_argument("--tls-ca-file",
                   help="CA certificate for tls:// schedulers, and for the scheduler that "
                        "--cluster slurm/pbs starts (default there: throwaway certificates)")
    g.add_argument("--tls-cert", help="certificate of this process (and of slurm/pbs workers)")
    g.add_argument("--tls-key", help="private key of --tls-cert")
    g.add_argument("--jobs", type=int, default=1, help="batch jobs (slurm/pbs; default: 1)")
    site = " (slurm/pbs; default: the site's jobqueue.yaml, jobqueue.<kind>.{})"
    g.add_argument("--cores", type=int, default=None, help="cores per job" + site.format("cores"))
    g.add_argument("--memory", default=None,
                   help="memory per job, e.g. 120GiB" + site.format("memory"))
    g.add_argument("--walltime", default=None,
                   help="walltime per job, e.g. 04:00:00" + site.format("walltime"))
    g.add_argument("--queue", default=None,
                   help="queue or partition" + site.format("queue"))
    g.add_argument("--processes", type=int, default=None,
                   help="worker processes per job (slurm/pbs; default: the site's "
                        "jobqueue.<kind>.processes, else 1)")
    g.add_argument("--interface",
                   help="network interface, e.g. ib0, that the scheduler listens on and the "
                        "workers use (slurm/pbs; default: the scheduler listens on every "
                        "interface; either way it accepts mutual TLS only)")
    g.add_argument("--account", help="account to charge" + site.format("account"))
    g.add_argument("--shared-dir", metavar="DIR",
                   help="directory of yours that the compute nodes see, for the throwaway TLS "
                        "files, readable by you only (slurm/pbs without --tls-*; default: dask's "
                        "jobqueue.<kind>.shared-temp-directory setting, else ~/.dkicf)")
    g.add_argument("--image", default=None, help="container image (kubernetes)")
    g.add_argument("--name", default="dkicf", help="cluster name (kubernetes)")
    g.add_argument("--timeout", type=float, default=20.0,
                   help="seconds to wait for a scheduler (--scheduler, --scheduler-file; "
                        "default: 20)")
    g.add_argument("--worker-timeout", type=float, default=None, metavar="SECONDS",
                   help="kubernetes/slurm/pbs: seconds to wait for all workers to join, as "
                        f"pods or batch jobs start (default: {get('cluster.worker-timeout')}, "
                        "dask config dkicf.cluster.worker-timeout; inf: no limit); then the "
                        "fit goes on with those that joined, or stops if none did")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object on stdout")


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output Zarr group (path or fsspec URL)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (a local one only once the new one is "
                        "complete; on an object store the old one is deleted first)")


def _column_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected column names or indices A,B,..., got {text!r}")
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2^32 - 1, got {value}")
    return value


def kernel_hyperparameters() -> list[HyperParameter]:
    """The hyper-parameters of the registered kernels, one ``--<name>`` flag each."""
    names = dict.fromkeys(name for cls in KERNELS.values() for name in cls.hyperparameters)
    return [HYPERPARAMETERS[name] for name in names]


def _flag_type(read):
    """``read`` as an argparse type: its ValueError becomes the flag's error message."""
    def flag_type(text: str):
        try:
            return read(text)
        except ValueError as exc:
            if isinstance(read, type):  # float, int: argparse's own message
                raise argparse.ArgumentTypeError(
                    f"invalid {read.__name__} value: {text!r}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None

    flag_type.__name__ = getattr(read, "__name__", "value")
    return flag_type


class _Formatter(argparse.HelpFormatter):
    """Every option's default in its help, unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (and status 2), pointing at --help instead of the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_convert(sub) -> None:
    """The ``dkicf convert`` command's parser."""
    p = sub.add_parser("convert", help="convert .npy/.npz/.csv/svmlight/Parquet to Zarr")
    p.add_argument("src", help="the file to convert (.npy, .npz, .csv, .svm/.libsvm "
                               "svmlight, .parquet or a directory of Parquet files; .txt: "
                               "svmlight if it has index:value fields, else delimited numbers "
                               "like .csv)")
    p.add_argument("dst", help="the Zarr group to write (path or fsspec URL)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype of X in the store (default: float32, half the memory; "
                        "float64 keeps float64 input exact)")
    p.add_argument("--chunk-rows", type=_positive_int,
                   help="rows per chunk (default: dask's auto chunking, chunks of the "
                        "array.chunk-size setting, 128 MiB unless configured)")
    p.add_argument("--label-column",
                   help="label column (csv, Parquet): its name in the header, else a 0-based "
                        "index (-1: the last column)")
    p.add_argument("--columns", type=_column_list, metavar="A,B,...",
                   help="csv, Parquet: the feature columns to keep, by header name or 0-based "
                        "index, comma-separated (default: all but the label column)")
    p.add_argument("--drop-columns", type=_column_list, metavar="A,B,...",
                   help="csv, Parquet: columns to leave out, e.g. an id or a text column")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset at DST (only when the new one is "
                        "complete); anything else there, a model for instance, is refused")
    _add_storage(p)


def _add_generate(sub) -> None:
    """The ``dkicf generate`` command's parser."""
    p = sub.add_parser("generate", help="write a synthetic dataset to Zarr, chunk by chunk")
    p.add_argument("kind", choices=["ring", "parabolic", "zigzag", "blobs", "spheres", "mnist8m"],
                   help="the paper's 2-D sets (ring, parabolic, zigzag), Gaussian blobs / "
                        "concentric spheres in any dimension, or mnist8m: MNIST-like digits, "
                        "random elastic and affine deformations of MNIST's training images "
                        "(uint8 grey values 0..255; on them the paper's gamma 2^-6 for "
                        "pixels/255 is 2^-6/255^2)")
    p.add_argument("dst", help="the Zarr group to write (path or fsspec URL)")
    p.add_argument("--n", type=_positive_int, required=True, help="number of points")
    p.add_argument("--features", type=_positive_int, help="dimensions (blobs, spheres)")
    p.add_argument("--classes", type=_positive_int, help="clusters (blobs, spheres)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64",
                   help="dtype of X (default: float64; mnist8m writes uint8)")
    p.add_argument("--chunk-rows", type=_positive_int,
                   help="rows per chunk (default: dask's auto chunking, chunks of the "
                        "array.chunk-size setting, 128 MiB unless configured; mnist8m: 16384)")
    p.add_argument("--source", metavar="PATH",
                   help="mnist8m: the base images, an .npz with X (n x 784, values 0..255 or "
                        "0..1) and y (digits 0..9) (default: MNIST's training set, "
                        "dkicf.datasets)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default: 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing Zarr store at DST (only when the new one is complete)")
    _add_storage(p)


def _add_fit(sub) -> None:
    """The ``dkicf fit`` command's parser."""
    p = sub.add_parser("fit", help="cluster a Zarr dataset and write the model and labels")
    p.add_argument("store", help="Zarr dataset (group with X, or an array)")
    p.add_argument("--clusters", type=_positive_int, required=True, help="number of clusters k")
    p.add_argument("--kernel", default="gaussian", choices=kernel_names(),
                   help="kernel (default: gaussian, exp(-gamma*|x-y|^2))")
    for hp in kernel_hyperparameters():
        p.add_argument(f"--{hp.name}", type=_flag_type(hp.from_text), default=hp.default,
                       help=hp.help)
    p.add_argument("--rank", type=_positive_int, default=get("fit.rank"),
                   help=f"rank s (default: {get('fit.rank')}, dask config dkicf.fit.rank)")
    p.add_argument("--tol", type=float, default=1e-3, help="trace-error tolerance (default: 1e-3)")
    p.add_argument("--pivoting", choices=list(PIVOT_RULES), default=get("fit.pivoting"),
                   help=f"pivot rule of the factorization (default: {get('fit.pivoting')}, dask "
                        "config dkicf.fit.pivoting): "
                        + "; ".join(f"{name}: {rule.description}"
                                    for name, rule in PIVOT_RULES.items()))
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default="minibatch-lloyd",
                   help="k-means on the rows of P: mini-batch steps then Lloyd iterations "
                        "to Lloyd's fixed point, mini-batch alone, or Lloyd alone "
                        "(default: minibatch-lloyd)")
    p.add_argument("--init", choices=list(INITS), default="k-means||",
                   help="initial centres: k-means|| over all of P, or k-means++ on a sample "
                        "(default: k-means||)")
    p.add_argument("--batch-size", type=_positive_int, default=1024,
                   help="rows per mini-batch step (default: 1024)")
    p.add_argument("--n-init", type=_positive_int, default=5,
                   help="k-means restarts; the lowest inertia wins (default: 5)")
    p.add_argument("--max-iter", type=_positive_int, default=100,
                   help="mini-batch steps and Lloyd iterations (each) per restart "
                        "(default: 100)")
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default: 0)")
    p.add_argument("--checkpoint", metavar="URL",
                   help="Zarr group to checkpoint the factorization and k-means in (resumable)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=None,
                   help="factorization iterations between checkpoints, with --checkpoint "
                        "(default: 25; k-means "
                        "commits every 100 steps or 5 Lloyd iterations, and after each run)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint (refused if data or parameters differ)")
    p.add_argument("--p-storage", choices=["auto", "memory", "zarr"], default="auto",
                   help="keep P in worker memory, or in Zarr beside the output (in the "
                        "--checkpoint with one; default: memory when it fits; a --resume "
                        "keeps the checkpoint's choice)")
    p.add_argument("--persist", choices=["auto", "yes", "no"], default="auto",
                   help="hold X in worker memory (default: when it fits)")
    p.add_argument("--save-p", action=argparse.BooleanOptionalAction, default=True,
                   help="write P (n x rank float64, the training points' features) into the "
                        "output; --no-save-p leaves it out: predict needs only the model "
                        "(default: --save-p)")
    _add_output(p)
    _add_cluster(p)
    _add_storage(p)
    _add_json(p)


def _add_predict(sub) -> None:
    """The ``dkicf predict`` command's parser."""
    p = sub.add_parser("predict", help="assign the points of a Zarr dataset with a saved model")
    p.add_argument("model", help="a model written by dkicf fit (its --out)")
    p.add_argument("store", help="Zarr dataset to assign (group with X, or an array)")
    _add_output(p)
    _add_cluster(p)
    _add_storage(p)
    _add_json(p)


def _add_info(sub) -> None:
    """The ``dkicf info`` command's parser."""
    p = sub.add_parser("info", help="describe a dataset, a model or a fit's checkpoint")
    _add_json(p)
    p.add_argument("path", help="a Zarr dataset, a model (dkicf fit --out) or a --checkpoint "
                                "(how far the fit got, where P lives, how to resume)")
    p.add_argument("--rank", type=_positive_int, default=get("fit.rank"),
                   help=f"rank used for the memory estimate of a fit (default: "
                        f"{get('fit.rank')}, dask config dkicf.fit.rank)")
    p.add_argument("--n-init", type=_positive_int, default=5,
                   help="k-means restarts in that estimate: with k-means|| each keeps a "
                        "distance and a label per row (default: 5)")
    p.add_argument("--init", choices=list(INITS), default="k-means||",
                   help="k-means initialisation in that estimate (default: k-means||)")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default="minibatch-lloyd",
                   help="k-means algorithm in that estimate: Lloyd alone fetches no "
                        "mini-batch rows (default: minibatch-lloyd)")
    _add_storage(p)


def _add_plot(sub) -> None:
    """The ``dkicf plot`` command's parser."""
    p = sub.add_parser("plot", help="write PNG plots of a model")
    p.add_argument("model")
    p.add_argument("--data", help="the dataset, for the scatter plot of 2-D data")
    p.add_argument("--out-dir", default=".", help="folder for the PNGs (default: .)")
    _add_storage(p)


def _add_demo(sub) -> None:
    """The ``dkicf demo`` command's parser."""
    p = sub.add_parser("demo", help="generate the Ring at 1e6 points, cluster it, report")
    p.add_argument("--n", type=_positive_int, default=1_000_000,
                   help="points of the Ring (default: 1000000)")
    p.add_argument("--rank", type=_positive_int, default=50, help="rank s (default: 50)")
    p.add_argument("--workdir", default=None,
                   help="folder for data, model and plots (default: a new temporary folder, "
                        "printed with its size at the end); the model and plots there are "
                        "replaced on every run, the data reused")
    p.add_argument("--overwrite", action="store_true",
                   help="generate the data again even if WORKDIR holds it")
    _add_cluster(p)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``dkicf`` parser.

    ``bench``'s own options (from :mod:`dkicf._bench_grid`) are added only
    when ``argv`` (the arguments about to be parsed; None: all of them) names
    ``bench``: no other command needs them.
    """
    parser = _Parser(
        prog="dkicf",
        description="Kernel k-means on an incomplete Cholesky factorization, on dask.",
        epilog="Exit status: 0 success, 1 failure while running (missing input, scheduler "
               "not answering, worker failure), 2 error in the command line, 130 "
               "interrupted, 143 terminated.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"dkicf {__version__}")
    # These flags are accepted after the command name too.
    common = _Parser(add_help=False)
    for where, default in ((parser, False), (common, argparse.SUPPRESS)):
        where.add_argument("--quiet", action="store_true", default=default,
                           help="no progress bars")
        where.add_argument("-v", "--verbose", action="store_true", default=default,
                           help="show dkicf's INFO logs (what it decides and why)")
        where.add_argument("--debug", action="store_true", default=default,
                           help="show tracebacks, and the debug logs of dkicf and dask")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_parser = sub.add_parser

    def add_parser(name, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        return _add_parser(name, parents=[common], **kwargs)

    sub.add_parser = add_parser

    for add in (_add_convert, _add_generate, _add_fit, _add_predict, _add_info, _add_plot,
                _add_demo):
        add(sub)
    if argv is None or "bench" in argv:
        _add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks: reproduce the paper's experiments")
    return parser
