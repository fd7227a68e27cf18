"""Block pivot rules: block-greedy against the sequential greedy rule, RPCholesky's sampling."""

import dask.array as da
import numpy as np
import pytest

from dkicf import incomplete_cholesky
from dkicf.kernels import LinearKernel, make_kernel
from dkicf.pivoting import (
    CandidateRequest,
    Candidates,
    block_traces,
    chunk_block_stats,
    greedy_block,
    rpcholesky_key,
    same_request,
)


def _grid(k):
    g = np.arange(float(k))
    return np.array([(a, b) for a in g for b in g])


def _duplicated(rng):
    base = rng.normal(size=(40, 4)) * 2
    X = np.vstack([base, base[::-1], base[:20]])
    return X[rng.permutation(X.shape[0])]


DATASETS = {
    # name: (X builder, kernel parameters, max_rank)
    "gaussian-random": (lambda rng: rng.normal(size=(500, 3)), {"gamma": 0.7}, 200),
    # A regular grid: every first pivot ties with all rows, later residuals tie
    # between mirror-image points (exactly, in floating point too).
    "gaussian-grid": (lambda rng: _grid(12), {"gamma": 0.3}, 144),
    # Each row two or three times: exact ties until one copy is a pivot.
    "duplicated-rows": (_duplicated, {"gamma": 0.5}, 100),
    # Linear kernel with d < n: rank 6, ends on the numerical-rank rule.
    "linear-rank-deficient": (lambda rng: rng.normal(size=(300, 6)), {"kernel": "linear"}, 300),
    "polynomial": (
        lambda rng: rng.normal(size=(300, 3)),
        {"kernel": "polynomial", "gamma": 0.5, "degree": 2},
        300,
    ),
}


@pytest.mark.parametrize("name", list(DATASETS))
def test_block_greedy_picks_the_sequential_pivots(name, rng):
    build, params, max_rank = DATASETS[name]
    X = build(rng)
    seq = incomplete_cholesky(X, max_rank=max_rank, tol=0, pivoting="greedy", **params)
    blk = incomplete_cholesky(X, max_rank=max_rank, tol=0, pivoting="block-greedy", **params)
    np.testing.assert_array_equal(blk.pivots, seq.pivots)
    assert blk.stop_reason == seq.stop_reason
    np.testing.assert_allclose(blk.trace_errors, seq.trace_errors, rtol=0, atol=1e-10)
    np.testing.assert_allclose(blk.P, seq.P, rtol=0, atol=1e-8)
    np.testing.assert_allclose(blk.residual, seq.residual, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(np.triu(blk.L, 1), 0)
    # One pass for the diagonal, then one per block.
    assert blk.n_passes == 1 + len(blk.info["block_sizes"])
    assert sum(blk.info["block_sizes"]) == blk.rank


def test_block_greedy_needs_far_fewer_passes(rng):
    X = rng.normal(size=(2000, 4))
    seq = incomplete_cholesky(X, gamma=0.5, max_rank=200, tol=0, pivoting="greedy")
    blk = incomplete_cholesky(X, gamma=0.5, max_rank=200, tol=0, pivoting="block-greedy")
    np.testing.assert_array_equal(blk.pivots, seq.pivots)
    assert seq.n_passes == 201
    assert blk.n_passes <= 25


def test_tol_met_inside_a_block_stops_where_the_sequential_loop_does(rng):
    X = rng.normal(size=(600, 3))
    seq_full = incomplete_cholesky(X, gamma=0.6, max_rank=150, tol=0, pivoting="greedy")
    blk_full = incomplete_cholesky(X, gamma=0.6, max_rank=150, tol=0, pivoting="block-greedy")
    ends = set(np.cumsum(blk_full.info["block_sizes"]).tolist())
    # A rank strictly inside a block of the untruncated run.
    k = next(r for r in range(60, 150) if r not in ends and r - 1 not in ends)
    tol = 0.5 * (seq_full.trace_errors[k - 1] + seq_full.trace_errors[k - 2])
    seq = incomplete_cholesky(X, gamma=0.6, max_rank=150, tol=tol, pivoting="greedy")
    blk = incomplete_cholesky(X, gamma=0.6, max_rank=150, tol=tol, pivoting="block-greedy")
    assert seq.stop_reason == blk.stop_reason == "tol"
    assert blk.rank == seq.rank == k
    np.testing.assert_array_equal(blk.pivots, seq.pivots)
    np.testing.assert_allclose(blk.trace_errors, seq.trace_errors, rtol=0, atol=1e-10)
    assert blk.trace_errors[-1] <= tol < blk.trace_errors[-2]
    # The residual belongs to the truncated factor, not to the whole block.
    np.testing.assert_allclose(blk.residual, seq.residual, rtol=0, atol=1e-10)
    assert blk.P.shape == (600, k)


def test_max_rank_is_exact_and_progress_is_per_block(rng):
    X = rng.normal(size=(400, 3))
    seen = []
    res = incomplete_cholesky(X, gamma=0.5, max_rank=77, tol=0, pivoting="block-greedy",
                              block_size=16, progress=seen.append)
    assert res.rank == 77 and res.stop_reason == "max_rank"
    assert max(res.info["block_sizes"]) <= 16
    ranks = [p.rank for p in seen]
    assert ranks == np.cumsum(res.info["block_sizes"]).tolist()
    assert [p.n_passes for p in seen] == list(range(2, res.n_passes + 1))


def test_block_delta_trades_exactness_for_passes(rng):
    X = rng.normal(size=(800, 3))
    exact = incomplete_cholesky(X, gamma=0.5, max_rank=150, tol=0, pivoting="block-greedy")
    loose = incomplete_cholesky(X, gamma=0.5, max_rank=150, tol=0, pivoting="block-greedy",
                                block_delta=0.5)
    assert loose.n_passes <= exact.n_passes
    assert np.all(np.diff(loose.trace_errors) <= 1e-12)
    assert loose.trace_errors[-1] <= 1.5 * exact.trace_errors[-1]


@pytest.mark.parametrize("pivoting", ["greedy", "block-greedy", "rpcholesky"])
def test_full_rank_reproduces_the_kernel_matrix(pivoting, rng):
    X = rng.normal(size=(60, 3))
    K = make_kernel("gaussian", gamma=0.8).block(X, X)
    res = incomplete_cholesky(X, gamma=0.8, max_rank=60, tol=0, pivoting=pivoting)
    np.testing.assert_allclose(res.P @ res.P.T, K, atol=1e-8)
    np.testing.assert_allclose(res.residual, np.diag(K - res.P @ res.P.T), atol=1e-10)
    assert np.all(np.diff(res.trace_errors) <= 1e-12)


# ----------------------------------------------------------------------- small driver step


def _orthogonal_candidates(values, index, bound):
    """Candidates whose Schur complement is diagonal (orthogonal rows, linear kernel)."""
    m = len(values)
    rows = np.eye(m) * np.sqrt(np.asarray(values, dtype=float))[:, None]
    return Candidates(
        index=np.array(index), values=np.array(values, dtype=float), rows=rows,
        aux=None, U=np.zeros((m, 0)), bound=bound,
    )


def test_a_candidate_tied_with_the_bound_ends_the_block():
    # After the first pivot the next candidate's residual (2) equals the
    # largest residual outside the candidates: a row outside could be the
    # sequential rule's choice, so the block stops.
    cand = _orthogonal_candidates([3.0, 2.0], [5, 9], bound=2.0)
    choice = greedy_block(LinearKernel(), cand, b_max=10, rank_tol=0.0, margin=1e-12)
    assert choice.order.tolist() == [0] and choice.reason == "bound"
    cand = _orthogonal_candidates([3.0, 2.0, 1.0], [5, 9, 2], bound=1.5)
    choice = greedy_block(LinearKernel(), cand, b_max=10, rank_tol=0.0, margin=1e-12)
    assert choice.order.tolist() == [0, 1] and choice.reason == "bound"
    np.testing.assert_allclose(choice.L, np.diag(np.sqrt([3.0, 2.0])))


def test_exact_ties_among_candidates_go_to_the_lowest_row_index():
    cand = _orthogonal_candidates([3.0, 2.0, 2.0], [7, 9, 4], bound=1.0)
    choice = greedy_block(LinearKernel(), cand, b_max=10, rank_tol=0.0, margin=1e-12)
    assert choice.order.tolist() == [0, 2, 1]
    # A near tie (within the rounding margin, not equal) is left to the next pass.
    cand = _orthogonal_candidates([3.0, 2.0, 2.0 - 1e-14], [7, 9, 4], bound=1.0)
    choice = greedy_block(LinearKernel(), cand, b_max=10, rank_tol=0.0, margin=1e-12)
    assert choice.order.tolist() == [0] and choice.reason == "ambiguous"


def test_block_traces_add_back_the_later_columns():
    np.testing.assert_allclose(block_traces(1.0, np.array([4.0, 2.0, 0.5])), [3.5, 1.5, 1.0])


# ----------------------------------------------------------------------- RPCholesky


class _State:
    def __init__(self, e, P=None):
        self.e = np.asarray(e, dtype=float)
        self.P = np.zeros((self.e.shape[0], 0)) if P is None else P


def _race(e, chunks, count, draw=0, key=None):
    key = rpcholesky_key(3) if key is None else key
    req = CandidateRequest("race", count, key, draw)
    parts, lo = [], 0
    for c in chunks:
        parts.append(chunk_block_stats(None, _State(e[lo : lo + c]), lo, 0, 0, req))
        lo += c
    t = np.concatenate([p["key"] for p in parts])
    g = np.concatenate([p["index"] for p in parts])
    order = np.lexsort((g, t))[:count]
    return t[order], g[order]


def test_race_draws_do_not_depend_on_the_chunking():
    e = np.random.default_rng(0).uniform(0, 1, size=1000) ** 4
    e[::7] = 0.0
    t1, g1 = _race(e, [1000], 300)
    t2, g2 = _race(e, [3, 500, 1, 496], 300)
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(t1, t2)
    assert not np.isin(g1, np.flatnonzero(e == 0)).any()
    # A dominant row is drawn many times (draws are with replacement).
    e2 = np.full(50, 1e-3)
    e2[17] = 10.0
    _, g = _race(e2, [20, 30], 100)
    assert np.sum(g == 17) > 80


def test_race_draws_are_proportional_to_the_residual():
    e = np.array([1.0, 2.0, 3.0, 4.0])
    counts = np.zeros(4)
    for draw in range(40):
        _, g = _race(e, [2, 2], 500, draw=draw)
        counts += np.bincount(g, minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), e / e.sum(), atol=0.015)


def test_rpcholesky_is_reproducible_and_seeded(rng):
    X = rng.normal(size=(500, 3))
    a = incomplete_cholesky(X, gamma=0.5, max_rank=60, tol=0, pivoting="rpcholesky",
                            random_state=7)
    b = incomplete_cholesky(X, gamma=0.5, max_rank=60, tol=0, pivoting="rpcholesky",
                            random_state=7)
    c = incomplete_cholesky(X, gamma=0.5, max_rank=60, tol=0, pivoting="rpcholesky",
                            random_state=8)
    np.testing.assert_array_equal(a.pivots, b.pivots)
    assert not np.array_equal(a.pivots, c.pivots)
    assert a.rank == 60 and a.n_passes < 20
    assert len(set(a.pivots.tolist())) == 60


# ----------------------------------------------------------------------- dask


def test_block_greedy_on_dask_with_uneven_chunks(client, rng):
    X = rng.normal(size=(800, 4))
    seq = incomplete_cholesky(X, gamma=0.4, max_rank=80, tol=0, pivoting="greedy")
    Xd = da.from_array(X, chunks=((100, 133, 17, 550), (4,)))
    res = incomplete_cholesky(Xd, gamma=0.4, max_rank=80, tol=0, client=client,
                              pivoting="block-greedy", persist=False)
    np.testing.assert_array_equal(res.pivots, seq.pivots)
    np.testing.assert_allclose(res.trace_errors, seq.trace_errors, rtol=0, atol=1e-10)
    np.testing.assert_allclose(res.P.compute(), seq.P, rtol=0, atol=1e-8)
    assert res.n_passes == 1 + len(res.info["block_sizes"]) < 20


@pytest.fixture
def map_names(monkeypatch):
    """The names of the task maps the dask backend submits, in order."""
    from dkicf._backends import DaskBackend

    names = []
    real_map = DaskBackend._map

    def spy(self, name, func, *args, each):
        names.append(name)
        return real_map(self, name, func, *args, each=each)

    monkeypatch.setattr(DaskBackend, "_map", spy)
    return names


@pytest.mark.parametrize("pivoting", ["block-greedy", "rpcholesky"])
def test_dask_takes_the_numpy_blocks_and_one_round_trip_fewer_per_pass(
    pivoting, client, rng, map_names
):
    """The block sizes do not depend on the backend, and the update tasks return the next
    candidates.  The set-up's summary brings block greedy's first candidates too, so its
    statistics are never mapped over the chunks; RPCholesky's first request depends on
    the rank threshold, which that summary gives, so they are mapped for its first pass."""
    maps = map_names
    X = rng.normal(size=(6000, 5))
    kw = {"gamma": 0.3, "max_rank": 150, "tol": 0, "pivoting": pivoting, "random_state": 3}
    ref = incomplete_cholesky(X, **kw)
    res = incomplete_cholesky(da.from_array(X, chunks=(3000, 5)), client=client, **kw)
    assert res.info["block_sizes"] == ref.info["block_sizes"]
    assert len(res.info["block_sizes"]) >= 2
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P, rtol=0, atol=1e-10)
    assert maps.count("update") == len(res.info["block_sizes"])
    mapped = [m for m in maps if m.startswith("chunk_block_stats")]
    assert mapped == ([] if pivoting == "block-greedy" else ["chunk_block_stats-1"])
    assert maps.count("stats") == 1


def test_the_pass_that_fills_the_capacity_asks_for_no_candidates(client, rng, monkeypatch):
    """No block follows the one that reaches max_rank: its update tasks send its column
    sums, not the next candidates and their rows, and the fit is the numpy backend's."""
    from dkicf._backends import DaskBackend

    asked = []
    real = DaskBackend.apply

    def spy(self, block, history, m=1, stash=0, prefetch=None):
        asked.append((block.rank + block.index.shape[0],
                      None if prefetch is None else prefetch[2].count, stash))
        return real(self, block, history, m, stash=stash, prefetch=prefetch)

    monkeypatch.setattr(DaskBackend, "apply", spy)
    X = rng.normal(size=(6000, 5))
    kw = {"gamma": 0.3, "max_rank": 150, "tol": 0}
    res = incomplete_cholesky(da.from_array(X, chunks=(3000, 5)), client=client, **kw)
    np.testing.assert_array_equal(res.pivots, incomplete_cholesky(X, **kw).pivots)
    assert res.stop_reason == "max_rank" and asked[-1][0] == 150
    assert asked[-1][1:] == (0, 0)  # the column sums alone, nothing stashed
    assert any(count for _, count, _ in asked[:-1])  # earlier passes did send candidates


def test_block_size_memory_rule_counts_a_slice_of_rows_unless_p_is_in_zarr():
    """In-memory updates work a slice at a time into P's full-rank buffer, so a dask chunk
    of half a million rows caps blocks as the numpy backend does; a Zarr-backed chunk
    allocates a new tail for all its rows."""
    from types import SimpleNamespace

    from dkicf._backends import NumpyBackend
    from dkicf.icf import _rows_per_task

    rows = NumpyBackend._BLOCK_ROWS
    in_memory = SimpleNamespace(chunks=(500_000, 499_000), store=None)
    in_zarr = SimpleNamespace(chunks=(500_000, 499_000), store=object())
    assert _rows_per_task(in_memory, 999_000) == rows
    assert _rows_per_task(in_zarr, 999_000) == 500_000
    # The numpy backend (one chunk, P in memory).
    assert _rows_per_task(SimpleNamespace(chunks=(10**6,), store=None), 10**6) == rows
    assert _rows_per_task(SimpleNamespace(chunks=(1000,), store=None), 1000) == 1000


def test_large_candidate_requests_are_mapped_not_sent_as_events(
    client, rng, monkeypatch, map_names
):
    """Above the event budget the next candidates are fetched by a map, with the same result."""
    import dkicf._backends as backends

    X = rng.normal(size=(3000, 4))
    kw = {"gamma": 0.3, "max_rank": 60, "tol": 0}
    ref = incomplete_cholesky(X, **kw)
    maps = map_names
    monkeypatch.setattr(backends, "_PREFETCH_ENTRIES", 8)
    res = incomplete_cholesky(da.from_array(X, chunks=(1000, 4)), client=client, **kw)
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    stats = [m for m in maps if m.startswith("chunk_block_stats")]
    # One map before each pass that needs candidates or the column sums of the block
    # before it (a block of several pivots; after one pivot the pass's trace is the
    # trace error).  The last block's sums come with its pass: it reaches max_rank, so
    # no candidates are asked after it, and the sums alone fit the budget.
    blocks = res.info["blocks"]
    assert res.stop_reason == "max_rank" and blocks[-1][1] > 1
    wanted = sum(why != "single" or (j and blocks[j - 1][1] > 1)
                 for j, (_, _, why) in enumerate(blocks))
    assert blocks[0][1] == 1 and blocks[1][2] == "single"  # a pass that needs no map
    assert len(stats) == wanted


@pytest.mark.parametrize("pivoting", ["greedy", "block-greedy"])
def test_a_fit_leaves_no_summaries_in_the_scheduler_event_log(pivoting, client, rng):
    """The update tasks report as dask events; the scheduler would keep the last
    1,000 of every topic for as long as it runs."""
    X = da.from_array(rng.normal(size=(2000, 3)), chunks=(500, 3))
    res = incomplete_cholesky(X, gamma=0.5, max_rank=30, tol=0, pivoting=pivoting,
                              client=client)
    assert res.rank == 30
    left = [t for t in client.get_events() if str(t).startswith("dkicf-icf-")]
    assert left == []


def test_a_prefetched_request_serves_only_the_same_request():
    key = np.array([1, 2], dtype=np.uint64)
    race = CandidateRequest("race", 40, key, 3, floor=1e-9)
    assert same_request(race, CandidateRequest("race", 40, key.copy(), 3, floor=1e-9))
    assert not same_request(race, CandidateRequest("race", 40, key, 4, floor=1e-9))
    assert not same_request(race, CandidateRequest("race", 40, key + 1, 3, floor=1e-9))
    assert not same_request(race, CandidateRequest("top", 40))
    assert same_request(CandidateRequest("top", 40), CandidateRequest("top", 40))
    assert not same_request(CandidateRequest("top", 40), CandidateRequest("top", 41))


def test_rpcholesky_does_not_depend_on_chunking_or_backend(client, rng):
    X = rng.normal(size=(900, 3))
    kw = {"gamma": 0.5, "max_rank": 80, "tol": 0, "pivoting": "rpcholesky", "random_state": 11}
    ref = incomplete_cholesky(X, **kw)
    for chunks in [(300, 3), ((50, 700, 150), (3,))]:
        res = incomplete_cholesky(da.from_array(X, chunks=chunks), client=client, **kw)
        np.testing.assert_array_equal(res.pivots, ref.pivots)
        np.testing.assert_allclose(res.trace_errors, ref.trace_errors, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"pivoting": "random"}, ValueError,
         "pivoting must be one of 'greedy', 'block-greedy', 'rpcholesky', got 'random'"),
        ({"pivoting": "greedy", "block_size": 8}, ValueError,
         "block_size=8 has no effect with pivoting='greedy'"),
        ({"pivoting": "block-greedy", "block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"pivoting": "block-greedy", "block_size": 2.5}, TypeError, "block_size must be an int"),
        ({"pivoting": "block-greedy", "block_delta": 1.0}, ValueError, r"in \[0, 1\)"),
        ({"pivoting": "rpcholesky", "block_delta": 0.1}, ValueError,
         "applies to pivoting='block-greedy' only"),
    ],
)
def test_bad_pivoting_parameters_are_refused(kwargs, error, match, rng):
    with pytest.raises(error, match=match):
        incomplete_cholesky(rng.normal(size=(10, 2)), gamma=1.0, **kwargs)


def test_driver_panels_on_threads_and_sized_from_the_last_block_choose_the_same(rng):
    """Splitting the driver's Schur-complement panels over threads, or sizing them from
    the last block, changes neither the pivots nor (beyond rounding) their factor."""
    from concurrent.futures import ThreadPoolExecutor

    X = rng.normal(size=(3000, 60))
    kernel = make_kernel("gaussian", gamma=0.01)
    cand = Candidates(index=np.arange(3000), values=np.ones(3000), rows=X,
                      aux=kernel.prepare(X), U=np.zeros((3000, 0)), bound=0.6)
    args = {"b_max": 200, "rank_tol": 1e-12, "margin": 1e-10}
    plain = greedy_block(kernel, cand, **args)
    assert plain.order.shape[0] > 20  # a real block, over several panels
    with ThreadPoolExecutor(2) as pool:
        for panel in (None, 5, plain.order.shape[0], 150):
            other = greedy_block(kernel, cand, panel=panel, pool=pool, n_threads=2, **args)
            np.testing.assert_array_equal(other.order, plain.order)
            assert other.reason == plain.reason
            np.testing.assert_allclose(other.L, plain.L, rtol=0, atol=1e-12)



def test_candidates_grow_with_the_blocks_but_not_for_a_smaller_last_block():
    from dkicf.pivoting import BlockSizer

    sizer = BlockSizer("block-greedy", capacity=500, n=60000, d=10, rows_per_task=8192,
                       block_size=None)
    assert sizer.count(0) == 1875  # n / 32
    sizer.update(150, 1875, 131, "bound")  # 1 in 16 accepted, 219 still to add: grow
    assert sizer.count(281) == 3750
    sizer.update(281, 3750, 300, "bound")  # the 19 left fit in a block like this one
    assert sizer.count(481) == 3750


class _RangesBackend:
    """Chunks as row ranges of one state; the first map sends each chunk's largest
    residuals cut at ``limit`` (as dask update tasks do), later maps in full."""

    def __init__(self, state, bounds, limit):
        from dataclasses import replace

        self.state, self.bounds, self.limit, self.maps = state, bounds, limit, []
        self._replace = replace

    def map_chunks(self, func, lo, hi, request):
        from dkicf._chunk import RowRange

        if not self.maps:
            request = self._replace(request, limit=self.limit)
        self.maps.append(request.limit)
        return [func(None, RowRange(self.state, a, b), a, lo, hi, request)
                for a, b in self.bounds]

    def rows(self, index):
        st = self.state
        return st.P[index, :0], None, st.P[index, :st.rank], st.e[index].copy()


@pytest.mark.parametrize("spread", [True, False])
def test_candidates_cut_per_chunk_are_asked_again_only_when_needed(spread, rng):
    """Chunks that send twice their share of the largest residuals give the full request's
    candidates; when one chunk holds more of them than it sent, the map is made again."""
    from types import SimpleNamespace

    from dkicf.pivoting import gather_candidates

    n, count = 4000, 300
    e = np.round(rng.random(n), 3)  # ties too
    if not spread:
        e = np.sort(e)  # the largest residuals all in the last chunk
    state = SimpleNamespace(e=e, P=np.asfortranarray(rng.normal(size=(n, 3))), rank=3)
    bounds = [(k * 1000, (k + 1) * 1000) for k in range(4)]
    backend = _RangesBackend(state, bounds, limit=2 * (count + 1) // 4 + 64)
    colsq, cand = gather_candidates(backend, 0, 3, CandidateRequest("top", count))
    order = np.lexsort((np.arange(n), -e))
    np.testing.assert_array_equal(cand.index, order[:count])
    assert cand.bound == e[order[count]]
    np.testing.assert_allclose(colsq, (state.P**2).sum(axis=0), rtol=1e-13)
    assert backend.maps == ([214] if spread else [214, 0])


def test_blocks_that_stay_at_one_pivot_fall_back_to_greedy_passes(rng, monkeypatch):
    """A near-identity kernel: blocks end at one pivot, so block greedy then takes the
    largest residual alone for a while (no candidates), with the sequential pivots."""
    from sklearn.datasets import load_digits

    from dkicf import pivoting

    X = load_digits().data.astype(float)
    kw = {"gamma": 2.0**-6, "max_rank": 300, "tol": 0}  # 296 blocks for 300 pivots
    seq = incomplete_cholesky(X, pivoting="greedy", **kw)
    calls = []
    real = pivoting.chunk_block_stats
    monkeypatch.setattr(pivoting, "chunk_block_stats",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    blk = incomplete_cholesky(X, **kw)
    np.testing.assert_array_equal(blk.pivots, seq.pivots)
    np.testing.assert_allclose(blk.trace_errors, seq.trace_errors, rtol=0, atol=1e-10)
    whys = [why for _, _, why in blk.info["blocks"]]
    assert whys.count("single") > 0.8 * len(whys)
    assert len(calls) < 0.2 * blk.n_passes  # candidates asked for by the tried blocks only


def test_single_passes_follow_the_blocks_and_the_cost_of_a_pass():
    from dkicf.pivoting import _DRIVER_ROWS, _RUN_CAP, _single_pass

    one, big, single = (64, 1, "bound"), (64, 9, "bound"), (0, 1, "single")
    small_n = 2000  # a pass costs less than the candidates: runs of up to 16 * 16 passes
    assert not _single_pass([], small_n, 64)
    assert not _single_pass([big], small_n, 64)
    assert _single_pass([one], small_n, 64)  # one block of one: one single pass
    assert not _single_pass([one, single], small_n, 64)  # then a block again
    assert _single_pass([one, single, one, single], small_n, 64)  # two in a row: two
    assert not _single_pass([one, single, one, single, single], small_n, 64)
    assert not _single_pass([one, single, big], small_n, 64)  # a block grew: blocks
    assert not _single_pass([(64, 1, "cap")], small_n, 64)  # capped by the caller
    # Runs double, up to a cap set by the cost ratio.
    history = [one, single, one, single, single, one, single, single, single]
    assert _single_pass(history, small_n, 64)  # three blocks of one: four single passes
    cap = _RUN_CAP * ((64 + _DRIVER_ROWS) // small_n)
    assert cap == 256
    history = [one] * 10 + [single] * (cap - 1)
    assert _single_pass(history, small_n, 64)
    assert not _single_pass(history + [single], small_n, 64)
    # Large n: a pass costs more than the candidates' work, never a single pass.
    assert not _single_pass([one] * 10, 10**6, 4096)


@pytest.mark.parametrize("n, d", [
    (2000, 4),
    # Wide rows: fewer candidates fit as the rank grows, and at rank 205 the
    # cap of a run of single passes falls from 16 to 0, inside a run.
    (33768, 33350),
])
def test_the_rule_s_single_pass_answer_kept_pass_by_pass_equals_the_whole_history_s(
        rng, n, d):
    from dkicf.pivoting import BlockGreedy, _run_cap, _single_pass

    kinds = [(64, 1, "bound"), (64, 1, "ambiguous"), (64, 1, "cap"), (64, 5, "bound"),
             (0, 1, "single")]
    for trial in range(20):
        rule = BlockGreedy(capacity=10**6, n=n, d=d)
        rule.size_blocks(n)
        if d > 4:
            assert _run_cap(n, rule.sizer.count(200)) == 16 > _run_cap(n, rule.sizer.count(210))
        blocks = []
        for step in range(300):
            if trial % 2 and step % 37 == 0:
                blocks = list(blocks)  # a resumed fit: the same history, a new list
            want = _single_pass(blocks, n, rule.sizer.count(len(blocks)))
            assert rule.single_pass(blocks, n, len(blocks)) == want
            assert rule.single_pass(blocks, n, len(blocks)) == want  # asked twice
            if want or rng.random() < 0.2:
                blocks.append(kinds[-1])
            else:
                blocks.append(kinds[rng.choice(4, p=[0.6, 0.2, 0.05, 0.15])])


def test_a_block_that_ends_at_its_first_pivot_is_found_without_the_small_cholesky(
    rng, monkeypatch
):
    """The first-pivot test of greedy_block gives the block of the full construction."""
    from dkicf import pivoting
    from dkicf.kernels import GaussianKernel

    kernel = GaussianKernel(gamma=0.5)
    lone, small = pivoting._lone_pivot, pivoting._SmallCholesky
    built = []
    monkeypatch.setattr(pivoting, "_SmallCholesky",
                        lambda *a, **k: built.append(1) or small(*a, **k))
    seen = {"full": 0}
    for trial in range(240):
        scale = (0.3, 1.0, 20.0)[trial % 3]
        m, rank = int(rng.integers(1, 40)), int(rng.integers(0, 6))
        rows = rng.normal(size=(m, 3)) * scale
        U = rng.normal(size=(m, rank)) * 0.1
        if trial % 4 == 0:
            U[:3] = U[0]  # tied residuals
        elif trial % 4 == 1:
            U[1:4] = U[0] + rng.normal(size=U[1:4].shape) * 1e-6  # near ties
        values = 1.0 - (U**2).sum(axis=1)  # the Gaussian kernel's residual diagonal
        order = np.lexsort((np.arange(m), -values))
        rows, U, values = rows[order], U[order], values[order]
        bound = values[-1] * float(rng.choice([0.0, 0.5, 0.99]))
        cand = pivoting.Candidates(np.arange(m) * 3, values, rows, None, U, bound=bound)
        kw = dict(b_max=int(rng.choice([1, 2, 8])), rank_tol=float(rng.choice([1e-12, 0.6])),
                  margin=float(rng.choice([1e-12, 1e-3])), trace=float(rng.uniform(1, 50)),
                  tol=float(rng.choice([0.0, 10.0])), delta=float(rng.choice([0.0, 0.0, 0.3])))
        built.clear()
        fast = pivoting.greedy_block(kernel, cand, **kw)
        monkeypatch.setattr(pivoting, "_lone_pivot", lambda *a: None)
        slow = pivoting.greedy_block(kernel, cand, **kw)
        monkeypatch.setattr(pivoting, "_lone_pivot", lone)
        assert len(built) == 1 + (slow.order.shape[0] > 1)  # the fast one only for a block
        np.testing.assert_array_equal(fast.order, slow.order)
        assert fast.reason == slow.reason
        np.testing.assert_allclose(fast.L, slow.L, rtol=1e-14, atol=0)
        key = slow.reason if slow.order.shape[0] == 1 else "full"
        seen[key] = seen.get(key, 0) + 1
    # Every way a block ends at one pivot was tried, and blocks of several.
    assert set(seen) == {"full", "cap", "tol", "exhausted", "rank", "bound", "ambiguous"}, seen


def test_a_chunk_cut_inside_a_tie_at_its_largest_residual_sends_the_tie():
    """Candidate statistics limited to a few rows: a chunk whose limit falls inside a tie at
    its largest residual sends every wanted row, exactly what an unlimited request gives;
    a chunk cut below its largest value stays cut."""
    from dataclasses import replace

    from dkicf._candidates import CandidateRequest, chunk_block_stats

    class _State:
        def __init__(self, e):
            self.e, self.P = e, np.zeros((e.shape[0], 0))

    flat = np.ones(500)
    flat[[3, 70, 250]] = 0.25  # rows near a pivot; the rest tie at 1.0
    falling = np.linspace(1.0, 0.5, 500)
    request = CandidateRequest(rule="top", count=99)
    for e, tied in [(flat, True), (falling, False)]:
        full = chunk_block_stats(None, _State(e), 1000, 0, 0, request)
        cut = chunk_block_stats(None, _State(e), 1000, 0, 0, replace(request, limit=30))
        if tied:
            assert not cut["cut"]
            np.testing.assert_array_equal(cut["index"], full["index"])
            np.testing.assert_array_equal(cut["key"], full["key"])
            assert cut["index"][:3].tolist() == [1000, 1001, 1002]
        else:
            assert cut["cut"] and cut["index"].shape == (30,)
            np.testing.assert_array_equal(cut["index"], full["index"][:30])


def _separated_blobs(rng, n: int = 8000) -> np.ndarray:
    """Four tight blobs 100 apart: the Gaussian kernel between them is exactly 0, so the
    residuals of the blobs without a pivot stay tied at exactly 1."""
    centres = np.array([[0.0, 0.0], [100.0, 0.0], [0.0, 100.0], [100.0, 100.0]])
    return centres[np.arange(n) % 4] + 0.3 * rng.normal(size=(n, 2))


def test_tied_candidates_cost_no_second_ask_and_only_missing_rows_are_fetched(
        client, rng, monkeypatch):
    """Chunks held interleaved (so each sends only its share of the largest residuals) and
    residuals tied at 1: the candidates come without asking the chunks again, the rows
    the pass did not bring are fetched alone, and the pivots are the numpy backend's."""
    from distributed import wait

    from dkicf import _backends, pivoting

    X = _separated_blobs(rng)
    lazy = da.from_array(X, chunks=(500, 2))
    workers = sorted(client.nthreads())
    futs = [client.compute(b, workers=[workers[j % 2]])
            for j, b in enumerate(lazy.to_delayed().ravel())]
    wait(futs)
    rebuild, args = lazy.__dask_postpersist__()
    Xd = rebuild({f.key: f for f in futs}, *args)
    complete, fetched = [], []
    real_complete, real_fetch = pivoting._complete_top, _backends.DaskBackend._fetch_rows

    def spy_complete(*a):
        complete.append(real_complete(*a))
        return complete[-1]

    def spy_fetch(self, index):
        fetched.append(index.shape[0])
        return real_fetch(self, index)

    monkeypatch.setattr(pivoting, "_complete_top", spy_complete)
    monkeypatch.setattr(_backends.DaskBackend, "_fetch_rows", spy_fetch)
    kw = {"gamma": 0.5, "max_rank": 60, "tol": 0}
    res = incomplete_cholesky(Xd, client=client, **kw)
    np.testing.assert_array_equal(res.pivots, incomplete_cholesky(X, **kw).pivots)
    blocks = [size for size, _, why in res.info["blocks"] if why != "single"]
    assert len(blocks) >= 3
    assert len(complete) >= len(blocks) and all(complete)  # no chunk asked again
    # Fewer rows fetched than candidates, the first block's too: the rest came with the
    # set-up's summary or with the pass.
    assert fetched and all(0 < f < blocks[0] for f in fetched), (fetched, blocks)


@pytest.mark.parametrize("carried", ["report", "tasks"])
def test_candidate_rows_come_with_the_pass(client, rng, monkeypatch, map_names, carried):
    """With X held on the workers, each pass also fetches its chunks' largest residuals'
    rows, and the driver takes the candidates' rows from them: no task after the choice,
    and the same fit.  The rows come in the update's report (the set-up's summary's
    result), or from tasks that follow it where they are too large for it."""
    from dkicf import _backends
    from dkicf._backends import DaskBackend

    if carried == "tasks":
        monkeypatch.setattr(_backends, "_REPORT_ROW_BYTES", 0)

    X = rng.normal(size=(6000, 5))
    kw = {"gamma": 0.3, "max_rank": 150, "tol": 0}
    ref = incomplete_cholesky(X, **kw)
    served = []
    real = DaskBackend._rows_from

    def spy(self, *args):
        found = real(self, *args)
        served.append(found is not None)
        return found

    monkeypatch.setattr(DaskBackend, "_rows_from", spy)
    res = incomplete_cholesky(da.from_array(X, chunks=(1500, 5)), client=client, **kw)
    np.testing.assert_array_equal(res.pivots, ref.pivots)
    np.testing.assert_allclose(res.P.compute(), ref.P, rtol=0, atol=1e-10)
    tried = [why for _, _, why in res.info["blocks"] if why != "single"]
    assert len(tried) >= 3
    if carried == "tasks":
        # One map beside the set-up's summary, and one after each pass before a block.
        assert len(tried) <= map_names.count("top-rows") <= map_names.count("update") + 1
    else:
        assert "top-rows" not in map_names
    # The first block's candidate rows come with the set-up's summary, every later
    # block's with a pass.
    assert served == [True] * len(tried)


def test_a_state_selects_its_largest_residuals_once_per_pass(rng, monkeypatch):
    """The update's candidate statistics and the rows sent with the pass share one
    selection; a state updated in place (the numpy backend's) selects again."""
    from dkicf import _candidates, _chunk

    e = rng.random(5000)
    state = _chunk.ChunkState(np.zeros((5000, 4)), e, None, rank=2, offset=100, n_passes=2)
    calls = []
    real = _candidates._top_rows
    monkeypatch.setattr(_candidates, "_top_rows", lambda e, m: calls.append(m) or real(e, m))
    stats = _candidates.chunk_block_stats(None, state, 100, 2, 2,
                                          _candidates.CandidateRequest("top", 40))
    x = rng.normal(size=(5000, 3))
    index, *_ = _chunk.chunk_top_rows(x, state, 41)
    assert calls == [41]  # one selection for both
    np.testing.assert_array_equal(index, stats["index"])
    np.testing.assert_array_equal(index - 100, np.argsort(-e, kind="stable")[:41])
    e[:] = rng.random(5000)  # the next pass, in place
    state.n_passes += 1
    index, *_ = _chunk.chunk_top_rows(x, state, 41)
    assert calls == [41, 41]
    np.testing.assert_array_equal(index - 100, np.argsort(-e, kind="stable")[:41])


def test_the_largest_residuals_are_those_of_a_full_sort_also_with_many_ties(rng):
    """Ties to the lowest index, as the sequential argmax; residuals still flat (many rows
    at the largest value, the first passes of a Gaussian kernel) take the fast way."""
    from dkicf._candidates import _top_rows, rows_reaching_top

    for trial in range(2000):
        n, m = int(rng.integers(1, 80)), int(rng.integers(1, 90))
        if trial % 3 == 0:
            e = np.ones(n)
            e[rng.random(n) < 0.3] = 0.5
        elif trial % 3 == 1:
            e = rng.choice([0.0, 0.25, 0.5, 1.0], size=n)
        else:
            e = rng.random(n)
        full = np.lexsort((np.arange(n), -e))  # decreasing, ties to the lowest index
        np.testing.assert_array_equal(_top_rows(e, m), full[:m])
        cut = e[full[min(m, n) - 1]]
        np.testing.assert_array_equal(rows_reaching_top(e, m),
                                      np.arange(n) if m >= n else np.flatnonzero(e >= cut))
