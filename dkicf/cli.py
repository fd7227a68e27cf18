"""The ``dkicf`` command line: its entry point, exit statuses and error reporting.

The parser is :mod:`dkicf._cli_parser`; the commands, with their progress
bars, are :mod:`dkicf._cli_commands`, imported only once a command runs.

Every computing command runs on a LocalCluster that dkicf starts itself
(127.0.0.1 only, no dashboard unless ``--dashboard``), on an existing
scheduler (``--scheduler``), or on a cluster it creates on Kubernetes or a
batch system (``--cluster``).  Usage errors exit with status 2 and one line
on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from . import __version__, _cli_signals
from ._cli_parser import UsageError, build_parser
from .errors import DkicfError

__all__ = ["build_parser", "main"]

logger = logging.getLogger("dkicf")


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dkicf`` command."""
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--version"]:  # without building the parser, which reads dask's configuration
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
    # SIGTERM unwinds as Ctrl-C does: staged outputs and temporary folders are removed.
    with _cli_signals.handled():
        return _run(args)


def _run(args) -> int:
    """Run the parsed command; errors become one line on stderr and an exit status.

    Status 2 means the command line itself is wrong (a flag, a value, an
    output that exists or is an input): fixed by changing the command.  Status
    1 is a failure while running: missing or unreadable input, a scheduler
    that does not answer, a worker that died, too little memory.
    """
    try:
        # The command line's one deferred import: the commands bring dask, zarr,
        # scikit-learn and the rest of dkicf, which --help, --version and a usage
        # error (answered by the parser above) do not wait for.
        from . import _cli_commands

        status = _cli_commands.COMMANDS[args.command](args)
        _cli_signals.raise_pending()  # a Ctrl-C that a finalizer swallowed
        return status
    except _cli_signals.Terminated:
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
