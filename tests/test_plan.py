"""The plan layer on its own: what plan_fit decides from a dataset's shape and the workers."""

import math

import pytest

from dkicf import _memory, pipeline
from dkicf._plan import FitPlan, plan_fit

GiB = 2**30


def test_without_worker_memory_nothing_is_decided_from_memory():
    plan = plan_fit((10_000, 16), 2_500, 4, 100)
    assert isinstance(plan, FitPlan)
    assert (plan.x_bytes, plan.p_bytes) == (10_000 * 16 * 4, 8 * 10_000 * 100)
    assert (plan.chunk_rows, plan.n_chunks, plan.rechunked) == (2_500, 4, False)
    assert plan.p_storage == "memory" and not plan.persist_x
    assert any("decided by fit" in line for line in plan.lines())
    assert plan_fit((50, 3), 50, 8, 100).rank == 50  # the rank never exceeds the rows


def test_the_plan_counts_the_kmeans_state_and_a_fetch():
    """k-means||: a float64 distance and an int32 label per run and row and the squared
    norms, twice at the end of a round; k-means++ keeps the labels; one mini-batch fetch
    of 102,400 rows of P (at most 128 MiB) beside them."""
    plan = plan_fit((10**6, 16), 250_000, 8, 150)
    assert plan.kmeans_bytes == 10**6 * 2 * (5 * 12 + 8) + 102_400 * 8 * 150
    assert "  k-means besides P: 0.241 GiB (its state of every row and, but for Lloyd " \
           "alone, one mini-batch fetch)" in plan.lines()
    plan = plan_fit((10**6, 16), 250_000, 8, 500, n_init=2, init="k-means++")
    assert plan.kmeans_bytes == 10**6 * 8 + (2**27 // 4000) * 4000
    plan = plan_fit((10**6, 16), 250_000, 8, 500, n_init=2, algorithm="lloyd")
    assert plan.kmeans_bytes == 10**6 * 2 * (2 * 12 + 8)  # Lloyd alone: no fetch
    # A small rank on a cluster at its edge: k-means|| moves P to Zarr where the
    # state of k-means++ leaves it in memory.
    kw = dict(worker_memory=1000 * 2**20, n_workers=2, worker_baseline=150 * 2**20)
    assert plan_fit((4 * 10**6, 8), 250_000, 8, 20, **kw).p_storage == "zarr"
    assert plan_fit((4 * 10**6, 8), 250_000, 8, 20, init="k-means++", **kw).p_storage == "memory"
    # 16 chunks grouped into one task per worker: P reaches the k-means as views of the
    # factorization's buffers, held once. Counted twice, P (160 bytes a row), its residual
    # and the state would not fit a worker's room below 60% of 1300 MiB.
    kw["worker_memory"] = 1300 * 2**20
    assert plan_fit((4 * 10**6, 8), 250_000, 8, 20, **kw).p_storage == "memory"
    assert 2 * 10**6 * (2 * 160 + 8 + 136) > 0.6 * 1300 * 2**20 - 150 * 2**20


def test_a_roomy_cluster_holds_x_and_p_and_keeps_the_chunks():
    plan = plan_fit((100_000, 16), 10_000, 8, 100, worker_memory=8 * GiB, n_workers=4,
                    threads_per_worker=2, worker_baseline=200 * 2**20, memory_fraction=0.6)
    assert plan.p_storage == "memory" and plan.persist_x and not plan.rechunked
    assert plan.cluster_memory == 32 * GiB and plan.n_chunks == 10
    assert plan.task_bytes > 10_000 * 8 * 100  # the chunk's rows of P at least


def test_p_goes_to_zarr_when_the_cluster_cannot_hold_it():
    # P is 8 * 4e6 * 200 = 6.4 GB; the cluster holds 2 x 2 GiB.
    kw = dict(worker_memory=2 * GiB, n_workers=2, threads_per_worker=1,
              worker_baseline=150 * 2**20, memory_fraction=0.6)
    plan = plan_fit((4_000_000, 16), 50_000, 4, 200, **kw)
    assert plan.p_storage == "zarr" and 1 <= plan.p_columns <= 32
    assert plan.p_columns == _memory.zarr_width(
        _memory._Workers([2 * GiB] * 2, [1, 1], 150 * 2**20, 0.6), 4_000_000, 32)
    with pytest.raises(MemoryError, match="keep it in Zarr"):
        plan_fit((4_000_000, 16), 50_000, 4, 200, p_storage="memory", **kw)


def test_workers_whose_own_memory_fills_their_limit_are_refused_with_the_limit_needed():
    with pytest.raises(MemoryError, match=r"use about 700 MiB each .*\(--memory-limit \d+MiB"):
        plan_fit((10_000, 8), 1_000, 8, 50, worker_memory=2**30, n_workers=2,
                 worker_baseline=700 * 2**20, memory_fraction=0.6)


def test_chunks_too_large_for_a_task_are_made_smaller():
    plan = plan_fit((2_000_000, 64), 2_000_000, 8, 100, worker_memory=4 * GiB, n_workers=8,
                    threads_per_worker=4, worker_baseline=150 * 2**20, memory_fraction=0.6)
    assert plan.rechunked and plan.chunk_rows < 2_000_000
    assert plan.n_chunks == math.ceil(2_000_000 / plan.chunk_rows)


def test_the_pipeline_plans_with_the_plan_layer():
    assert pipeline.plan_fit is plan_fit and pipeline.FitPlan is FitPlan
