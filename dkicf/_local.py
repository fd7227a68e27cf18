"""Local clusters on one machine: where the scheduler and the nannies run.

A ``LocalCluster`` runs its scheduler and every worker's nanny inside the
driver's own process, on the event loop it shares with the client.  With a
few workers that costs nothing noticeable.  With many it is the serial part
of a fit: on 16 cores, with 16 workers, that process was busy for the whole
factorization (the scheduler's transitions, every worker's heartbeats and
task reports, 16 memory monitors), and each pass waited on it.

So for more than :data:`_SHARED_PROCESS_MAX` workers (the setting
``dkicf.cluster.separate-processes: auto``) the scheduler runs in a process of
its own and each nanny in one of its own, as they would on a real cluster.
Both are ``python -m distributed.cli.dask_spec`` processes, started with the
driver's dask configuration, bound to 127.0.0.1, in a session of their own
(Ctrl-C is for the driver, which closes them), and they end themselves if the
driver dies without closing them (:mod:`dkicf._orphan_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dask
from distributed import LocalCluster, SpecCluster
from distributed.deploy.spec import ProcessInterface
from distributed.worker_memory import parse_memory_limit

from ._config import process_settings
from ._connect import scheduler_http
from ._orphan_guard import descendants, kill_all

# A LocalCluster (scheduler and nannies in the driver's process) up to this
# many workers; own processes beyond it (dkicf.cluster.separate-processes: auto).
_SHARED_PROCESS_MAX = 4

# Seconds to wait for the scheduler process to write its address.
_START_SECONDS = 60

_GUARD = "dkicf._orphan_guard"


def separate_processes(setting, workers: int) -> bool:
    """Whether a local cluster of ``workers`` runs its scheduler and nannies apart.

    ``setting`` is ``True``, ``False`` or ``"auto"`` (apart for more than
    :data:`_SHARED_PROCESS_MAX` workers).
    """
    if setting in (True, False):
        return setting
    if isinstance(setting, str) and setting.lower() == "auto":
        return workers > _SHARED_PROCESS_MAX
    raise ValueError(
        f"separate_processes must be True, False or 'auto', got {setting!r} (dask setting "
        "dkicf.cluster.separate-processes)."
    )


def _worker_preloads() -> list[str]:
    preload = dask.config.get("distributed.worker.preload", None) or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    # Ctrl-C is for the driver, which closes the cluster: the workers
    # ignore it rather than print tracebacks (see _worker_preload).
    return [*preload, "dkicf._worker_preload"]


def local_cluster_object(workers: int, threads: int, memory_limit, dashboard: bool,
                         separate) -> object:
    """A started local cluster (a ``LocalCluster`` or a ``SpecCluster`` of processes)."""
    try:
        with dask.config.set(process_settings()):
            return _start(workers, threads, memory_limit, dashboard, separate)
    except RuntimeError as exc:
        script = _unguarded_script()
        if script is None:
            raise
        raise RuntimeError(
            f"the local worker processes failed to start ({exc}). They are new Python "
            f"processes that import {script} first, and a script that starts a cluster "
            "at import time starts it again in each of them: put the code that starts "
            'the cluster under if __name__ == "__main__":'
        ) from exc


def _start(workers: int, threads: int, memory_limit, dashboard: bool, separate) -> object:
    if separate_processes(separate, workers):
        return _process_cluster(workers, threads, memory_limit, dashboard)
    with scheduler_http(dashboard):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=threads,
            memory_limit=memory_limit,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"dashboard": bool(dashboard)},
            preload=_worker_preloads(),
        )


def _unguarded_script() -> str | None:
    """The running script, if it starts clusters at import time (no ``__main__`` guard).

    Spawned worker processes import the script as ``__mp_main__``; when they
    fail to start, its source says whether it guards its code.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    if re.search(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", text, re.MULTILINE):
        return None
    return path


def _process_cluster(workers: int, threads: int, memory_limit, dashboard: bool):
    """Scheduler and nannies each in a process of their own (see the module docstring)."""
    with scheduler_http(dashboard), dask.config.set({"logging.distributed": "warning"}):
        # The driver's settings (dkicf's own and distributed's) go with the processes.
        env = {**os.environ,
               "DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(dask.config.global_config)}
    # As a LocalCluster does: "auto" shares the machine's memory among the workers.
    limit = parse_memory_limit(memory_limit, 1, workers, logger=logging.getLogger(__name__))
    scheduler = {"cls": _SchedulerProcess, "options": {"env": env, "options": {
        "host": "127.0.0.1", "port": 0, "dashboard": bool(dashboard),
        "dashboard_address": "127.0.0.1:0", "preload": [_GUARD],
    }}}
    worker = {"cls": _NannyProcess, "options": {"env": env, "options": {
        "host": "127.0.0.1", "nthreads": threads, "memory_limit": limit,
        "dashboard_address": "127.0.0.1:0", "preload": _worker_preloads(),
        "preload_nanny": [_GUARD],
    }}}
    cluster = _ProcessCluster(
        workers={i: worker for i in range(workers)}, scheduler=scheduler, worker=worker,
        name="dkicf-local",
    )
    try:
        _wait_for_workers(cluster, workers)
    except BaseException:
        cluster.close()
        raise
    return cluster


def _wait_for_workers(cluster, count: int) -> None:
    """Return once ``count`` workers have joined, as a ``LocalCluster`` does when it starts."""
    deadline = time.monotonic() + _START_SECONDS
    while len(cluster.scheduler_info.get("workers", ())) < count:
        gone = [w for w in cluster.workers.values()
                if w.process is not None and w.process.returncode is not None]
        if gone:
            raise RuntimeError(f"a worker process exited with status "
                               f"{gone[0].process.returncode} before it joined the scheduler")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} local workers did not all start within "
                               f"{_START_SECONDS} s")
        time.sleep(0.05)


class _ProcessCluster(SpecCluster):
    """A ``SpecCluster`` of :class:`_SchedulerProcess` and :class:`_NannyProcess`.

    Closing ends the nannies and workers first: workers left running when
    the scheduler goes print a traceback per failed heartbeat.
    """

    async def _close(self):
        await asyncio.gather(*(w.close() for w in self.workers.values()),
                             return_exceptions=True)
        await super()._close()


class _SpecProcess(ProcessInterface):
    """One ``python -m distributed.cli.dask_spec`` process, for a ``SpecCluster``."""

    def __init__(self, spec: dict, args: tuple = (), env: dict | None = None):
        super().__init__()
        self._cmd = [sys.executable, "-m", "distributed.cli.dask_spec", *args,
                     "--spec", json.dumps(spec)]
        self._env = env
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self._cmd, env=self._env, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        await super().start()

    async def close(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.returncode is None:
            # The process first, then its children: a nanny that outlived its
            # children even briefly could, closing its worker's queues, find its
            # multiprocessing resource tracker gone and start another, which
            # then prints a KeyError traceback for each semaphore it never saw
            # under the driver's one-line "interrupted".
            children = descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            kill_all(children)
            await proc.wait()
        await super().close()

    def __repr__(self) -> str:
        pid = None if self.process is None else self.process.pid
        return f"<{type(self).__name__}: pid={pid}>"


class _SchedulerProcess(_SpecProcess):
    """The scheduler, in a process of its own; ``address`` once it listens."""

    def __init__(self, options: dict, env: dict | None = None):
        self._file = os.path.join(tempfile.gettempdir(), f"dkicf-scheduler-{uuid.uuid4().hex}")
        spec = {"cls": "distributed.Scheduler", "opts": {**options, "scheduler_file": self._file}}
        super().__init__(spec, env=env)
        self.address = None

    async def start(self) -> None:
        await super().start()
        deadline = time.monotonic() + _START_SECONDS
        path = Path(self._file)
        while self.process.returncode is None and time.monotonic() < deadline:
            try:
                self.address = json.loads(path.read_text())["address"]
                break
            except (OSError, ValueError, KeyError):
                await asyncio.sleep(0.05)
        with contextlib.suppress(OSError):
            path.unlink()
        if self.address is None:
            code = self.process.returncode
            await self.close()
            raise RuntimeError(
                "the scheduler process did not start within "
                f"{_START_SECONDS} s" if code is None else
                f"the scheduler process exited with status {code} before it listened"
            )


class _NannyProcess(_SpecProcess):
    """A nanny (and so its worker process) in a process of its own."""

    def __init__(self, scheduler: str, name=None, options: dict | None = None,
                 env: dict | None = None):
        spec = {"cls": "distributed.Nanny", "opts": {**(options or {}), "name": name}}
        super().__init__(spec, args=(scheduler,), env=env)
        self.name = name
