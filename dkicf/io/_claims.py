"""Claims on disk: one dkicf run at a time writes a location."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from ._stores import DkicfIOError, _local_path, absolute_location

# A claim file still being written by the run that created it (it is written
# right after its exclusive creation) is read again until it is this old.
_CLAIM_WRITE_GRACE_S = 5.0


class ClaimedError(DkicfIOError):
    """Another dkicf run holds the location, or a run that held it ended without releasing it.

    Attributes
    ----------
    location : str
        The location claimed.
    holder : dict
        What the claim says of the run holding it: ``pid``, ``host``, ``since``.
    stale : bool
        True when that run is known to have ended (killed, crashed): the claim
        can be taken over (``resume=True`` or ``overwrite=True``).
    """

    def __init__(self, message: str, location: str, holder: dict, stale: bool):
        super().__init__(message)
        self.location = location
        self.holder = holder
        self.stale = stale

    def __reduce__(self):
        return (type(self), (str(self), self.location, self.holder, self.stale))


def _claim_file(local: Path) -> Path:
    return local.parent / f".{local.name}.dkicf-claim"


def _process_started(pid: int) -> float | None:
    """When process ``pid`` of this host started, or None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return -1.0  # it exists; its start time is not ours to read


def _holder_alive(holder: dict) -> bool | None:
    """Whether the run of a claim still runs: True, False, or None (another host)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid, started = holder.get("pid"), holder.get("started")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    now = _process_started(pid)
    # A pid that was reused by a later process is not the run that claimed.
    return now is not None and (now < 0 or abs(now - started) < 1.0)


def _read_claim(path: Path) -> dict | None:
    """The record of the claim at ``path``; None once it is gone; {} while unreadable."""
    try:
        raw = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    if isinstance(holder, dict):
        return holder
    # Created but not written yet by its run, or damaged: damaged once old enough.
    return {} if time.time() - mtime < _CLAIM_WRITE_GRACE_S else {"damaged": True}


def _claim_message(what: str, url: str, holder: dict, alive: bool | None, path: Path) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    run = f"pid {holder.get('pid')} on {holder.get('host')}, since {when}"
    if holder.get("damaged"):
        return (f"{what} {url} has a claim file that is not readable ({path}); if no dkicf "
                "run is writing there, pass resume=True (dkicf fit: --resume) or "
                "overwrite=True (--overwrite) to take it over.")
    if alive:
        return (f"{what} {url} is being written by another dkicf run ({run}); two runs "
                f"cannot share it. Wait for that run to end, or choose another location.")
    if alive is None:
        return (f"{what} {url} is claimed by a dkicf run on another host ({run}); this "
                f"machine cannot tell whether it still runs. If it has ended, remove {path}.")
    return (f"{what} {url} was claimed by a dkicf run that is no longer running ({run}; "
            "killed or crashed). Pass resume=True (dkicf fit: --resume) to continue from its "
            "checkpoint, or overwrite=True (--overwrite) to start again; either takes the "
            "claim over.")


def _take_claim(url: str, what: str, take_over: bool) -> tuple[Path, str] | None:
    """Create the claim file of a local ``url``; (its path, our token), or None for URLs."""
    local = _local_path(url)
    if local is None:
        return None
    local = local.absolute()
    path = _claim_file(local)
    token = uuid.uuid4().hex
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": _process_started(os.getpid()), "since": time.time(),
              "location": str(local), "token": token}
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_claim(path)
            if holder is None:
                continue  # released meanwhile: try again
            if holder == {}:
                time.sleep(0.05)
                continue
            alive = None if holder.get("damaged") else _holder_alive(holder)
            if alive is not False and not (holder.get("damaged") and take_over):
                raise ClaimedError(_claim_message(what, url, holder, alive, path), url,
                                   holder, stale=False) from None
            if not take_over:
                raise ClaimedError(_claim_message(what, url, holder, alive, path), url,
                                   holder, stale=True) from None
            # Moved aside by one taker only: the others find the claim it makes next.
            aside = path.with_name(f"{path.name}-stale-{token}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            with contextlib.suppress(OSError):
                os.unlink(aside)
            continue
        else:
            break
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path, token


def _release_claim(path: Path, token: str) -> None:
    holder = _read_claim(path)
    if isinstance(holder, dict) and holder.get("token") == token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def claimed(locations: dict[str, Any], *, take_over: bool = False):
    """Hold an exclusive claim on each location for the ``with`` block.

    A run that writes a location (an output, a checkpoint) claims it first,
    so that a second run on the same location is refused at once instead of
    mixing its writes with the first's.  The claim is a small file beside
    the location (``.NAME.dkicf-claim``) naming the process, created
    exclusively; it is removed when the block ends, also on an error.  A
    claim whose process no longer runs (killed) is stale: it is taken over
    with ``take_over=True`` and refused otherwise.  Locations other than
    local paths (object stores) are not claimed.

    Parameters
    ----------
    locations : dict
        What each location is called in messages (e.g. ``"the output"``)
        mapped to the location; None locations are skipped.
    take_over : bool, default=False
        Take over claims left by runs that no longer run.

    Raises
    ------
    ClaimedError
        A location is claimed by a running process, by one on another host,
        or (without ``take_over``) by one that ended without releasing it.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with claimed({"the output": os.path.join(d, "m.zarr")}):
    ...     with claimed({"the output": os.path.join(d, "m.zarr")}):  # doctest: +ELLIPSIS
    ...         pass
    Traceback (most recent call last):
    ...
    dkicf.io.ClaimedError: the output ... is being written by another dkicf run (pid ...
    """
    held = []
    try:
        for what, url in locations.items():
            if url is None:
                continue
            claim = _take_claim(absolute_location(os.fspath(url)), what, take_over)
            if claim is not None:
                held.append(claim)
        yield
    finally:
        for path, token in reversed(held):
            _release_claim(path, token)

