"""Block pivot rules with P in Zarr (``p_store=``) and with checkpoints (crash, then resume)."""

import json
import subprocess
import sys
import textwrap

import dask
import dask.array as da
import numpy as np
import pytest
import zarr

import dkicf._memory as memory
from dkicf import incomplete_cholesky
from dkicf import pivoting as _pivoting
from dkicf.errors import CheckpointMismatchError

RULES = ["block-greedy", "rpcholesky"]
# Small blocks and 8-column Zarr chunks: blocks cross column-block boundaries
# and flush mid-run.
PARAMS = {"gamma": 0.5, "max_rank": 48, "tol": 0.0, "block_size": 12, "random_state": 3}
COLUMNS = 8
EVERY = 2  # passes (blocks) between commits
CHUNK = 150


def make_X():
    return np.random.default_rng(5).normal(size=(600, 3))


def assert_same_fit(res, ref):
    """Bit-identical factorizations, with the same blocks."""
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_array_equal(np.asarray(res.P), np.asarray(ref.P))
    np.testing.assert_array_equal(res.trace_errors, ref.trace_errors)
    np.testing.assert_array_equal(np.asarray(res.residual), np.asarray(ref.residual))
    np.testing.assert_array_equal(res.L, ref.L)
    np.testing.assert_array_equal(res.pivot_rows, ref.pivot_rows)
    assert res.info["blocks"] == ref.info["blocks"]
    assert res.n_passes == ref.n_passes and res.stop_reason == ref.stop_reason


def computed(res):
    res.P, res.residual = dask.compute(res.P, res.residual)
    return res


@pytest.fixture
def small_columns(monkeypatch):
    monkeypatch.setattr(memory, "COLUMN_BLOCK", COLUMNS)


# ----------------------------------------------------------------------- P in Zarr


@pytest.mark.parametrize("rule", RULES)
def test_block_rules_with_p_in_zarr_equal_in_memory(client, tmp_path, small_columns, rule):
    X = make_X()
    kw = dict(PARAMS, pivoting=rule)
    ref = incomplete_cholesky(X, **kw)  # P in memory; the dask backend's agrees (test_pivoting)
    url = str(tmp_path / "P.zarr")
    res = computed(incomplete_cholesky(da.from_array(X, chunks=((CHUNK, 250, 200), (3,))),
                                       client=client, p_store=url, **kw))
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    assert res.info["blocks"] == ref.info["blocks"]
    # Blocks of up to 12 columns cross the 8-column Zarr chunks.
    assert max(res.info["block_sizes"]) > COLUMNS
    # The flushed columns are multiplied block by block: rounding-level differences only.
    np.testing.assert_allclose(res.P, ref.P, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.residual, ref.residual, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.trace_errors, ref.trace_errors, rtol=0, atol=1e-10)
    arr = zarr.open_array(url, mode="r")
    assert arr.chunks[1] == COLUMNS
    assert arr.attrs["dkicf"]["rank"] == 48
    assert arr.attrs["dkicf"]["pivots"] == res.pivots.tolist()


def test_tol_inside_a_block_with_p_in_zarr_and_in_a_checkpoint(client, tmp_path, small_columns):
    X = make_X()
    full = incomplete_cholesky(X, **dict(PARAMS, pivoting="block-greedy"))
    ends = set(np.cumsum(full.info["block_sizes"]).tolist())
    k = next(r for r in range(20, 48) if r not in ends and r - 1 not in ends)
    kw = dict(PARAMS, pivoting="block-greedy",
              tol=0.5 * (full.trace_errors[k - 1] + full.trace_errors[k - 2]))
    ref = incomplete_cholesky(X, **kw)
    url = str(tmp_path / "P.zarr")
    res = computed(incomplete_cholesky(da.from_array(X, chunks=CHUNK), client=client,
                                       p_store=url, **kw))
    assert ref.rank == res.rank == k and res.stop_reason == "tol"
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P, ref.P, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.residual, ref.residual, rtol=0, atol=1e-12)
    meta = zarr.open_array(url, mode="r").attrs["dkicf"]
    assert meta["rank"] == k and meta["pivots"] == res.pivots.tolist()
    # A finished checkpoint returns the cut result with the same bits as the run.
    Xd = da.from_array(X, chunks=CHUNK)
    ck_url = str(tmp_path / "ck.zarr")
    run = computed(incomplete_cholesky(Xd, client=client, checkpoint=ck_url, **kw))
    assert commit_of(ck_url)["result_rank"] == k < commit_of(ck_url)["rank"]
    again = computed(incomplete_cholesky(Xd, client=client, checkpoint=ck_url, resume=True, **kw))
    assert again.info["already_finished"]
    assert_same_fit(again, run)


# ----------------------------------------------------------------- crash and resume

CRASH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import dkicf._commit as ck
    import dkicf._memory as memory
    from dkicf import incomplete_cholesky

    url, phase, at, kind, params, every, chunk, columns = sys.argv[1:]
    at, every, chunk, params = int(at), int(every), int(chunk), json.loads(params)
    memory.COLUMN_BLOCK = int(columns)

    def crash(name, iteration):
        if (name, iteration) == (phase, at):
            os._exit(3)

    def progress(p):
        if phase == "pass" and p.n_passes == at:
            os._exit(3)

    ck._fault_hook = crash
    X = np.random.default_rng(5).normal(size=(600, 3))
    client = None
    if kind == "dask":
        import dask.array as da
        from distributed import Client, LocalCluster

        client = Client(LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                     dashboard_address=None))
        X = da.from_array(X, chunks=chunk)
    incomplete_cholesky(X, client=client, checkpoint=url, checkpoint_every=every,
                        progress=progress, **params)
    os._exit(0)
    """
)


def crash_driver(url, phase, at, kind, params):
    args = [sys.executable, "-c", CRASH_SCRIPT, str(url), phase, str(at), kind,
            json.dumps(params), str(EVERY), str(CHUNK), str(COLUMNS)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 3, proc.stderr[-3000:]


def commit_of(url):
    return zarr.open_group(str(url), mode="r").attrs["dkicf"]["commit"]


@pytest.mark.parametrize(
    "rule, phase, at, resumed_at",
    [
        ("block-greedy", "e", 4, 2),  # residual in the spare buffer, not committed
        ("rpcholesky", "pass", 6, 4),  # between commits (a pass counts the diagonal too)
    ],
)
def test_numpy_crash_then_resume_is_bit_identical(tmp_path, rule, phase, at, resumed_at):
    params = dict(PARAMS, pivoting=rule)
    plain = incomplete_cholesky(make_X(), **params)
    ref = incomplete_cholesky(make_X(), checkpoint=str(tmp_path / "ref.zarr"),
                              checkpoint_every=EVERY, **params)
    assert_same_fit(ref, plain)  # checkpoints do not change a numpy fit
    assert len(ref.info["blocks"]) > 2 * EVERY
    url = tmp_path / "ck.zarr"
    crash_driver(url, phase, at, "numpy", params)
    saved = commit_of(url)
    assert saved["iteration"] == resumed_at
    res = incomplete_cholesky(make_X(), checkpoint=str(url), resume=True,
                              checkpoint_every=EVERY, **params)
    assert res.info["resumed_from"] == saved["rank"]
    assert_same_fit(res, ref)


@pytest.mark.parametrize("p_storage", ["memory", "zarr"])
@pytest.mark.parametrize("rule, phase, at", [("block-greedy", "pass", 6), ("rpcholesky", "P", 4)])
def test_dask_crash_then_resume_is_bit_identical(client, tmp_path, rule, phase, at, p_storage):
    """P in the checkpoint (its tails in memory) or in worker memory (copied at commits)."""
    params = dict(PARAMS, pivoting=rule, p_storage=p_storage)
    X = da.from_array(make_X(), chunks=CHUNK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "COLUMN_BLOCK", COLUMNS)
        ref = computed(incomplete_cholesky(X, client=client, checkpoint=str(tmp_path / "ref"),
                                           checkpoint_every=EVERY, **params))
    url = tmp_path / "ck.zarr"
    crash_driver(url, phase, at, "dask", params)
    saved = commit_of(url)
    # The last commit is mid-run, past a flushed column block.
    assert 0 < saved["iteration"] < at and COLUMNS < saved["rank"] < ref.rank
    res = computed(incomplete_cholesky(X, client=client, checkpoint=str(url), resume=True,
                                       checkpoint_every=EVERY, **params))
    assert res.info["resumed_from"] == saved["rank"] and not res.info["already_finished"]
    assert res.info["p_storage"] == ref.info["p_storage"] == p_storage
    assert_same_fit(res, ref)


def test_rpcholesky_resumes_with_the_committed_key(tmp_path, monkeypatch):
    """random_state=None draws a fresh key; the resumed run must use the checkpoint's."""
    params = dict(PARAMS, pivoting="rpcholesky", random_state=None)
    url = tmp_path / "ck.zarr"
    crash_driver(url, "commit", 4, "numpy", params)
    key = np.array([int(h, 16) for h in commit_of(url)["driver"]["key"]], dtype=np.uint64)
    res = incomplete_cholesky(make_X(), checkpoint=str(url), resume=True,
                              checkpoint_every=EVERY, **params)
    monkeypatch.setattr(_pivoting, "rpcholesky_key", lambda random_state: key)
    ref = incomplete_cholesky(make_X(), **params)
    assert_same_fit(res, ref)


def test_finished_block_checkpoint_cut_inside_a_block_is_returned_as_is(tmp_path):
    X = make_X()
    full = incomplete_cholesky(X, **dict(PARAMS, pivoting="block-greedy"))
    ends = set(np.cumsum(full.info["block_sizes"]).tolist())
    k = next(r for r in range(20, 48) if r not in ends and r - 1 not in ends)
    params = dict(PARAMS, pivoting="block-greedy",
                  tol=0.5 * (full.trace_errors[k - 1] + full.trace_errors[k - 2]))
    url = str(tmp_path / "ck.zarr")
    ref = incomplete_cholesky(X, checkpoint=url, checkpoint_every=EVERY, **params)
    assert ref.rank == k and ref.stop_reason == "tol"
    assert_same_fit(ref, incomplete_cholesky(X, **params))
    res = incomplete_cholesky(X, checkpoint=url, resume=True, checkpoint_every=EVERY, **params)
    assert res.info["already_finished"]
    assert_same_fit(res, ref)


@pytest.mark.parametrize("change, match", [({"block_size": 8}, "block_size: checkpoint 12"),
                                           ({"pivoting": "rpcholesky"}, "pivoting: checkpoint")])
def test_resume_with_other_block_parameters_is_refused(tmp_path, change, match):
    url = str(tmp_path / "ck.zarr")
    params = dict(PARAMS, pivoting="block-greedy", max_rank=10)
    incomplete_cholesky(make_X(), checkpoint=url, **params)
    with pytest.raises(CheckpointMismatchError, match=match):
        incomplete_cholesky(make_X(), checkpoint=url, resume=True, **dict(params, **change))
