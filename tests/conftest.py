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
