"""Reaching a running dask scheduler: its TLS settings, its address or scheduler file.

A TLS connection requires encryption and mutual authentication; a failed
connection says what to check.  :mod:`dkicf.deploy` offers both functions.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client
    from distributed.security import Security

__all__ = ["TLS_FLAGS", "connect", "make_security"]

#: The command line's TLS flags, as messages name them.
TLS_FLAGS = "--tls-ca-file, --tls-cert and --tls-key"


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


def scheduler_http(dashboard: bool):
    """Configuration for a scheduler started by dkicf.

    distributed always starts an HTTP server next to the scheduler.  Without a
    dashboard it serves only ``/health`` (no worker pages, logs or JSON state).
    """
    import dask

    if dashboard:
        return contextlib.nullcontext()
    return dask.config.set({"distributed.scheduler.http.routes": ["distributed.http.health"]})


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
            f"TLS needs {TLS_FLAGS} (the key may be inside the certificate file); "
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
            f"the scheduler at {address} speaks TLS: pass {TLS_FLAGS} "
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
            f"(A TLS scheduler needs a tls:// address and {TLS_FLAGS}.)"
        )
    if any(
        sign in message
        for sign in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "EOF occurred",
                     "Connection reset by peer")
    ):
        # With TLS 1.3 the scheduler's refusal may arrive as an alert, as a closed
        # connection or (seen with Python 3.13) as a reset one, depending on timing.
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
