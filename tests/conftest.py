"""Shared fixtures: a small 2-worker LocalCluster for the distributed tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def client():
    """A LocalCluster of 2 worker processes x 1 thread on 127.0.0.1, shared by the session."""
    from dkicf import local_cluster

    c = local_cluster(2, 1, memory_limit="2GiB")
    yield c
    cluster = c.cluster
    c.close()
    cluster.close()


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the fuzz tests skip themselves
    pass
else:
    _FUZZ = dict(deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])
    # The suite's run: short, and the same cases every time.
    settings.register_profile("default", max_examples=30, derandomize=True, **_FUZZ)
    # The campaign's (--hypothesis-profile=long, benchmarks/bench_campaign.py).
    settings.register_profile("long", max_examples=2000, **_FUZZ)
    settings.load_profile("default")
