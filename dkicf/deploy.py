"""Where a fit runs: an existing scheduler (plain or TLS), a local cluster, Kubernetes, HPC.

Everything here is secure by default: a local cluster listens on 127.0.0.1
only, no dashboard is served unless asked for (and then on 127.0.0.1 only, or
inside the Kubernetes cluster), and a TLS connection requires encryption and
mutual authentication.  The Kubernetes and batch-system back ends are optional
extras; this module imports without them and names the extra to install when
one is missing.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import re
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client
    from distributed.security import Security

__all__ = [
    "CLUSTER_KINDS",
    "MissingExtraError",
    "connect",
    "jobqueue_script",
    "kubernetes_spec",
    "make_security",
    "start_cluster",
]

CLUSTER_KINDS = ("local", "kubernetes", "slurm", "pbs")

# Share of a Kubernetes worker container's memory that dask may manage; the rest
# is headroom for the nanny process, the interpreter and unmanaged memory, so
# that dask pauses, spills or restarts a worker before the kernel OOM-kills it.
_K8S_DASK_MEMORY_FRACTION = 0.9
_SCRIPT_SCHEDULER = "tcp://<scheduler-address>:8786"
_TLS_FLAGS = "--tls-ca-file, --tls-cert and --tls-key"


class MissingExtraError(ImportError):
    """An optional dependency of one way of deploying is not installed."""


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


# --------------------------------------------------------------------------- TLS


def _read_file(path, flag: str) -> bytes:
    """Read a file named by a command-line flag; errors name the flag and the path."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: no such file.") from None
    except PermissionError:
        raise PermissionError(f"{flag} {path}: not readable by this user.") from None
    except OSError as exc:
        raise OSError(f"{flag} {path}: cannot be read ({exc.strerror or exc}).") from None


def make_security(
    tls_ca_file: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
) -> Security | None:
    """Build the TLS settings for a scheduler that requires mutual TLS.

    Parameters
    ----------
    tls_ca_file : str or Path, optional
        PEM file of the certificate authority that signed the scheduler's and
        the workers' certificates.
    tls_cert : str or Path, optional
        PEM certificate of this process, signed by that authority.
    tls_key : str or Path, optional
        PEM private key of ``tls_cert``.  May be omitted when ``tls_cert``
        holds the key too.

    Returns
    -------
    distributed.security.Security or None
        None when no file is given (plain ``tcp://``); otherwise settings with
        ``require_encryption=True`` that use the same certificate for the
        client, scheduler and worker roles.

    Raises
    ------
    ValueError
        Only some of the files are given, a file is not PEM, or the
        certificate and key do not belong together.
    FileNotFoundError, PermissionError
        A file is missing or unreadable (the message names the flag and path).

    Notes
    -----
    Whether the certificate was signed by the authority the *scheduler*
    trusts can only be known at the TLS handshake; :func:`connect` reports that
    case.

    Examples
    --------
    >>> from dkicf.deploy import make_security
    >>> make_security() is None
    True
    """
    from distributed.security import Security

    if tls_ca_file is None and tls_cert is None and tls_key is None:
        return None
    missing = [
        flag
        for flag, value in (("--tls-ca-file", tls_ca_file), ("--tls-cert", tls_cert))
        if value is None
    ]
    if missing:
        raise ValueError(
            f"TLS needs {_TLS_FLAGS} (the key may be inside the certificate file); "
            f"missing: {', '.join(missing)}."
        )
    ca_pem = _read_file(tls_ca_file, "--tls-ca-file")
    cert_pem = _read_file(tls_cert, "--tls-cert")
    if tls_key is None:
        if b"PRIVATE KEY-----" not in cert_pem:
            raise ValueError(
                f"--tls-key is missing and --tls-cert {tls_cert} holds no private key; "
                "pass the key file with --tls-key."
            )
    else:
        _read_file(tls_key, "--tls-key")
    if b"-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise ValueError(f"--tls-ca-file {tls_ca_file}: not a PEM certificate.")
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise ValueError(f"--tls-cert {tls_cert}: not a PEM certificate.")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(tls_ca_file))
    except ssl.SSLError as exc:
        raise ValueError(
            f"--tls-ca-file {tls_ca_file}: not a usable CA certificate ({exc.reason or exc})."
        ) from None
    try:
        context.load_cert_chain(str(tls_cert), None if tls_key is None else str(tls_key))
    except ssl.SSLError as exc:
        raise ValueError(
            f"--tls-cert {tls_cert} and --tls-key {tls_key} are not a certificate and its "
            f"private key ({exc.reason or exc}). Pass the key that was generated with "
            "this certificate."
        ) from None
    files = {"ca": str(tls_ca_file), "cert": str(tls_cert), "key": tls_key and str(tls_key)}
    return Security(
        tls_ca_file=files["ca"],
        tls_client_cert=files["cert"],
        tls_client_key=files["key"],
        tls_scheduler_cert=files["cert"],
        tls_scheduler_key=files["key"],
        tls_worker_cert=files["cert"],
        tls_worker_key=files["key"],
        require_encryption=True,
    )


# ------------------------------------------------------------- existing scheduler


def _read_scheduler_file(path, timeout: float) -> str:
    """The address in a scheduler file, waiting up to ``timeout`` s for it to appear."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            address = json.loads(Path(path).read_text())["address"]
        except FileNotFoundError:
            problem = "does not exist"
        except (json.JSONDecodeError, KeyError, TypeError):
            # A scheduler may be half-way through writing it.
            problem = "holds no scheduler address"
        else:
            if isinstance(address, str) and address:
                return address
            problem = "holds no scheduler address"
        if time.monotonic() >= deadline:
            raise FileNotFoundError(
                f"scheduler file {path} {problem} after {timeout:g} s. Is the scheduler "
                "running (dask scheduler --scheduler-file ...), and is the file on a "
                "filesystem this machine shares with it?"
            )
        time.sleep(0.2)


def _security_from_config() -> Security | None:
    """TLS settings from dask's configuration (``distributed.comm.tls``), if complete."""
    from distributed.security import Security

    configured = Security()
    if configured.tls_ca_file and configured.tls_client_cert:
        return configured
    return None


def connect(
    scheduler: str | None = None,
    *,
    scheduler_file: str | Path | None = None,
    security: Security | None = None,
    timeout: float = 10.0,
) -> Client:
    """Connect to a running dask scheduler.

    Parameters
    ----------
    scheduler : str, optional
        Its address, ``tcp://host:port`` or ``tls://host:port`` (``host:port``
        means ``tls://`` when ``security`` is given, else ``tcp://``).
    scheduler_file : str or Path, optional
        Instead of ``scheduler``: the JSON file written by
        ``dask scheduler --scheduler-file``; waited for up to ``timeout``.
    security : distributed.security.Security, optional
        TLS settings from :func:`make_security`.  Without it, TLS settings in
        dask's configuration (``distributed.comm.tls``) are used if complete.
    timeout : float, default=10
        Seconds before giving up.

    Returns
    -------
    distributed.Client

    Raises
    ------
    ValueError
        The address and the TLS settings disagree (``tls://`` without
        certificates, or certificates with ``tcp://``).
    ConnectionError
        No scheduler answered at the address within ``timeout``, or the TLS
        handshake failed; the message names the address.
    FileNotFoundError
        The scheduler file did not appear.
    """
    from distributed import Client

    if (scheduler is None) == (scheduler_file is None):
        raise ValueError("Give exactly one of scheduler (an address) and scheduler_file.")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}.")
    start = time.monotonic()
    if scheduler_file is not None:
        scheduler = _read_scheduler_file(scheduler_file, timeout)
    if not isinstance(scheduler, str) or not scheduler:
        raise TypeError(f"scheduler must be an address string, got {scheduler!r}.")
    protocol = scheduler.split("://", 1)[0] if "://" in scheduler else None
    if security is None and protocol in ("tls", None):
        security = _security_from_config()
    if protocol is None:
        protocol = "tls" if security is not None else "tcp"
        scheduler = f"{protocol}://{scheduler}"
    address = scheduler
    if protocol == "tls" and security is None:
        raise ValueError(
            f"the scheduler at {address} speaks TLS: pass {_TLS_FLAGS} "
            "(security=make_security(ca_file, cert, key))."
        )
    if protocol != "tls" and security is not None and security.require_encryption:
        raise ValueError(
            f"TLS certificates were given but the address {address} is not tls://; "
            f"use tls://{address.split('://', 1)[1]} or drop the certificates."
        )
    remaining = max(timeout - (time.monotonic() - start), 1.0)
    try:
        return Client(address, security=security, timeout=remaining)
    except (OSError, TimeoutError) as exc:
        raise ConnectionError(
            f"could not connect to the dask scheduler at {address} (timeout {timeout:g} s): "
            f"{exc}. {_connect_hint(protocol, str(exc), security)}"
        ) from None


def _connect_hint(protocol: str, message: str, security: Security | None) -> str:
    """What to check after a failed connection, from the error text."""
    if protocol != "tls":
        return (
            "Is the scheduler running, reachable from here, and listening on tcp://? "
            f"(A TLS scheduler needs a tls:// address and {_TLS_FLAGS}.)"
        )
    if any(
        sign in message
        for sign in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "EOF occurred")
    ):
        # With TLS 1.3 the scheduler's refusal may arrive as an alert or as a
        # closed connection, depending on timing.
        return (
            f"The scheduler ended the TLS handshake: most likely it refused this client's "
            f"certificate (--tls-cert {security.tls_client_cert}; is it signed by a CA the "
            "scheduler trusts?), or it does not speak TLS."
        )
    if "does not match" in message or "CERTIFICATE_VERIFY_FAILED" in message:
        return (
            f"The scheduler's certificate is not signed by the CA in --tls-ca-file "
            f"{security.tls_ca_file}."
        )
    return (
        "Check that --tls-ca-file holds the CA that signed the scheduler's certificate and "
        "that --tls-cert/--tls-key were signed by the CA the scheduler trusts."
    )


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


def _scheduler_http(dashboard: bool):
    """Configuration for a scheduler started in this process.

    distributed always starts an HTTP server next to the scheduler.  Without a
    dashboard it serves only ``/health`` (no worker pages, logs or JSON state).
    """
    import dask

    if dashboard:
        return contextlib.nullcontext()
    return dask.config.set({"distributed.scheduler.http.routes": ["distributed.http.health"]})


def _local_cluster(workers=2, threads=1, memory_limit="auto", dashboard=False):
    from distributed import LocalCluster

    _positive_int(workers, "workers")
    _positive_int(threads, "threads")
    with _scheduler_http(dashboard):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=threads,
            memory_limit=memory_limit,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"dashboard": bool(dashboard)},
        )


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
        Environment variables for the scheduler and workers.
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
    env_list = [{"name": k, "value": str(v)} for k, v in (env or {}).items()]
    container_security = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }

    def pod(container):
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

    def resources(cpu, memory):
        amount = {"cpu": str(cpu), "memory": memory}
        return {"requests": dict(amount), "limits": dict(amount)}

    worker = {
        "name": "worker",
        "image": image,
        "args": [
            "dask", "worker",
            "--name", "$(DASK_WORKER_NAME)",
            "--nthreads", str(threads),
            "--memory-limit", str(dask_bytes),
            "--no-dashboard",
        ],
        "resources": resources(threads, worker_memory),
        "securityContext": container_security,
        "env": env_list,
    }
    if secret is not None:
        worker["envFrom"] = [{"secretRef": {"name": secret}}]
    health = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    scheduler = {
        "name": "scheduler",
        "image": image,
        "args": ["dask", "scheduler", "--port", "8786", "--dashboard-address", ":8787"],
        "resources": resources(scheduler_cpu, _k8s_memory(scheduler_bytes)),
        "securityContext": container_security,
        "ports": [
            {"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
            {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"},
        ],
        "readinessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 5},
        "livenessProbe": {**health, "initialDelaySeconds": 15, "periodSeconds": 20},
        "env": env_list,
    }
    return {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {"name": name},
        "spec": {
            "worker": {"replicas": workers, "spec": pod(worker)},
            "scheduler": {
                "spec": pod(scheduler),
                "service": {
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
                },
            },
        },
    }


_KUBERNETES_OPTIONS = (
    "name", "image", "workers", "threads", "memory_limit", "env", "secret",
    "scheduler_cpu", "scheduler_memory", "namespace",
)


def _kubernetes_cluster(**options):
    operator = _require(
        "dask_kubernetes.operator", "kubernetes", 'start_cluster("kubernetes")'
    )
    _check_options("kubernetes", options, _KUBERNETES_OPTIONS)
    namespace = options.pop("namespace", None)
    for required in ("name", "image"):
        if required not in options:
            raise TypeError(f'start_cluster("kubernetes") needs {required}=.')
    spec = kubernetes_spec(options.pop("name"), options.pop("image"), **options)
    return operator.KubeCluster(custom_cluster_spec=spec, namespace=namespace)


_JOBQUEUE = {"slurm": "SLURM", "pbs": "PBS"}
# Options passed on to dask-jobqueue's Job class (they shape the batch script).
_JOB_OPTIONS = (
    "cores", "memory", "processes", "walltime", "queue", "account", "interface",
    "local_directory", "log_directory", "job_script_prologue", "job_extra_directives",
    "python",
)
# Options of the cluster object itself (they do not change the script).
_JOBQUEUE_CLUSTER_OPTIONS = ("jobs", "dashboard", "security", "shared_temp_directory")


def _job_kwargs(kind: str, options: dict) -> dict:
    """Validate start_cluster/jobqueue_script options; return the Job class keywords."""
    _check_options(kind, options, _JOB_OPTIONS + _JOBQUEUE_CLUSTER_OPTIONS)
    for required in ("cores", "memory"):
        if options.get(required) is None:
            raise TypeError(
                f"kind={kind!r} needs {required}= (per job), e.g. cores=8, memory='32GiB'."
            )
    kwargs = {k: v for k, v in options.items() if k in _JOB_OPTIONS}
    kwargs["cores"] = _positive_int(kwargs["cores"], "cores")
    kwargs["processes"] = _positive_int(kwargs.get("processes", 1), "processes")
    if kwargs["cores"] % kwargs["processes"]:
        raise ValueError(
            f"cores={kwargs['cores']} should be a multiple of processes={kwargs['processes']} "
            "so that every worker process gets the same number of threads."
        )
    _positive_int(options.get("jobs", 1), "jobs")
    return kwargs


def _jobqueue_module(kind: str):
    if kind not in _JOBQUEUE:
        raise ValueError(f"kind must be one of {sorted(_JOBQUEUE)}, got {kind!r}.")
    return _require("dask_jobqueue", "hpc", f"start_cluster({kind!r})")


def _jobqueue_cluster(kind: str, **options):
    module = _jobqueue_module(kind)
    kwargs = _job_kwargs(kind, options)
    dashboard = bool(options.get("dashboard", False))
    # The scheduler runs in this process and must be reachable from the compute
    # nodes, so it listens on ``interface`` (or every interface); its HTTP server
    # stays on 127.0.0.1 (reach it with an ssh tunnel).
    with _scheduler_http(dashboard):
        cluster = getattr(module, f"{_JOBQUEUE[kind]}Cluster")(
            **kwargs,
            security=options.get("security"),
            shared_temp_directory=options.get("shared_temp_directory"),
            scheduler_options={"dashboard_address": "127.0.0.1:0", "dashboard": dashboard},
        )
    cluster.scale(jobs=options.get("jobs", 1))
    return cluster


def jobqueue_script(kind: str, **options) -> str:
    """The batch script dask-jobqueue submits for one job, without any batch system.

    Parameters
    ----------
    kind : {"slurm", "pbs"}
    **options
        As for :func:`start_cluster`.  ``jobs``, ``dashboard`` and
        ``shared_temp_directory`` are accepted and do not change the script.

    Returns
    -------
    str
        The script, with ``tcp://<scheduler-address>:8786`` where the running
        cluster's scheduler address goes (``tls://`` with ``security``).

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
    if security is not None:
        kwargs.update(security=security, protocol="tls://")
        scheduler = scheduler.replace("tcp://", "tls://")
    job_cls = getattr(module, f"{_JOBQUEUE[kind]}Cluster").job_cls
    return job_cls(scheduler, name="dummy-name", **kwargs).job_script()


def start_cluster(kind: str = "local", **options):
    """Start a dask cluster and return ``(client, cluster)``.

    Parameters
    ----------
    kind : {"local", "kubernetes", "slurm", "pbs"}
        Where the workers run.
    **options
        ``local``: ``workers=2``, ``threads=1`` (per worker),
        ``memory_limit="auto"`` (per worker), ``dashboard=False``.  Binds to
        127.0.0.1; the dashboard, when on, too.

        ``kubernetes``: ``name``, ``image``, ``workers``, ``threads``,
        ``memory_limit``, ``env``, ``secret``, ``scheduler_cpu``, ``scheduler_memory``,
        ``namespace`` (see :func:`kubernetes_spec`).  Needs the
        dask-kubernetes operator in the Kubernetes cluster.

        ``slurm``/``pbs``: ``jobs`` (batch jobs to submit), ``cores`` and
        ``memory`` (per job), ``processes=1`` (worker processes per job),
        ``walltime``, ``queue``, ``account``, ``interface`` (network for the
        scheduler and workers, e.g. ``"ib0"``), ``local_directory``,
        ``log_directory``, ``job_script_prologue``, ``job_extra_directives``,
        ``python``, ``dashboard=False``, ``security`` and
        ``shared_temp_directory``.  The scheduler runs in this process and
        listens on ``interface``, where other users of the site's network can
        reach it: pass ``security=make_security(...)``, or ``security=True``
        for throwaway certificates (needs ``cryptography``) that dask-jobqueue
        writes, readable by you only, into ``shared_temp_directory`` (a
        directory the compute nodes see).

    Returns
    -------
    client : distributed.Client
    cluster : distributed.deploy.Cluster
        Close both when done: ``client.close(); cluster.close()``.

    Raises
    ------
    MissingExtraError
        The kind's optional dependency is not installed (an ImportError whose
        message says which ``pip install "dkicf[...]"`` adds it).

    Examples
    --------
    >>> from dkicf.deploy import start_cluster
    >>> client, cluster = start_cluster("local", workers=1, threads=1)  # doctest: +SKIP
    >>> client.close(); cluster.close()  # doctest: +SKIP
    """
    from distributed import Client

    if kind == "local":
        _check_options(kind, options, ("workers", "threads", "memory_limit", "dashboard"))
        cluster = _local_cluster(**options)
    elif kind == "kubernetes":
        cluster = _kubernetes_cluster(**options)
    elif kind in _JOBQUEUE:
        cluster = _jobqueue_cluster(kind, **options)
    else:
        raise ValueError(f"kind must be one of {list(CLUSTER_KINDS)}, got {kind!r}.")
    try:
        client = Client(cluster)
    except BaseException:
        cluster.close()
        raise
    return client, cluster
