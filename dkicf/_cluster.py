"""Finding the dask cluster a computation runs on, and counting its workers.

Starting one is :mod:`dkicf.deploy`'s job (:func:`dkicf.deploy.local_cluster`).
"""

from __future__ import annotations

import functools

__all__ = ["all_workers", "get_client"]


def all_workers(client) -> dict:
    """Every worker the scheduler knows, as ``{address: info}``.

    Asked of the scheduler on each call.  ``Client.scheduler_info()`` returns
    the client's cached copy, which a timer on the client's event loop
    replaces every two seconds with one that lists no workers (distributed
    2026.8); read back after the timer ran, it says the cluster has none.  It
    also lists only the first few workers by default on some versions (five
    on 2025.4 to 2026.6).  Every count of workers in dkicf goes through here.

    Parameters
    ----------
    client : distributed.Client
        Or anything with a ``scheduler_info`` method.

    Returns
    -------
    dict
        The ``"workers"`` entry of the scheduler's information.
    """
    ask = client.scheduler_info  # an asynchronous client or a stand-in: its own answer
    scheduler = getattr(client, "scheduler", None)
    if scheduler is not None and not getattr(client, "asynchronous", True):
        ask = functools.partial(client.sync, scheduler.identity)
    try:
        info = ask(n_workers=-1)
    except TypeError:  # distributed < 2025.4: no such argument, every worker listed
        info = ask()
    return dict(info.get("workers", {}))


def get_client(client=None, *, timeout: float = 10.0):
    """Return a ``distributed.Client`` from a client, an address, or the current one.

    Parameters
    ----------
    client : distributed.Client, str or None
        A client is used as it is; a string is a scheduler address
        (``tcp://host:port`` or ``tls://host:port``); None means the client
        current in this process.
    timeout : float
        Seconds to wait for a scheduler given by address.
    """
    from distributed import Client

    if isinstance(client, Client):
        return client
    if isinstance(client, str):
        try:
            return Client(client, timeout=timeout)
        except OSError as exc:
            raise ConnectionError(
                f"could not reach the dask scheduler at {client} within {timeout:g} s: {exc}"
            ) from None
    if client is not None:
        raise TypeError(
            f"client must be a distributed.Client, an address string or None, "
            f"got {type(client).__name__}."
        )
    try:
        from distributed import get_client as _current

        return _current()
    except ValueError:
        raise RuntimeError(
            "dask input needs a distributed cluster and none is running in this process. "
            "Start one first: `client = dkicf.local_cluster()` for workers on this machine, "
            "or `distributed.Client(address)` to connect to a running scheduler."
        ) from None

