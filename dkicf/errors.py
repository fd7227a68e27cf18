"""Errors and warnings that dkicf raises on purpose, so callers can catch them by type."""

from __future__ import annotations

import traceback

__all__ = [
    "CheckpointMismatchError",
    "DegenerateKernelWarning",
    "DkicfError",
    "WorkerFailureError",
    "worker_failure",
    "worker_failure_types",
]


class DkicfError(Exception):
    """Base class of the errors raised by dkicf itself."""


class WorkerFailureError(DkicfError, RuntimeError):
    """A stage of the fit lost the same task's worker too many times.

    Attributes
    ----------
    stage : str
        ``"factorization"``, ``"k-means"``, ``"labelling"`` (:func:`dkicf.kmeans.assign`)
        or ``"writing"`` (an array computed by the cluster while it is written).
    iteration : int
        The iteration the stage was at: for k-means, the mini-batch step or
        Lloyd iteration of the current run (0 before its first).
    checkpoint : str or None
        Location of the last committed checkpoint, if any: resume from it
        with ``resume=True``.
    """

    def __init__(self, message: str, stage: str, iteration: int, checkpoint: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.iteration = iteration
        self.checkpoint = checkpoint


class CheckpointMismatchError(DkicfError, ValueError):
    """A checkpoint was written for other data or other parameters than the call resuming it."""


class DegenerateKernelWarning(UserWarning):
    """The kernel matrix is numerically the identity or the all-ones matrix for this data."""


def worker_failure_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean "a task kept killing its workers" (empty without dask)."""
    try:
        from distributed import KilledWorker
    except ImportError:  # pragma: no cover - distributed is a dependency
        return ()
    return (KilledWorker,)


# What kills the same task's worker again and again, and what to do about it.
_CAUSE = (
    "A worker usually dies like this when the task needs more memory than the worker's "
    "memory limit (give the workers more memory, or use smaller row chunks) or when "
    "native code crashes; the workers' logs say which."
)


def worker_failure(exc: BaseException, stage: str, iteration: int, storage=None, *,
                   where: str | None = None, resume_hint: str | None = None):
    """The :class:`WorkerFailureError` for a task that killed its workers in ``stage``.

    ``storage`` is the fit's checkpoint (or P store, or None): the message
    says whether and from where the fit can be resumed.  ``where`` says where
    in the stage the task ran (default: ``"iteration N"``) and
    ``resume_hint``, when given, replaces the sentence on resuming built from
    a factorization checkpoint's last commit.
    """
    _release_frames(exc)
    url = getattr(storage, "url", None)
    if resume_hint is not None:
        hint = resume_hint
    elif url and getattr(storage, "commit", None):
        commit = storage.commit
        hint = (
            f"The last checkpoint, at iteration {commit['iteration']} (rank {commit['rank']}), "
            f"is in {url!r}: call again with resume=True (dkicf fit: --resume) to continue "
            "from it."
        )
    elif url:
        hint = (f"No checkpoint was committed yet in {url!r}: call again with resume=True "
                "(dkicf fit: --resume) to use it, from the start.")
    else:
        hint = ("Pass checkpoint= (dkicf fit: --checkpoint DIR) and resume=True after a "
                "failure (--resume) to be able to resume.")
    where = f"iteration {iteration}" if where is None else where
    return WorkerFailureError(
        f"{stage} failed at {where}: a task killed every worker that ran it ({exc}). "
        f"{_CAUSE} {hint}",
        stage, iteration, url,
    )


def _release_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames that ``exc`` (and its causes) went
    through.

    The error is kept after it is raised (an interactive session keeps the
    last one).  Those frames held the futures of the tasks that failed, and
    with them their erred keys on the scheduler: calling again with the same
    data, as the message says to, got the same error back without running.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
