"""Deployment: real scheduler and worker processes, TLS, loopback binding, manifests, job scripts.

No Kubernetes or batch system runs here.  What can run does: dask schedulers
and workers as separate processes (plain and mutual TLS), the LocalCluster of
``start_cluster("local")`` with its sockets inspected, and the manual SLURM and
PBS scripts with stand-ins for ``srun`` and ``pbsdsh``.  Manifests are validated
offline against the DaskCluster CRD shipped in dask-kubernetes and Kubernetes'
own schemas; job scripts come from dask-jobqueue without a batch system.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import datetime
import ipaddress
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from _tied import tied_popen
from numpy.testing import assert_allclose, assert_array_equal

from dkicf import incomplete_cholesky
from dkicf._cluster import all_workers
from dkicf.deploy import (
    MissingExtraError,
    connect,
    jobqueue_script,
    kubernetes_spec,
    make_security,
    process_environment,
    start_cluster,
)

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
START_TIMEOUT = 60  # seconds for processes to come up on a busy 2-core machine
REFUSE_TIMEOUT = 3  # client connect timeout when a refusal is expected


# --------------------------------------------------------------------- processes


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(extra)
    return env


class _Processes:
    """Start processes whose output goes to log files; stop them all at teardown."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], **env: str) -> subprocess.Popen:
        log = self.directory / f"{name}.log"
        with open(log, "wb") as out:
            # Its own session, ended with the test run even when that is killed.
            proc = tied_popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=_child_env(**env),
                cwd=self.directory,
            )
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.procs
        )

    def stop(self) -> None:
        # Last started first: workers whose scheduler is gone retry it for a while.
        for proc, _ in reversed(self.procs):
            # Each child leads its own session: end it with everything it started.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(timeout=10)


@pytest.fixture
def processes(tmp_path):
    procs = _Processes(tmp_path)
    yield procs
    procs.stop()


def _dask(role: str) -> list[str]:
    return [sys.executable, "-m", f"distributed.cli.dask_{role}"]


def _start_dask(procs: _Processes, directory: Path, tls: list[str] | None = None):
    """A scheduler and two single-threaded workers on 127.0.0.1; the scheduler file."""
    scheduler_file = directory / "scheduler.json"
    tls = tls or []
    env = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"} if tls else {}
    procs.start(
        "scheduler",
        _dask("scheduler") + [
            "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file),
            *(["--protocol", "tls"] if tls else []), *tls,
        ],
        **env,
    )
    workers = [
        procs.start(
            f"worker{i}",
            _dask("worker") + [
                "--scheduler-file", str(scheduler_file), "--host", "127.0.0.1",
                "--nthreads", "1", "--memory-limit", "1GiB", "--no-dashboard",
                "--no-nanny", "--name", f"w{i}", "--death-timeout", str(START_TIMEOUT), *tls,
            ],
            **env,
        )
        for i in range(2)
    ]
    return scheduler_file, workers


def _wait_for_workers(client, n: int, procs: _Processes) -> None:
    try:
        client.wait_for_workers(n, timeout=START_TIMEOUT)
    except TimeoutError:
        pytest.fail(f"{n} workers did not join within {START_TIMEOUT} s\n{procs.logs()}")


# ------------------------------------------------------------------ certificates


def _pki_cryptography(directory: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name, key, cert):
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(common_name, key):
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        )

    for ca_name, leaves in (("ca", ("node", "client")), ("otherca", ("othernode",))):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dkicf test {ca_name}")])
        ca_cert = (
            builder(f"dkicf test {ca_name}", ca_key)
            .issuer_name(ca_subject)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        write(ca_name, ca_key, ca_cert)
        for leaf in leaves:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (
                builder(leaf, key)
                .issuer_name(ca_subject)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                    critical=False,
                )
                .add_extension(
                    x509.SubjectAlternativeName([
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]),
                    critical=False,
                )
                .add_extension(
                    x509.ExtendedKeyUsage(
                        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                    ),
                    critical=False,
                )
                .sign(ca_key, hashes.SHA256())
            )
            write(leaf, key, cert)


def _pki_openssl(directory: Path) -> None:
    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ext = directory / "leaf.ext"
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "authorityKeyIdentifier=keyid\n"
        "subjectKeyIdentifier=hash\n"
    )
    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca_name, leaves in (("ca", ("node", "client")), ("otherca", ("othernode",))):
        run("req", "-x509", *newkey, "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem",
            "-days", "1", "-subj", f"/CN=dkicf test {ca_name}",
            "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
        for serial, leaf in enumerate(leaves, start=1):
            run("req", *newkey, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr",
                "-subj", f"/CN={leaf}")
            run("x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca_name}.pem",
                "-CAkey", f"{ca_name}.key", "-set_serial", str(serial), "-days", "1",
                "-extfile", str(ext), "-out", f"{leaf}.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """Two CAs: ``ca`` signed ``node`` (scheduler, workers) and ``client``; ``otherca`` signed
    ``othernode``.  Each as ``NAME.pem`` and ``NAME.key``."""
    directory = tmp_path_factory.mktemp("pki")
    try:
        _pki_cryptography(directory)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        _pki_openssl(directory)
    return directory


def _tls_args(pki: Path, name: str, ca: str = "ca") -> list[str]:
    return [
        "--tls-ca-file", str(pki / f"{ca}.pem"),
        "--tls-cert", str(pki / f"{name}.pem"),
        "--tls-key", str(pki / f"{name}.key"),
    ]


def _security(pki: Path, name: str, ca: str = "ca"):
    return make_security(pki / f"{ca}.pem", pki / f"{name}.pem", pki / f"{name}.key")


# ------------------------------------------------------- an existing scheduler


def _factorize(X, client):
    res = incomplete_cholesky(X, kernel="gaussian", gamma=0.5, max_rank=20, client=client)
    return res.pivots, client.compute(res.P, sync=True)


def test_separate_scheduler_and_worker_processes_match_local_cluster(processes, tmp_path, client):
    scheduler_file, workers = _start_dask(processes, tmp_path)
    X = np.random.default_rng(7).normal(size=(2000, 3))
    dX = da.from_array(X, chunks=(500, 3))
    with connect(scheduler_file=scheduler_file, timeout=START_TIMEOUT) as remote:
        _wait_for_workers(remote, 2, processes)
        # The work ran in the worker processes started above, not in this one.
        assert sorted(remote.run(os.getpid).values()) == sorted(w.pid for w in workers)
        pivots, P = _factorize(dX, remote)
    ref_pivots, ref_P = _factorize(dX, client)
    assert P.shape == (2000, 20)
    assert_array_equal(pivots, ref_pivots)
    assert_allclose(P, ref_P, rtol=0, atol=1e-10)


def test_connect_to_nothing_fails_within_timeout_naming_the_address():
    address = "tcp://127.0.0.1:9"  # discard port: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(address)):
        connect(address, timeout=1)
    assert time.monotonic() - t0 < 1 + 5


def test_scheduler_file_that_never_appears(tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        connect(scheduler_file=missing, timeout=0.5)


@pytest.mark.parametrize("message, hint", [
    ("[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca", "refused this client's certificate"),
    ("EOF occurred in violation of protocol", "refused this client's certificate"),
    # How the same refusal reached a client under Python 3.13.
    ("in <TLS (closed)>: ConnectionResetError: [Errno 104] Connection reset by peer",
     "refused this client's certificate"),
    ("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed", "not signed by the CA"),
    ("Timed out trying to connect", "Check that --tls-ca-file holds the CA"),
])
def test_a_refused_tls_connection_names_the_likely_cause(pki, message, hint):
    from dkicf._connect import _connect_hint

    assert hint in _connect_hint("tls", message, _security(pki, "client"))


def test_connect_argument_errors(pki):
    with pytest.raises(ValueError, match="exactly one"):
        connect()
    with pytest.raises(ValueError, match="--tls-ca-file, --tls-cert and --tls-key"):
        connect("tls://127.0.0.1:9", timeout=1)
    with pytest.raises(ValueError, match=r"tls://127\.0\.0\.1:9"):
        connect("tcp://127.0.0.1:9", security=_security(pki, "client"), timeout=1)


# ------------------------------------------------------------------------- TLS


@pytest.fixture
def tls_cluster(processes, tmp_path, pki):
    scheduler_file, _ = _start_dask(processes, tmp_path, tls=_tls_args(pki, "node"))
    with connect(
        scheduler_file=scheduler_file, security=_security(pki, "client"), timeout=START_TIMEOUT
    ) as client:
        _wait_for_workers(client, 2, processes)
        yield client


def _refused(make_client, match: str | None = None) -> None:
    """The connection attempt fails, within the timeout plus slack."""
    t0 = time.monotonic()
    with pytest.raises((OSError, TimeoutError), match=match):
        make_client().close()
    assert time.monotonic() - t0 < REFUSE_TIMEOUT + 10


def _identity(address: str, ssl_context) -> dict:
    """Ask the scheduler who it is over a bare dask comm with the given TLS context."""
    from distributed.comm import connect as comm_connect

    async def ask():
        comm = await comm_connect(address, timeout=REFUSE_TIMEOUT, ssl_context=ssl_context)
        try:
            await comm.write({"op": "identity"})
            return await comm.read()
        finally:
            await comm.close()

    return asyncio.run(ask())


def test_tls_cluster_computes_and_refuses_the_wrong_clients(tls_cluster, pki):
    from distributed import Client

    address = tls_cluster.scheduler.address
    assert address.startswith("tls://127.0.0.1:")
    X = da.from_array(np.arange(4000.0).reshape(2000, 2), chunks=(500, 2))
    expected = np.sum(np.arange(4000.0) ** 2)
    assert tls_cluster.compute((X**2).sum(), sync=True) == pytest.approx(expected)
    assert len(all_workers(tls_cluster)) == 2

    # A client that trusts the CA but has no certificate of its own: the
    # scheduler demands one.  (The same comm with the client's certificate works.)
    good = _security(pki, "client").get_connection_args("client")["ssl_context"]
    assert _identity(address, good)["type"] == "Scheduler"
    no_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    no_cert.check_hostname = False
    _refused(lambda: _identity(address, no_cert))
    # Everything from another CA: neither side trusts the other.
    other = _security(pki, "othernode", ca="otherca")
    _refused(
        lambda: connect(address, security=other, timeout=REFUSE_TIMEOUT),
        rf"{re.escape(address)}.*not signed by the CA in --tls-ca-file .*otherca\.pem",
    )
    # The right CA file, but a certificate that CA did not sign.
    forged = _security(pki, "othernode", ca="ca")
    _refused(
        lambda: connect(address, security=forged, timeout=REFUSE_TIMEOUT),
        r"refused this client's certificate \(--tls-cert .*othernode\.pem;",
    )
    # Plain TCP to the TLS port.
    plain = "tcp://" + address.split("://", 1)[1]
    _refused(lambda: Client(plain, timeout=REFUSE_TIMEOUT))
    _refused(lambda: connect(plain, timeout=REFUSE_TIMEOUT), re.escape(plain))


def test_make_security(pki, tmp_path):
    assert make_security() is None
    sec = _security(pki, "client")
    assert sec.require_encryption
    assert sec.tls_ca_file == str(pki / "ca.pem")
    assert sec.get_tls_config_for_role("client")["cert"] == str(pki / "client.pem")
    with pytest.raises(ValueError, match="missing: --tls-cert"):
        make_security(tls_ca_file=pki / "ca.pem")
    with pytest.raises(FileNotFoundError, match="--tls-key .*absent.key"):
        make_security(pki / "ca.pem", pki / "client.pem", tmp_path / "absent.key")
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello\n")
    with pytest.raises(ValueError, match="--tls-ca-file .*ca.txt: not a PEM"):
        make_security(not_pem, pki / "client.pem", pki / "client.key")
    with pytest.raises(ValueError, match="client.pem and --tls-key .*node.key are not"):
        make_security(pki / "ca.pem", pki / "client.pem", pki / "node.key")
    with pytest.raises(ValueError, match="holds no private key"):
        make_security(pki / "ca.pem", pki / "client.pem")
    combined = tmp_path / "combined.pem"
    combined.write_bytes((pki / "client.pem").read_bytes() + (pki / "client.key").read_bytes())
    assert make_security(pki / "ca.pem", combined).tls_client_key is None


# ---------------------------------------------------------- start_cluster("local")


def _listening(proc) -> list:
    import psutil

    return [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def _http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("dashboard", [False, True])
def test_local_cluster_listens_on_loopback_only(dashboard):
    import psutil

    me = psutil.Process()
    # Other tests' clusters may live in this process and its children: look at
    # new sockets and new processes only.
    before = set(_listening(me))
    children_before = set(me.children(recursive=True))
    client, cluster = start_cluster(
        "local", workers=2, threads=1, memory_limit="1GiB", dashboard=dashboard
    )
    try:
        children = set(me.children(recursive=True)) - children_before
        sockets = {proc.pid: _listening(proc) for proc in children}
        sockets[me.pid] = [a for a in _listening(me) if a not in before]
        worker_pids = set(client.run(os.getpid).values())
        info = all_workers(client)
        direct = client.direct_to_workers
        http_port = cluster.scheduler.http_server.port
        status = {path: _http_status(http_port, path) for path in ("/health", "/status")}
        workers_page = _http_status(http_port, "/info/main/workers.html")
    finally:
        client.close()
        cluster.close()

    # Every listening socket of this process (scheduler, nannies) and of the
    # worker processes is on 127.0.0.1.
    assert worker_pids <= set(sockets)
    assert all(sockets[pid] for pid in worker_pids)
    bad = {pid: [a for a in addrs if a.ip != "127.0.0.1"] for pid, addrs in sockets.items()}
    assert not any(bad.values()), bad
    scheduler_port = int(cluster.scheduler_address.rsplit(":", 1)[1])
    assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    assert {a.port for a in sockets[os.getpid()]} >= {scheduler_port, http_port}
    assert sorted(w["nthreads"] for w in info.values()) == [1, 1]
    assert direct is True  # results come from the workers on this machine, not the scheduler
    assert all(w["memory_limit"] == 2**30 for w in info.values())
    assert status["/health"] == 200
    if dashboard:
        assert status["/status"] == 200
    else:
        # The HTTP server distributed always starts answers health checks only.
        assert status["/status"] == 404
        assert workers_page == 404
        assert 8787 not in {a.port for addrs in sockets.values() for a in addrs}


def test_start_cluster_rejects_unknown_kinds_and_options():
    with pytest.raises(ValueError, match="'local', 'kubernetes', 'slurm', 'pbs'"):
        start_cluster("yarn")
    with pytest.raises(TypeError, match="n_workers.*Valid options: dashboard, memory_limit"):
        start_cluster("local", n_workers=2)
    for bad in (0, "all", 2.5, True):
        with pytest.raises(ValueError, match=r"workers must be an integer >= 1 or 'auto', "
                                             rf"got {bad!r}\."):
            start_cluster("local", workers=bad)


def test_auto_local_workers_are_one_a_core_this_process_may_use(monkeypatch):
    """workers="auto" (the default) starts one single-thread worker per core that dask
    counts for this process (affinity and cgroup quota), not a fixed 2."""
    import dask.system

    from dkicf import _local

    seen = []

    class Started(Exception):
        pass

    def local_cluster_object(workers, threads, *rest):
        seen.append((workers, threads))
        raise Started  # no cluster, and no client of dask's own defaults either

    monkeypatch.setattr(_local, "local_cluster_object", local_cluster_object)
    monkeypatch.setattr(dask.system, "CPU_COUNT", 7)
    for options in ({}, {"workers": "auto", "threads": 2}, {"workers": 3}):
        with pytest.raises(Started):
            start_cluster("local", **options)
    monkeypatch.setattr(dask.system, "CPU_COUNT", 0)
    with pytest.raises(Started):
        start_cluster("local")
    assert seen == [(7, 1), (7, 2), (3, 1), (1, 1)]


# ------------------------------------------------------------- optional extras


def _without(monkeypatch, *modules: str) -> None:
    """Make ``import module`` fail as if the package were not installed."""
    for name in list(sys.modules):
        if name in modules or name.startswith(tuple(m + "." for m in modules)):
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_kubernetes_extra_names_it(monkeypatch):
    _without(monkeypatch, "dask_kubernetes", "dask_kubernetes.operator")
    with pytest.raises(ImportError, match=re.escape('pip install "dkicf[kubernetes]"')) as info:
        start_cluster("kubernetes", name="fit", image="registry.example.com/dkicf:0.1.0")
    assert isinstance(info.value, MissingExtraError)
    assert "dask-kubernetes" in str(info.value)


@pytest.mark.parametrize("kind", ["slurm", "pbs"])
def test_missing_hpc_extra_names_it(monkeypatch, kind):
    _without(monkeypatch, "dask_jobqueue")
    with pytest.raises(MissingExtraError, match=re.escape('pip install "dkicf[hpc]"')):
        start_cluster(kind, jobs=1, cores=2, memory="4GiB")
    with pytest.raises(MissingExtraError, match=re.escape('pip install "dkicf[hpc]"')):
        jobqueue_script(kind, cores=2, memory="4GiB")


def test_deploy_imports_without_optional_packages(monkeypatch):
    import importlib

    import dkicf

    original = sys.modules["dkicf.deploy"]
    _without(monkeypatch, "dask_kubernetes", "dask_jobqueue", "kubernetes", "cryptography")
    # Both the module table and the package attribute get the original back afterwards.
    monkeypatch.delitem(sys.modules, "dkicf.deploy")
    monkeypatch.setattr(dkicf, "deploy", original, raising=False)
    fresh = importlib.import_module("dkicf.deploy")
    assert fresh is not original
    spec = fresh.kubernetes_spec("fit", "registry.example.com/dkicf:0.1.0")
    assert spec["kind"] == "DaskCluster"


# ------------------------------------------------------------------ Kubernetes

_QUANTITY = re.compile(r"^([0-9.]+)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_UNITS = {
    None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def _quantity(value) -> float:
    """A Kubernetes resource quantity ("8Gi", "500m", "2") as a number."""
    match = _QUANTITY.match(str(value))
    assert match, f"not a Kubernetes quantity: {value!r}"
    return float(match.group(1)) * _UNITS[match.group(2)]


def _load_yaml(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DEPLOY / "kubernetes" / name).read_text())


def _strict(schema):
    """The CRD schema with unknown fields refused, as ``kubectl apply`` (strict) does."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_validator():
    """A validator for DaskCluster objects from the CRD dask-kubernetes ships."""
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("dask_kubernetes")
    import dask_kubernetes

    root = Path(dask_kubernetes.__file__).parent
    candidates = sorted(root.rglob("daskcluster.yaml"))
    for path in candidates:
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
        schema = version["schema"]["openAPIV3Schema"]
        if "$ref" not in schema:  # the generated CRD, with the schema inlined
            strict = _strict(schema)
            # apiVersion, kind and metadata are Kubernetes' own, not in the CRD.
            del strict["additionalProperties"]
            return jsonschema.Draft4Validator(strict)
    pytest.fail(f"no DaskCluster CRD with an inline schema among {candidates}")


def _k8s_errors(obj: dict) -> list[str]:
    kv = pytest.importorskip("kubernetes_validate")
    try:
        kv.validate(obj, kv.latest_version(), strict=True)
    except kv.ValidationError as exc:
        return [str(exc)]
    return []


def _daskcluster_errors(doc: dict, validator) -> list[str]:
    """Everything wrong with a DaskCluster: schema, pods, and the rules of ../README.md."""
    errors = [e.message for e in validator.iter_errors(doc)]
    if errors:
        return errors
    name = doc["metadata"]["name"]
    for role in ("scheduler", "worker"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-{role}"},
               "spec": doc["spec"][role]["spec"]}
        errors += _k8s_errors(pod)
    service = doc["spec"]["scheduler"]["service"]
    errors += _k8s_errors({"apiVersion": "v1", "kind": "Service",
                           "metadata": {"name": f"{name}-scheduler"}, "spec": service})
    if service.get("type") != "ClusterIP":
        errors.append(f"scheduler Service type is {service.get('type')!r}, not ClusterIP")
    for role in ("scheduler", "worker"):
        for container in doc["spec"][role]["spec"]["containers"]:
            errors += _container_errors(container, doc["spec"][role]["spec"])
    for container in doc["spec"]["worker"]["spec"]["containers"]:
        args = container.get("args", [])
        limits = container.get("resources", {}).get("limits", {})
        if "--memory-limit" not in args or "--nthreads" not in args:
            errors.append("worker args lack --memory-limit or --nthreads")
            continue
        from dask.utils import parse_bytes

        dask_memory = parse_bytes(args[args.index("--memory-limit") + 1])
        if "memory" in limits and dask_memory > _quantity(limits["memory"]):
            errors.append(
                f"worker --memory-limit {dask_memory} > container memory limit {limits['memory']}"
            )
        nthreads = int(args[args.index("--nthreads") + 1])
        if "cpu" in limits and nthreads > _quantity(limits["cpu"]):
            errors.append(f"worker --nthreads {nthreads} > container cpu limit {limits['cpu']}")
    return errors


def _container_errors(container: dict, pod_spec: dict) -> list[str]:
    errors = []
    name = container.get("name")
    image = container.get("image", "")
    if not re.search(r"(:[\w][\w.-]*|@sha256:[0-9a-f]{64})$", image.rsplit("/", 1)[-1]):
        errors.append(f"container {name}: image {image!r} has no tag or digest")
    if image.endswith(":latest"):
        errors.append(f"container {name}: image {image!r} uses :latest")
    resources = container.get("resources", {})
    for kind in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            if resource not in resources.get(kind, {}):
                errors.append(f"container {name}: no {resource} in resources.{kind}")
    for resource in ("cpu", "memory"):
        request = resources.get("requests", {}).get(resource)
        limit = resources.get("limits", {}).get(resource)
        if request and limit and _quantity(request) > _quantity(limit):
            errors.append(f"container {name}: {resource} request > limit")
    non_root = {**pod_spec.get("securityContext", {}), **container.get("securityContext", {})}
    if not non_root.get("runAsNonRoot") or non_root.get("runAsUser") == 0:
        errors.append(f"container {name}: may run as root")
    if container.get("securityContext", {}).get("allowPrivilegeEscalation", True):
        errors.append(f"container {name}: allows privilege escalation")
    for env in container.get("env", []):
        if re.search("SECRET|PASSWORD|TOKEN|KEY", env["name"]) and "value" in env:
            errors.append(f"container {name}: {env['name']} given literally, not from a Secret")
    return errors


def test_daskcluster_manifest_is_valid(crd_validator):
    doc = _load_yaml("daskcluster.yaml")
    assert doc["apiVersion"] == "kubernetes.dask.org/v1"
    assert doc["kind"] == "DaskCluster"
    assert _daskcluster_errors(doc, crd_validator) == []
    worker = doc["spec"]["worker"]["spec"]["containers"][0]
    assert worker["args"][:2] == ["dask", "worker"]
    # Object-store credentials reach the workers from a Secret.
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in worker["env"] if "valueFrom" in e]
    assert refs and set(refs) == {"dkicf-object-store"}
    # The scheduler and the workers run with dkicf's process settings.
    scheduler = doc["spec"]["scheduler"]["spec"]["containers"][0]
    for container in (worker, scheduler):
        values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        assert values == process_environment()


def _broken(doc: dict, change) -> dict:
    import copy

    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def _worker_container(doc):
    return doc["spec"]["worker"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["spec"]["worker"].update(replicas="four"), "is not of type 'integer'"),
        (lambda d: d["spec"]["worker"].update(replicaz=4), "Additional properties"),
        (lambda d: d["spec"].pop("scheduler"), "'scheduler' is a required property"),
        (lambda d: _worker_container(d).pop("name"), "'name' is a required property"),
        (lambda d: _worker_container(d).pop("image"), "has no tag or digest"),
        (lambda d: _worker_container(d).update(image="registry.example.com/dkicf:latest"),
         "uses :latest"),
        (lambda d: _worker_container(d)["resources"].pop("limits"),
         "no memory in resources.limits"),
        (lambda d: _worker_container(d)["args"].__setitem__(7, "9GiB"),
         "--memory-limit 9663676416 > container memory limit 8Gi"),
        (lambda d: _worker_container(d)["args"].__setitem__(5, "3"),
         "--nthreads 3 > container cpu"),
        (lambda d: d["spec"]["scheduler"]["service"].update(type="LoadBalancer"),
         "not ClusterIP"),
        (lambda d: d["spec"]["worker"]["spec"]["securityContext"].pop("runAsNonRoot"),
         "worker: may run as root"),
    ],
)
def test_broken_daskcluster_is_rejected(crd_validator, change, expected):
    doc = _broken(_load_yaml("daskcluster.yaml"), change)
    errors = _daskcluster_errors(doc, crd_validator)
    assert any(expected in e for e in errors), errors


def test_fit_job_manifest_is_valid():
    job = _load_yaml("job-fit.yaml")
    cluster = _load_yaml("daskcluster.yaml")
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert _k8s_errors(job) == []
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert _container_errors(container, pod) == []
    args = container["args"]
    assert args[:3] == ["dkicf", "fit", "s3://bucket/data.zarr"]
    assert args[args.index("--clusters") + 1] == "10"
    assert args[args.index("--out") + 1] == "s3://bucket/model.zarr"
    assert "--storage-option" in args
    # It talks to the DaskCluster's scheduler Service.
    name = cluster["metadata"]["name"]
    assert args[args.index("--scheduler") + 1] == f"tcp://{name}-scheduler:8786"
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]}
    assert secrets == {"dkicf-object-store"}
    assert not any("value" in e for e in container["env"])
    # The image is the one the cluster runs.
    assert container["image"] == _worker_container(cluster)["image"]

    broken = _broken(job, lambda j: j["spec"].update(backoffLimit="one"))
    assert _k8s_errors(broken)
    broken = _broken(job, lambda j: j["spec"]["template"]["spec"]["containers"][0].pop("name"))
    assert _k8s_errors(broken)


def test_network_policy_admits_only_the_cluster_and_the_job():
    policy = _load_yaml("networkpolicy.yaml")
    assert _k8s_errors(policy) == []
    cluster = _load_yaml("daskcluster.yaml")
    job = _load_yaml("job-fit.yaml")
    name = cluster["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"dask.org/cluster-name": name}
    sources = [
        peer.get("podSelector", {}).get("matchLabels")
        for peer in policy["spec"]["ingress"][0]["from"]
    ]
    assert {"dask.org/cluster-name": name} in sources
    assert job["spec"]["template"]["metadata"]["labels"] in sources
    assert _k8s_errors(_broken(policy, lambda p: p["spec"].update(policyTypes="Ingress")))


def test_kubernetes_spec_is_valid_and_consistent(crd_validator):
    from dask.utils import parse_bytes

    spec = kubernetes_spec(
        "fit", "registry.example.com/dkicf:0.1.0", workers=3, threads=4,
        memory_limit="6GiB", env={"OMP_NUM_THREADS": "1"}, secret="dkicf-object-store",
    )
    assert _daskcluster_errors(spec, crd_validator) == []
    assert spec["spec"]["worker"]["replicas"] == 3
    worker = _worker_container(spec)
    limit = _quantity(worker["resources"]["limits"]["memory"])
    assert parse_bytes("6GiB") <= limit <= parse_bytes("6GiB") / 0.9 + 2**20
    assert worker["resources"]["limits"]["cpu"] == "4"
    assert worker["envFrom"] == [{"secretRef": {"name": "dkicf-object-store"}}]
    settings = process_environment()
    assert len(settings) == 2
    for container in (worker, spec["spec"]["scheduler"]["spec"]["containers"][0]):
        assert {e["name"]: e["value"] for e in container["env"]} == {
            **settings, "OMP_NUM_THREADS": "1"}
    # A variable passed replaces dkicf's of the same name; null settings give none.
    tick = "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"
    env = _worker_container(kubernetes_spec("fit", "r.example/dkicf:1", env={tick: "20ms"}))["env"]
    assert [e["value"] for e in env if e["name"] == tick] == ["20ms"]
    with dask.config.set({"dkicf.cluster.worker-profiler": None,
                          "dkicf.cluster.tick-interval": None}):
        assert _worker_container(kubernetes_spec("fit", "r.example/dkicf:1"))["env"] == []
    for image in ("registry.example.com/dkicf:latest", "registry.example.com:5000/dkicf"):
        with pytest.raises(ValueError, match="pinned version"):
            kubernetes_spec("fit", image)
    digest = "registry.example.com:5000/dkicf@sha256:" + "0" * 64
    assert _worker_container(kubernetes_spec("fit", digest))["image"] == digest


def test_start_cluster_kubernetes_hands_the_spec_to_the_operator(monkeypatch, crd_validator):
    seen = {}

    class FakeKubeCluster:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("no Kubernetes here")

    monkeypatch.setitem(
        sys.modules, "dask_kubernetes.operator", types.SimpleNamespace(KubeCluster=FakeKubeCluster)
    )
    with pytest.raises(RuntimeError, match="no Kubernetes here"):
        start_cluster(
            "kubernetes", name="fit", image="registry.example.com/dkicf:0.1.0", workers=2,
            threads=2, memory_limit="3GiB", namespace="science",
        )
    assert seen["namespace"] == "science"
    assert _daskcluster_errors(seen["custom_cluster_spec"], crd_validator) == []
    with pytest.raises(TypeError, match="needs image="):
        start_cluster("kubernetes", name="fit")


# ---------------------------------------------------------------- dask-jobqueue


def _directive_counts(script: str, prefix: str) -> dict[str, int]:
    lines = [line for line in script.splitlines() if line.startswith(prefix)]
    return {line: lines.count(line) for line in lines}


def _worker_command(script: str) -> str:
    (line,) = [line for line in script.splitlines() if "distributed.cli.dask_worker" in line]
    return line


def _flag(command: str, flag: str) -> str | None:
    match = re.search(rf"{flag} (\S+)", command)
    return match and match.group(1)


@pytest.mark.parametrize("processes", [1, 2])
def test_slurm_job_script(processes):
    pytest.importorskip("dask_jobqueue")
    from dask.utils import parse_bytes

    script = jobqueue_script(
        "slurm", jobs=3, cores=8, processes=processes, memory="32GiB", walltime="02:30:00",
        queue="compute", account="proj42",
    )
    directives = _directive_counts(script, "#SBATCH")
    for expected in ("#SBATCH --cpus-per-task=8", "#SBATCH -t 02:30:00", "#SBATCH -p compute",
                     "#SBATCH -A proj42", "#SBATCH -n 1"):
        assert directives.get(expected) == 1, (expected, script)
    (mem,) = [d for d in directives if d.startswith("#SBATCH --mem=")]
    assert directives[mem] == 1
    assert mem == "#SBATCH --mem=32G"
    command = _worker_command(script)
    assert _flag(command, "--nthreads") == str(8 // processes)
    assert _flag(command, "--nworkers") == (str(processes) if processes > 1 else None)
    assert parse_bytes(_flag(command, "--memory-limit")) * processes == pytest.approx(
        parse_bytes("32GiB"), rel=0.01
    )
    assert "tcp://<scheduler-address>:8786" in command


def test_job_scripts_give_the_workers_dkicf_s_process_settings_before_the_prologue():
    """The exports come first: the site's prologue (configured or passed) runs after them,
    so that its own exports win; with both settings null there are none."""
    pytest.importorskip("dask_jobqueue")
    import dask

    exports = ["export DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False",
               "export DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=1s"]

    def lines(script: str) -> list[str]:
        body = [line for line in script.splitlines() if line and not line.startswith("#")]
        assert "distributed.cli.dask_worker" in body[-1]
        return body[:-1]

    assert lines(jobqueue_script("slurm", cores=2, memory="4GiB")) == exports
    assert lines(jobqueue_script("pbs", cores=2, memory="4GiB",
                                 job_script_prologue=["module load site"])) == [
        *exports, "module load site"]
    with dask.config.set({"jobqueue.slurm.job-script-prologue": ["source /site/env"]}):
        assert lines(jobqueue_script("slurm", cores=2, memory="4GiB")) == [
            *exports, "source /site/env"]
    with dask.config.set({"dkicf.cluster.worker-profiler": None,
                          "dkicf.cluster.tick-interval": "200ms"}):
        assert lines(jobqueue_script("slurm", cores=2, memory="4GiB")) == [
            "export DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=0.2s"]
    with dask.config.set({"dkicf.cluster.worker-profiler": None,
                          "dkicf.cluster.tick-interval": None}):
        assert lines(jobqueue_script("slurm", cores=2, memory="4GiB")) == []


def test_pbs_job_script():
    pytest.importorskip("dask_jobqueue")
    script = jobqueue_script(
        "pbs", cores=16, processes=4, memory="64GiB", walltime="04:00:00", queue="workq",
    )
    directives = _directive_counts(script, "#PBS")
    for expected in ("#PBS -l select=1:ncpus=16:mem=64GB", "#PBS -l walltime=04:00:00",
                     "#PBS -q workq"):
        assert directives.get(expected) == 1, (expected, script)
    command = _worker_command(script)
    assert _flag(command, "--nthreads") == "4"
    assert _flag(command, "--nworkers") == "4"


def test_job_script_with_tls(pki):
    pytest.importorskip("dask_jobqueue")
    script = jobqueue_script(
        "slurm", cores=2, memory="4GiB", security=_security(pki, "node"),
    )
    command = _worker_command(script)
    assert "tls://<scheduler-address>:8786" in command
    assert _flag(command, "--tls-ca-file") == str(pki / "ca.pem")
    assert _flag(command, "--tls-cert") == str(pki / "node.pem")
    assert _flag(command, "--tls-key") == str(pki / "node.key")
    assert "--protocol tls://" in command
    with pytest.raises(ValueError, match="throwaway certificates"):
        jobqueue_script("slurm", cores=2, memory="4GiB", security=True)


def test_job_script_option_errors():
    pytest.importorskip("dask_jobqueue")
    with pytest.raises(TypeError, match="needs memory="):
        jobqueue_script("slurm", cores=4)
    with pytest.raises(ValueError, match="cores=6 should be a multiple of processes=4"):
        jobqueue_script("pbs", cores=6, processes=4, memory="8GiB")
    with pytest.raises(TypeError, match="unknown option.*partition.*Valid options"):
        jobqueue_script("slurm", cores=4, memory="8GiB", partition="x")
    with pytest.raises(ValueError, match="kind must be one of"):
        jobqueue_script("lsf", cores=4, memory="8GiB")


@pytest.mark.parametrize("kind", ["slurm", "pbs"])
def test_jobqueue_examples_print_their_script(kind, capsys):
    import importlib.util

    pytest.importorskip("dask_jobqueue")
    example = DEPLOY / "hpc" / f"{kind}-jobqueue.py"
    spec = importlib.util.spec_from_file_location(f"_example_{kind}", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["in.zarr", "out.zarr", "--print-script", "--cores", "8", "--processes", "2",
                 "--memory", "32GiB", "--queue", "q1", "--shared-dir", "/home/me/.dkicf"])
    printed = capsys.readouterr()
    script = printed.out
    assert script.startswith("#!")  # stdout is the script alone
    # The script shows plain TCP; stderr says what is really submitted.
    assert "tcp://" in script
    assert "connect over tls://" in printed.err and "/home/me/.dkicf" in printed.err
    module.main(["in.zarr", "out.zarr", "--print-script", "--cores", "8", "--no-tls"])
    assert capsys.readouterr().err == ""
    command = _worker_command(script)
    assert _flag(command, "--nthreads") == "4"
    assert _flag(command, "--nworkers") == "2"
    assert ("#SBATCH -p q1" if kind == "slurm" else "#PBS -q q1") in script
    # What the examples import exists.
    tree = ast.parse(example.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("dkicf"):
            imported = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(imported, alias.name), f"{node.module}.{alias.name}"


# ------------------------------------------------- batch scripts without jobqueue

_SRUN = """#!/bin/bash
# Stand-in for srun: --ntasks copies of the command, on this machine.
n=1
while [[ $1 == -* ]]; do
    case $1 in --ntasks=*) n=${1#*=} ;; esac
    shift
done
pids=()
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null; wait' TERM INT
wait
"""

_PBSDSH = """#!/bin/bash
# Stand-in for pbsdsh: the command once per line of $PBS_NODEFILE, on this machine.
[[ $1 == -- ]] && shift
pids=()
while read -r _; do "$@" & pids+=($!); done < "$PBS_NODEFILE"
trap 'kill "${pids[@]}" 2>/dev/null; wait' TERM INT
wait
"""

# Stand-in for the dkicf CLI: records its arguments and what it finds on the cluster.
_DKICF = """#!{python}
import json, os, sys
from dkicf._cluster import all_workers
from dkicf.deploy import connect, make_security
args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1] if flag in args else None
def settings():
    import dask
    return [dask.config.get("distributed.worker.profile.enabled"),
            dask.config.get("distributed.admin.tick.interval")]
security = make_security(value("--tls-ca-file"), value("--tls-cert"), value("--tls-key"))
with connect(scheduler_file=value("--scheduler-file"), security=security, timeout=30) as c:
    workers = all_workers(c).values()
    record = {{
        "args": args,
        "address": c.scheduler.address,
        "nthreads": sorted(w["nthreads"] for w in workers),
        "memory_limit": sorted(w["memory_limit"] for w in workers),
        "total": c.submit(sum, [1, 2, 3]).result(),
        "settings": [*sorted(set(map(tuple, c.run(settings).values()))),
                     c.run_on_scheduler(settings)],
    }}
with open(os.environ["DKICF_STUB_RECORD"], "w") as f:
    json.dump(record, f)
"""


def _group_members(pgid: int) -> list[str]:
    """Live processes of a process group."""
    import psutil

    members = []
    for proc in psutil.process_iter(["name", "status"]):
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(" ".join(proc.cmdline()))
    return members


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.mark.parametrize(
    ("script", "n_workers"), [("slurm-manual.sbatch", 2), ("pbs-manual.pbs", 1)]
)
def test_manual_batch_script_runs_and_cleans_up(tmp_path, script, n_workers):
    import json

    if shutil.which("openssl") is None or shutil.which("bash") is None:
        pytest.skip("needs bash and the openssl CLI")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _write_executable(stubs / "srun", _SRUN)
    _write_executable(stubs / "pbsdsh", _PBSDSH)
    _write_executable(stubs / "dkicf", _DKICF.format(python=sys.executable))
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node1\n" * n_workers)
    run_dir = tmp_path / "run"
    record = tmp_path / "record.json"
    env = _child_env(
        PATH=os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]]),
        HOME=str(tmp_path), DATA="s3://bucket/data.zarr", OUT="s3://bucket/model.zarr",
        CLUSTERS="7", RANK="50", RUN_DIR=str(run_dir), LOCAL_DIR=str(tmp_path),
        DKICF_INTERFACE="lo", DKICF_STUB_RECORD=str(record),
        # SLURM: tasks of 1 CPU, two to a node with 2048 MiB.
        SLURM_JOB_ID="4242", SLURM_NTASKS=str(n_workers), SLURM_CPUS_PER_TASK="1",
        SLURM_NTASKS_PER_NODE="2", SLURM_MEM_PER_NODE="2048",
        # PBS: a line in the node file per worker, 1 thread and 1024 MiB per worker.
        PBS_JOBID="4242.pbs", PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path),
        NTHREADS="1", NODE_MEM_MIB="2048", WORKERS_PER_NODE="2",
    )
    proc = tied_popen(
        ["bash", str(DEPLOY / "hpc" / script)], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=150)
        # Whatever the script left behind is in its process group.
        leftovers = _group_members(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    result = json.loads(record.read_text())
    args = result["args"]
    assert args[:2] == ["fit", "s3://bucket/data.zarr"]
    assert args[args.index("--clusters") + 1] == "7"
    assert args[args.index("--rank") + 1] == "50"
    assert args[args.index("--out") + 1] == "s3://bucket/model.zarr"
    assert "--scheduler-file" in args
    # Mutual TLS by default, on the loopback interface here.
    assert "--tls-ca-file" in args
    assert result["address"].startswith("tls://127.0.0.1:")
    assert result["nthreads"] == [1] * n_workers
    assert result["memory_limit"] == [921 * 2**20] * n_workers  # 90% of 1024 MiB
    assert result["total"] == 6
    # The workers and the scheduler run with dkicf's process settings.
    assert result["settings"] == [[False, "1s"], [False, "1s"]]  # the workers as one, the scheduler
    assert f"{n_workers} workers joined" in text
    # The certificates and scheduler file are gone, and so is every process.
    assert not run_dir.exists()
    assert leftovers == []


# ----------------------------------------- start_cluster("slurm") with stand-ins

_SBATCH = """#!/bin/bash
# Stand-in for sbatch: runs the job script here, in the background, in its own session,
# after STUB_DELAY seconds (as if it had waited in the queue).
id=$$  # the stand-in's own process id: unique among concurrent submissions
cp "$1" "$STUB_DIR/job-$id.sh"
setsid bash -c 'sleep "${STUB_DELAY:-0}"; exec bash "$0"' "$STUB_DIR/job-$id.sh" \\
    > "$STUB_DIR/job-$id.log" 2>&1 < /dev/null &
echo $! > "$STUB_DIR/job-$id.pid"
echo "Submitted batch job $id"
"""

_SCANCEL = """#!/bin/bash
# Stand-in for scancel: ends the jobs' process groups.
for id in "$@"; do kill -TERM -- "-$(cat "$STUB_DIR/job-$id.pid")" 2>/dev/null; done
exit 0
"""

# Stand-ins for a queue that accepts jobs and never starts them, and for its scancel.
_SBATCH_QUEUED = """#!/bin/bash
id=$$  # the stand-in's own process id: unique among concurrent submissions
echo "$id" >> "$STUB_DIR/queued"
echo "Submitted batch job $id"
"""

_SCANCEL_RECORD = """#!/bin/bash
echo "$@" >> "$STUB_DIR/cancelled"
"""

_SBATCH_REFUSED = """#!/bin/bash
echo "sbatch: error: Batch job submission failed: Invalid account or account/partition \\
combination specified" >&2
exit 1
"""


def _stubs(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    """Put stand-in commands first on PATH; they keep their records in ``tmp_path``."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in scripts.items():
        _write_executable(stubs / name, text)
    monkeypatch.setenv("STUB_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", os.pathsep.join([str(stubs), os.environ["PATH"]]))
    monkeypatch.setenv("PYTHONPATH", _child_env()["PYTHONPATH"])
    return stubs


def _kill_stub_jobs(directory: Path) -> None:
    for pid_file in directory.glob("job-*.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), 9)


def test_start_cluster_slurm_is_tls_by_default_and_waits_for_late_jobs(tmp_path, monkeypatch):
    """start_cluster("slurm") end to end, with sbatch and scancel stand-ins that run here.

    No security is asked for: the scheduler speaks mutual TLS with throwaway
    certificates in ~/.dkicf, and start_cluster returns once the job, which
    the queue holds for a few seconds, has started its workers.
    """
    pytest.importorskip("dask_jobqueue")
    pytest.importorskip("cryptography")  # the throwaway certificates
    from distributed import Client

    _stubs(tmp_path, monkeypatch, sbatch=_SBATCH, scancel=_SCANCEL)
    delay = 3
    monkeypatch.setenv("STUB_DELAY", str(delay))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    messages = []

    def job_logs() -> str:
        return "".join(log.read_text() for log in tmp_path.glob("job-*.log"))

    try:
        t0 = time.monotonic()
        client, cluster = start_cluster(
            "slurm", jobs=1, cores=2, processes=2, memory="2GiB", walltime="00:10:00",
            interface="lo", worker_timeout=START_TIMEOUT, progress=messages.append,
        )
        try:
            # Both workers are there when it returns, after the queue's delay.
            assert time.monotonic() - t0 >= delay
            info = client.scheduler_info()
            assert sorted(w["nthreads"] for w in info["workers"].values()) == [1, 1]
            (script,) = tmp_path.glob("job-*.sh")
            job_id = script.stem.split("-")[1]
            assert messages[0].startswith(f"submitted 1 SLURM job ({job_id}) for 2 workers")
            assert f"squeue -j {job_id}" in messages[0]
            assert messages[-1].startswith("all 2 workers joined after")
            # Mutual TLS: the scheduler, the job's worker command, the private files.
            address = cluster.scheduler_address
            assert address.startswith("tls://127.0.0.1:")
            text = script.read_text()
            assert f" {address} " in text and "--tls-cert" in text and "--tls-key" in text
            shared = home / ".dkicf"
            assert shared.stat().st_mode & 0o777 == 0o700
            files = list(shared.glob(".dask-jobqueue.worker.*"))
            assert len(files) == 3 and all(f.stat().st_mode & 0o077 == 0 for f in files)
            assert client.submit(sum, [1, 2, 3]).result() == 6
            # The job's workers, and the scheduler here, run with dkicf's process
            # settings; this process's own are as they were.
            import dask

            assert set(client.run(dask.config.get, "distributed.worker.profile.enabled")
                       .values()) == {False}
            assert set(client.run(lambda dask_worker: dask_worker._tick_interval)
                       .values()) == {1}
            assert cluster.scheduler._tick_interval == 1
            assert dask.config.get("distributed.worker.profile.enabled") is True
            # Results come through the scheduler, the one address a batch job's
            # driver is sure to reach (a local cluster's come from its workers).
            assert not client.direct_to_workers
            # A client without TLS gets nowhere.
            _refused(lambda: Client(address.replace("tls://", "tcp://"),
                                    timeout=REFUSE_TIMEOUT))
            http_port = cluster.scheduler.http_server.port
            assert _http_status(http_port, "/health") == 200
            assert _http_status(http_port, "/status") == 404
        finally:
            client.close()
            cluster.close()

        # scancel's SIGTERM reaches the job asynchronously: on a busy machine the
        # workers may still be shutting down when cluster.close() returns.
        deadline = time.monotonic() + START_TIMEOUT
        while not ("Stopping worker" in job_logs() or "signal-15" in job_logs()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        _kill_stub_jobs(tmp_path)
    logs = job_logs()
    assert "Stopping worker" in logs or "signal-15" in logs, logs[-2000:]


def test_start_cluster_slurm_times_out_naming_the_jobs_and_cancels_them(tmp_path, monkeypatch):
    pytest.importorskip("dask_jobqueue")
    pytest.importorskip("cryptography")
    from dkicf.deploy import WorkersTimeoutError
    from dkicf.errors import DkicfError

    _stubs(tmp_path, monkeypatch, sbatch=_SBATCH_QUEUED, scancel=_SCANCEL_RECORD)
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    with pytest.raises(WorkersTimeoutError) as info:
        start_cluster(
            "slurm", jobs=2, cores=1, memory="1GiB", interface="lo", log_directory=str(logs),
            shared_temp_directory=str(tmp_path / "shared"), worker_timeout=1.5,
        )
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 30
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, DkicfError)
    queued = (tmp_path / "queued").read_text().split()
    assert len(queued) == 2
    message = str(info.value)
    assert message.startswith("no worker joined within 2 s: 2 SLURM jobs (")
    assert all(job_id in message for job_id in queued)
    # The two jobs are submitted concurrently: the file's order need not be the cluster's.
    assert f"squeue -j {','.join(queued)}" in message or (
        f"squeue -j {','.join(reversed(queued))}" in message
    )
    assert any(f"scontrol show job {job_id})" in message for job_id in queued)
    assert f"read their output in {logs}" in message
    assert "--worker-timeout" in message
    # Closing the cluster cancelled both jobs.
    assert sorted((tmp_path / "cancelled").read_text().split()) == sorted(queued)


def test_start_cluster_slurm_reports_a_refused_job_in_one_line(
    tmp_path, monkeypatch, caplog, capfd
):
    pytest.importorskip("dask_jobqueue")
    pytest.importorskip("cryptography")
    from dkicf.deploy import JobSubmissionError

    _stubs(tmp_path, monkeypatch, sbatch=_SBATCH_REFUSED, scancel=_SCANCEL_RECORD)
    with pytest.raises(JobSubmissionError, match=re.escape(
        "sbatch refused the job: sbatch: error: Batch job submission failed: Invalid account "
        "or account/partition combination specified. Check the queue, account"
    )):
        start_cluster("slurm", jobs=1, cores=1, memory="1GiB", interface="lo",
                      shared_temp_directory=str(tmp_path / "shared"), worker_timeout=30)
    # No traceback from the event loop, and nothing to cancel.
    assert [r.getMessage() for r in caplog.records if r.levelno >= 40] == []
    assert "Traceback" not in capfd.readouterr().err
    assert not (tmp_path / "cancelled").exists()


@pytest.mark.parametrize(("kind", "command", "label"),
                         [("slurm", "sbatch", "SLURM"), ("pbs", "qsub", "PBS")])
def test_start_cluster_without_the_batch_system_names_it(tmp_path, monkeypatch, kind, command,
                                                          label):
    pytest.importorskip("dask_jobqueue")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(FileNotFoundError, match=re.escape(
        f"{command} not found: run on a login node of a {label} cluster"
    )):
        start_cluster(kind, jobs=1, cores=1, memory="1GiB")


def test_start_cluster_without_cryptography_names_the_ways_out(tmp_path, monkeypatch):
    pytest.importorskip("dask_jobqueue")
    _stubs(tmp_path, monkeypatch, sbatch=_SBATCH_QUEUED, scancel=_SCANCEL_RECORD)
    _without(monkeypatch, "cryptography")
    with pytest.raises(MissingExtraError) as info:
        start_cluster("slurm", jobs=1, cores=1, memory="1GiB", worker_timeout=1)
    message = str(info.value)
    assert "pip install cryptography" in message
    assert "--tls-ca-file, --tls-cert and --tls-key" in message
    assert "make_security" in message
    assert not (tmp_path / "queued").exists()  # nothing was submitted


def test_start_cluster_slurm_plain_tcp_only_when_asked(tmp_path, monkeypatch, caplog):
    pytest.importorskip("dask_jobqueue")
    from dkicf.deploy import WorkersTimeoutError

    _stubs(tmp_path, monkeypatch, sbatch=_SBATCH_QUEUED, scancel=_SCANCEL_RECORD)
    with pytest.raises(WorkersTimeoutError):
        start_cluster("slurm", jobs=1, cores=1, memory="1GiB", interface="lo",
                      security=False, worker_timeout=0.5)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == 30]
    assert "plain TCP on lo" in warning and "can run code as you" in warning
    script = jobqueue_script("slurm", cores=1, memory="1GiB", security=False)
    assert "tcp://<scheduler-address>:8786" in script and "--tls" not in script


# ------------------------------------------- waiting for the pods of Kubernetes


def _fake_operator(monkeypatch, workers_at_start: int, later: int = 0, after: float = 0.0):
    """A dask-kubernetes operator whose KubeCluster is an in-process LocalCluster.

    It starts with ``workers_at_start`` workers and grows to ``later`` after
    ``after`` seconds, as pods would when they get scheduled.
    """
    import threading

    from distributed import LocalCluster

    made = []

    def kube_cluster(custom_cluster_spec, namespace):
        cluster = LocalCluster(n_workers=workers_at_start, threads_per_worker=1,
                               processes=False, dashboard_address="127.0.0.1:0")
        if later:
            timer = threading.Timer(after, cluster.scale, [later])
            timer.start()
            made.append(timer)
        made.append(cluster)
        return cluster

    monkeypatch.setitem(
        sys.modules, "dask_kubernetes.operator", types.SimpleNamespace(KubeCluster=kube_cluster)
    )
    return made


def test_start_cluster_kubernetes_waits_for_the_worker_pods(monkeypatch):
    _fake_operator(monkeypatch, workers_at_start=0, later=2, after=1.0)
    messages = []
    t0 = time.monotonic()
    client, cluster = start_cluster(
        "kubernetes", name="fit", image="registry.example.com/dkicf:0.1.0", workers=2,
        namespace="science", worker_timeout=START_TIMEOUT, progress=messages.append,
    )
    try:
        assert time.monotonic() - t0 >= 1.0
        assert len(all_workers(client)) == 2
        assert "kubectl -n science get pods -l dask.org/cluster-name=fit" in messages[0]
        assert messages[-1].startswith("all 2 workers joined after")
    finally:
        client.close()
        cluster.close()


def test_start_cluster_goes_on_with_the_workers_there_after_the_timeout(monkeypatch, caplog):
    _fake_operator(monkeypatch, workers_at_start=1)
    t0 = time.monotonic()
    client, cluster = start_cluster(
        "kubernetes", name="fit", image="registry.example.com/dkicf:0.1.0", workers=3,
        worker_timeout=1.0,
    )
    try:
        assert time.monotonic() - t0 >= 1.0
        assert len(all_workers(client)) == 1
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == 30]
        assert warning.startswith("only 1 of 3 workers joined within 1 s; going on with them")
    finally:
        client.close()
        cluster.close()
    with pytest.raises(ValueError, match="worker_timeout must be a number of seconds > 0"):
        start_cluster("kubernetes", name="fit", image="registry.example.com/dkicf:0.1.0",
                      worker_timeout=0)


# ---------------------------------------------------------------------- Docker


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    split = (line.strip().partition(" ") for line in logical)
    return [(op.upper(), rest.strip()) for op, _, rest in split]


def test_dockerfile_is_pinned_non_root_and_passes_commands_through():
    import fnmatch
    import json

    path = DEPLOY / "docker" / "Dockerfile"
    instructions = _dockerfile(path)
    ops = [op for op, _ in instructions]
    bases = [args.split()[0] for op, args in instructions if op == "FROM"]
    assert bases
    for base in bases:
        # A full version (3.11.x), a slim variant, optionally a digest; never a moving tag.
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", base), base
    assert not any(":latest" in args for _, args in instructions)
    # The final stage runs as a non-root user.
    final = len(ops) - 1 - ops[::-1].index("FROM")
    users = [args for op, args in instructions[final:] if op == "USER"]
    assert users, "no USER in the final stage"
    assert users[-1].split(":")[0] not in ("root", "0")
    # No role is forced: the entrypoint only passes the command through.
    entrypoints = [json.loads(args) for op, args in instructions if op == "ENTRYPOINT"]
    assert all(e[-1] == "--" for e in entrypoints), entrypoints
    assert json.loads([a for op, a in instructions if op == "CMD"][-1])[0] == "dkicf"
    # dkicf is installed from the source tree, with extras that exist.
    (extras,) = [a.split("=", 1)[1] for op, a in instructions if op == "ARG"
                 and a.startswith("DKICF_EXTRAS=")]
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras.split(",")) <= set(declared)
    assert {"s3", "gcs"} <= set(extras.split(","))
    assert any(op == "RUN" and 'pip install "/src[${DKICF_EXTRAS}]"' in a for op, a in instructions)
    assert ("COPY", ". /src") in instructions
    # The build context keeps what pip needs and leaves out history, tests and keys.
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(name):
        # Docker's "**/" also matches at the top of the context.
        forms = [q for p in patterns for q in {p, p.removeprefix("**/")}]
        return any(fnmatch.fnmatch(name, q) or name.startswith(q + "/") for q in forms)

    for needed in ("pyproject.toml", "README.md", "dkicf/__init__.py", "dkicf/deploy.py"):
        assert not ignored(needed), needed
    for unwanted in (".git", "tests/test_deploy.py", "secrets/tls.key", "ca.pem"):
        assert ignored(unwanted), unwanted


def _ring_store(directory: Path) -> Path:
    from dkicf import io
    from dkicf.synthetic import make_ring

    data = directory / "ring.zarr"
    if not data.exists():
        X, y = make_ring(1500, random_state=0)
        np.savez(directory / "ring.npz", X=X, y=y)
        io.convert(directory / "ring.npz", data, dtype="float64", chunk_rows=400)
    return data


def _cli_fit(tmp_path, name, *extra, data=None):
    import zarr

    data = _ring_store(tmp_path) if data is None else data
    out = tmp_path / f"{name}.zarr"
    proc = subprocess.run(
        [sys.executable, "-m", "dkicf.cli", "fit", str(data), "--clusters", "2", "--gamma", "16",
         "--rank", "30", "--out", str(out), "--quiet", *extra],
        capture_output=True, text=True, timeout=300, env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = zarr.open_group(str(out), mode="r")
    return group["pivots"][...], group["P"][...], group["labels"][...]


@pytest.fixture(scope="module")
def local_fit(tmp_path_factory):
    """The reference: the ring fitted on dkicf's own LocalCluster, once for this module."""
    tmp = tmp_path_factory.mktemp("local-fit")
    return (_ring_store(tmp), *_cli_fit(tmp, "local", "--workers", "2"))


def test_cli_fit_on_an_existing_scheduler_matches_the_builtin_cluster(processes, tmp_path,
                                                                      local_fit):
    data, ref_pivots, ref_P, ref_labels = local_fit
    scheduler_file, _ = _start_dask(processes, tmp_path)
    with connect(scheduler_file=scheduler_file, timeout=START_TIMEOUT) as remote:
        _wait_for_workers(remote, 2, processes)
        address = remote.scheduler.address
    pivots, P, labels = _cli_fit(tmp_path, "remote", "--scheduler", address, data=data)
    assert_array_equal(pivots, ref_pivots)
    assert_allclose(P, ref_P, rtol=0, atol=1e-10)
    assert_array_equal(labels, ref_labels)


def test_cli_fit_over_tls_and_refused_without_certificates(tls_cluster, pki, tmp_path):
    address = tls_cluster.scheduler.address
    assert address.startswith("tls://")
    pivots, _, _ = _cli_fit(
        tmp_path, "tls", "--scheduler", address, "--tls-ca-file", str(pki / "ca.pem"),
        *_tls_args(pki, "client")[2:],
    )
    assert pivots.shape == (30,)
    proc = subprocess.run(
        [sys.executable, "-m", "dkicf.cli", "fit", str(tmp_path / "ring.zarr"), "--clusters",
         "2", "--out", str(tmp_path / "no.zarr"), "--scheduler", address, "--timeout", "5",
         "--quiet"],
        capture_output=True, text=True, timeout=120, env=_child_env(),
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert address.split("://")[1] in proc.stderr


def _cli(tmp_path, *args, **env):
    """Run ``dkicf fit`` on a small store (made here if missing): cluster errors come first."""
    if not (tmp_path / "data.zarr").exists():
        _tiny_store(tmp_path / "data.zarr")
    return subprocess.run(
        [sys.executable, "-m", "dkicf.cli", "fit", str(tmp_path / "data.zarr"), "--clusters",
         "2", "--out", str(tmp_path / "out.zarr"), *args],
        capture_output=True, text=True, timeout=120, env=_child_env(**env), cwd=tmp_path,
    )


@pytest.mark.timeout(120)
def test_a_script_without_main_guard_is_told_how_to_fix_it(tmp_path):
    """Spawned workers import the script; one that starts a cluster at import time breaks
    them, and dask only says "Nanny failed to start"."""
    script = tmp_path / "unguarded.py"
    script.write_text("import dkicf\n\nclient = dkicf.local_cluster(1, 1)\nprint('started')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, env=_child_env(), cwd=tmp_path)
    assert proc.returncode == 1 and "started" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: the local worker processes failed to start")
    assert str(script) in last and 'if __name__ == "__main__":' in last
    # Guarded, the same code runs.
    script.write_text(
        "import dkicf\n\nif __name__ == '__main__':\n    client = dkicf.local_cluster(1, 1)\n"
        "    print('started')\n    cluster = client.cluster\n    client.close()\n"
        "    cluster.close()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, env=_child_env(), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "started", proc.stderr[-2000:]


def test_cli_memory_sizes_are_checked_naming_the_flag(tmp_path, capsys):
    from dkicf.cli import main

    for args, expected in (
        (["--memory-limit", "lots"], "--memory-limit expects a size such as 4GiB or 500MB, "
                                     "or auto; got 'lots'."),
        (["--memory-limit", "0"], "--memory-limit expects a size such as 4GiB or 500MB, "
                                  "or auto; got '0'."),
        (["--cluster", "slurm", "--memory", "auto"],
         "--memory expects a size such as 4GiB or 500MB; got 'auto'."),
    ):
        code = main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out",
                     str(tmp_path / "out.zarr"), *args])
        assert code == 2
        assert capsys.readouterr().err.splitlines() == [f"dkicf fit: error: {expected}"]
        assert not (tmp_path / "out.zarr").exists()


def test_cli_kubernetes_default_memory_limit_gives_pods_a_size(monkeypatch, crd_validator,
                                                               tmp_path, capsys):
    """The local default ``auto`` means nothing to a pod: kubernetes_spec's default applies."""
    from dkicf.cli import main

    seen = []

    class FakeKubeCluster:
        def __init__(self, **kwargs):
            seen.append(kwargs["custom_cluster_spec"])
            raise RuntimeError("no Kubernetes here")

    monkeypatch.setitem(
        sys.modules, "dask_kubernetes.operator", types.SimpleNamespace(KubeCluster=FakeKubeCluster)
    )
    image = "registry.example.com/dkicf:0.1.0"
    _tiny_store(tmp_path / "data.zarr")
    for extra, spec in (([], kubernetes_spec("dkicf", image, workers=2, threads=1)),
                        (["--memory-limit", "3GiB"],
                         kubernetes_spec("dkicf", image, workers=2, threads=1,
                                         memory_limit="3GiB"))):
        code = main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out",
                     str(tmp_path / "out.zarr"), "--cluster", "kubernetes", "--image", image,
                     *extra])
        assert code == 1 and "no Kubernetes here" in capsys.readouterr().err
        assert seen[-1] == spec
        assert _daskcluster_errors(seen[-1], crd_validator) == []
    assert len(seen) == 2


def test_cli_fit_on_slurm_is_tls_by_default_waits_and_matches_local(tmp_path, local_fit):
    """--cluster slurm without TLS flags: mutual TLS, and the fit waits for queued jobs."""
    pytest.importorskip("dask_jobqueue")
    pytest.importorskip("cryptography")
    import zarr

    data, ref_pivots, ref_P, ref_labels = local_fit
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _write_executable(stubs / "sbatch", _SBATCH)
    _write_executable(stubs / "scancel", _SCANCEL)
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "slurm.zarr"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dkicf.cli", "fit", str(data),
             "--clusters", "2", "--gamma", "16", "--rank", "30", "--out", str(out),
             "--cluster", "slurm", "--jobs", "2", "--cores", "1", "--memory", "1GiB",
             "--interface", "lo", "--worker-timeout", str(START_TIMEOUT)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env=_child_env(PATH=os.pathsep.join([str(stubs), os.environ["PATH"]]),
                           STUB_DIR=str(tmp_path), STUB_DELAY="2", HOME=str(home)),
        )
    finally:
        _kill_stub_jobs(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_ids = sorted(p.stem.split("-")[1] for p in tmp_path.glob("job-*.sh"))
    assert len(job_ids) == 2
    assert "dkicf: submitted 2 SLURM jobs (" in proc.stderr
    assert all(job_id in proc.stderr for job_id in job_ids)
    assert "dkicf: all 2 workers joined after" in proc.stderr
    for script in tmp_path.glob("job-*.sh"):
        text = script.read_text()
        assert "tls://127.0.0.1:" in text and "--tls-key" in text
    # The throwaway key went with the command.
    assert (home / ".dkicf").is_dir() and list((home / ".dkicf").iterdir()) == []
    group = zarr.open_group(str(out), mode="r")
    assert_array_equal(group["pivots"][...], ref_pivots)
    assert_allclose(group["P"][...], ref_P, rtol=0, atol=1e-10)
    assert_array_equal(group["labels"][...], ref_labels)


def test_cli_cluster_slurm_errors_are_one_line(tmp_path):
    pytest.importorskip("dask_jobqueue")
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _cli(tmp_path, "--cluster", "slurm", "--cores", "1", "--memory", "1GiB",
                PATH=str(empty))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "dkicf fit: error: sbatch not found: run on a login node of a SLURM cluster (where "
        "sbatch is on PATH), or use --scheduler to connect to a running dask scheduler "
        "(dkicf.deploy.connect in Python)."
    ]
    proc = _cli(tmp_path, "--cluster", "pbs", "--worker-timeout", "0")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "dkicf fit: error: --worker-timeout must be a number of seconds > 0 (inf: no limit), "
        "got 0.0."
    ]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _write_executable(stubs / "sbatch", _SBATCH_QUEUED)
    _write_executable(stubs / "scancel", _SCANCEL_RECORD)
    proc = _cli(tmp_path, "--cluster", "slurm", "--cores", "1", "--memory", "1GiB",
                "--worker-timeout", "1", "--interface", "lo",
                "--shared-dir", str(tmp_path / "shared"),
                PATH=os.pathsep.join([str(stubs), os.environ["PATH"]]), STUB_DIR=str(tmp_path))
    (job_id,) = (tmp_path / "queued").read_text().split()
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"dkicf: submitted 1 SLURM job ({job_id}) for 1 worker;")
    assert lines[1].startswith(
        f"dkicf fit: error: no worker joined within 1 s: the SLURM job {job_id} has not started"
    )
    assert f"squeue -j {job_id}" in lines[1] and f"read their output in {tmp_path}" in lines[1]
    assert len(lines) == 2 and "Traceback" not in proc.stderr
    assert (tmp_path / "cancelled").read_text().split() == [job_id]


# ------------------------------------------------------------- counting workers


class _FewWorkersByDefault:
    """A client of distributed 2025.4 to 2026.6: ``scheduler_info()`` lists 5 workers
    unless asked for all with ``n_workers=-1``."""

    def __init__(self, n):
        self.workers = {f"tcp://127.0.0.1:{4000 + k}": {"memory_limit": 2**30, "nthreads": 1}
                        for k in range(n)}

    def scheduler_info(self, n_workers=5):
        shown = list(self.workers.items())
        if n_workers != -1:
            shown = shown[:n_workers]
        return {"workers": dict(shown)}


class _Watch:
    """The part of a batch cluster's watch that waiting for workers uses."""

    expected = 7

    def submitted(self):
        return True

    def waiting(self):
        return "7 jobs"

    def none_joined(self):
        return "none"

    def rest(self):
        return "the rest later"


def test_seven_workers_are_all_counted():
    """With 7 workers joined, the wait ends at once instead of waiting out the timeout."""
    from dkicf.deploy import _wait_for_workers
    from dkicf.pipeline import _worker_resources

    client = _FewWorkersByDefault(7)
    assert len(all_workers(client)) == 7
    messages = []
    t0 = time.monotonic()
    _wait_for_workers(client, _Watch(), timeout=30.0, progress=messages.append)
    assert time.monotonic() - t0 < 5
    assert messages[-1].startswith("all 7 workers joined after")
    assert _worker_resources(client) == (2**30, 7, 1)


def test_seven_workers_of_a_real_cluster_are_counted():
    import dask
    from distributed import Client, LocalCluster


    # Workers in this process, talking in memory (no socket), without a dashboard.
    with dask.config.set({"distributed.scheduler.http.routes": []}), LocalCluster(
            n_workers=7, threads_per_worker=1, processes=False, dashboard_address=None,
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(7, timeout=START_TIMEOUT)
        assert len(all_workers(client)) == 7


def test_workers_are_asked_of_the_scheduler_not_the_clients_cached_copy(monkeypatch):
    """The client's cached information, as its timer leaves it, lists no workers.

    distributed 2026.8 replaces ``Client.scheduler_info()``'s copy every two
    seconds with one without workers, so a count read back from it after the
    timer ran said the cluster had none (a fit refused to start, 1 in about
    20,000 calls).
    """
    from distributed import Client


    with Client(processes=False, n_workers=2, threads_per_worker=1,
                dashboard_address=None) as client:
        client.wait_for_workers(2, timeout=START_TIMEOUT)
        monkeypatch.setattr(client, "scheduler_info",
                            lambda *a, **k: {"type": "Scheduler", "workers": {}})
        found = all_workers(client)
        assert len(found) == 2
        assert all(info["nthreads"] == 1 for info in found.values())


def test_job_options_left_out_come_from_the_sites_jobqueue_yaml():
    """dask-jobqueue's configuration applies to what the caller leaves out."""
    pytest.importorskip("dask_jobqueue")
    import dask

    site = {"jobqueue.slurm.cores": 16, "jobqueue.slurm.memory": "120GiB",
            "jobqueue.slurm.walltime": "08:00:00", "jobqueue.slurm.processes": 4}
    with dask.config.set(site):
        script = jobqueue_script("slurm")
        given = jobqueue_script("slurm", cores=8, processes=2, memory="32GiB")
    assert "#SBATCH --cpus-per-task=16" in script and "#SBATCH -t 08:00:00" in script
    assert "--nworkers 4" in script and "--nthreads 4" in script
    assert "#SBATCH --cpus-per-task=8" in given and "--nworkers 2" in given
    with pytest.raises(TypeError, match=r"needs cores=.*or jobqueue.slurm.cores"):
        jobqueue_script("slurm", memory="8GiB")


def test_cli_slurm_flags_left_out_leave_the_site_settings(monkeypatch, tmp_path, capsys):
    """Without --cores/--memory/--walltime/--processes the CLI passes none of them on."""
    import dkicf.deploy
    from dkicf.cli import main

    seen = {}

    def start_cluster(kind, **options):
        seen.update(options, kind=kind)
        raise ConnectionError("no batch system here")

    monkeypatch.setattr(dkicf.deploy, "start_cluster", start_cluster)
    _tiny_store(tmp_path / "data.zarr")
    code = main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out",
                 str(tmp_path / "out.zarr"), "--cluster", "slurm", "--quiet"])
    assert code == 1 and "no batch system here" in capsys.readouterr().err
    assert seen["kind"] == "slurm" and seen["jobs"] == 1
    for flag in ("cores", "memory", "walltime", "processes", "queue", "account", "interface"):
        assert flag not in seen, flag
    main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out",
          str(tmp_path / "out.zarr"), "--cluster", "pbs", "--cores", "16", "--memory", "1GiB",
          "--quiet"])
    assert seen["cores"] == 16 and seen["memory"] == "1GiB" and "walltime" not in seen


def _tiny_store(path):
    from dkicf import io

    X = np.random.default_rng(0).normal(size=(60, 2))
    io.write_group(str(path), {"X": X}, {})


def test_local_cluster_takes_its_defaults_from_dask_config(monkeypatch):
    """Like the dkicf command: dkicf.cluster.* settings, unless given as arguments."""
    import dask

    import dkicf
    import dkicf.deploy

    seen = []

    def start_cluster(kind, **options):
        seen.append(dict(options, kind=kind))
        return "client", "cluster"

    monkeypatch.setattr(dkicf.deploy, "start_cluster", start_cluster)
    with dask.config.set({"dkicf.cluster.workers": 5, "dkicf.cluster.threads": 3,
                          "dkicf.cluster.memory-limit": "3GiB"}):
        assert dkicf.local_cluster() == "client"
        dkicf.local_cluster(1, 2, memory_limit="1GiB", dashboard=True)
    dkicf.local_cluster()
    assert seen == [
        {"kind": "local", "workers": 5, "threads": 3, "memory_limit": "3GiB",
         "dashboard": False, "separate_processes": None},
        {"kind": "local", "workers": 1, "threads": 2, "memory_limit": "1GiB",
         "dashboard": True, "separate_processes": None},
        {"kind": "local", "workers": "auto", "threads": 1, "memory_limit": "auto",
         "dashboard": False, "separate_processes": None},
    ]
