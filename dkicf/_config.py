"""dkicf's section of dask's configuration: defaults shipped in ``dkicf.yaml``.

The defaults join dask's own (``dask.config.update_defaults``), so a user's
YAML files and ``DASK_DKICF__...`` environment variables override them as for
any dask setting.  ``DKICF_...`` variables are read too, as if they were
spelled ``DASK_DKICF__...``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_DEFAULTS = Path(__file__).with_name("dkicf.yaml")
_PREFIX = "DKICF_"
_shipped: dict | None = None  # dkicf.yaml, once read


def _load() -> None:
    """Add the shipped defaults and the ``DKICF_`` variables to dask's configuration.

    Once, and again whenever dkicf's section is gone: a ``dask.config.set``
    of a dkicf setting entered before the first load removes the whole
    section on exit, the defaults with it.
    """
    global _shipped
    import dask.config

    if _shipped is not None and "dkicf" in dask.config.config:
        return
    if _shipped is None:
        import yaml

        _shipped = yaml.safe_load(_DEFAULTS.read_text())
        dask.config.update_defaults(_shipped)
    else:
        dask.config.update(dask.config.config, _shipped, priority="old")
    short = {f"DASK_DKICF__{key[len(_PREFIX):]}": value for key, value in os.environ.items()
             if key.startswith(_PREFIX)}
    if short:
        # Spelled out in full, a DASK_DKICF__ variable of the same name wins.
        found = dask.config.collect_env(short)
        full = dask.config.collect_env(
            {k: v for k, v in os.environ.items() if k.startswith("DASK_DKICF__")})
        dask.config.update(dask.config.config, found, priority="new")
        dask.config.update(dask.config.config, full, priority="new")


def get(key: str, default: Any = None) -> Any:
    """The setting ``dkicf.<key>``, e.g. ``get("cluster.workers")``.

    Examples
    --------
    >>> import dask
    >>> from dkicf._config import get
    >>> get("fit.rank")
    100
    >>> with dask.config.set({"dkicf.fit.rank": 40}):
    ...     get("fit.rank")
    40
    """
    import dask.config

    _load()
    return dask.config.get(f"dkicf.{key}", default)


def local_workers(value: Any) -> int:
    """Worker processes of a local cluster for ``value``: an integer >= 1 as it is, or
    ``"auto"``: one a core that this process may use (its CPU affinity and any cgroup
    quota, as dask counts them), each worker having one thread.

    Examples
    --------
    >>> from dkicf._config import local_workers
    >>> local_workers(3)
    3
    >>> local_workers("auto") >= 1
    True
    """
    if value == "auto":
        import dask.system

        return max(1, int(dask.system.CPU_COUNT))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"workers must be an integer >= 1 or 'auto', got {value!r}.")
    return value


def process_settings() -> dict:
    """The dask settings that the processes of the clusters dkicf starts (a local
    cluster's scheduler, nannies and workers; a SLURM or PBS job's workers) run with on top
    of the driver's, which stay as they were: ``dkicf.cluster.worker-profiler`` and
    ``dkicf.cluster.tick-interval``, each unless it is null.

    An idle worker spent about 5% of a core on two things that only
    diagnose: its statistical profiler (a stack sample every 10 ms) and the
    event-loop health check of every server (every 20 ms).  With 16 workers
    on 16 cores that is most of a core, taken from the fit's tasks.
    """
    from dask.utils import parse_timedelta

    out = {}
    profiler = get("cluster.worker-profiler")
    if profiler is not None:
        if not isinstance(profiler, bool):
            raise ValueError(
                f"dkicf.cluster.worker-profiler must be true, false or null, got {profiler!r}.")
        out["distributed.worker.profile.enabled"] = profiler
    tick = get("cluster.tick-interval")
    if tick is not None:
        try:
            seconds = parse_timedelta(tick, default="ms")
        except (TypeError, ValueError, KeyError):
            seconds = None
        if not seconds or seconds <= 0:
            raise ValueError(
                "dkicf.cluster.tick-interval must be a positive duration such as 1s or "
                f"200ms, or null (dask's own distributed.admin.tick.interval), got {tick!r}.")
        out["distributed.admin.tick.interval"] = f"{seconds}s"
    return out
