"""Errors and warnings that dkicf raises on purpose, so callers can catch them by type."""

from __future__ import annotations

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
        ``"factorization"`` or ``"k-means"``.
    iteration : int
        The iteration the stage was at.
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


def worker_failure(exc: BaseException, stage: str, iteration: int, storage=None):
    """The :class:`WorkerFailureError` for a task that killed its workers in ``stage``.

    ``storage`` is the fit's checkpoint (or P store, or None): the message
    says whether and from where the fit can be resumed.
    """
    url = getattr(storage, "url", None)
    commit = getattr(storage, "commit", None)
    if url and commit:
        hint = (
            f"The last checkpoint, at iteration {commit['iteration']} (rank {commit['rank']}), "
            f"is in {url!r}: call again with resume=True to continue from it."
        )
    elif url:
        hint = f"No checkpoint was committed yet in {url!r}."
    else:
        hint = "Pass checkpoint= (and resume=True after a failure) to be able to resume."
    return WorkerFailureError(
        f"{stage} failed at iteration {iteration}: a task killed every worker that ran it "
        f"({exc}). {hint}",
        stage, iteration, url,
    )
