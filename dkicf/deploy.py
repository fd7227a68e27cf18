"""Where a fit runs: an existing scheduler (plain or TLS), a local cluster, Kubernetes, HPC.

Everything here is secure by default: a local cluster listens on 127.0.0.1
only, no dashboard is served unless asked for (and then on 127.0.0.1 only, or
inside the Kubernetes cluster), the scheduler of a SLURM or PBS cluster, which
must listen on the site's network, accepts mutual TLS only (with throwaway
certificates unless given some), and a TLS connection requires encryption and
mutual authentication.  The Kubernetes and batch-system back ends are optional
extras; this module imports without them and names the extra to install when
one is missing.  Clusters on Kubernetes or a batch system are returned once
their workers have joined, or a time limit has passed.  Connecting to a
running scheduler, and its TLS settings, are :mod:`dkicf._connect`'s
(:func:`connect` and :func:`make_security` here too).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from . import _config
from ._cluster import all_workers
from ._connect import TLS_FLAGS, connect, make_security, scheduler_http
from .errors import DkicfError

__all__ = [
    "CLUSTER_KINDS",
    "JobSubmissionError",
    "MissingExtraError",
    "WorkersTimeoutError",
    "connect",
    "jobqueue_script",
    "kubernetes_spec",
    "local_cluster",
    "make_security",
    "process_environment",
    "start_cluster",
]

CLUSTER_KINDS = ("local", "kubernetes", "slurm", "pbs")

# Share of a Kubernetes worker container's memory that dask may manage; the rest
# is headroom for the nanny process, the interpreter and unmanaged memory, so
# that dask pauses, spills or restarts a worker before the kernel OOM-kills it.
_K8S_DASK_MEMORY_FRACTION = 0.9
_SCRIPT_SCHEDULER = "tcp://<scheduler-address>:8786"
# How long start_cluster waits for the workers of batch jobs or pods by default,
# how often it looks, and how often it says that it is still waiting.
_WORKER_TIMEOUT = 3600.0
_POLL_INTERVAL = 0.5
_REMINDER_INTERVAL = 600.0
# Where throwaway TLS files go when neither the caller nor dask's configuration says.
_SHARED_TEMP_DIRECTORY = "~/.dkicf"

logger = logging.getLogger(__name__)


class MissingExtraError(ImportError):
    """An optional dependency of one way of deploying is not installed."""


class JobSubmissionError(DkicfError, RuntimeError):
    """The batch system refused to queue the jobs of a cluster (``sbatch``/``qsub`` failed)."""


class WorkersTimeoutError(DkicfError, TimeoutError):
    """No worker of a new cluster joined within ``worker_timeout`` seconds."""


def _require(module: str, extra: str, purpose: str):
    """Import ``module`` or raise a :class:`MissingExtraError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0].replace("_", "-")
        raise MissingExtraError(
            f"{purpose} needs the optional dependency {package}, which is not installed. "
            f'Install it with: pip install "dkicf[{extra}]"'
        ) from exc


# ---------------------------------------------------------------- start a cluster


def _check_options(kind: str, options: dict, allowed) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"unknown option(s) for kind={kind!r}: {', '.join(unknown)}. "
            f"Valid options: {', '.join(sorted(allowed))}."
        )


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def _local_cluster(workers="auto", threads=1, memory_limit="auto", dashboard=False,
                   separate_processes=None):
    workers = _config.local_workers(workers)
    _positive_int(threads, "threads")
    if separate_processes is None:
        separate_processes = _config.get("cluster.separate-processes")
    # Loaded here: _local imports distributed, which `import dkicf` leaves out.
    from . import _local

    return _local.local_cluster_object(workers, threads, memory_limit, dashboard,
                                       separate_processes)


def _k8s_memory(nbytes: int) -> str:
    """Kubernetes memory quantity in whole MiB, rounded up."""
    return f"{math.ceil(nbytes / 2**20)}Mi"


def kubernetes_spec(
    name: str,
    image: str,
    *,
    workers: int = 2,
    threads: int = 1,
    memory_limit: str | int = "4GiB",
    env: dict[str, str] | None = None,
    secret: str | None = None,
    scheduler_cpu: int = 1,
    scheduler_memory: str | int = "2GiB",
) -> dict[str, Any]:
    """A ``DaskCluster`` resource (kubernetes.dask.org/v1) for the dask-kubernetes operator.

    Worker containers request and are limited to ``threads`` CPUs and
    ``memory_limit / 0.9`` of memory; dask's own ``--memory-limit`` is
    ``memory_limit``, so the worker pauses and spills before the container
    is killed.  The scheduler Service is ``ClusterIP`` (reachable inside the
    Kubernetes cluster only; use ``kubectl port-forward`` for the dashboard).
    Pods run as a non-root user without privilege escalation or a service
    account token.

    Parameters
    ----------
    name : str
        Name of the DaskCluster; the scheduler is ``tcp://<name>-scheduler:8786``.
    image : str
        Container image with dkicf installed (see ``deploy/docker/Dockerfile``),
        with a version tag or digest.
    workers, threads : int
        Worker pods, and threads (= CPUs) per worker.
    memory_limit : str or int
        Memory dask may use per worker, e.g. ``"4GiB"``.
    env : dict, optional
        Environment variables for the scheduler and workers.  They come
        with those of dkicf's process settings (:func:`process_environment`),
        and replace one of the same name.
    secret : str, optional
        Name of a Secret whose keys become environment variables of the
        workers (object-store credentials, e.g. ``AWS_ACCESS_KEY_ID``), so
        they never travel in the task graph.
    scheduler_cpu, scheduler_memory : int and str or int
        Resources of the scheduler pod.

    Returns
    -------
    dict
        The resource, ready for ``yaml.safe_dump`` or ``KubeCluster(custom_cluster_spec=...)``.

    Examples
    --------
    >>> from dkicf.deploy import kubernetes_spec
    >>> spec = kubernetes_spec("fit", "registry.example/dkicf:0.1.0", memory_limit="900MiB")
    >>> spec["spec"]["worker"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    '1000Mi'
    """
    from dask.utils import parse_bytes

    _positive_int(workers, "workers")
    _positive_int(threads, "threads")
    _positive_int(scheduler_cpu, "scheduler_cpu")
    pinned = re.search(r"(:\w[\w.-]*|@sha256:[0-9a-f]{64})$", image.rsplit("/", 1)[-1])
    if not pinned or image.endswith(":latest"):
        raise ValueError(
            f"image must name a pinned version (tag or digest), got {image!r}; "
            "a moving tag makes scheduler and workers run different code."
        )
    dask_bytes = parse_bytes(memory_limit) if isinstance(memory_limit, str) else memory_limit
    worker_memory = _k8s_memory(math.ceil(dask_bytes / _K8S_DASK_MEMORY_FRACTION))
    scheduler_bytes = (
        parse_bytes(scheduler_memory) if isinstance(scheduler_memory, str) else scheduler_memory
    )
    # dkicf's process settings first; a variable of the same name in env replaces one.
    merged = {**process_environment(), **(env or {})}
    env_list = [{"name": k, "value": str(v)} for k, v in merged.items()]
    worker = _k8s_worker(image, threads, dask_bytes, worker_memory, env_list)
    if secret is not None:
        worker["envFrom"] = [{"secretRef": {"name": secret}}]
    scheduler = _k8s_scheduler(image, scheduler_cpu, _k8s_memory(scheduler_bytes), env_list)
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": name},
        "spec": {
            "worker": {"replicas": workers, "spec": _k8s_pod(worker)},
            "scheduler": {"spec": _k8s_pod(scheduler), "service": _k8s_service(name)},
        },
    }


def _k8s_container_security() -> dict:
    """Every container's: no privilege escalation, no Linux capabilities."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _k8s_pod(container: dict) -> dict:
    """A pod spec of one container, run as a non-root user without a service account token."""
    return {
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
    }


def _k8s_resources(cpu, memory: str) -> dict:
    """Requests equal to limits: the pod gets what dask was told it has."""
    amount = {"cpu": str(cpu), "memory": memory}
    return {"requests": dict(amount), "limits": dict(amount)}


def _k8s_worker(image: str, threads: int, dask_bytes: int, memory: str, env: list) -> dict:
    """The worker container: ``threads`` CPUs, dask's memory limit below the container's."""
    return {
        "name": "worker",
        "image": image,
        "args": [
            "dask", "worker",
            "--name", "$(DASK_WORKER_NAME)",
            "--nthreads", str(threads),
            "--memory-limit", str(dask_bytes),
            "--no-dashboard",
        ],
        "resources": _k8s_resources(threads, memory),
        "securityContext": _k8s_container_security(),
        "env": env,
    }


def _k8s_scheduler(image: str, cpu: int, memory: str, env: list) -> dict:
    """The scheduler container, its dashboard's ``/health`` probed for readiness and life."""
    health = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    return {
        "name": "scheduler",
        "image": image,
        "args": ["dask", "scheduler", "--port", "8786", "--dashboard-address", ":8787"],
        "resources": _k8s_resources(cpu, memory),
        "securityContext": _k8s_container_security(),
        "ports": [
            {"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
            {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"},
        ],
        "readinessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 5},
        "livenessProbe": {**health, "initialDelaySeconds": 15, "periodSeconds": 20},
        "env": env,
    }


def _k8s_service(name: str) -> dict:
    """The scheduler's Service: ClusterIP, reachable inside the Kubernetes cluster only."""
    return {
        "type": "ClusterIP",
        "selector": {
            "dask.org/cluster-name": name,
            "dask.org/component": "scheduler",
        },
        "ports": [
            {"name": "tcp-comm", "protocol": "TCP", "port": 8786,
             "targetPort": "tcp-comm"},
            {"name": "http-dashboard", "protocol": "TCP", "port": 8787,
             "targetPort": "http-dashboard"},
        ],
    }

_KUBERNETES_OPTIONS = (
    "name", "image", "workers", "threads", "memory_limit", "env", "secret",
    "scheduler_cpu", "scheduler_memory", "namespace",
)
# Options of start_cluster for the kinds whose workers start after it returns
# from the platform: pods and batch jobs.
_WAIT_OPTIONS = ("worker_timeout", "progress")


def _kubernetes_cluster(**options):
    operator = _require(
        "dask_kubernetes.operator", "kubernetes", 'start_cluster("kubernetes")'
    )
    _check_options("kubernetes", options, _KUBERNETES_OPTIONS)
    namespace = options.pop("namespace", None)
    for required in ("name", "image"):
        if required not in options:
            raise TypeError(f'start_cluster("kubernetes") needs {required}=.')
    name = options.pop("name")
    spec = kubernetes_spec(name, options.pop("image"), **options)
    cluster = operator.KubeCluster(custom_cluster_spec=spec, namespace=namespace)
    return cluster, _PodsWatch(name, namespace, options.get("workers", 2))


_JOBQUEUE = {"slurm": "SLURM", "pbs": "PBS"}
# Options passed on to dask-jobqueue's Job class (they shape the batch script).
_JOB_OPTIONS = (
    "cores", "memory", "processes", "walltime", "queue", "account", "interface",
    "local_directory", "log_directory", "job_script_prologue", "job_extra_directives",
    "python",
)
# Options of the cluster object itself (they do not change the script).
_JOBQUEUE_CLUSTER_OPTIONS = (
    "jobs", "dashboard", "security", "shared_temp_directory", *_WAIT_OPTIONS,
)
# How to look at a queued job, and why it has not started.
_JOB_STATUS = {
    "slurm": ("squeue -j {ids}", "scontrol show job {id}"),
    "pbs": ("qstat {ids}", "qstat -f {id}"),
}


def _job_kwargs(kind: str, options: dict) -> dict:
    """Validate start_cluster/jobqueue_script options; return the Job class keywords.

    An option left out or None is taken from dask-jobqueue's configuration
    (``jobqueue.<kind>.*`` in ``jobqueue.yaml``), as dask-jobqueue itself
    does, so that a site's settings apply; ``processes`` falls back to one
    worker process per job when the configuration does not set it either.
    """
    import dask

    _check_options(kind, options, _JOB_OPTIONS + _JOBQUEUE_CLUSTER_OPTIONS)
    kwargs = {k: v for k, v in options.items() if k in _JOB_OPTIONS and v is not None}

    def configured(name: str):
        return dask.config.get(f"jobqueue.{kind}.{name}", None)

    for required in ("cores", "memory"):
        if required not in kwargs and configured(required) is None:
            raise TypeError(
                f"kind={kind!r} needs {required}= (per job), e.g. cores=8, memory='32GiB', "
                f"or jobqueue.{kind}.{required} in dask's configuration (jobqueue.yaml)."
            )
    cores = _positive_int(kwargs.get("cores", configured("cores")), "cores")
    kwargs["processes"] = _positive_int(
        kwargs.get("processes", configured("processes") or 1), "processes")
    if cores % kwargs["processes"]:
        raise ValueError(
            f"cores={cores} should be a multiple of processes={kwargs['processes']} "
            "so that every worker process gets the same number of threads."
        )
    _positive_int(options.get("jobs", 1), "jobs")
    exports = _setting_exports()
    if exports:
        # First, so that an export of the same variable in the prologue wins.
        prologue = kwargs.get("job_script_prologue", configured("job-script-prologue"))
        kwargs["job_script_prologue"] = [*exports, *(prologue or [])]
    return kwargs


def process_environment() -> dict[str, str]:
    """Environment variables that give a dask process dkicf's process settings.

    dkicf's own clusters start their schedulers, nannies and workers with
    ``dkicf.cluster.worker-profiler`` and ``dkicf.cluster.tick-interval``
    (no statistical profiler on the workers, the event-loop check every
    second: by default they took about 5% of a core per idle worker).  A
    cluster started by other means takes them from these variables: the
    Kubernetes spec and the SLURM and PBS job scripts that dkicf writes
    include them, and the batch scripts in ``deploy/hpc`` ask for them.
    Setting a value to null in the configuration leaves dask's own.

    Returns
    -------
    dict
        Variable name to value, e.g. ``{"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s", ...}``.

    Examples
    --------
    >>> from dkicf.deploy import process_environment
    >>> sorted(process_environment())
    ['DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL', 'DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED']
    """
    return {f"DASK_{key.upper().replace('.', '__').replace('-', '_')}": str(value)
            for key, value in _config.process_settings().items()}


def _setting_exports() -> list[str]:
    """Shell lines that give a job's workers dkicf's process settings
    (:func:`process_environment`)."""
    return [f"export {name}={value}" for name, value in process_environment().items()]


def _jobqueue_module(kind: str):
    if kind not in _JOBQUEUE:
        raise ValueError(f"kind must be one of {sorted(_JOBQUEUE)}, got {kind!r}.")
    return _require("dask_jobqueue", "hpc", f"start_cluster({kind!r})")


def _check_submit_command(kind: str, job_cls) -> None:
    """Fail at once, in one line, when the batch system's submit command is missing."""
    command = shlex.split(job_cls.submit_command)[0]
    if shutil.which(command) is None:
        raise FileNotFoundError(
            f"{command} not found: run on a login node of a {_JOBQUEUE[kind]} cluster "
            f"(where {command} is on PATH), or use --scheduler to connect to a running dask "
            "scheduler (dkicf.deploy.connect in Python)."
        )


def _jobqueue_security(kind: str, options: dict):
    """The ``security`` and ``shared_temp_directory`` to give dask-jobqueue.

    ``True`` (also for a missing or None ``security``) means throwaway
    certificates, whose files go to a private directory that is created if
    needed; ``False`` means plain TCP.
    """
    import dask

    security = options.get("security")
    if security is False:
        logger.warning(
            "start_cluster(%r, security=False): the scheduler accepts plain TCP on %s; "
            "whoever reaches it can run code as you on every worker.",
            kind, options.get("interface") or "every interface",
        )
        return None, options.get("shared_temp_directory")
    if security is not None and security is not True:
        return security, options.get("shared_temp_directory")
    try:
        importlib.import_module("cryptography")
    except ImportError:
        raise MissingExtraError(
            f"the scheduler of a {_JOBQUEUE[kind]} cluster speaks mutual TLS, by default with "
            "throwaway certificates (security=True), which need the cryptography package: "
            'pip install cryptography (part of pip install "dkicf[hpc]"). Or bring '
            f"certificates of your own: {TLS_FLAGS} on the dkicf command line, "
            "security=make_security(ca_file, cert, key) in Python."
        ) from None
    directory = (
        options.get("shared_temp_directory")
        or dask.config.get(f"jobqueue.{kind}.shared-temp-directory", None)
        or _SHARED_TEMP_DIRECTORY
    )
    local = Path(os.path.expandvars(os.path.expanduser(str(directory))))
    try:
        local.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        # Same type (PermissionError, ...), so that callers can tell the cases apart.
        raise type(exc)(
            f"shared_temp_directory {local}: cannot be created ({exc.strerror or exc}); it "
            "holds the throwaway TLS files, so name a directory of yours that the compute "
            "nodes see (dkicf: --shared-dir)."
        ) from None
    return True, str(local)


def _submission_failure(exc: BaseException) -> str:
    """The useful part of a failed ``sbatch``/``qsub`` call: what it printed on stderr."""
    text = str(exc)
    if "\nstderr:\n" in text:
        text = text.split("\nstderr:\n", 1)[1]
    return " ".join(text.split()) or type(exc).__name__


def _reporting_job_class(job_cls):
    """``job_cls`` that records a failed submission instead of raising it in the event loop.

    dask-jobqueue submits jobs from a callback of the cluster's event loop,
    where an exception becomes a traceback on stderr that no caller can catch.
    The failure is kept in ``submit_error`` for :func:`start_cluster` to
    report, and logged as one line once ``log_failures`` is set (for later
    scaling, after start_cluster has returned).  ``close`` also marks
    the job closed, which dask-jobqueue's own ``close`` leaves out (closing the
    cluster then fails an assertion for any job still referenced).
    """
    from distributed.core import Status
    from distributed.deploy.spec import ProcessInterface

    class _ReportingJob(job_cls):
        submit_error = None
        log_failures = False

        async def start(self):
            try:
                await super().start()
            except (OSError, RuntimeError, ValueError) as exc:
                self.submit_error = _submission_failure(exc)
                if self.log_failures:
                    logger.warning("%s failed: %s", self.submit_command, self.submit_error)
                # A job that never ran: nothing to cancel (job_id stays None).
                self.status = Status.running

        async def close(self):
            try:
                await super().close()  # cancels the job
            finally:
                await ProcessInterface.close(self)

    _ReportingJob.__name__ = job_cls.__name__
    _ReportingJob.__qualname__ = job_cls.__qualname__
    return _ReportingJob


def _jobqueue_cluster(kind: str, **options):
    import dask

    module = _jobqueue_module(kind)
    kwargs = _job_kwargs(kind, options)
    cluster_cls = getattr(module, f"{_JOBQUEUE[kind]}Cluster")
    _check_submit_command(kind, cluster_cls.job_cls)
    security, shared = _jobqueue_security(kind, options)
    dashboard = bool(options.get("dashboard", False))
    # The scheduler runs in this process and must be reachable from the compute
    # nodes, so it listens on ``interface`` (or every interface), for mutual TLS
    # unless security=False; its HTTP server stays on 127.0.0.1 (reach it with an
    # ssh tunnel).
    job_cls = _reporting_job_class(cluster_cls.job_cls)
    with scheduler_http(dashboard), dask.config.set(_config.process_settings()):
        cluster = cluster_cls(
            **kwargs,
            job_cls=job_cls,
            security=security,
            shared_temp_directory=shared,
            scheduler_options={"dashboard_address": "127.0.0.1:0", "dashboard": dashboard},
        )
    jobs = options.get("jobs", 1)
    try:
        cluster.scale(jobs=jobs)
    except BaseException:
        cluster.close()
        raise
    return cluster, _JobsWatch(kind, cluster, job_cls, jobs, kwargs["processes"])


def jobqueue_script(kind: str, **options) -> str:
    """The batch script dask-jobqueue submits for one job, without any batch system.

    Parameters
    ----------
    kind : {"slurm", "pbs"}
    **options
        As for :func:`start_cluster`.  ``jobs``, ``dashboard``,
        ``shared_temp_directory``, ``worker_timeout`` and ``progress`` are
        accepted and do not change the script.

    Returns
    -------
    str
        The script, with ``tcp://<scheduler-address>:8786`` where the running
        cluster's scheduler address goes (``tls://`` with
        ``security=make_security(...)``).  Without ``security`` the script
        shows plain TCP, but the cluster :func:`start_cluster` starts uses
        ``tls://`` and throwaway certificate files (see its ``security``).

    Raises
    ------
    ValueError
        ``security=True``: its certificates only exist once a cluster starts.

    Examples
    --------
    >>> from dkicf.deploy import jobqueue_script
    >>> script = jobqueue_script("slurm", cores=4, memory="16GiB", walltime="01:00:00")
    >>> "#SBATCH --cpus-per-task=4" in script
    True
    """
    module = _jobqueue_module(kind)
    kwargs = _job_kwargs(kind, options)
    security = options.get("security")
    scheduler = _SCRIPT_SCHEDULER
    if security is True:
        raise ValueError(
            "security=True makes throwaway certificates when the cluster starts, so no "
            "script shows them; pass make_security(ca_file, cert, key) to see TLS in the script."
        )
    if security is not None and security is not False:
        kwargs.update(security=security, protocol="tls://")
        scheduler = scheduler.replace("tcp://", "tls://")
    job_cls = getattr(module, f"{_JOBQUEUE[kind]}Cluster").job_cls
    return job_cls(scheduler, name="dummy-name", **kwargs).job_script()


# --------------------------------------------------------- waiting for workers


def _duration(seconds: float) -> str:
    """Seconds as a short human duration: ``45 s``, ``10 min``, ``1.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.3g} h"


def _count(n: int, word: str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{n} {word}{'s' * (n != 1)}"


def _id_list(ids: list[str], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


class _JobsWatch:
    """What waiting for the workers of a dask-jobqueue cluster needs to know of its jobs."""

    def __init__(self, kind: str, cluster, job_cls, jobs: int, processes: int):
        self.kind = kind
        self.label = _JOBQUEUE[kind]
        self.cluster = cluster
        self.job_cls = job_cls
        self.jobs = jobs
        self.expected = jobs * processes

    def _all(self) -> list:
        return list(self.cluster.workers.values())

    def _ids(self) -> list[str]:
        return [str(job.job_id) for job in self._all() if job.job_id]

    def _status_command(self) -> str:
        return _JOB_STATUS[self.kind][0].format(ids=",".join(self._ids()) or "--me")

    def submitted(self) -> bool:
        """Whether every job has been handed to the batch system; raise if one was refused."""
        jobs = self._all()
        if len(jobs) < self.jobs or any(
            not job.job_id and getattr(job, "submit_error", None) is None for job in jobs
        ):
            return False
        failed = [job.submit_error for job in jobs if getattr(job, "submit_error", None)]
        if failed:
            command = shlex.split(jobs[0].submit_command)[0]
            which = "the job" if self.jobs == 1 else f"{len(failed)} of {self.jobs} jobs"
            accepted = (
                "" if len(failed) == self.jobs else " The jobs it accepted have been cancelled."
            )
            raise JobSubmissionError(
                f"{command} refused {which}: {failed[0].rstrip('.')}. Check the queue, "
                "account, walltime, cores and memory asked for against the site's limits."
                + accepted
            )
        return True

    def started(self) -> None:
        """From now on, jobs that the batch system refuses are logged."""
        self.job_cls.log_failures = True

    def waiting(self) -> str:
        ids = self._ids()
        return (
            f"submitted {_count(len(ids), self.label + ' job')} ({_id_list(ids)}) for "
            f"{_count(self.expected, 'worker')}; check the queue with: {self._status_command()}"
        )

    def _log_directory(self) -> str:
        jobs = self._all()
        directory = getattr(jobs[0], "log_directory", None) if jobs else None
        return os.path.abspath(directory or os.getcwd())

    def none_joined(self) -> str:
        ids = self._ids()
        if len(ids) < self.jobs:
            return (
                f"the {self.label} jobs were not all submitted ({len(ids)} of {self.jobs}): "
                "is the batch system answering?"
            )
        reason = _JOB_STATUS[self.kind][1].format(id=ids[0])
        jobs = f"{len(ids)} {self.label} jobs ({_id_list(ids)}) have"
        if len(ids) == 1:
            jobs = f"the {self.label} job {ids[0]} has"
        return (
            f"{jobs} not started, or their workers could not connect. See where they are with "
            f"{self._status_command()} (why one waits: {reason}) and read their output in "
            f"{self._log_directory()}. They have been cancelled. Wait longer with "
            "--worker-timeout (worker_timeout=), or ask for fewer resources (cores, memory, "
            "walltime) to start sooner."
        )

    def rest(self) -> str:
        return f"the others join when their {self.label} jobs start"


class _PodsWatch:
    """What waiting for the workers of a DaskCluster on Kubernetes needs to know."""

    def __init__(self, name: str, namespace: str | None, workers: int):
        self.name = name
        self.expected = workers
        self.pods = (
            f"kubectl {'-n ' + namespace + ' ' if namespace else ''}get pods "
            f"-l dask.org/cluster-name={name}"
        )

    def submitted(self) -> bool:
        return True

    def started(self) -> None:
        pass

    def waiting(self) -> str:
        return (
            f"DaskCluster {self.name} has started its scheduler; its "
            f"{_count(self.expected, 'worker pod')} show with: {self.pods}"
        )

    def none_joined(self) -> str:
        return (
            f"the worker pods of DaskCluster {self.name} have not joined. See "
            f"them with {self.pods}, and kubectl describe pod on one that is Pending (image "
            "pull, quota, node resources) or kubectl logs on one that runs. Wait longer with "
            "--worker-timeout (worker_timeout=)."
        )

    def rest(self) -> str:
        return "the others join when their pods start"


def _wait_options(options: dict) -> dict:
    """Take ``worker_timeout`` and ``progress`` out of ``options``, checked."""
    timeout = options.pop("worker_timeout", _WORKER_TIMEOUT)
    progress = options.pop("progress", None)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                f"worker_timeout must be a number of seconds > 0 (or None to wait without "
                f"limit), got {timeout!r}."
            )
        if math.isinf(timeout):
            timeout = None
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a function of one string, got {progress!r}.")
    return {"timeout": timeout, "progress": progress}


def _joined(client) -> int:
    return len(all_workers(client))


def _wait_for_workers(client, watch, *, timeout: float | None, progress) -> None:
    """Block until ``watch.expected`` workers joined, or ``timeout`` seconds passed.

    After the timeout the cluster is used as it is if at least one worker
    joined (with a warning); with none, :class:`WorkersTimeoutError`.
    """
    say = progress or logger.info
    start = time.monotonic()
    announced = False
    seen = 0
    reminder = start + _REMINDER_INTERVAL
    limit = "without a time limit" if timeout is None else f"up to {_duration(timeout)}"
    while True:
        if not announced and watch.submitted():
            say(f"{watch.waiting()}; waiting {limit} for the workers to join ...")
            announced = True
        joined = _joined(client)
        elapsed = time.monotonic() - start
        if joined >= watch.expected:
            say(f"all {_count(watch.expected, 'worker')} joined after {_duration(elapsed)}")
            return
        if joined != seen:
            say(f"{joined} of {watch.expected} workers joined after {_duration(elapsed)}")
            seen = joined
        if timeout is not None and elapsed >= timeout:
            if joined:
                logger.warning(
                    "only %d of %d workers joined within %s; going on with them (%s).",
                    joined, watch.expected, _duration(timeout), watch.rest(),
                )
                return
            raise WorkersTimeoutError(
                f"no worker joined within {_duration(timeout)}: {watch.none_joined()}"
            )
        if time.monotonic() >= reminder:
            say(f"still waiting: {joined} of {watch.expected} workers after {_duration(elapsed)}")
            reminder += _REMINDER_INTERVAL
        pause = _POLL_INTERVAL
        if timeout is not None:
            pause = min(pause, max(timeout - elapsed, 0.0))
        time.sleep(pause)


def start_cluster(kind: str = "local", **options):
    """Start a dask cluster and return ``(client, cluster)``.

    For Kubernetes and batch systems it also waits for the workers: their
    pods or jobs may take minutes or hours to start, and a fit needs workers.

    Parameters
    ----------
    kind : {"local", "kubernetes", "slurm", "pbs"}
        Where the workers run.
    **options
        ``local``: ``workers="auto"`` (one a core this process may use),
        ``threads=1`` (per worker),
        ``memory_limit="auto"`` (per worker), ``dashboard=False``,
        ``separate_processes`` (see :func:`local_cluster`).  Binds to
        127.0.0.1; the dashboard, when on, too.

        ``kubernetes``: ``name``, ``image``, ``workers``, ``threads``,
        ``memory_limit``, ``env``, ``secret``, ``scheduler_cpu``, ``scheduler_memory``,
        ``namespace`` (see :func:`kubernetes_spec`).  Needs the
        dask-kubernetes operator in the Kubernetes cluster.

        ``slurm``/``pbs``: ``jobs`` (batch jobs to submit), ``cores`` and
        ``memory`` (per job), ``processes`` (worker processes per job; 1 unless
        configured), ``walltime``, ``queue``, ``account``, ``interface`` (network for the
        scheduler and workers, e.g. ``"ib0"``), ``local_directory``,
        ``log_directory``, ``job_script_prologue``, ``job_extra_directives``,
        ``python``, ``dashboard=False``, ``security=True`` and
        ``shared_temp_directory``.  The scheduler runs in this process and
        listens on ``interface`` (every interface if not given), where other
        users of the site's network can reach it, so it only speaks mutual
        TLS unless told otherwise.  A job option left out (or None) takes
        its value from dask-jobqueue's configuration, ``jobqueue.<kind>.*``
        in the site's ``jobqueue.yaml``:

        - ``security=True`` (the default; ``None`` means the same): throwaway
          certificates, made with the ``cryptography`` package.  dask-jobqueue
          writes the workers' copy, readable by you only, into
          ``shared_temp_directory``, which must be a directory the compute
          nodes see; by default dask's ``jobqueue.<kind>.shared-temp-directory``
          setting or else ``~/.dkicf``, created with mode 700 if missing.
        - ``security=make_security(ca_file, cert, key)``: your certificates;
          the files must be readable on the compute nodes at the same paths.
        - ``security=False``: plain TCP.  Whoever reaches the scheduler can
          run code as you on every worker: only on a network you trust.

        ``kubernetes``, ``slurm``, ``pbs`` also take ``worker_timeout=3600``
        (seconds) and ``progress``.  The call returns once all requested
        workers (``workers``, or ``jobs * processes``) have joined.  If
        ``worker_timeout`` passes first, it returns with the workers that
        joined (and logs a warning), or raises :class:`WorkersTimeoutError`
        when none did; ``None`` or ``math.inf`` waits without limit.
        ``progress``, a function of one string, receives the messages about
        the wait (the job ids, how many workers joined); by default they are
        logged at INFO level on the ``dkicf.deploy`` logger.

    Returns
    -------
    client : distributed.Client
    cluster : distributed.deploy.Cluster
        Close both when done: ``client.close(); cluster.close()``.  Closing a
        batch-system cluster cancels its jobs.

    Raises
    ------
    MissingExtraError
        The kind's optional dependency is not installed (an ImportError whose
        message says which ``pip install "dkicf[...]"`` adds it), or
        ``cryptography`` for ``security=True``.
    FileNotFoundError
        ``sbatch`` or ``qsub`` is not on PATH: this is not a login node of
        the batch system.
    JobSubmissionError
        ``sbatch`` or ``qsub`` refused a job; the message quotes it.
    WorkersTimeoutError
        No worker joined within ``worker_timeout``; the message names the
        jobs and where to look.  The jobs have been cancelled.

    Examples
    --------
    >>> from dkicf.deploy import start_cluster
    >>> client, cluster = start_cluster("local", workers=1, threads=1)  # doctest: +SKIP
    >>> client.close(); cluster.close()  # doctest: +SKIP

    On a login node of a SLURM cluster, with TLS files in ``~/.dkicf``:

    >>> client, cluster = start_cluster(
    ...     "slurm", jobs=4, cores=16, processes=4, memory="120GiB", walltime="04:00:00",
    ...     interface="ib0", worker_timeout=2 * 3600, progress=print,
    ... )  # doctest: +SKIP
    """
    from distributed import Client

    watch = wait = None
    if kind == "local":
        _check_options(kind, options, ("workers", "threads", "memory_limit", "dashboard",
                                       "separate_processes"))
        cluster = _local_cluster(**options)
    elif kind == "kubernetes":
        wait = _wait_options(options)
        cluster, watch = _kubernetes_cluster(**options)
    elif kind in _JOBQUEUE:
        wait = _wait_options(options)
        cluster, watch = _jobqueue_cluster(kind, **options)
    else:
        raise ValueError(f"kind must be one of {list(CLUSTER_KINDS)}, got {kind!r}.")
    client = None
    try:
        # Local workers hand results straight to the driver (docs/kmeans.md).
        client = Client(cluster, direct_to_workers=kind == "local")
        if watch is not None:
            _wait_for_workers(client, watch, **wait)
            watch.started()
    except BaseException:
        # Also on Ctrl-C while waiting: closing the cluster cancels its jobs.
        if client is not None:
            client.close()
        cluster.close()
        raise
    return client, cluster


def local_cluster(
    n_workers: int | str | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int | None = None,
    *,
    dashboard: bool = False,
    separate_processes: bool | str | None = None,
):
    """Start a local cluster bound to 127.0.0.1 and return a client connected to it.

    The workers are separate processes.  Without ``dashboard=True`` the
    scheduler's HTTP port serves only ``/health``; with it, the dashboard is
    on 127.0.0.1 only.  Close both when done:
    ``cluster = client.cluster; client.close(); cluster.close()``.

    Parameters
    ----------
    n_workers : int or "auto", optional
        Worker processes, or ``"auto"``: one a core that this process may
        use (its CPU affinity and cgroup quota).  By default dask's setting
        ``dkicf.cluster.workers`` (``auto`` unless configured), as for the
        ``dkicf`` command.
    threads_per_worker : int, optional
        By default ``dkicf.cluster.threads`` (1 unless configured).
    memory_limit : str or int, optional
        Per worker, e.g. ``"4GiB"``; ``"auto"`` shares the machine's memory
        among the workers.  By default ``dkicf.cluster.memory-limit`` (``auto``
        unless configured).
    dashboard : bool
        Serve the dask dashboard (on 127.0.0.1 only).
    separate_processes : bool or "auto", optional
        Run the scheduler, and each worker's nanny, in a process of its own
        rather than in this one (a ``LocalCluster``).  With many workers, a
        scheduler and nannies in the driver's process keep it busy and slow
        every pass of a fit down: on 16 cores with 16 workers that process was
        the serial part of the factorization.  ``"auto"`` separates them for
        more than 4 workers.  By default ``dkicf.cluster.separate-processes``
        (``auto`` unless configured).

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> import dask
    >>> import dkicf
    >>> with dask.config.set({"dkicf.cluster.workers": 4}):
    ...     client = dkicf.local_cluster()  # doctest: +SKIP
    """
    if n_workers is None:
        n_workers = _config.get("cluster.workers")
    if threads_per_worker is None:
        threads_per_worker = _config.get("cluster.threads")
    if memory_limit is None:
        memory_limit = _config.get("cluster.memory-limit")
    client, _ = start_cluster(
        "local", workers=n_workers, threads=threads_per_worker, memory_limit=memory_limit,
        dashboard=dashboard, separate_processes=separate_processes,
    )
    return client
