"""The factorization against Algorithm 1 run on the full kernel matrix."""

import functools
import os

import dask.array as da
import numpy as np
import pytest
from _blas import blas_threads, check_driver_steps_run_one_blas_thread
from _smaps import mapping_of

from dkicf import incomplete_cholesky as _incomplete_cholesky
from dkicf.kernels import GaussianKernel, make_kernel

# Algorithm 1 as the paper writes it, one pass per pivot: these tests check
# its properties (and the dask backend's per-iteration machinery).  The
# default rule, block greedy, is checked against it in test_pivoting.py.
incomplete_cholesky = functools.partial(_incomplete_cholesky, pivoting="greedy")


def reference_icf(K, max_rank, tol=0.0):
    """Algorithm 1 of the paper on an explicit kernel matrix (the test oracle)."""
    n = K.shape[0]
    e = np.diag(K).astype(float).copy()
    selected = np.zeros(n, dtype=bool)
    P = np.zeros((n, 0))
    pivots, traces = [], []
    for _ in range(max_rank):
        if e.sum() <= tol:
            break
        masked = np.where(selected, -np.inf, e)
        t = int(np.argmax(masked))
        nu = np.sqrt(e[t])
        p = (K[:, t] - P @ P[t]) / nu
        P = np.column_stack([P, p])
        e = e - p**2
        e[t] = 0.0
        selected[t] = True
        pivots.append(t)
        traces.append(np.trace(K - P @ P.T))
    return np.array(pivots), P, np.array(traces)


@pytest.fixture
def data(rng):
    return rng.normal(size=(120, 3))


def test_full_rank_reproduces_kernel_matrix(data):
    K = GaussianKernel(0.8).block(data, data)
    res = incomplete_cholesky(data, kernel="gaussian", gamma=0.8, max_rank=120, tol=0)
    np.testing.assert_allclose(res.P @ res.P.T, K, atol=1e-8)
    assert res.trace_errors[-1] < 1e-8


def test_pivots_and_trace_errors_follow_algorithm_1(data):
    K = GaussianKernel(0.8).block(data, data)
    res = incomplete_cholesky(data, kernel="gaussian", gamma=0.8, max_rank=40, tol=0)
    ref_pivots, ref_P, ref_traces = reference_icf(K, 40)
    np.testing.assert_array_equal(res.pivots, ref_pivots)
    np.testing.assert_allclose(res.P, ref_P, atol=1e-10)
    # trace_errors are tr(K - P P^T) from the full matrix, and never increase.
    for r in (1, 5, 17, 40):
        Pr = res.P[:, :r]
        np.testing.assert_allclose(res.trace_errors[r - 1], np.trace(K - Pr @ Pr.T), atol=1e-9)
    np.testing.assert_allclose(res.trace_errors, ref_traces, atol=1e-9)
    assert np.all(np.diff(res.trace_errors) <= 1e-12)
    np.testing.assert_allclose(res.residual, np.diag(K - res.P @ res.P.T), atol=1e-10)


def test_each_pivot_is_the_largest_residual():
    """Every pivot maximises diag(K - P P^T) over the unselected rows, at its iteration."""
    rng = np.random.default_rng(7)
    X = rng.uniform(-1, 1, size=(80, 2))
    K = make_kernel("laplacian", gamma=1.5).block(X, X)
    res = incomplete_cholesky(X, kernel="laplacian", gamma=1.5, max_rank=25, tol=0)
    for i, t in enumerate(res.pivots):
        Pi = res.P[:, :i]
        resid = np.diag(K) - np.einsum("ij,ij->i", Pi, Pi)
        resid[res.pivots[:i]] = -np.inf
        assert t == int(np.argmax(resid))


def test_ties_go_to_the_lowest_row_index():
    # Gaussian diagonal is all ones: the first pivot must be row 0; a duplicate of
    # row 3 placed at rows 3 and 9 ties, and row 3 must come first.
    X = np.array([[0.0, 0], [5, 5], [9, 0], [2, 7], [-4, 1], [8, 8], [1, -6], [-7, -7],
                  [3, 3], [2, 7]])
    res = incomplete_cholesky(X, kernel="gaussian", gamma=1.0, max_rank=10, tol=0)
    assert res.pivots[0] == 0
    assert 9 not in res.pivots.tolist()  # the duplicate of row 3 is never a pivot
    assert 3 in res.pivots.tolist()


def test_linear_kernel_stops_at_the_rank_of_X(rng):
    X = rng.normal(size=(50, 3))
    res = incomplete_cholesky(X, kernel="linear", max_rank=50, tol=0)
    assert res.rank == 3
    assert res.stop_reason == "numerical_rank"
    np.testing.assert_allclose(res.P @ res.P.T, X @ X.T, atol=1e-9)


def test_duplicated_rows_stop_at_the_rank_without_nan(rng):
    base = rng.normal(size=(10, 4)) * 2
    X = np.vstack([base, base[::-1], base[:5]])
    rng.shuffle(X)
    res = incomplete_cholesky(X, kernel="gaussian", gamma=0.5, max_rank=25, tol=0)
    assert res.rank == 10
    assert res.stop_reason == "numerical_rank"
    assert np.isfinite(res.P).all()
    K = GaussianKernel(0.5).block(X, X)
    np.testing.assert_allclose(res.P @ res.P.T, K, atol=1e-8)


def test_tol_stops_at_the_trace_error(data):
    res = incomplete_cholesky(data, gamma=0.8, max_rank=120, tol=1.0)
    assert res.stop_reason == "tol"
    assert res.trace_errors[-1] <= 1.0 < res.trace_errors[-2]


def test_max_rank_larger_than_n_is_capped(rng):
    X = rng.normal(size=(6, 2))
    res = incomplete_cholesky(X, gamma=0.1, max_rank=100, tol=0)
    assert res.rank <= 6


def test_L_is_lower_triangular_and_transform_reproduces_P(data):
    res = incomplete_cholesky(data, gamma=0.8, max_rank=30, tol=0)
    np.testing.assert_array_equal(res.L, res.P[res.pivots])
    np.testing.assert_array_equal(np.triu(res.L, 1), 0)
    np.testing.assert_allclose(res.transform(data), res.P, atol=1e-8)


def test_float32_input_is_computed_in_float64(data):
    X32 = data.astype(np.float32)
    r32 = incomplete_cholesky(X32, gamma=0.8, max_rank=20, tol=0)
    r64 = incomplete_cholesky(X32.astype(np.float64), gamma=0.8, max_rank=20, tol=0)
    assert r32.P.dtype == np.float64
    np.testing.assert_array_equal(r32.pivots, r64.pivots)
    np.testing.assert_allclose(r32.P, r64.P, atol=1e-12)


def test_progress_callback_sees_every_iteration(data):
    seen = []
    incomplete_cholesky(data, gamma=0.8, max_rank=7, tol=0, progress=seen.append)
    assert [p.rank for p in seen] == list(range(1, 8))
    assert all(p.max_rank == 7 for p in seen)


@pytest.mark.parametrize(
    "X, match",
    [
        (np.array([[0.0, np.nan], [1, 2]]), "NaN or infinity: first at row 0"),
        (np.array([[0.0, 1], [1, np.inf]]), "NaN or infinity: first at row 1"),
        (np.zeros(5), "must be 2-D"),
        (np.zeros((2, 2, 2)), "must be 2-D"),
        (np.zeros((0, 3)), "is empty"),
    ],
)
def test_bad_X_is_refused(X, match):
    with pytest.raises(ValueError, match=match):
        incomplete_cholesky(X, gamma=1.0)


@pytest.mark.parametrize("X", [np.array([["a", "b"]]), np.array([[1 + 2j, 0]])])
def test_non_real_dtypes_are_refused(X):
    with pytest.raises(TypeError, match="real"):
        incomplete_cholesky(X, gamma=1.0)


@pytest.mark.parametrize("max_rank", [0, -3])
def test_bad_rank_is_refused(max_rank, data):
    with pytest.raises(ValueError, match=f"max_rank must be >= 1, got {max_rank}"):
        incomplete_cholesky(data, gamma=1.0, max_rank=max_rank)


# ----------------------------------------------------------------------- dask backend


@pytest.mark.parametrize("kernel, params", [("gaussian", {"gamma": 0.4}), ("linear", {}),
                                            ("polynomial", {"gamma": 0.3, "degree": 2})])
def test_dask_backend_matches_numpy(client, rng, kernel, params):
    X = rng.normal(size=(1000, 4))
    ref = incomplete_cholesky(X, kernel=kernel, max_rank=40, tol=0, **params)
    Xd = da.from_array(X, chunks=((100, 333, 17, 550), (4,)))
    res = incomplete_cholesky(Xd, kernel=kernel, max_rank=40, tol=0, client=client, **params)
    assert isinstance(res.P, da.Array)
    assert res.P.chunks[0] == Xd.chunks[0]
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P, atol=1e-10)
    np.testing.assert_allclose(res.trace_errors, ref.trace_errors, atol=1e-9)
    np.testing.assert_allclose(res.residual.compute(), ref.residual, atol=1e-10)
    np.testing.assert_array_equal(res.L, ref.L)


def test_dask_backend_streaming_matches_numpy(client, rng):
    X = rng.normal(size=(600, 3)).astype(np.float32)
    ref = incomplete_cholesky(X, gamma=0.4, max_rank=15, tol=0)
    Xd = da.from_array(X, chunks=(150, 3))
    res = incomplete_cholesky(Xd, gamma=0.4, max_rank=15, tol=0, client=client, persist=False)
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P, atol=1e-10)
    # Each iteration is one pass over X, plus the pass that computes the diagonal.
    assert res.n_passes == 16


def test_dask_median_gamma_matches_numpy(client, rng):
    X = rng.normal(size=(900, 3))
    ref = incomplete_cholesky(X, max_rank=5, random_state=3)
    res = incomplete_cholesky(da.from_array(X, chunks=200), max_rank=5, random_state=3,
                              client=client)
    assert res.kernel == ref.kernel
    np.testing.assert_array_equal(res.pivots, ref.pivots)


def test_dask_nan_names_row_and_chunk(client, rng):
    X = rng.normal(size=(400, 2))
    X[317, 1] = np.nan
    with pytest.raises(ValueError, match=r"first at row 317 \(chunk 3\)"):
        incomplete_cholesky(da.from_array(X, chunks=100), gamma=1.0, client=client)


def test_dask_task_graph_does_not_grow_with_iterations(client, rng):
    """Per-iteration tasks are constant, and the scheduler forgets old iterations."""
    X = da.from_array(rng.normal(size=(400, 2)), chunks=100)
    counts = []

    def count(progress):
        counts.append(len(client.cluster.scheduler.tasks))

    res = incomplete_cholesky(X, gamma=1.0, max_rank=90, tol=0, client=client, progress=count)
    assert res.rank == 90
    # Lineage is cut every few dozen iterations: the scheduler's task count at
    # iteration 90 is no larger than around iteration 30.
    assert max(counts[70:]) <= max(counts[:40]) + 8


def test_dask_rebase_replays_a_lost_state_bit_for_bit(client, rng):
    """A chunk whose state is gone is rebuilt from X and the pivot history exactly."""
    from dkicf import _chunk
    from dkicf._backends import NumpyBackend

    X = rng.normal(size=(300, 3))
    kern = GaussianKernel(0.7)
    backend = NumpyBackend(X, kern, 12, n_threads=1)
    history = _chunk.History(kern, 12, 3)
    summary = backend.summary()
    for i in range(12):
        block = _chunk.PivotBlock(kern, summary["index"][:1], summary["x_rows"][:1],
                                  summary["aux"][:1], summary["p_rows"][:1],
                                  np.array([[np.sqrt(summary["values"][0])]]), i)
        history.append(block)
        summary = backend.apply(block)
    chunk = X[100:200]
    state = _chunk.chunk_rebase(chunk, "no-such-key", history.snapshot(), 100, 12, 1)
    np.testing.assert_array_equal(state.P[:, :12], backend.state.P[100:200, :12])
    np.testing.assert_array_equal(state.e, backend.state.e[100:200])


def _logged_read(block, path):
    with open(path, "a") as fh:
        fh.write("r\n")
    return block


def test_dask_streaming_rereads_X_on_every_pass(client, rng, tmp_path):
    """persist=False: every pass reads the chunks again (data larger than the cluster)."""
    log = tmp_path / "reads.log"
    X = da.from_array(rng.normal(size=(400, 2)), chunks=100).map_blocks(
        _logged_read, path=str(log), dtype=float
    )
    res = incomplete_cholesky(X, gamma=1.0, max_rank=10, tol=0, client=client, persist=False)
    assert res.n_passes == 11
    reads = len(log.read_text().splitlines())
    # 4 chunks per pass (plus the median-free start): at least one read per chunk and pass.
    assert reads >= 4 * res.n_passes


def _bitwise_same(a, b):
    np.testing.assert_array_equal(a.pivots, b.pivots)
    np.testing.assert_array_equal(np.asarray(a.P), np.asarray(b.P))
    np.testing.assert_array_equal(a.trace_errors, b.trace_errors)
    np.testing.assert_array_equal(np.asarray(a.residual), np.asarray(b.residual))


def test_grouping_chunks_into_tasks_changes_no_bit(client, rng, monkeypatch):
    """One task per chunk of X, or chunks grouped per worker thread: the same bits."""
    from dkicf import _backends

    X = rng.normal(size=(1000, 3))
    Xd = da.from_array(X, chunks=((130, 270, 100, 300, 200), (3,)))
    grouped = incomplete_cholesky(Xd, gamma=0.5, max_rank=40, tol=0, client=client)
    assert grouped.P.chunks[0] == Xd.chunks[0]  # P comes back chunked like X
    # ... as views of the groups' buffers: no rechunk, which would copy the rows.
    assert not any("rechunk" in str(k) for k in dict(grouped.P.__dask_graph__()))
    monkeypatch.setattr(_backends, "work_chunks", lambda client, chunks, *a: tuple(chunks))
    single = incomplete_cholesky(Xd, gamma=0.5, max_rank=40, tol=0, client=client)
    _bitwise_same(grouped, single)


def test_work_chunks_follow_threads_and_memory():
    from dkicf._backends import work_chunks

    class FakeClient:
        def __init__(self, workers):
            self.workers = workers

        def scheduler_info(self, n_workers=-1):
            return {"workers": {f"w{i}": w for i, w in enumerate(self.workers)}}

    two = FakeClient([{"nthreads": 1, "memory_limit": 8 << 30}] * 2)
    # Eight equal chunks on two threads: two tasks of four chunks.
    assert work_chunks(two, (100,) * 8, 4, np.float64, 10, None) == (400, 400)
    # As many chunks as threads, or fewer: unchanged.
    assert work_chunks(two, (100, 50), 4, np.float64, 10, None) == (100, 50)
    # Memory: a task holds at most a quarter of a thread's share of memory.
    small = FakeClient([{"nthreads": 1, "memory_limit": 4 << 20}] * 2)
    per_row = 8 * 4 + 8 * 4 + 8 * 10 + 48
    sizes = work_chunks(small, (1000,) * 40, 4, np.float64, 10, None)
    assert sum(sizes) == 40_000 and max(sizes) * per_row <= (4 << 20) / 4
    assert all(s % 1000 == 0 for s in sizes)  # never splits a chunk
    # No memory limits: one group per thread.
    free = FakeClient([{"nthreads": 2, "memory_limit": 0}])
    assert work_chunks(free, (10,) * 9, 4, np.float64, 10, None) == (50, 40)


def test_summaries_by_event_or_by_task_are_the_same(client, rng, monkeypatch):
    """The update tasks' events and the fallback summary tasks give the same fit."""
    from dkicf import _backends

    X = rng.normal(size=(600, 4))
    Xd = da.from_array(X, chunks=150)
    by_event = incomplete_cholesky(Xd, gamma=0.3, max_rank=30, tol=0, client=client)
    calls = []

    def no_events(self, step, futures, grace=1.0):
        calls.append(step)
        return None

    monkeypatch.setattr(_backends._EventInbox, "collect", no_events)
    by_task = incomplete_cholesky(Xd, gamma=0.3, max_rank=30, tol=0, client=client)
    assert calls  # the fallback really ran
    _bitwise_same(by_event, by_task)


def _report_rows(topic, step, chunk):
    from dkicf._services import report_summary

    P = np.asfortranarray(np.arange(12.0).reshape(4, 3) / 7.0)
    report_summary((topic, step, chunk), {"trace": 0.1 + 0.2, "top_rows.p": P,
                                          "top_rows.index": np.arange(4, dtype=np.int64)})
    return True


def test_reports_carry_arrays_bit_for_bit_and_the_scheduler_forgets_them(client):
    """An update's report carries arrays (rows of P, Fortran-ordered) exactly; once the
    reports hold more bytes than allowed, the scheduler's copy of them is dropped while
    the driver keeps what it collected and goes on receiving."""
    from dkicf._services import _EventInbox

    inbox = _EventInbox(client, "dkicf-test-trim")
    try:
        futs = [client.submit(_report_rows, inbox.topic, 1, j, pure=False) for j in range(2)]
        got = inbox.collect(1, futs)
        P = np.arange(12.0).reshape(4, 3) / 7.0
        for part in got:
            assert part["trace"] == 0.1 + 0.2
            np.testing.assert_array_equal(part["top_rows"]["p"], P)
            assert part["top_rows"]["index"].dtype == np.int64
            part["top_rows"]["p"][0, 0] = 1.0  # writeable
        assert len(client.get_events(inbox.topic)) == 2
        inbox.trim(10_000)  # 2 x 128 bytes of arrays: under the limit, kept
        assert len(client.get_events(inbox.topic)) == 2
        inbox.trim(100)
        assert len(client.get_events(inbox.topic)) == 0
        futs = [client.submit(_report_rows, inbox.topic, 2, j, pure=False) for j in range(2)]
        assert len(inbox.collect(2, futs)) == 2  # still subscribed
    finally:
        inbox.close()


def test_a_chunk_of_p_is_a_view_of_its_groups_buffer(rng):
    from dkicf._chunk import chunk_init, chunk_P
    from dkicf.kernels import make_kernel

    state = chunk_init(rng.normal(size=(50, 3)), make_kernel("rbf", gamma=0.5), 0, 8)
    piece = chunk_P(state, 5, 10, 30)
    assert piece.shape == (20, 5) and np.shares_memory(piece, state.P)


def test_factor_buffers_are_writable_fortran_arrays():
    from dkicf._chunk import empty_columns, empty_vector

    for n, cols in [(10, 3), (300_000, 4)]:  # np.empty and the memory map
        P = empty_columns(n, cols)
        assert P.shape == (n, cols) and P.flags.f_contiguous and P.flags.writeable
        P[:, 1] = 2.0
        assert float(P[:, 1].sum()) == 2.0 * n
    e = empty_vector(600_000)
    e[:] = 1.0
    assert e.shape == (600_000,) and float(e.sum()) == 600_000.0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_large_factor_buffers_are_resident_at_once_in_the_system_s_pages():
    """P's large buffers are faulted in by one call, not page by page in the passes, and
    ask for no huge pages (a fresh 2 MiB page can cost 6x more to fault in on a VM)."""
    import platform

    from dkicf._chunk import empty_columns

    if tuple(int(v) for v in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    P = empty_columns(300_000, 4)  # 9.2 MiB
    entry = mapping_of(P.__array_interface__["data"][0])
    assert int(entry["Size"][0]) * 1024 >= P.nbytes
    assert int(entry["Rss"][0]) * 1024 >= P.nbytes  # every page present before any write
    assert "hg" not in entry["VmFlags"]  # no MADV_HUGEPAGE
    lazy = empty_columns(300_000, 4, populate=False)
    address = lazy.__array_interface__["data"][0]
    before = int(mapping_of(address)["Rss"][0]) * 1024  # the kernel may merge adjacent maps
    lazy[...] = 0.0
    assert int(mapping_of(address)["Rss"][0]) * 1024 - before >= lazy.nbytes - 8192


@pytest.mark.parametrize("pivoting", ["greedy", "block-greedy"])
def test_numpy_thread_count_changes_nothing_but_rounding(pivoting, rng, monkeypatch):
    """Rows shared evenly between threads, tasks straddling the residual-sum units: the same
    pivots and, to rounding (BLAS kernels treat a row by its place in a task), the same P."""
    from dkicf import _backends, _chunk

    X = rng.normal(size=(2 * _chunk.ROW_BLOCK + 1234, 3))
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(_backends, "_cpu_count", lambda t=threads: t)
        runs.append(incomplete_cholesky(X, gamma=0.5, max_rank=30, tol=0, pivoting=pivoting))
    for other in runs[1:]:
        np.testing.assert_array_equal(other.pivots, runs[0].pivots)
        np.testing.assert_allclose(other.P, runs[0].P, rtol=0, atol=1e-14)
        np.testing.assert_allclose(other.trace_errors, runs[0].trace_errors, rtol=1e-13)
        np.testing.assert_allclose(other.residual, runs[0].residual, rtol=0, atol=1e-14)


@pytest.mark.parametrize("pool", [False, True])
def test_numpy_passes_run_one_blas_thread_where_it_pays_and_restore_the_limit(
        pool, rng, monkeypatch):
    """With a thread pool every pass runs one BLAS thread per pool thread.  Without one
    (a few thousand rows), block passes run one BLAS thread (BLAS's own threads made
    them many times slower) and one-pivot passes keep BLAS's threads.  The process's
    limit is back afterwards, also when the set-up fails."""
    from threadpoolctl import threadpool_limits

    from dkicf import _backends, _chunk

    monkeypatch.setattr(_backends, "_cpu_count", lambda: 2)
    X = rng.normal(size=(2 * _chunk.ROW_BLOCK + 10 if pool else 600, 3))
    seen = {1: set(), "block": set()}
    real = _chunk.update_rows

    def update_rows(*args, **kw):
        b = args[4].index.shape[0]
        seen[1 if b == 1 else "block"] |= blas_threads()
        return real(*args, **kw)

    monkeypatch.setattr(_chunk, "update_rows", update_rows)
    with threadpool_limits(2, user_api="blas"):
        for rule in ("greedy", "block-greedy"):
            incomplete_cholesky(X, gamma=0.5, max_rank=12, tol=0, pivoting=rule)
            assert blas_threads() == {2}
        assert seen == {1: {1} if pool else {2}, "block": {1}}

        def failing(*a, **k):
            raise MemoryError("no room for P")

        monkeypatch.setattr(_chunk, "chunk_init", failing)
        with pytest.raises(MemoryError, match="no room for P"):
            incomplete_cholesky(X, gamma=0.5, max_rank=8)
        assert blas_threads() == {2}


def test_dask_fit_runs_the_driver_s_products_on_one_blas_thread(client, rng, monkeypatch):
    """The driver's own products (the candidates' small Cholesky) run on one BLAS thread
    while a dask fit runs (BLAS's idle threads spin on cores the workers need); the
    process's threads are back afterwards, also when the fit fails."""
    from dkicf import pivoting

    X = da.from_array(rng.normal(size=(3000, 4)), chunks=1000)
    result = check_driver_steps_run_one_blas_thread(
        monkeypatch, pivoting, "greedy_block",
        lambda: incomplete_cholesky(X, gamma=0.5, max_rank=20, tol=0, client=client,
                                    pivoting="block-greedy"))
    assert result.rank == 20


_IN_PROCESS_AFTER_POOL = """
import sys
import numpy as np
import dask.array as da
from distributed import Client, LocalCluster
from dkicf import incomplete_cholesky

X = np.random.default_rng(3).normal(size=(20_000, 6))
incomplete_cholesky(X, gamma=0.3, max_rank=20, tol=0)  # the numpy backend's thread pool
with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                  dashboard_address=None) as cluster, Client(cluster) as client:
    r = incomplete_cholesky(da.from_array(X, chunks=5_000), gamma=0.3, max_rank=60, tol=0,
                            client=client, pivoting="block-greedy")
    np.save(sys.argv[1], np.asarray(r.P))
"""


def test_in_process_workers_after_a_numpy_fit_compute_as_process_workers(client, tmp_path):
    """In a process where the numpy backend's pool has run, OpenBLAS 0.3.31 ignores limits
    set from other threads; the driver's limit, set from its own thread for the whole fit,
    still holds in-process workers to one BLAS thread: P is bit for bit that of workers in
    processes of their own (16,464 of its 1,200,000 entries differed in the last bit before)."""
    import subprocess
    import sys

    from dkicf import _backends

    if _backends._cpu_count() < 2:
        pytest.skip("the numpy backend runs a thread pool on two cores or more")
    out = tmp_path / "P.npy"
    # A process that started nannies holds their thread variables (OMP_NUM_THREADS=1, ...):
    # the subprocess starts as a user's would, its BLAS with a thread per core.
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    subprocess.run([sys.executable, "-c", _IN_PROCESS_AFTER_POOL, str(out)], check=True,
                   timeout=120, capture_output=True, env=env)
    X = np.random.default_rng(3).normal(size=(20_000, 6))
    ref = incomplete_cholesky(da.from_array(X, chunks=5_000), gamma=0.3, max_rank=60, tol=0,
                              client=client, pivoting="block-greedy")
    np.testing.assert_array_equal(np.load(out), np.asarray(ref.P))


def test_even_bounds_cover_the_rows_in_equal_shares():
    from dkicf._backends import _even_bounds

    for n, rows, threads in [(60000, 8192, 2), (17618, 32768, 3), (10**6, 8192, 2)]:
        bounds = _even_bounds(n, rows, threads)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(lo % 256 == 0 for lo, _ in bounds)
        sizes = [hi - lo for lo, hi in bounds]
        assert len(sizes) % threads == 0 and max(sizes) <= rows + 256
        assert max(sizes) - min(sizes) <= 256
    assert _even_bounds(5, 8192, 4) == [(0, 5)]  # fewer rows than the alignment: one task
    assert _even_bounds(100, 32768, 2) == [(0, 100)]


def _spilled_keys(dask_worker=None) -> int:
    return len(getattr(dask_worker.data, "slow", ()))


def test_states_sharing_p_are_weighed_once(client):
    """Dask weighs a new chunk state while the update's input is still held.
    The two share P: counting P in each made the workers spill states to
    disk (pickling all of P) once P took more than ~30% of their memory.
    Here P is ~35% of each 2 GiB worker."""
    n, capacity = 1_000_000, 180  # 500,000 rows x 180 columns = 720 MB per worker
    kind = da.arange(n, chunks=n // 2) % 3  # three distinct points: rank 3
    X = da.stack([(kind == 1).astype(float), 2.0 * (kind == 2)], axis=1)
    res = incomplete_cholesky(X, gamma=1.0, max_rank=capacity, client=client)
    assert res.rank == 3
    assert sum(client.run(_spilled_keys).values()) == 0


def test_consecutive_states_weigh_their_distinct_buffers(rng):
    """The weights dask sees for an update's input and output add up to the
    memory the two hold together (their buffers are shared, not copied)."""
    from dask.sizeof import sizeof

    from dkicf._chunk import PivotBlock, chunk_init, chunk_update

    x = rng.normal(size=(5000, 3))
    kernel = GaussianKernel(0.5)
    states = [chunk_init(x, kernel, 0, 40)]
    for i in range(3):
        st = states[-1]
        t = int(np.argmax(st.e))
        block = PivotBlock(kernel=kernel, index=np.array([t]), rows=x[t : t + 1],
                           aux=None if st.aux is None else st.aux[t : t + 1],
                           U=st.P[t : t + 1, :i].copy(), L=np.array([[np.sqrt(st.e[t])]]),
                           rank=i)
        states.append(chunk_update(x, st, block))
    for a, b in zip(states[1:], states[2:]):
        buffers = {}
        for arr in (a.P, a.e, a.spare, a.aux, b.P, b.e, b.spare, b.aux):
            if arr is not None:
                base = arr if arr.base is None else arr.base
                buffers[id(base)] = base.nbytes
        held = sum(buffers.values())
        assert held == a.P.nbytes + 2 * a.e.nbytes + a.aux.nbytes  # P once, two residuals
        assert abs(sizeof(a) + sizeof(b) - held) < 0.01 * held


def test_states_must_fit_below_dask_spilling_threshold(client, monkeypatch):
    """A chunk whose state would cross the fraction of memory at which dask
    spills (pickling P to disk on every pass, since the states share it) or
    pauses the worker is refused before any work, naming the threshold."""
    import dask

    from dkicf import _memory
    from dkicf._memory import check_worker_memory, usable_memory_fraction

    # The workers' own memory, fixed: measured, it grows over a long session
    # of tests on the shared cluster, and the sizes below leave room for 0.2 GiB.
    monkeypatch.setattr(_memory, "_baseline_of", lambda found: 200 * 2**20)

    assert usable_memory_fraction() == 0.6  # dask's default target
    # 900,000 rows x 180 columns: 1.37 GB of a 2 GiB worker (64%).
    args = ((900_000, 100_000), 2, np.float64, 180, None, False)
    with pytest.raises(ValueError, match=r"row chunk 0 .*more than 60% of the smallest "
                       r"worker's memory limit of 2.00 GiB, at which dask starts spilling"):
        check_worker_memory(client, *args)
    with dask.config.set({"distributed.worker.memory.target": False,
                          "distributed.worker.memory.spill": 0.85,
                          "distributed.worker.memory.pause": False}):
        assert usable_memory_fraction() == 0.85
        check_worker_memory(client, *args)
    # P over the whole cluster: the advice is to keep it in Zarr.
    with pytest.raises(ValueError, match=r"more than 60% of the cluster's 4.00 GiB.*p_store="):
        check_worker_memory(client, (250_000,) * 4, 2, np.float64, 350, None, False)


def _incoming(dask_worker=None) -> list:
    """On a worker: the keys it fetched from other workers, in order."""
    return [str(k) for entry in dask_worker.transfer_incoming_log for k in entry["keys"]]


@pytest.mark.parametrize("pivoting", ["greedy", "block-greedy"])
def test_persisted_X_and_P_never_move_between_workers(client, rng, pivoting):
    """X held on the workers (several chunks each): the fit groups chunks only where they
    are held, so the workers' transfer logs show no chunk of X or state (P) moving."""
    from distributed import wait

    X = rng.normal(size=(4000, 3))
    Xd = client.persist(da.from_array(X, chunks=500))  # 8 chunks on 2 workers
    wait(Xd)
    assert len({w for ws in client.who_has(Xd).values() for w in ws}) == 2  # spread over both
    before = {w: len(keys) for w, keys in client.run(_incoming).items()}
    res = _incomplete_cholesky(Xd, gamma=0.5, max_rank=40, tol=0, client=client,
                               pivoting=pivoting)
    moved = [k for w, keys in client.run(_incoming).items() for k in keys[before.get(w, 0):]]
    names = [Xd.name, "icf-x-", "icf-init-", "icf-update-", "icf-rebase-"]
    assert [k for k in moved if any(name in k for name in names)] == []
    ref = _incomplete_cholesky(X, gamma=0.5, max_rank=40, tol=0, pivoting=pivoting)
    np.testing.assert_array_equal(res.pivots, ref.pivots)


def test_persist_rows_holds_one_run_per_worker_and_a_pass_runs_one_task_each(
        client, rng, caplog):
    """persist_rows: the same rows, one run of consecutive chunks per worker, no worker
    restriction left on the chunks; a fit on it groups each run into one task (two
    update tasks a pass on two workers), moves nothing, and has the numpy pivots.
    dask's own persist of the same chunks holds them in more runs, which the fit logs."""
    import logging

    from distributed import wait

    from dkicf import persist_rows
    from dkicf._services import _holders

    X = rng.normal(size=(4000, 3))
    lazy = da.from_array(X, chunks=(250, 1))  # 16 row chunks, column chunks merged
    Xd = persist_rows(lazy, client=client)
    holders = _holders(client, Xd)
    assert Xd.chunks == ((250,) * 16, (3,)) and holders is not None
    assert holders == sorted(holders) and len(set(holders)) == 2
    assert holders.count(holders[0]) == 8  # rows shared in proportion to threads
    restricted = client.run_on_scheduler(
        lambda keys, dask_scheduler=None: [dask_scheduler.tasks[k].worker_restrictions
                                           for k in keys],
        keys=[k for row in Xd.__dask_keys__() for k in row])
    assert not any(restricted)
    tasks = []
    real = client.map

    def spy(func, *args, key=None, **kwargs):
        tasks.extend(k for k in (key or []) if "icf-update-" in k)
        return real(func, *args, key=key, **kwargs)

    before = {w: len(keys) for w, keys in client.run(_incoming).items()}
    with caplog.at_level(logging.INFO, logger="dkicf._backends"), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "map", spy)
        res = _incomplete_cholesky(Xd, gamma=0.5, max_rank=30, tol=0, client=client)
    assert "runs of consecutive" not in caplog.text
    moved = [k for w, keys in client.run(_incoming).items() for k in keys[before.get(w, 0):]]
    assert [k for k in moved if any(n in k for n in (Xd.name, "icf-x-", "icf-update-"))] == []
    steps = {k.rsplit("-", 2)[1] for k in tasks}
    assert len(tasks) == 2 * len(steps)
    np.testing.assert_array_equal(
        res.pivots, _incomplete_cholesky(X, gamma=0.5, max_rank=30, tol=0).pivots)
    np.testing.assert_array_equal(Xd.compute(), X)  # copies chunks to one worker
    # Chunks now held twice are assigned to their consecutive homes, not piled on one.
    assert any(len(ws) == 2 for ws in client.who_has(Xd).values())
    assert _holders(client, Xd) == holders
    # Chunks held alternately, as dask's own persist often leaves them: the fit says how
    # to do better.
    lazy = da.from_array(X, chunks=(500, 3))
    workers = sorted(client.nthreads())
    blocks = list(lazy.to_delayed().ravel())
    futs = [client.compute(b, workers=[workers[j % 2]]) for j, b in enumerate(blocks)]
    wait(futs)
    rebuild, args = lazy.__dask_postpersist__()
    spread = rebuild({f.key: f for f in futs}, *args)
    assert _holders(client, spread) == [workers[j % 2] for j in range(8)]
    with caplog.at_level(logging.INFO, logger="dkicf._backends"):
        _incomplete_cholesky(spread, gamma=0.5, max_rank=5, tol=0, client=client)
    assert "8 row chunks are held on 2 workers in 8 runs" in caplog.text
    assert "dkicf.persist_rows(X)" in caplog.text


def test_persist_rows_refuses_what_it_cannot_hold(client):
    from dkicf import persist_rows

    with pytest.raises(TypeError, match="dask.array.from_array"):
        persist_rows(np.zeros((10, 2)), client=client)
    with pytest.raises(ValueError, match="2-D"):
        persist_rows(da.zeros(10, chunks=5), client=client)


@pytest.mark.parametrize("held", [True, False])
def test_set_up_tasks_are_pinned_where_x_is_held(client, rng, monkeypatch, held):
    """Where X is held on the workers the set-up tasks may run only there (work stealing
    would move the chunk); otherwise their worker is a preference."""
    from distributed import wait

    X = rng.normal(size=(2000, 3))
    # Keys of their own: the other case's held chunks may not yet be released.
    Xd = da.from_array(X, chunks=500, name=f"x-held-{held}")
    if held:
        Xd = client.persist(Xd)
        wait(Xd)
    asked = {}
    real = client.submit

    def spy(*args, **kwargs):
        asked[kwargs.get("key", "")] = kwargs.get("allow_other_workers")
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "submit", spy)
    res = _incomplete_cholesky(Xd, gamma=0.5, max_rank=20, tol=0, client=client)
    set_up = {k: v for k, v in asked.items() if "icf-init-" in k or "icf-x-" in k}
    assert set_up and set(set_up.values()) == ({False} if held else {True})
    np.testing.assert_array_equal(
        res.pivots, _incomplete_cholesky(X, gamma=0.5, max_rank=20, tol=0).pivots)


def test_work_chunks_group_only_neighbours_held_together():
    from dkicf._backends import work_chunks

    class FakeClient:
        def scheduler_info(self, n_workers=-1):
            return {"workers": {"a": {"nthreads": 1, "memory_limit": 0},
                                "b": {"nthreads": 2, "memory_limit": 0}}}

    homes = ["a", "a", "b", "b", "b", "b", "a", "a"]
    sizes = work_chunks(FakeClient(), (100,) * 8, 4, np.float64, 10, None, homes=homes)
    # a: two runs of 200 rows, one thread: one group each; b: 400 rows, two threads.
    assert sizes == (200, 200, 200, 200)


def test_parallel_set_up_equals_the_serial_one(rng):
    """The numpy backend's set-up split over threads: the same state as one call."""
    from concurrent.futures import ThreadPoolExecutor

    from dkicf import _chunk
    from dkicf._backends import _even_bounds

    X = rng.normal(size=(3 * _chunk.ROW_BLOCK + 17, 4))
    kernel = make_kernel("gaussian", gamma=0.3)
    bounds = _even_bounds(X.shape[0], 5000, 3)
    with ThreadPoolExecutor(3) as pool:
        def run(func):
            return [f.result() for f in [pool.submit(func, lo, hi) for lo, hi in bounds]]

        par = _chunk.chunk_init(X, kernel, 7, 12, run=run)
        one = _chunk.chunk_init(X, kernel, 7, 12)
        np.testing.assert_array_equal(par.e, one.e)
        np.testing.assert_array_equal(par.aux, one.aux)
        assert par.max_sqnorm == one.max_sqnorm and par.P.shape == (X.shape[0], 12)
        assert par.P.flags.f_contiguous and not par.P.any()  # touched, zero
        Xbad = X.copy()
        Xbad[4 * 5000 // 3 + 1, 2] = np.nan
        with pytest.raises(ValueError, match=f"first at row {4 * 5000 // 3 + 1}"):
            _chunk.chunk_init(Xbad, kernel, 0, 12, run=run)


def test_numpy_candidate_statistics_by_thread_range_equal_one_chunk(rng, monkeypatch):
    """Block-greedy's candidate statistics computed per thread's rows (the numpy backend):
    the same candidates and, to rounding, the same column sums as over all rows at once."""
    from dkicf import _backends, _chunk, pivoting

    monkeypatch.setattr(_backends, "_cpu_count", lambda: 3)
    X = rng.normal(size=(2 * _chunk.ROW_BLOCK + 500, 3))
    kernel = make_kernel("gaussian", gamma=0.5)
    backend = _backends.NumpyBackend(X, kernel, 20)
    try:
        st = backend.state
        st.e[:] = np.round(rng.random(X.shape[0]), 2)  # many ties
        st.P[:, :5] = rng.normal(size=(X.shape[0], 5))
        st.rank = 5
        request = pivoting.CandidateRequest("top", 300)
        colsq, cand = pivoting.gather_candidates(backend, 1, 5, request)
        assert len(backend.map_chunks(pivoting.chunk_block_stats, 1, 5, request)) == 3
    finally:
        backend.close()
    np.testing.assert_allclose(colsq, (st.P[:, 1:5] ** 2).sum(axis=0), rtol=1e-13)
    order = np.lexsort((np.arange(X.shape[0]), -st.e))
    np.testing.assert_array_equal(cand.index, order[:300])
    assert cand.bound == st.e[order[300]]


def _task_modules_state() -> dict:
    """On a worker: whether the background import ran, and the task modules present."""
    import sys
    import threading

    for t in threading.enumerate():
        if t.name == "dkicf-imports":
            t.join(60)
    from dkicf._memory import _TASK_MODULES

    return {name: name in sys.modules for name in _TASK_MODULES}


def test_workers_of_a_local_cluster_import_the_task_modules_before_any_fit():
    """The preload imports what a fit's tasks import, in the background: a first fit's
    set-up does not wait for it (a fresh cluster: nothing else ran there)."""
    from dkicf import local_cluster
    from dkicf._memory import _TASK_MODULES

    fresh = local_cluster(1, 1, memory_limit="1GiB")
    try:
        found = fresh.run(_task_modules_state)
    finally:
        cluster = fresh.cluster
        fresh.close()
        cluster.close()
    assert list(found.values()) == [dict.fromkeys(_TASK_MODULES, True)]


@pytest.mark.parametrize("b", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("rank", [0, 5])
@pytest.mark.parametrize("kernel", ["gaussian", "polynomial", "laplacian"])
@pytest.mark.parametrize("d", [5, 40])
def test_a_block_update_adds_the_columns_of_the_kernel_matrix_s_cholesky_factor(
    b, rank, kernel, d, rng
):
    """A pass of ``b`` pivots after ``rank`` columns writes the next ``b`` columns of
    ``K[:, T] chol(K[T, T])^-T`` (T the pivots so far) and subtracts their squares from the
    residual, whichever product form the block's size and the features select."""
    from scipy.linalg import cholesky, solve_triangular

    from dkicf import _chunk
    from dkicf._factor import PivotBlock

    n = 300
    X = rng.normal(size=(n, d))
    kern = make_kernel(kernel, gamma=0.5 / d, degree=2)
    K = kern.block(X, X)
    T = rng.choice(n, size=rank + b, replace=False)
    C = cholesky(K[np.ix_(T, T)], lower=True)
    want = solve_triangular(C, K[:, T].T, lower=True).T  # K[:, T] C^-T
    P = np.zeros((n, rank + b + 2), order="F")
    P[:, :rank] = want[:, :rank]
    e = np.diag(K) - np.einsum("ij,ij->i", P[:, :rank], P[:, :rank])
    aux = kern.prepare(X)
    new = T[rank:]
    U = P[new, :rank].copy()
    L = cholesky(K[np.ix_(new, new)] - U @ U.T, lower=True)
    block = PivotBlock(kernel=kern, index=new, rows=X[new], aux=None if aux is None else aux[new],
                       U=U, L=L, rank=rank)
    _chunk.update_rows(X, P, e, aux, block, 0, n)
    np.testing.assert_allclose(P[:, rank:rank + b], want[:, rank:], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(P[:, rank + b:], 0.0)
    left = np.diag(K) - np.einsum("ij,ij->i", want, want)
    np.testing.assert_allclose(e, np.maximum(left, 0.0), rtol=0, atol=1e-12)


def test_overlapping_tasks_of_one_process_share_one_blas_limit(monkeypatch):
    """In-process workers run tasks in threads of one process: when one task leaves its
    BLAS limit while another still computes, the other keeps one BLAS thread (some products
    round differently with more), and the last to leave restores the process's threads.
    BLAS is a stand-in here that records the thread count it is set to."""
    import threading

    from dkicf import _services

    class FakeBlas:  # the process's BLAS as threadpoolctl's controller sets it
        threads = 4

        def limit(self, limits, user_api):
            assert user_api == "blas"
            old, FakeBlas.threads = FakeBlas.threads, limits
            return type("Limiter", (), {"restore_original_limits":
                                        lambda _: setattr(FakeBlas, "threads", old)})()

    monkeypatch.setattr(_services, "_CONTROLLER", FakeBlas())
    first_in, second_in, first_out, seen = (threading.Event(), threading.Event(),
                                            threading.Event(), {})

    def first_task():  # enters first, leaves while the second still computes
        with _services.threadpool_limits(1):
            first_in.set()
            second_in.wait(10)
            seen["both inside"] = FakeBlas.threads
        first_out.set()

    def second_task():
        first_in.wait(10)
        with _services.threadpool_limits(1):
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = FakeBlas.threads

    tasks = [threading.Thread(target=first_task), threading.Thread(target=second_task)]
    for t in tasks:
        t.start()
    for t in tasks:
        t.join(10)
    seen["all left"] = FakeBlas.threads
    held = _services.threadpool_limits(1)  # held across calls, as the numpy backend's pool
    with _services.threadpool_limits(1):
        pass
    seen["still held"] = FakeBlas.threads
    with _services.threadpool_limits(2):  # another limit while one is held: its own
        seen["another limit"] = FakeBlas.threads
    seen["back to the held one"] = FakeBlas.threads
    held.restore_original_limits()
    held.restore_original_limits()  # a second release changes nothing
    seen["released"] = FakeBlas.threads
    assert seen == {"both inside": 1, "after the first left": 1, "all left": 4,
                    "still held": 1, "another limit": 2, "back to the held one": 1,
                    "released": 4}
