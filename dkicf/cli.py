"""The ``dkicf`` command line: argument parsing, progress bars and error reporting.

Every computing command runs on a LocalCluster that dkicf starts itself
(127.0.0.1 only, no dashboard unless ``--dashboard``), on an existing
scheduler (``--scheduler``), or on a cluster it creates on Kubernetes or a
batch system (``--cluster``).  Usage errors exit with status 2 and one line
on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("dkicf")


# Factorization iterations between the commits of --checkpoint, unless --checkpoint-every.
_CHECKPOINT_EVERY = 25


class UsageError(Exception):
    """A problem with the command's input that the user can fix (exit status 2)."""


# ---------------------------------------------------------------------------- parsing


def _storage_options(values: list[str] | None, config: str | None, *paths) -> dict:
    """The fsspec options of --storage-option/--storage-options-file, for ``paths``.

    They only reach stores named by URL: given with local paths only, they
    would be ignored, so they are refused instead.
    """
    if (values or config) and not any("://" in str(p) for p in paths if p):
        given = "--storage-option" if values else "--storage-options-file"
        local = ", ".join(str(p) for p in paths if p)
        raise UsageError(
            f"{given} applies to stores named by URL (s3://, gs://, abfs://, https://, ...), "
            f"and every path here is local ({local}): drop it, or name the remote store "
            "by its URL."
        )
    opts: dict = {}
    if config:
        try:
            opts.update(json.loads(Path(config).read_text()))
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read --storage-options-file {config}: {exc}") from None
    for item in values or []:
        if "=" not in item:
            raise UsageError(f"--storage-option expects key=value, got {item!r}.")
        key, value = item.split("=", 1)
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return opts


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
    from ._config import get

    g.add_argument("--cluster", choices=["local", "kubernetes", "slurm", "pbs"], default=None,
                   help="cluster to start when no scheduler is given (default: none for data "
                        "that fit in memory, which run in this process on numpy; else local). "
                        "--cluster local, or any of --workers, --threads, --memory-limit and "
                        "--dashboard, starts a local cluster whatever the size")
    g.add_argument("--workers", type=_positive_int, default=None,
                   help=f"local or kubernetes workers (default: {get('cluster.workers')}, "
                        "dask config dkicf.cluster.workers)")
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


def _check_size(flag: str, text: str, *, auto: bool) -> str:
    """A memory size as dask reads it (4GiB, 500MB, 2e9), or ``auto`` where allowed.

    Checked once the command runs, not while parsing: importing dask before
    the logging is set up would let distributed's INFO logs through.
    """
    from dask.utils import parse_bytes

    if auto and text == "auto":
        return text
    try:
        value = parse_bytes(text)
    except (ValueError, TypeError):
        value = None
    if value is None or value <= 0:
        example = "a size such as 4GiB or 500MB" + (", or auto" if auto else "")
        raise UsageError(f"{flag} expects {example}; got {text!r}.")
    return text


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


def _gamma(text: str):
    if text == "median":
        return "median"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number, a power like 2^-6, or 'median', got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"gamma must be > 0, got {text}")
    return value


def _gamma_arg(text: str):
    # Accept the paper's notation 2^-6 as well as plain numbers.
    if "^" in text:
        base, _, exp = text.partition("^")
        try:
            return float(base) ** float(exp)
        except ValueError:
            pass
    return _gamma(text)


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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``dkicf`` parser.

    ``bench``'s own options come from :mod:`dkicf.bench`, which imports every
    baseline: they are added only when ``argv`` (the arguments about to be
    parsed; None: all of them) names ``bench``, so that other commands and
    ``--help`` start fast.
    """
    from . import __version__
    from ._config import get

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

    p = sub.add_parser("fit", help="cluster a Zarr dataset and write the model and labels")
    p.add_argument("store", help="Zarr dataset (group with X, or an array)")
    p.add_argument("--clusters", type=_positive_int, required=True, help="number of clusters k")
    p.add_argument("--kernel", default="gaussian",
                   choices=["gaussian", "rbf", "laplacian", "polynomial", "linear"],
                   help="kernel (default: gaussian, exp(-gamma*|x-y|^2))")
    p.add_argument("--gamma", type=_gamma_arg, default="median",
                   help="kernel width (number, 2^e, or 'median'; default: median)")
    p.add_argument("--degree", type=_positive_int, default=3,
                   help="degree of the polynomial kernel (default: 3)")
    p.add_argument("--coef0", type=float, default=1.0,
                   help="constant term of the polynomial kernel (default: 1.0)")
    p.add_argument("--rank", type=_positive_int, default=get("fit.rank"),
                   help=f"rank s (default: {get('fit.rank')}, dask config dkicf.fit.rank)")
    p.add_argument("--tol", type=float, default=1e-3, help="trace-error tolerance (default: 1e-3)")
    p.add_argument("--pivoting", choices=["greedy", "block-greedy", "rpcholesky"],
                   default=get("fit.pivoting"),
                   help=f"pivot rule of the factorization (default: {get('fit.pivoting')}, dask "
                        "config dkicf.fit.pivoting; block-greedy: the paper's greedy pivots, "
                        "several per pass over X)")
    # The k-means names only: dkicf.kmeans imports numpy and scipy, but no cluster code.
    from .kmeans import ALGORITHMS, INITS

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

    p = sub.add_parser("predict", help="assign the points of a Zarr dataset with a saved model")
    p.add_argument("model", help="a model written by dkicf fit (its --out)")
    p.add_argument("store", help="Zarr dataset to assign (group with X, or an array)")
    _add_output(p)
    _add_cluster(p)
    _add_storage(p)
    _add_json(p)

    p = sub.add_parser("info", help="describe a dataset, a model or a fit's checkpoint")
    _add_json(p)
    p.add_argument("path", help="a Zarr dataset, a model (dkicf fit --out) or a --checkpoint "
                                "(how far the fit got, where P lives, how to resume)")
    p.add_argument("--rank", type=_positive_int, default=get("fit.rank"),
                   help=f"rank used for the memory estimate of a fit (default: "
                        f"{get('fit.rank')}, dask config dkicf.fit.rank)")
    _add_storage(p)

    p = sub.add_parser("plot", help="write PNG plots of a model")
    p.add_argument("model")
    p.add_argument("--data", help="the dataset, for the scatter plot of 2-D data")
    p.add_argument("--out-dir", default=".", help="folder for the PNGs (default: .)")
    _add_storage(p)

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

    if argv is None or "bench" in argv:
        from . import bench

        bench.add_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks: reproduce the paper's experiments")
    return parser


# ---------------------------------------------------------------------------- progress


class _Progress:
    """tqdm bars on stderr for the factorization and k-means (silent with --quiet)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = None
        self.kind = None

    def __call__(self, info) -> None:
        if self.quiet:
            return
        from tqdm.auto import tqdm

        kind = type(info).__name__
        if kind == "ICFProgress":
            if self.kind != "icf":
                self.close()
                self.bar = tqdm(total=info.max_rank, desc="factorization", unit="col",
                                file=sys.stderr, dynamic_ncols=True)
                self.kind = "icf"
            self.bar.update(info.rank - self.bar.n)
            self.bar.set_postfix(trace_error=f"{info.trace_error:.3e}", passes=info.n_passes,
                                 refresh=False)
        else:
            self._kmeans(info, tqdm)

    def _kmeans(self, info, tqdm) -> None:
        """One bar over the restarts: each run's share moves with its steps and passes.

        A run is at most ``max_iter`` mini-batch steps then at most ``max_iter``
        Lloyd passes; most stop earlier, and the bar jumps to the next run.
        """
        if self.kind != "kmeans":
            self.close()
            self.bar = tqdm(total=info.n_init, file=sys.stderr, dynamic_ncols=True,
                            bar_format="k-means: {percentage:3.0f}%|{bar}| {desc} [{elapsed}]")
            self.kind = "kmeans"
        share = min(info.step, info.max_iter) / info.max_iter
        lloyd = info.phase == "lloyd"
        self.bar.n = info.restart + (0.5 + 0.5 * share if lloyd else 0.5 * share)
        where = f"Lloyd pass {info.step}" if lloyd else f"mini-batch step {info.step}"
        self.bar.set_description_str(
            f"run {info.restart + 1}/{info.n_init}, {where}, inertia {info.inertia:.4g}",
            refresh=False,
        )
        self.bar.refresh()

    def finish(self) -> None:
        """Close the bars of a completed fit: the k-means bar ends at 100%."""
        if self.kind == "kmeans":
            self.bar.n = self.bar.total
            self.bar.set_description_str(f"{self.bar.total} runs done", refresh=False)
            self.bar.refresh()
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.kind = None


def _rows_bar(desc: str):
    """A progress callback for row-by-row writers: called with (rows_done, rows_total)."""
    from tqdm.auto import tqdm

    state = {}
    started = time.time()

    def update(done, total=None):
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=total, desc=desc, unit="row", unit_scale=True,
                                      file=sys.stderr, dynamic_ncols=True)
            # The first call reports rows already done: time them from the start,
            # not from this call (which made rates such as "717Mrow/s").
            bar.start_t = bar.last_print_t = started
        bar.update(done - bar.n)
        if total is not None and done >= total:
            bar.close()

    return update


# ---------------------------------------------------------------------------- cluster


def _wants_cluster(args) -> bool:
    """Whether the command line asks for a cluster, whatever the size of the data."""
    return bool(args.scheduler or args.scheduler_file or args.cluster is not None
                or args.workers is not None or args.threads is not None
                or args.memory_limit is not None or args.dashboard)


def _fits_in_process(nbytes: int) -> bool:
    """Whether ``nbytes`` fit comfortably in this process: dkicf.in-process-max-bytes, and a
    quarter of the memory free now."""
    import psutil
    from dask.utils import parse_bytes

    from ._config import get

    limit = get("in-process-max-bytes")
    limit = parse_bytes(limit) if isinstance(limit, str) else int(limit)
    return nbytes <= min(limit, psutil.virtual_memory().available / 4)


def _check_cluster_args(args) -> None:
    """The cluster flags' values, checked before anything is read or started."""
    from ._config import get

    _check_size("--memory-limit", args.memory_limit or str(get("cluster.memory-limit")),
                auto=True)
    if args.cluster in ("slurm", "pbs") and args.memory is not None:
        _check_size("--memory", args.memory, auto=False)
    if args.cluster in ("kubernetes", "slurm", "pbs"):
        timeout = (args.worker_timeout if args.worker_timeout is not None
                   else float(get("cluster.worker-timeout")))
        if not timeout > 0:
            raise UsageError(
                f"--worker-timeout must be a number of seconds > 0 (inf: no limit), "
                f"got {timeout}."
            )
    if args.cluster == "kubernetes" and not args.image:
        raise UsageError("--cluster kubernetes needs --image (the dkicf container image).")


@contextlib.contextmanager
def _cluster(args, *, in_process: bool = False):
    """Yield a client for the command, closing whatever this command started.

    ``in_process``: no cluster is started and None is yielded; the command
    computes in this process.
    """
    from . import deploy
    from ._config import get

    if in_process:
        logger.info("running in this process on numpy: the data fit in memory (start a "
                    "cluster with --cluster local or --scheduler)")
        yield None
        return
    security = None
    if args.tls_ca_file or args.tls_cert or args.tls_key:
        security = deploy.make_security(args.tls_ca_file, args.tls_cert, args.tls_key)
    if args.scheduler or args.scheduler_file:
        client = deploy.connect(args.scheduler, scheduler_file=args.scheduler_file,
                                security=security, timeout=args.timeout)
        try:
            yield client
        finally:
            client.close()
        return
    kind = args.cluster or "local"
    workers = args.workers or get("cluster.workers")
    threads = args.threads or get("cluster.threads")
    memory_limit = args.memory_limit or str(get("cluster.memory-limit"))
    worker_timeout = (args.worker_timeout if args.worker_timeout is not None
                      else float(get("cluster.worker-timeout")))
    logger.info("starting a %s cluster", kind)
    if kind == "local":
        options = dict(workers=workers, threads=threads,
                       memory_limit=memory_limit, dashboard=args.dashboard)
    else:
        def say(line: str) -> None:
            print(f"dkicf: {line}", file=sys.stderr, flush=True)

        # Batch jobs and pods may take hours to start: say what is being waited for.
        options = dict(worker_timeout=worker_timeout, progress=None if args.quiet else say)
    if kind in ("slurm", "pbs"):
        # Flags left out fall back to dask-jobqueue's configuration (the site's jobqueue.yaml).
        given = dict(cores=args.cores, memory=args.memory, walltime=args.walltime,
                     queue=args.queue, processes=args.processes, interface=args.interface,
                     account=args.account)
        options.update(jobs=args.jobs, **{k: v for k, v in given.items() if v is not None})
        # The scheduler listens on the site's network: mutual TLS, with throwaway
        # certificates unless --tls-* name some.
        options["security"] = True if security is None else security
        if args.shared_dir:
            options["shared_temp_directory"] = args.shared_dir
    elif kind == "kubernetes":
        options.update(name=args.name, image=args.image, workers=workers, threads=threads)
        if memory_limit != "auto":  # a pod needs a size: kubernetes_spec's default
            options["memory_limit"] = memory_limit
    client, cluster = deploy.start_cluster(kind, **options)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


# ---------------------------------------------------------------------------- commands


def _check_outputs(out: str, inputs: dict, *, overwrite: bool | None, writes: str,
                   storage_options: dict | None = None) -> None:
    """Refuse an output that is one of the inputs, exists without --overwrite, or is
    something else than what the command writes.

    All are usage errors (status 2): another --out, or --overwrite, fixes
    them.  ``writes`` is the kind of output (``"dataset"``, ``"model"``,
    ``"labels"``, as :func:`dkicf.io.inspect` names them): --overwrite
    replaces only that, never a model by a dataset for instance.
    ``overwrite=None`` checks the inputs only.
    """
    from . import io

    try:
        io.check_not_input(out, inputs)
    except io.DkicfIOError as exc:
        raise UsageError(str(exc)) from None
    if overwrite is None:
        return
    io.check_writable(out, overwrite=overwrite, storage_options=storage_options)
    if not overwrite:
        return
    try:
        kind, _ = io.inspect(out, storage_options=storage_options)
    except (io.DkicfIOError, OSError):
        return  # nothing there, or nothing dkicf reads: check_writable's decision stands
    if kind != writes:
        raise UsageError(
            f"{out} holds a {kind}, and --overwrite replaces only a {writes} (what this "
            f"command writes). Choose another output, or remove {out} first if it may go."
        )


def _cmd_convert(args) -> int:
    from . import io

    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.src, args.dst)
    _check_outputs(args.dst, {"the source": args.src}, overwrite=args.overwrite,
                   writes="dataset", storage_options=storage_options)
    info = io.convert(
        args.src, args.dst, dtype=args.dtype, chunk_rows=args.chunk_rows,
        overwrite=args.overwrite, label_column=args.label_column, columns=args.columns,
        drop_columns=args.drop_columns, storage_options=storage_options,
        progress=None if args.quiet else _rows_bar("convert"),
    )
    print(f"wrote {args.dst}: {_describe(info)}")
    return 0


def _cmd_generate(args) -> int:
    from . import io

    if args.kind == "mnist8m":
        return _cmd_generate_digits(args)
    if args.source is not None:
        raise UsageError(f"--source gives the base images of mnist8m; {args.kind} has none.")
    params = {}
    if args.kind in ("blobs", "spheres"):
        if args.features:
            params["n_features"] = args.features
        if args.classes:
            params["centers" if args.kind == "blobs" else "shells"] = args.classes
    elif args.features not in (None, 2) or args.classes not in (None, 2):
        raise UsageError(
            f"{args.kind} is a 2-D set of 2 classes; --features and --classes apply to "
            "blobs and spheres."
        )
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.dst)
    _check_outputs(args.dst, {}, overwrite=args.overwrite, writes="dataset",
                   storage_options=storage_options)
    info = io.generate(
        args.kind, args.dst, args.n, chunk_rows=args.chunk_rows, dtype=args.dtype,
        random_state=args.seed, overwrite=args.overwrite, storage_options=storage_options,
        progress=None if args.quiet else _rows_bar("generate"),
        **params,
    )
    print(f"wrote {args.dst}: {_describe(info)}")
    return 0


def _cmd_generate_digits(args) -> int:
    from . import mnist8m

    if args.features not in (None, 784) or args.classes not in (None, 10):
        raise UsageError("mnist8m has 784 features and 10 classes; --features and --classes "
                         "apply to blobs and spheres.")
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.dst)
    _check_outputs(args.dst, {}, overwrite=args.overwrite, writes="dataset",
                   storage_options=storage_options)
    info = mnist8m.generate_digits(
        args.dst, args.n, source=args.source, chunk_rows=args.chunk_rows,
        random_state=args.seed, overwrite=args.overwrite, storage_options=storage_options,
        progress=None if args.quiet else _rows_bar("generate"),
    )
    print(f"wrote {args.dst}: {_describe(info)}")
    return 0


def _describe(info: dict) -> str:
    parts = []
    for key in ("shape", "chunks", "dtype", "n_classes"):
        if key in info:
            parts.append(f"{key}={info[key]}")
    return ", ".join(parts) if parts else json.dumps(info, default=str)


def _cmd_fit(args) -> int:
    from . import io
    from .estimator import KernelKMeans
    from .pipeline import fit_store

    if args.resume and not args.checkpoint:
        raise UsageError("--resume continues a checkpointed fit: give its --checkpoint too.")
    if args.checkpoint_every is not None and not args.checkpoint:
        raise UsageError("--checkpoint-every sets how often --checkpoint commits: give "
                         "--checkpoint URL too, or drop --checkpoint-every.")
    _check_cluster_args(args)
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.store, args.out, args.checkpoint)
    params = dict(
        n_clusters=args.clusters, kernel=args.kernel, gamma=args.gamma, degree=args.degree,
        coef0=args.coef0, rank=args.rank, tol=args.tol, pivoting=args.pivoting,
        algorithm=args.algorithm, init=args.init,
        batch_size=args.batch_size, n_init=args.n_init, max_iter=args.max_iter,
        random_state=args.seed,
    )
    _check_outputs(args.out, {"the dataset": args.store, "the checkpoint": args.checkpoint},
                   overwrite=args.overwrite, writes="model", storage_options=storage_options)
    # What the data's metadata allows to check comes before any cluster starts.
    X, _, _ = io.open_dataset(args.store, storage_options=storage_options)
    n, d = X.shape
    try:
        KernelKMeans(**params)._check_params(n)
    except ValueError as exc:
        raise UsageError(f"{exc} ({args.store} has {n} rows.)") from None
    in_process = (not _wants_cluster(args) and args.checkpoint is None
                  and args.p_storage != "zarr" and args.persist == "auto"
                  and _fits_in_process(8 * n * d + 2 * 8 * n * min(args.rank, n)))
    progress = _Progress(args.quiet)
    with _cluster(args, in_process=in_process) as client:
        try:
            report = fit_store(
                args.store, args.out, params, client=client, overwrite=args.overwrite,
                p_storage=args.p_storage, persist=args.persist,
                storage_options=storage_options, progress=progress,
                checkpoint=args.checkpoint,
                checkpoint_every=args.checkpoint_every or _CHECKPOINT_EVERY,
                save_p=args.save_p,
                resume=args.resume,
            )
            progress.finish()
        finally:
            progress.close()  # an error is printed on a line of its own, not after the bar
    report["where"] = "in-process" if in_process else "cluster"
    _print_report(report, as_json=args.json)
    return 0


def _print_report(report: dict, *, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(report, default=str))
        return
    for key, value in report.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key}: {value}")


def _cmd_predict(args) -> int:
    from . import io
    from .estimator import load
    from .pipeline import predict_store

    _check_cluster_args(args)
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.model, args.store, args.out)
    _check_outputs(args.out, {"the model": args.model, "the dataset": args.store},
                   overwrite=args.overwrite, writes="labels", storage_options=storage_options)
    model = load(args.model, storage_options=storage_options)
    X, _, _ = io.open_dataset(args.store, storage_options=storage_options)
    n, d = X.shape
    if d != model.n_features_in_:
        raise ValueError(
            f"{args.store} has {d} features but the model {args.model} was fitted on "
            f"{model.n_features_in_}; predict with data of the same features."
        )
    in_process = not _wants_cluster(args) and _fits_in_process(8 * n * (d + model.rank_))
    with _cluster(args, in_process=in_process) as client:
        report = predict_store(args.model, args.store, args.out, client=client,
                               overwrite=args.overwrite, storage_options=storage_options)
    report["where"] = "in-process" if in_process else "cluster"
    _print_report(report, as_json=args.json)
    return 0


def _cmd_info(args) -> int:
    from .pipeline import describe

    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.path)
    if args.json:
        print(json.dumps(_info_json(args.path, args.rank, storage_options), default=str))
        return 0
    for line in describe(args.path, rank=args.rank, storage_options=storage_options):
        print(line)
    return 0


def _info_json(path: str, rank: int, storage_options: dict) -> dict:
    """What ``dkicf info`` shows, as one JSON object."""
    from dataclasses import asdict

    import numpy as np

    from . import io
    from .pipeline import plan_fit

    kind, details = io.inspect(path, storage_options=storage_options)
    result = {"path": path, "kind": kind, **details}
    if kind == "dataset":
        n, d = details["shape"]
        plan = plan_fit((n, d), details["chunks"][0], np.dtype(details["dtype"]).itemsize, rank)
        result["fit_estimate"] = asdict(plan)
    return result


def _cmd_plot(args) -> int:
    from .plotting import plot_model

    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.model, args.data)
    paths = plot_model(args.model, args.out_dir, data=args.data, storage_options=storage_options)
    for p in paths:
        print(f"wrote {p}")
    return 0


def _cmd_demo(args) -> int:
    import tempfile

    from . import io
    from .pipeline import fit_store
    from .plotting import plot_model

    _check_cluster_args(args)
    if args.workdir is None:
        work = Path(tempfile.mkdtemp(prefix="dkicf-demo-"))
    else:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
    print(f"data, model and plots go to {work}")
    data, model = work / "ring.zarr", work / "model.zarr"
    t0 = time.perf_counter()
    rows = _rows_of(data) if data.exists() and not args.overwrite else None
    if rows == args.n:
        print(f"using existing {data}")
    else:
        if rows is not None:
            print(f"regenerating {data}: it holds {rows} points, not --n {args.n}")
        io.generate("ring", str(data), args.n, random_state=0, overwrite=True)
    t_gen = time.perf_counter() - t0
    progress = _Progress(args.quiet)
    # The default k-means settings: they find the rings' partition.
    params = dict(n_clusters=2, kernel="gaussian", gamma=16.0, rank=args.rank, tol=1e-3,
                  random_state=0)
    in_process = not _wants_cluster(args) and _fits_in_process(16 * args.n * (1 + args.rank))
    with _cluster(args, in_process=in_process) as client:
        try:
            report = fit_store(str(data), str(model), params, client=client, overwrite=True,
                               progress=progress)
            progress.finish()
        finally:
            progress.close()
    paths = plot_model(str(model), str(work), data=str(data))
    report = {"points": args.n, "generate_s": t_gen, **report,
              "where": "in-process" if in_process else "cluster"}
    _print_report(report)
    for p in paths:
        print(f"wrote {p}")
    size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
    print(f"{work} holds {size / 2**20:.0f} MiB; remove it with: rm -r {work}")
    return 0


def _rows_of(data: Path) -> int | None:
    """Rows of the demo's dataset, or None when it cannot be read."""
    from . import io

    try:
        return int(io.open_dataset(str(data))[0].shape[0])
    except Exception:  # noqa: BLE001 - unreadable: the demo writes a new one
        return None


def _cmd_bench(args) -> int:
    from . import bench

    return bench.run_cli(args)


_COMMANDS = {
    "bench": _cmd_bench,
    "convert": _cmd_convert,
    "generate": _cmd_generate,
    "fit": _cmd_fit,
    "predict": _cmd_predict,
    "info": _cmd_info,
    "plot": _cmd_plot,
    "demo": _cmd_demo,
}


# Hints in the library's messages spelled as the Python API; the command's own flags here.
_CLI_SPELLING = (
    ("Pass resume=True to continue it, overwrite=True to replace it, or choose another location.",
     "Pass --resume to continue it; to start afresh, delete it or choose another --checkpoint."),
    ("(or overwrite=True with resume=False)", "(or delete this one)"),
    ("call again with resume=True (dkicf fit: --resume)", "run again with --resume"),
    ("Pass checkpoint= (dkicf fit: --checkpoint DIR) and resume=True after a failure "
     "(--resume) to be able to resume.",
     "Pass --checkpoint DIR, and --resume after a failure, to be able to resume."),
    ("pass overwrite=True to replace it", "pass --overwrite to replace it"),
    ("even with overwrite=True", "even with --overwrite"),
    ("convert the file first with dkicf.io.convert", "convert the file first with dkicf convert"),
    ("leave the column out with drop_columns (dkicf convert: --drop-columns)",
     "leave the column out with --drop-columns"),
    ("needs cores= (per job), e.g. cores=8, memory='32GiB',",
     "needs --cores (per job), e.g. --cores 8 --memory 32GiB,"),
    ("needs memory= (per job), e.g. cores=8, memory='32GiB',",
     "needs --memory (per job), e.g. --cores 8 --memory 32GiB,"),
    ("kind='slurm' needs --", "--cluster slurm needs --"),
    ("kind='pbs' needs --", "--cluster pbs needs --"),
)


def _cli_message(exc: BaseException) -> str:
    """The error's message, its hints spelled as this command's flags."""
    text = str(exc)
    for python, flags in _CLI_SPELLING:
        text = text.replace(python, flags)
    return text


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a batch system's walltime, ``kill``): unwinds like Ctrl-C, cleaning up."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dkicf`` command."""
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--version"]:  # without building the parser, which reads dask's configuration
        from . import __version__

        print(f"dkicf {__version__}")
        return 0
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    with _quiet_cluster_logs(not args.debug):
        return _main(args)


@contextlib.contextmanager
def _quiet_cluster_logs(quiet: bool):
    """Quiet the cluster's own INFO logs, in this process and in the workers it starts.

    For the command's duration only: ``main`` called from Python (or a test)
    leaves the environment, dask's configuration and the log levels as it
    found them.
    """
    import os

    name = "DASK_LOGGING__DISTRIBUTED"
    before = os.environ.get(name)
    log = logging.getLogger("distributed")
    level_before = log.level
    config = contextlib.nullcontext()
    if quiet:
        level = os.environ.setdefault(name, "warning")
        if "dask.config" in sys.modules:  # read the environment already (the parser's defaults)
            import dask.config

            config = dask.config.set({"logging.distributed": level})
        log.setLevel(level.upper())
    try:
        with config:
            yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        log.setLevel(level_before)


def _main(args) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.verbose and not args.debug:
        logger.setLevel(logging.INFO)
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        # Staged outputs and temporary folders are removed on the way out, as for Ctrl-C.
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    """Run the parsed command; errors become one line on stderr and an exit status.

    Status 2 means the command line itself is wrong (a flag, a value, an
    output that exists or is an input): fixed by changing the command.  Status
    1 is a failure while running: missing or unreadable input, a scheduler
    that does not answer, a worker that died, too little memory.
    """
    from .errors import DkicfError

    try:
        return _COMMANDS[args.command](args)
    except _Terminated:
        print("dkicf: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("dkicf: interrupted", file=sys.stderr)
        return 130
    except (UsageError, FileExistsError) as exc:
        if args.debug:
            raise
        print(f"dkicf {args.command}: error: {_cli_message(exc)}", file=sys.stderr)
        return 2
    except (DkicfError, ValueError, TypeError, OSError, ConnectionError, ImportError,
            MemoryError) as exc:
        if args.debug:
            raise
        print(f"dkicf {args.command}: error: {_cli_message(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - last resort: one line, not a traceback
        if args.debug:
            raise
        print(f"dkicf {args.command}: failed: {type(exc).__name__}: {_cli_message(exc)} "
              "(run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
