"""The ``dkicf`` commands: what each does with its parsed arguments.

Imported by :func:`dkicf.cli.main` only once a command runs: this module
imports dask and zarr, which ``--help``, ``--version`` and a usage error do
not need.  A command imports scikit-learn and the estimator where it uses
them (about 2 s): ``fit``, ``demo`` and ``bench`` do; ``predict``, ``plot``,
``info``, ``convert``, ``generate`` and the cluster commands do without
(a saved model is read by :func:`dkicf._saved.read_model`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import psutil
from dask.utils import parse_bytes

from . import _cli_signals, deploy, io
from ._cli_parser import UsageError, kernel_hyperparameters
from ._config import get, local_workers
from ._plan import describe, plan_fit

__all__ = ["COMMANDS"]

logger = logging.getLogger("dkicf")


# Factorization iterations between the commits of --checkpoint, unless --checkpoint-every.
_CHECKPOINT_EVERY = 25


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


def _check_size(flag: str, text: str, *, auto: bool) -> str:
    """A memory size as dask reads it (4GiB, 500MB, 2e9), or ``auto`` where allowed.

    Checked once the command runs, not while parsing: importing dask before
    the logging is set up would let distributed's INFO logs through.
    """
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


# ---------------------------------------------------------------------------- progress


class _Progress:
    """tqdm bars on stderr for the factorization and k-means (silent with --quiet)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = None
        self.kind = None

    def __call__(self, info) -> None:
        _cli_signals.raise_pending()  # after every pass and step
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
        Lloyd passes (shared by the runs still iterating); its share is full
        once it reports its last step.
        """
        if self.kind != "kmeans":
            self.close()
            self.bar = tqdm(total=info.n_init, file=sys.stderr, dynamic_ncols=True,
                            bar_format="k-means: {percentage:3.0f}%|{bar}| {desc} [{elapsed}]")
            self.kind = "kmeans"
            self.shares = {}
        share = min(info.step, info.max_iter) / info.max_iter
        lloyd = info.phase == "lloyd"
        self.shares[info.restart] = 1.0 if getattr(info, "done", False) else (
            0.5 + 0.5 * share if lloyd else 0.5 * share)
        self.bar.n = sum(self.shares.values())
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
    limit = get("in-process-max-bytes")
    limit = parse_bytes(limit) if isinstance(limit, str) else int(limit)
    return nbytes <= min(limit, psutil.virtual_memory().available / 4)


def _check_cluster_args(args) -> None:
    """The cluster flags' values, checked before anything is read or started."""
    _check_size("--memory-limit", args.memory_limit or str(get("cluster.memory-limit")),
                auto=True)
    if args.workers is None:
        configured = get("cluster.workers")
        try:
            local_workers(configured)
        except ValueError:
            raise UsageError(
                f"the dask setting dkicf.cluster.workers is {configured!r}: it must be an "
                "integer >= 1 or 'auto' (or pass --workers).") from None
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
        options.update(name=args.name, image=args.image, threads=threads)
        if workers != "auto":  # auto counts this machine's cores: pods take kubernetes_spec's
            options["workers"] = workers
        if memory_limit != "auto":  # a pod needs a size: kubernetes_spec's default
            options["memory_limit"] = memory_limit
    client, cluster = deploy.start_cluster(kind, **options)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


# ---------------------------------------------------------------------------- commands


def _check_outputs(out: str, inputs: dict, *, overwrite: bool, writes: str,
                   storage_options: dict | None = None) -> None:
    """Refuse an output that is one of the inputs, exists without --overwrite, or is
    something else than what the command writes.

    All are usage errors (status 2): another --out, or --overwrite, fixes
    them.  ``writes`` is the kind of output (``"dataset"``, ``"model"``,
    ``"labels"``, as :func:`dkicf.io.inspect` names them): --overwrite
    replaces only that, never a model by a dataset for instance.
    """
    try:
        io.check_not_input(out, inputs)
    except io.DkicfIOError as exc:
        raise UsageError(str(exc)) from None
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
        n_clusters=args.clusters, kernel=args.kernel,
        **{hp.name: getattr(args, hp.name) for hp in kernel_hyperparameters()},
        rank=args.rank, tol=args.tol, pivoting=args.pivoting,
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
    from ._saved import read_model
    from .pipeline import predict_store

    _check_cluster_args(args)
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.model, args.store, args.out)
    _check_outputs(args.out, {"the model": args.model, "the dataset": args.store},
                   overwrite=args.overwrite, writes="labels", storage_options=storage_options)
    model = read_model(args.model, storage_options=storage_options)
    X, _, _ = io.open_dataset(args.store, storage_options=storage_options)
    n, d = X.shape
    if d != model.n_features_in:
        raise ValueError(
            f"{args.store} has {d} features but the model {args.model} was fitted on "
            f"{model.n_features_in}; predict with data of the same features."
        )
    in_process = not _wants_cluster(args) and _fits_in_process(8 * n * (d + model.rank))
    with _cluster(args, in_process=in_process) as client:
        report = predict_store(args.model, args.store, args.out, client=client,
                               overwrite=args.overwrite, storage_options=storage_options)
    report["where"] = "in-process" if in_process else "cluster"
    _print_report(report, as_json=args.json)
    return 0


def _cmd_info(args) -> int:
    storage_options = _storage_options(args.storage_option, args.storage_options_file,
                                       args.path)
    if args.json:
        kmeans = dict(n_init=args.n_init, init=args.init, algorithm=args.algorithm)
        print(json.dumps(_info_json(args.path, args.rank, storage_options, **kmeans),
                         default=str))
        return 0
    for line in describe(args.path, rank=args.rank, n_init=args.n_init, init=args.init,
                         algorithm=args.algorithm, storage_options=storage_options):
        print(line)
    return 0


def _info_json(path: str, rank: int, storage_options: dict, n_init: int = 5,
               init: str = "k-means||", algorithm: str = "minibatch-lloyd") -> dict:
    """What ``dkicf info`` shows, as one JSON object."""
    kind, details = io.inspect(path, storage_options=storage_options)
    result = {"path": path, "kind": kind, **details}
    if kind == "dataset":
        n, d = details["shape"]
        plan = plan_fit((n, d), details["chunks"][0], np.dtype(details["dtype"]).itemsize, rank,
                        n_init=n_init, init=init, algorithm=algorithm)
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
    try:
        return int(io.open_dataset(str(data))[0].shape[0])
    except Exception:  # noqa: BLE001 - unreadable: the demo writes a new one
        return None


def _cmd_bench(args) -> int:
    from . import bench

    return bench.run_cli(args)


COMMANDS = {
    "bench": _cmd_bench,
    "convert": _cmd_convert,
    "generate": _cmd_generate,
    "fit": _cmd_fit,
    "predict": _cmd_predict,
    "info": _cmd_info,
    "plot": _cmd_plot,
    "demo": _cmd_demo,
}
