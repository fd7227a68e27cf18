"""P kept in Zarr (``p_store=``): same factorization as in worker memory, small chunk states."""

import pickle

import dask.array as da
import numpy as np
import pytest
import zarr
from dask.sizeof import sizeof

from dkicf import _chunk, incomplete_cholesky
from dkicf._memory import p_rows_for
from dkicf.kernels import GaussianKernel


@pytest.fixture(scope="module")
def X():
    return np.random.default_rng(3).normal(size=(900, 3))


@pytest.fixture(scope="module")
def in_memory(client, X):
    Xd = da.from_array(X, chunks=300)
    res = incomplete_cholesky(Xd, gamma=0.6, max_rank=40, tol=0, client=client)
    return res, res.P.compute(), res.residual.compute()


@pytest.mark.parametrize("chunks", [(300, 300, 300), (100, 333, 17, 450)])
def test_p_in_zarr_equals_in_memory(client, X, in_memory, tmp_path, chunks):
    ref, ref_P, ref_e = in_memory
    url = str(tmp_path / "P.zarr")
    res = incomplete_cholesky(da.from_array(X, chunks=(chunks, (3,))),
                              gamma=0.6, max_rank=40, tol=0, client=client, p_store=url)
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    P = res.P.compute()
    # The flushed columns are multiplied block by block: rounding-level differences only.
    np.testing.assert_allclose(P, ref_P, atol=1e-10, rtol=0)
    np.testing.assert_allclose(res.residual.compute(), ref_e, atol=1e-10, rtol=0)
    np.testing.assert_allclose(res.trace_errors, ref.trace_errors, atol=1e-9, rtol=0)
    np.testing.assert_allclose(res.L, ref.L, atol=1e-12, rtol=0)
    arr = zarr.open_array(url, mode="r")
    assert arr.shape == (900, 40)
    # Each task writes whole Zarr chunks: their rows divide the row chunks of P.
    assert arr.chunks[1] == 32 and all(c % arr.chunks[0] == 0 for c in res.P.chunks[0][:-1])
    assert arr.attrs["dkicf"]["rank"] == 40
    assert arr.attrs["dkicf"]["pivots"] == res.pivots.tolist()
    np.testing.assert_array_equal(np.asarray(arr[:, :40]), P)


def test_p_rows_divide_the_row_chunks():
    assert p_rows_for((10000, 10000, 3456)) == 5000
    assert p_rows_for((65536, 65536, 10)) == 8192
    assert p_rows_for((1000, 1000, 500)) == 1000
    assert p_rows_for((150,) * 4) == 150
    assert p_rows_for((10007, 10007, 5)) == 10007
    assert p_rows_for((777,)) == 777
    assert p_rows_for((100, 333, 17, 550)) == 0  # irregular: X is rechunked


def _spec(tmp_path, n, capacity, cb=4):
    url = str(tmp_path / "P.zarr")
    zarr.create_array(url, shape=(n, capacity), chunks=(n, cb), dtype="f8", fill_value=np.nan)
    return _chunk.StoreSpec(url, "", "t", cb)


def test_state_keeps_only_a_tail_and_stays_small(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 2))
    kern = GaussianKernel(0.5)
    spec = _spec(tmp_path, 500, 20)
    state = _chunk.chunk_init(x, kern, 0, 20, 0, spec)
    mem = _chunk.chunk_init(x, kern, 0, 20, 0)
    for i in range(11):
        stats = _chunk.chunk_stats(state, 1, x, rows=True)
        block = _chunk.PivotBlock(kern, stats["index"], stats["x_rows"], stats["aux"],
                                  stats["p_rows"], np.array([[np.sqrt(stats["values"][0])]]), i)
        state = _chunk.chunk_update(x, state, block)
        mem = _chunk.chunk_update(x, mem, block)
        assert state.rank - state.flushed < 4 and state.P.shape[1] == 4
        assert sizeof(state) < sizeof(mem)
    assert state.flushed == 8
    stored = np.asarray(spec.array()[:, :8])
    np.testing.assert_allclose(stored, mem.P[:, :8], atol=1e-13)
    _, _, rows, _ = _chunk.chunk_rows(x, state, np.array([7, 300]))
    np.testing.assert_allclose(rows, mem.P[[7, 300], :11], atol=1e-13)
    for lo, hi in ((0, 11), (3, 6), (6, 10), (9, 11)):
        np.testing.assert_allclose(state.columns(lo, hi), mem.columns(lo, hi), atol=1e-13)


def test_rerunning_an_update_writes_identical_bytes(tmp_path):
    """A task re-run from an earlier state (worker failure) leaves Zarr unchanged."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2))
    kern = GaussianKernel(0.5)
    spec = _spec(tmp_path, 300, 8)
    states = [_chunk.chunk_init(x, kern, 0, 8, 0, spec)]
    blocks = []
    for i in range(8):
        stats = _chunk.chunk_stats(states[-1], 1, x, rows=True)
        blocks.append(_chunk.PivotBlock(kern, stats["index"], stats["x_rows"], stats["aux"],
                                        stats["p_rows"], np.array([[np.sqrt(stats["values"][0])]]),
                                        i))
        states.append(_chunk.chunk_update(x, states[-1], blocks[-1]))
    before = np.asarray(spec.array()[:])
    again = _chunk.chunk_update(x, states[3], blocks[3])  # completes the first column block
    again = _chunk.chunk_update(x, again, blocks[4])
    np.testing.assert_array_equal(np.asarray(spec.array()[:]), before)
    np.testing.assert_array_equal(again.e, states[5].e)
    np.testing.assert_array_equal(again.P[:, :1], states[5].P[:, :1])


def test_numpy_input_refuses_p_store(tmp_path, X):
    with pytest.raises(ValueError, match="p_store= keeps P in Zarr for dask input"):
        incomplete_cholesky(X, gamma=1.0, p_store=str(tmp_path / "P.zarr"))


def test_existing_p_store_is_refused_then_overwritten(client, tmp_path, X):
    url = str(tmp_path / "P.zarr")
    Xd = da.from_array(X, chunks=450)
    incomplete_cholesky(Xd, gamma=1.0, max_rank=5, client=client, p_store=url)
    with pytest.raises(FileExistsError, match="already exists.*overwrite=True"):
        incomplete_cholesky(Xd, gamma=1.0, max_rank=5, client=client, p_store=url)
    res = incomplete_cholesky(Xd, gamma=1.0, max_rank=7, client=client, p_store=url,
                              overwrite=True)
    assert res.P.shape == (900, 7)


def test_foreign_data_at_the_location_is_never_touched(client, tmp_path, X):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    for kw in ({"p_store": str(target)}, {"p_store": str(target), "overwrite": True}):
        with pytest.raises(FileExistsError, match="not a dkicf P store"):
            incomplete_cholesky(da.from_array(X, chunks=450), gamma=1.0, max_rank=3,
                                client=client, **kw)
    assert (target / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


class _FakeClient:
    """The scheduler's view of workers; with ``own``, what they measure of themselves."""

    def __init__(self, workers, own=None):
        self.workers = workers
        self.own = own
        self.token = object()  # distinct names: measurements are cached per cluster

    def scheduler_info(self, n_workers=-1):
        return {"workers": {f"w{i}-{id(self.token)}": w for i, w in enumerate(self.workers)}}

    def run(self, func):
        if self.own is None:
            raise RuntimeError("no remote functions here")
        names = self.scheduler_info()["workers"]
        return {name: {"own": self.own, "fraction": 0.6} for name in names}


def test_zarr_column_block_follows_cluster_memory():
    """The tails of P, the vectors and a task's buffers fit what a worker may fill."""
    from dkicf._memory import store_columns, usable_memory_fraction

    assert usable_memory_fraction() == 0.6  # distributed's default spill target
    two = _FakeClient([{"nthreads": 1, "memory_limit": 400_000_000}] * 2)
    n = 1_000_000
    # The busiest worker holds 500,000 rows: four vectors and two tails of cb
    # columns (16 MB + 8 MB * cb). One task over them adds a residual and a
    # product (8 MB), its tail grown (4 MB * cb) and 32 MiB of streamed columns,
    # within 75% of what the states leave of 60% of 400 MB:
    # 41.55 MB + 4 MB * cb <= 0.75 * (224 MB - 8 MB * cb), i.e. cb <= 12.6.
    assert store_columns(two, n, 50, 32) == 12
    assert store_columns(two, 1000, 50, 32) == 32  # small data: the usual width
    assert store_columns(two, 1000, 5, 32) == 5  # never wider than P
    assert store_columns(_FakeClient([{"nthreads": 1, "memory_limit": 0}]), n, 50, 32) == 32
    # The worker processes' own memory counts: 100 MB each leave 140 MB, and
    # 41.55 MB + 4 MB * cb <= 0.75 * (124 MB - 8 MB * cb) gives cb <= 5.1.
    heavy = _FakeClient([{"nthreads": 1, "memory_limit": 400_000_000}] * 2, own=100_000_000)
    assert store_columns(heavy, n, 50, 32) == 5
    with pytest.raises(ValueError, match=r"10000000 rows need .* Add workers"):
        store_columns(two, 10_000_000, 50, 32)


def test_zarr_column_block_is_recorded_in_the_array(client, X, tmp_path, monkeypatch):
    """The fit writes P with the width chosen from memory, and still equals the reference."""
    from dkicf import _memory

    # Room for 7.5 columns of 900 rows and the four vectors on the 2 x 2 GiB cluster.
    room = (7.5 * 8 + 32) * 900
    monkeypatch.setattr(_memory, "_STORE_HOLD_FRACTION", room / (2 * 2 * 2**30))
    url = str(tmp_path / "P.zarr")
    res = incomplete_cholesky(da.from_array(X, chunks=300), gamma=0.6, max_rank=40, tol=0,
                              client=client, p_store=url)
    assert zarr.open_array(url, mode="r").chunks[1] == 7
    ref = incomplete_cholesky(X, gamma=0.6, max_rank=40, tol=0)
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P, atol=1e-10, rtol=0)


def test_streamed_chunks_carry_only_their_own_reads(tmp_path):
    """Each pass ships one LazyChunk per task: it must not carry the whole array's graph."""
    from dkicf._chunk import LazyChunk

    data = np.random.default_rng(0).normal(size=(4000, 3))
    zarr.create_array(str(tmp_path / "X.zarr"), data=data, chunks=(100, 3))
    X = da.from_zarr(str(tmp_path / "X.zarr")).rechunk({0: 1000})  # 40 reads -> 4 tasks
    lazy = LazyChunk.row_chunks(X)
    assert len(lazy) == 4
    full = len(dict(X.__dask_graph__()))
    for j, chunk in enumerate(lazy):
        np.testing.assert_array_equal(np.asarray(chunk), data[1000 * j : 1000 * (j + 1)])
        # Its 10 Zarr reads and the merge, not the 40 reads of the array.
        assert len(chunk.graph) <= full // 3


class _Unreadable(_chunk.LazyChunk):
    """Stands for a streamed chunk that must not be read."""

    def __init__(self):
        super().__init__({}, None)

    def read(self):
        raise AssertionError("the chunk was read again")


def test_streamed_update_keeps_the_candidates_rows(tmp_path):
    """A streamed block-greedy pass keeps its top rows of X: fetching candidates reads no X."""
    from dkicf._chunk import LazyChunk, chunk_rows
    from dkicf.pivoting import _top_rows

    data = np.random.default_rng(1).normal(size=(600, 3)).astype(np.float32)
    zarr.create_array(str(tmp_path / "X.zarr"), data=data, chunks=(200, 3))
    (lazy,) = LazyChunk.row_chunks(da.from_zarr(str(tmp_path / "X.zarr")).rechunk({0: 600}))
    kern = GaussianKernel(0.5)
    state = _chunk.chunk_init(data, kern, 0, 10, 0)
    stats = _chunk.chunk_stats(state, 1, data, rows=True)
    block = _chunk.PivotBlock(kern, stats["index"], stats["x_rows"], stats["aux"],
                              stats["p_rows"], np.array([[np.sqrt(stats["values"][0])]]), 0)
    new = _chunk.chunk_update(lazy, state, block, stash=40)
    top = _top_rows(new.e, 41)
    xr, aux, pr, er = chunk_rows(_Unreadable(), new, top)
    np.testing.assert_array_equal(xr, data[top].astype(np.float64))
    np.testing.assert_array_equal(pr, new.P[top, :1])
    np.testing.assert_array_equal(er, new.e[top])
    # A row outside the stash is read from the chunk; without a stash, so is every row.
    outside = np.setdiff1d(np.arange(600), new.stash[0])[:1]
    with pytest.raises(AssertionError, match="read again"):
        chunk_rows(_Unreadable(), new, outside)
    assert _chunk.chunk_update(data, state, block, stash=40).stash is None  # in memory: no copy
    assert pickle.loads(pickle.dumps(new)).stash is None  # scratch: never shipped


def test_streamed_block_greedy_equals_in_memory(client, X, tmp_path):
    zarr.create_array(str(tmp_path / "X.zarr"), data=X, chunks=(150, 3))
    Xz = da.from_zarr(str(tmp_path / "X.zarr"))
    kw = {"gamma": 0.6, "max_rank": 60, "tol": 0, "pivoting": "block-greedy"}
    streamed = incomplete_cholesky(Xz, client=client, persist=False, **kw)
    ref = incomplete_cholesky(X, pivoting="greedy", **{k: v for k, v in kw.items()
                                                       if k != "pivoting"})
    np.testing.assert_array_equal(streamed.pivots, ref.pivots)
    np.testing.assert_allclose(streamed.P.compute(), ref.P, atol=1e-10, rtol=0)
    assert streamed.n_passes < ref.n_passes


def test_stash_share_of_a_chunk():
    from dkicf._backends import _stash_share

    assert _stash_share(0, 500, 1000) == 0  # no candidates asked: nothing kept
    assert _stash_share(100, 10, 1000) == 64 + 4  # small chunk: its 4x share and a margin
    assert _stash_share(100, 500, 1000) == 100  # never more than asked
    assert _stash_share(10_000, 1000, 1_000_000) == 40 + 64
