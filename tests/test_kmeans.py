"""Tests of dkicf.kmeans: exact recovery, a numpy Lloyd reference, numpy/dask agreement."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _blas import check_driver_steps_run_one_blas_thread
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.metrics import adjusted_rand_score

from dkicf._cluster import all_workers
from dkicf.kmeans import KMeansProgress, KMeansResult, assign, kmeans

ALGORITHMS = ("minibatch", "lloyd", "minibatch-lloyd")
UNEVEN = (113, 250, 7, 330)  # 700 rows in 4 uneven chunks


@pytest.fixture(scope="module")
def km_client():
    from dkicf.deploy import local_cluster

    client = local_cluster(2, 1)
    yield client
    cluster = client.cluster
    client.close()
    cluster.close()


def blobs(sizes=(60, 80, 100, 70), spread=1.0, seed=0):
    """Points within ``spread`` (per coordinate) of hand-placed centres 10 apart, shuffled."""
    centres = np.array([[5.0, 5.0, 5.0], [15.0, 5.0, 5.0], [5.0, 15.0, 5.0], [5.0, 5.0, 15.0]])
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(len(sizes)), sizes)
    X = centres[y] + rng.uniform(-spread, spread, size=(y.size, 3))
    order = rng.permutation(y.size)
    return X[order], y[order]


def overlapping(n=700, seed=1):
    """Gaussian data with no clear clusters: many rows near decision boundaries."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)) * np.array([3.0, 2.0, 1.0])


def sq_inertia(X, centers, labels):
    return float(((X - centers[labels]) ** 2).sum())


def numpy_lloyd(X, C, max_iter):
    """Textbook Lloyd that stops when the centres stop moving."""
    it = 0
    while it < max_iter:
        it += 1
        labels = ((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
        assert np.unique(labels).size == C.shape[0], "reference hit an empty cluster"
        new = np.array([X[labels == j].mean(axis=0) for j in range(C.shape[0])])
        shift = ((new - C) ** 2).sum()
        C = new
        if shift == 0:
            break
    labels = ((X[:, None, :] - C[None, :, :]) ** 2).sum(axis=2).argmin(axis=1)
    return C, labels, it


def as_dask(X, chunks):
    import dask.array as da

    return da.from_array(X, chunks=(chunks, X.shape[1]))


def from_futures(client, X, chunks):
    import dask.array as da

    bounds = np.cumsum((0,) + tuple(chunks))
    # hash=False: fresh keys, not ones a previous test has just released.
    parts = client.scatter([X[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])], hash=False)
    return da.concatenate(
        [da.from_delayed(f, shape=(hi - lo, X.shape[1]), dtype=X.dtype)
         for f, lo, hi in zip(parts, bounds[:-1], bounds[1:])]
    )


# --------------------------------------------------------------------------- numpy input


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_recovers_separated_blobs(algorithm):
    X, y = blobs()
    res = kmeans(X, 4, algorithm=algorithm, batch_size=64, random_state=0)
    assert isinstance(res, KMeansResult)
    assert isinstance(res.labels, np.ndarray)
    assert res.labels.dtype == np.int64 and res.labels.shape == (X.shape[0],)
    assert res.cluster_centers.shape == (4, 3) and res.cluster_centers.dtype == np.float64
    assert adjusted_rand_score(y, res.labels) == 1.0
    means = np.array([X[res.labels == j].mean(axis=0) for j in range(4)])
    # Lloyd (alone or after mini-batch) ends at the cluster means; mini-batch near them.
    assert_allclose(res.cluster_centers, means, atol=0.3 if algorithm == "minibatch" else 1e-9)
    assert res.inertia == min(res.inertias) and len(res.inertias) == 5  # the default n_init


@pytest.mark.parametrize("max_iter", [2, 100])
def test_lloyd_matches_numpy_reference(max_iter):
    X = overlapping(300)
    init = X[:6].copy()
    ref_centers, ref_labels, ref_iter = numpy_lloyd(X, init, max_iter)
    res = kmeans(X, 6, algorithm="lloyd", init=init, tol=0.0, max_iter=max_iter)
    assert ref_iter == max_iter or ref_iter > 3  # the comparison covers several iterations
    assert res.n_iter == ref_iter
    assert res.stop_reason == ("max_iter" if max_iter == 2 else "converged")
    assert_allclose(res.cluster_centers, ref_centers, rtol=1e-12, atol=1e-12)
    assert_array_equal(res.labels, ref_labels)
    assert_allclose(res.inertia, sq_inertia(X, ref_centers, ref_labels), rtol=1e-12)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_inertia_is_sum_of_squared_distances(algorithm):
    X = overlapping(400)
    res = kmeans(X, 5, algorithm=algorithm, batch_size=50, random_state=3)
    d2 = ((X[:, None, :] - res.cluster_centers[None, :, :]) ** 2).sum(axis=2)
    assert_array_equal(res.labels, d2.argmin(axis=1))
    assert_allclose(res.inertia, d2.min(axis=1).sum(), rtol=1e-12)
    labels, inertia = assign(X, res.cluster_centers)
    assert_array_equal(labels, res.labels)
    assert inertia == res.inertia


def test_assign_toy_case():
    labels, inertia = assign(np.array([[0.0], [2.0], [10.0]]), np.array([[0.0], [10.0]]))
    assert labels.tolist() == [0, 0, 1]
    assert inertia == 4.0  # squared: 2**2, not 2


def test_tol_is_relative_to_the_data_scale():
    X = overlapping(600)
    kw = dict(n_clusters=4, batch_size=40, tol=1e-2, max_no_improvement=None, random_state=5)
    small = kmeans(X, **kw)
    large = kmeans(X * 1024.0, **kw)  # a power of two: every operation scales exactly
    assert small.stop_reason == large.stop_reason == "tol"
    assert small.n_iter == large.n_iter
    assert_array_equal(small.labels, large.labels)
    assert_allclose(large.cluster_centers, small.cluster_centers * 1024.0, rtol=1e-12)


def test_max_iter_counts_steps_and_progress_reports_each():
    X = overlapping(300)
    seen: list[KMeansProgress] = []
    res = kmeans(
        X, 3, algorithm="minibatch", batch_size=20, n_init=2, max_iter=7, tol=0.0,
        max_no_improvement=None, random_state=0, progress=seen.append,
    )
    assert res.n_iter == 7 and res.n_steps_total == 14 and res.stop_reason == "max_iter"
    assert [(p.restart, p.step) for p in seen] == [(r, s) for r in range(2) for s in range(1, 8)]
    assert all(p.max_iter == 7 and p.n_init == 2 and p.inertia > 0 for p in seen)


def test_same_random_state_same_result_and_seeds_differ():
    X = overlapping(300)
    a = kmeans(X, 4, batch_size=30, random_state=7)
    b = kmeans(X, 4, batch_size=30, random_state=np.random.default_rng(7))
    assert_array_equal(a.cluster_centers, b.cluster_centers)
    assert_array_equal(a.labels, b.labels)
    assert a.inertias == b.inertias
    # Runs start from different initialisations: mini-batch alone ends where they lead.
    alone = kmeans(X, 4, algorithm="minibatch", batch_size=30, random_state=7)
    assert len(set(alone.inertias)) == 5


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_cluster_is_reseeded(algorithm):
    X, y = blobs(sizes=(100, 100, 100, 100))
    X, y = X[y < 3], y[y < 3]
    far = np.array([[1000.0, 1000.0, 1000.0]])
    init = np.concatenate([X[y == 0][:1], X[y == 1][:1], far])
    res = kmeans(X, 3, algorithm=algorithm, init=init, batch_size=32, random_state=0)
    c = res.cluster_centers
    assert np.isfinite(c).all()
    assert not (c == 0).all(axis=1).any()
    assert np.abs(c).max() < 100  # the far centre moved into the data
    assert (np.bincount(res.labels, minlength=3) > 0).all()
    assert adjusted_rand_score(y, res.labels) == 1.0


def test_more_clusters_than_distinct_rows_is_refused():
    X = np.repeat(np.array([[0.0, 0.0], [1.0, 1.0]]), 10, axis=0)
    with pytest.raises(ValueError, match=r"n_clusters=3 is larger than the number of "
                       r"distinct rows of P \(2\): pass n_clusters <= 2\."):
        kmeans(X, 3, algorithm="lloyd", n_init=1, random_state=0)
    res = kmeans(X, 2, n_init=1, random_state=0)
    assert res.inertia == 0.0


X5 = np.arange(10.0).reshape(5, 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n_clusters=8), ValueError, r"n_samples=5 should be >= n_clusters=8\."),
        (dict(n_clusters=0), ValueError, r"n_clusters must be >= 1, got 0\."),
        (dict(n_clusters=2.5), TypeError, r"n_clusters must be an integer, got 2\.5"),
        (dict(batch_size=0), ValueError, r"batch_size must be >= 1, got 0\."),
        (dict(n_init=0), ValueError, r"n_init must be >= 1, got 0\."),
        (dict(max_iter=0), ValueError, r"max_iter must be >= 1, got 0\."),
        (dict(tol=-1e-3), ValueError, r"tol must be a finite number >= 0, got -0\.001\."),
        (dict(tol=float("nan")), ValueError, r"tol must be a finite number >= 0, got nan\."),
        (
            dict(algorithm="elkan"),
            ValueError,
            r"algorithm='elkan' is not supported; choose one of 'minibatch-lloyd', "
            r"'minibatch', 'lloyd'\.",
        ),
        (dict(max_no_improvement=0), ValueError, r"max_no_improvement must be >= 1, got 0\."),
        (dict(init_size=1), ValueError, r"init_size=1 should be >= n_clusters=2\."),
        (dict(init="random"), ValueError, r"init='random' is not supported"),
        (
            dict(init=np.zeros((3, 2))),
            ValueError,
            r"init has shape \(3, 2\); it should be \(2, 2\)\.",
        ),
        (dict(progress=3), TypeError, r"progress must be callable or None, got int\."),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"n_clusters": 2, **kwargs}
    with pytest.raises(error, match=match):
        kmeans(X5, **kwargs)


def test_bad_input_arrays():
    with pytest.raises(ValueError, match=r"P must be 2-D"):
        kmeans(np.zeros(5), 2)
    X = X5.copy()
    X[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"P contains NaN or infinity: first at row 3"):
        kmeans(X, 2)
    bad = r"centers has shape \(2, 3\); it should be \(n_clusters, 2\)\."
    with pytest.raises(ValueError, match=bad):
        assign(X5, np.zeros((2, 3)))


# --------------------------------------------------------------------------- dask input


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_numpy_and_dask_agree(km_client, algorithm):
    import dask.array as da

    X = overlapping(sum(UNEVEN))
    kw = dict(algorithm=algorithm, batch_size=50, max_iter=30, random_state=11)
    ref = kmeans(X, 5, **kw)
    res = kmeans(as_dask(X, UNEVEN), 5, client=km_client, **kw)
    assert isinstance(res.labels, da.Array)
    assert res.labels.chunks == (UNEVEN,) and res.labels.dtype == np.int64
    assert_array_equal(res.labels.compute(), ref.labels)
    assert_allclose(res.cluster_centers, ref.cluster_centers, rtol=1e-12, atol=1e-12)
    assert_allclose(res.inertias, ref.inertias, rtol=1e-12)
    assert (res.n_iter, res.n_steps_total) == (ref.n_iter, ref.n_steps_total)
    labels, inertia = assign(as_dask(X, UNEVEN), res.cluster_centers, client=km_client)
    assert_array_equal(labels.compute(), ref.labels)
    assert_allclose(inertia, ref.inertia, rtol=1e-12)


@pytest.mark.parametrize("on_dask", [False, True])
def test_the_driver_s_products_run_on_one_blas_thread(km_client, on_dask, monkeypatch):
    """Mini-batch steps in the driver run on one BLAS thread (BLAS's idle threads would
    spin on the cores of the workers or of the pool's threads); the process's threads
    are back afterwards, also when the fit fails."""
    from dkicf import _kmeans_runs

    X = overlapping(sum(UNEVEN))
    P = as_dask(X, UNEVEN) if on_dask else X
    check_driver_steps_run_one_blas_thread(
        monkeypatch, _kmeans_runs, "_minibatch_step",
        lambda: kmeans(P, 5, batch_size=50, max_iter=5, random_state=0,
                       client=km_client if on_dask else None))


def test_reclustering_is_imported_while_the_workers_draw_the_candidates(km_client, monkeypatch):
    """scikit-learn's k-means (1-2 s to import the first time in a process) is imported
    once the k-means|| graph is sent, before its results are awaited."""
    from dkicf import _kmeans_runs

    calls = []

    def meanwhile():
        calls.append(sorted({str(k).split("-")[0] for k in km_client.futures}))

    monkeypatch.setattr(_kmeans_runs, "_import_reclustering", meanwhile)
    X = overlapping(sum(UNEVEN))
    kmeans(as_dask(X, UNEVEN), 5, batch_size=50, max_iter=5, random_state=0, client=km_client)
    assert len(calls) == 1 and "kmpar" in calls[0]
    kmeans(X, 5, batch_size=50, max_iter=5, random_state=0, init="k-means++")
    assert len(calls) == 1  # k-means++ draws no candidates


def _batch_threads() -> list:
    import threading
    import time

    deadline = time.monotonic() + 10
    while True:  # an idle pool's thread ends soon after the pool is shut down
        alive = [t for t in threading.enumerate() if t.name.startswith("dkicf-batches")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_runs_first_batches_come_ahead_on_dask_and_change_nothing(km_client, monkeypatch):
    """On a remote P each run's first mini-batch fetch is brought by a thread of the
    driver while k-means|| runs; the fit equals the one that fetches them in turn."""
    import threading

    from dkicf import _kmeans_rows, _kmeans_runs, _kmeans_tasks

    X = overlapping(sum(UNEVEN))
    kw = dict(batch_size=50, max_iter=30, random_state=11, n_init=3)
    monkeypatch.setattr(_kmeans_runs, "_PREFETCH_ROWS", 200)  # fetches of 4 steps: several a run
    seen = []
    rows = _kmeans_tasks._DaskBackend.rows

    def spy(self, index, out=None):
        seen.append(threading.current_thread().name)
        return rows(self, index, out)

    monkeypatch.setattr(_kmeans_tasks._DaskBackend, "rows", spy)
    ahead = kmeans(as_dask(X, UNEVEN), 5, client=km_client, **kw)
    assert sum(name.startswith("dkicf-batches") for name in seen) == 3  # one per run
    assert not _batch_threads()
    monkeypatch.setattr(_kmeans_runs, "_AHEAD_BYTES", 0)
    seen.clear()
    plain = kmeans(as_dask(X, UNEVEN), 5, client=km_client, **kw)
    assert seen and not any(name.startswith("dkicf-batches") for name in seen)
    assert_array_equal(ahead.cluster_centers, plain.cluster_centers)
    assert ahead.inertias == plain.inertias
    assert (ahead.n_iter, ahead.n_steps_total) == (plain.n_iter, plain.n_steps_total)
    assert_array_equal(ahead.labels.compute(), plain.labels.compute())
    # The numpy backend fetches in turn (its rows are in this process).
    seen_np = []
    monkeypatch.setattr(_kmeans_runs, "_AHEAD_BYTES", 1 << 30)
    monkeypatch.setattr(_kmeans_tasks._NumpyBackend, "rows",
                        lambda self, index, out=None: seen_np.append(
                            threading.current_thread().name) or _kmeans_rows._take_rows(
                                self.P, np.asarray(index, dtype=np.int64), out))
    kmeans(X, 5, **kw)
    assert seen_np and not any(name.startswith("dkicf-batches") for name in seen_np)


def test_a_default_run_fetches_its_rows_once_and_all_five_come_ahead():
    """With the defaults (100 steps of 1,024 rows) a run's rows fit one fetch up to
    s = 163, and the five runs' first fetches fit the budget brought during k-means||:
    the mini-batch phase then never waits on the workers."""
    import inspect

    from dkicf import _kmeans_runs
    from dkicf._kmeans_config import _check_config
    from dkicf._memory import kmeans_fetch_bytes

    d = {k: v.default for k, v in inspect.signature(kmeans).parameters.items()}
    assert (d["batch_size"], d["max_iter"], d["n_init"]) == (1024, 100, 5)
    for s, steps in ((16, 100), (150, 100), (163, 100), (164, 99), (500, 32)):
        cfg = _check_config(10**6, s, 10, d["algorithm"], d["init"], d["batch_size"],
                            d["n_init"], d["max_iter"], d["tol"], d["max_no_improvement"],
                            d["init_size"], None)
        per = _kmeans_runs._batches_per_fetch(cfg, s)
        assert per == steps, (s, per)
        assert _kmeans_runs._AHEAD_BYTES // (8 * per * cfg.batch_size * s) >= cfg.n_init
        # The memory plan counts at least one such fetch's rows on the workers.
        assert 8 * per * cfg.batch_size * s <= kmeans_fetch_bytes(s) < 8 * (per + 1) * 1024 * s


def test_a_first_fetch_that_failed_raises_when_its_run_takes_it(km_client, monkeypatch):
    import threading

    from dkicf import _kmeans_tasks

    class Lost(Exception):
        pass

    rows = _kmeans_tasks._DaskBackend.rows

    def failing(self, index, out=None):
        if threading.current_thread().name.startswith("dkicf-batches"):
            raise Lost("the rows did not come")
        return rows(self, index, out)

    monkeypatch.setattr(_kmeans_tasks._DaskBackend, "rows", failing)
    X = overlapping(sum(UNEVEN))
    with pytest.raises(Lost, match="the rows did not come"):
        kmeans(as_dask(X, UNEVEN), 5, client=km_client, batch_size=50, max_iter=30,
               random_state=11, n_init=3)
    assert not _batch_threads()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reading_p_from_zarr_each_pass_equals_holding_it(km_client, algorithm, tmp_path):
    """persist=False (P larger than memory) reads P's chunks per task: same result."""
    import dask.array as da
    import zarr

    X = overlapping(sum(UNEVEN))
    zarr.create_array(str(tmp_path / "P.zarr"), data=X, chunks=(100, X.shape[1]))
    P = da.from_zarr(str(tmp_path / "P.zarr"))
    kw = dict(algorithm=algorithm, batch_size=50, max_iter=20, n_init=2, random_state=4)
    held = kmeans(P, 5, client=km_client, **kw)
    read = kmeans(P, 5, client=km_client, persist=False, **kw)
    assert_array_equal(read.labels.compute(), held.labels.compute())
    assert_array_equal(read.cluster_centers, held.cluster_centers)
    assert read.inertia == held.inertia and read.n_iter == held.n_iter
    with pytest.raises(TypeError, match="persist must be True or False"):
        kmeans(P, 5, client=km_client, persist="no")


def test_holding_a_p_larger_than_the_cluster_is_refused(km_client):
    """persist=True with P beyond the workers' memory: a clear error before any task runs."""
    import dask.array as da

    info = all_workers(km_client).values()
    total = sum(int(w["memory_limit"]) for w in info)
    rows = int(1.5 * total // (8 * 1000))
    P = da.zeros((rows, 1000), chunks=(rows // 8 + 1, 1000))  # lazy: never computed
    with pytest.raises(ValueError, match=r"more than the .* GiB of memory .* persist=False"):
        kmeans(P, 5, client=km_client, random_state=0)
    assert not any("zeros" in str(k) for k in km_client.who_has())


def test_the_kmeans_state_is_refused_when_it_exceeds_the_cluster():
    """The memory check counts k-means||'s state of every row besides P."""
    import dask.array as da

    from dkicf._kmeans_tasks import _check_fits
    from dkicf._memory import kmeans_row_bytes

    limits = [2**30, 2**30]
    state = kmeans_row_bytes(5)
    # P of 10 columns (80 bytes a row) and the state fit 2 GiB up to 2**31 / 216 rows.
    rows = 2**31 // (80 + state)
    _check_fits(None, da.zeros((rows, 10)), limits, True, state)
    with pytest.raises(ValueError, match=r"P is 1\.19 GiB and the k-means's state 1\.26 GiB.*"
                                         r"persist=False"):
        _check_fits(None, da.zeros((rows + 1000, 16)), limits, True, state)
    _check_fits(None, da.zeros((rows + 1000, 16)), limits, False, state)
    # The state alone beyond the cluster: read from the source does not help.
    big = da.zeros((2**31 // state + 1, 10))
    for persist in (True, False):
        with pytest.raises(ValueError, match=r"136 bytes a row.*lower n_init, pass "
                                             r"init='k-means\+\+'"):
            _check_fits(None, big, limits, persist, state)
    _check_fits(None, big, limits, False, kmeans_row_bytes(5, "k-means++"))
    _check_fits(None, big, [0, 2**30], True, state)  # a worker without a limit: no check


def test_the_memory_model_counts_the_kmeans_parallel_state(rng):
    """kmeans_row_bytes is twice the bytes a row of a chunk's real k-means|| state (a
    round's new states and the ones before them), kmeans_task_bytes a Lloyd scan's."""
    from dkicf import _kmeans_tasks
    from dkicf._memory import kmeans_row_bytes, kmeans_task_bytes

    p = np.asfortranarray(rng.normal(size=(2000, 8)))
    for runs in (1, 5):
        cands = [p[[r]] for r in range(runs)]
        state, _ = _kmeans_tasks._chunk_nearest_update(p, 0, None, cands, [0] * runs)
        more = [p[[100 + r, 200 + r]] for r in range(runs)]
        state, _ = _kmeans_tasks._chunk_nearest_update(p, 0, state, more, [1] * runs)
        arrays = [a for run in state.runs for a in run] + [state.x_sq]
        assert len({id(a) for a in arrays}) == 2 * runs + 1
        assert 2 * sum(a.nbytes for a in arrays) == kmeans_row_bytes(runs) * len(p)
        labels, d2, _ = _kmeans_tasks._scan(p, 0, [p[:3]] * runs, with_sums=False)
        scanned = sum(a.nbytes for a in labels + d2)
        assert scanned + 32 * len(p) == kmeans_task_bytes(runs) * len(p)
    assert kmeans_row_bytes(5, "k-means++") == kmeans_row_bytes(5, np.zeros((3, 2))) == 8


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chunkings_agree(km_client, algorithm):
    X = overlapping(sum(UNEVEN))
    kw = dict(algorithm=algorithm, batch_size=50, max_iter=15, n_init=2, random_state=2)
    inputs = [
        as_dask(X, (350, 350)),
        as_dask(X, (1, 99, 200, 400)),
        from_futures(km_client, X, UNEVEN),
    ]
    results = [kmeans(P, 5, client=km_client, **kw) for P in inputs]
    first = results[0]
    for P, res in zip(inputs[1:], results[1:]):
        assert res.labels.chunks == (P.chunks[0],)
        assert_array_equal(res.labels.compute(), first.labels.compute())
        assert_allclose(res.cluster_centers, first.cluster_centers, rtol=1e-12, atol=1e-12)
        assert res.n_iter == first.n_iter


def _managed_bytes(dask_worker=None) -> int:
    """On a worker: the bytes dask counts for the keys it holds in memory."""
    return sum(dask_worker.state.tasks[k].nbytes or 0 for k in dask_worker.data
               if k in dask_worker.state.tasks)


def test_dask_kmeans_holds_a_factorization_s_p_once(km_client):
    """A factorization's P reaches the k-means as aliases of the futures that hold it:
    the k-means's passes read those futures, and no worker keeps the same array under a
    second key, which dask would count twice and spill to disk before the workers fill
    up.  A P whose chunks need computing still gets its own keys."""
    import dask.array as da

    from dkicf import incomplete_cholesky
    from dkicf._kmeans_tasks import _DaskBackend

    X = da.from_array(blobs(sizes=(400, 300, 500, 400))[0], chunks=(400, 3))
    res = incomplete_cholesky(X, gamma=0.05, max_rank=30, client=km_client)
    graph = dict(res.P.__dask_graph__())
    holders = [k for k, v in graph.items() if type(v).__name__ == "Future"]
    before = sum(km_client.run(_managed_bytes).values())
    backend = _DaskBackend(res.P, km_client)
    try:
        assert sorted(b.key for b in backend.blocks) == sorted(holders)
        labels, _ = backend.full_pass([np.zeros((2, res.P.shape[1]))])
        assert labels.shape == (res.P.shape[0],)
        after = sum(km_client.run(_managed_bytes).values())
        assert after - before < res.P.nbytes / 4  # the passes' small results, not P again
    finally:
        backend.close()
    lazy = da.from_array(np.asarray(res.P), chunks=(500, -1))
    backend = _DaskBackend(lazy, km_client)
    try:
        assert not {b.key for b in backend.blocks} & set(holders)
        assert_allclose(backend.rows(np.arange(0, 1600, 7)), np.asarray(res.P)[::7])
    finally:
        backend.close()


def test_dask_empty_cluster_matches_numpy(km_client):
    X, y = blobs(sizes=(100, 100, 100, 100))
    init = np.concatenate([X[y == 0][:1], X[y == 1][:1], [[1000.0] * 3, [-1000.0] * 3]])
    ref = kmeans(X, 4, algorithm="lloyd", init=init)
    res = kmeans(as_dask(X, (90, 150, 60, 100)), 4, algorithm="lloyd", init=init, client=km_client)
    # Both empty clusters take far points (here of the same blob): a local optimum, not 4 blobs.
    assert (np.bincount(ref.labels, minlength=4) > 0).all()
    assert np.abs(ref.cluster_centers).max() < 100
    assert_array_equal(res.labels.compute(), ref.labels)
    assert_allclose(res.cluster_centers, ref.cluster_centers, rtol=1e-12, atol=1e-12)


def test_dask_nan_names_the_global_row(km_client):
    X = overlapping(40)
    X[27, 0] = np.inf
    with pytest.raises(ValueError, match=r"P contains NaN or infinity: first at row 27"):
        assign(as_dask(X, (10, 15, 15)), np.zeros((2, 3)), client=km_client)


@pytest.mark.parametrize("init", ["k-means||", "k-means++"])
def test_fetched_rows_are_checked_only_while_p_is_not(km_client, monkeypatch, init):
    """The driver checks fetched rows (the runs' init samples, the mini-batches) for NaN
    and infinity only until a pass has checked every chunk: never on a numpy P (checked on
    entry); on dask the samples, fetched first, and the mini-batches only where no
    k-means|| pass came before them (and a bad row is named)."""
    from dkicf import _kmeans_runs

    checked = []
    real = _kmeans_runs._check_finite
    monkeypatch.setattr(_kmeans_runs, "_check_finite",
                        lambda rows, index: (checked.append(len(rows)), real(rows, index)))
    X = overlapping(600)
    kw = dict(init=init, batch_size=40, max_iter=6, n_init=2, random_state=4)
    kmeans(X, 3, **kw)
    assert checked == []
    kmeans(as_dask(X, (200, 250, 150)), 3, client=km_client, **kw)
    if init == "k-means||":  # the two runs' samples of 120 rows
        assert checked == [2 * 120]
    else:  # the samples, then each run's one fetch of 6 batches
        assert checked == [2 * 120, 6 * 40, 6 * 40]
        bad = X.copy()
        bad[:, 1] = np.nan
        with pytest.raises(ValueError, match=r"P contains NaN or infinity: first at row \d+\."):
            kmeans(as_dask(bad, (200, 250, 150)), 3, client=km_client, **kw)


def test_a_fetch_buffer_is_resident_before_the_rows_land():
    """A run's fetched rows go into a buffer whose pages were all faulted in by one call
    (filled page by page, a fresh 123 MB buffer took 0.34 s instead of 0.09 s); they are
    P's rows, in the order asked."""
    import os
    import platform

    from _smaps import mapping_of

    from dkicf._kmeans_rows import _rows_in_new_buffer
    from dkicf._kmeans_tasks import _NumpyBackend

    if not os.path.exists("/proc/self/smaps") or tuple(
            int(v) for v in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("needs Linux 5.14 (MADV_POPULATE_WRITE) and its smaps")
    rng = np.random.default_rng(2)
    P = np.asfortranarray(rng.normal(size=(40_000, 30)))
    backend = _NumpyBackend(P)
    resident = []
    real = backend.rows

    def rows(index, out=None):
        resident.append(int(mapping_of(out.__array_interface__["data"][0])["Rss"][0]) * 1024)
        return real(index, out)

    backend.rows = rows
    index = rng.integers(0, 40_000, 30_000)
    try:
        # 36 MB: past glibc's largest mmap threshold, np.empty would be a fresh map too.
        got, buffer = _rows_in_new_buffer(backend, index, 150_000)
    finally:
        backend.close()
    assert buffer.shape == (150_000, 30) and buffer.flags.c_contiguous
    assert resident[0] >= buffer.nbytes  # every page present before any row was written
    assert np.shares_memory(got, buffer)
    assert_array_equal(got, P[index])


@pytest.mark.parametrize("k", [3, 5000])
def test_cluster_sums_dense_and_sparse_equal_numpy(k):
    """Per-centre sums, through the dense product and (many clusters) the sparse one."""
    from dkicf._kmeans_tasks import _BLOCK_ELEMENTS, _cluster_sums

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4))
    labels = rng.integers(0, k, size=300)
    expected = np.zeros((k, 4))
    np.add.at(expected, labels, x)
    assert (k * 300 > _BLOCK_ELEMENTS) == (k == 5000)
    np.testing.assert_allclose(_cluster_sums(x, labels, k), expected, rtol=0, atol=1e-12)


# ------------------------------------------------------------ restarts in shared passes


@pytest.mark.parametrize("algorithm", ["lloyd", "minibatch-lloyd"])
def test_a_run_sharing_the_passes_equals_the_run_alone(algorithm):
    """The restarts iterate in the same passes over P, with one matrix product for all:
    the first of five runs ends where the single run of the same seed ends (same labels,
    centres and inertia up to rounding)."""
    X = overlapping(500)
    shared = kmeans(X, 4, algorithm=algorithm, n_init=5, random_state=3)
    alone = kmeans(X, 4, algorithm=algorithm, n_init=1, random_state=3)
    assert shared.inertias[0] == pytest.approx(alone.inertia, rel=1e-12)
    assert len(set(shared.inertias)) > 1  # the other runs start elsewhere
    if shared.inertias.index(min(shared.inertias)) == 0:
        assert_array_equal(shared.labels, alone.labels)
        assert_allclose(shared.cluster_centers, alone.cluster_centers, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["C", "F"])
def test_scan_of_several_runs_equals_each_run_alone(layout):
    """One chunk pass over runs of different k (padded side by side in one product):
    each run's labels, distances and per-centre sums are those of a plain numpy
    computation for that run alone, ties to the lowest centre index."""
    from dkicf._kmeans_tasks import _BLOCK_BYTES, _scan

    rng = np.random.default_rng(5)
    n = _BLOCK_BYTES // (8 * 6) + 77  # more than one row block
    x = rng.normal(size=(n, 6))
    x = np.asfortranarray(x) if layout == "F" else x
    centers = [x[[3, 9, 40]] + 0.0, rng.normal(size=(5, 6)), x[[11]] + 0.0]
    centers[1][4] = centers[1][2]  # a tie: the lower index wins
    labels, d2, sums = _scan(x, 0, centers, with_sums=True)
    for r, c in enumerate(centers):
        ref = ((x[:, None, :] - c[None, :, :]) ** 2).sum(axis=2)
        assert_array_equal(labels[r], ref.argmin(axis=1))
        assert_allclose(d2[r], ref.min(axis=1), rtol=1e-9, atol=1e-9)
        expected = np.zeros_like(c)
        np.add.at(expected, labels[r], x)
        assert_allclose(sums[r], expected, rtol=1e-12, atol=1e-9)
        assert sums[r].shape == c.shape
    assert not np.any(labels[1] == 4)
    # The labels pass (no sums; a column-major chunk is read in place): the same.
    only_labels, only_d2, none = _scan(x, 0, centers, with_sums=False)
    assert none is None
    for r in range(len(centers)):
        assert_array_equal(only_labels[r], labels[r])
        assert_allclose(only_d2[r], d2[r], rtol=1e-12, atol=1e-12)


def test_scan_labels_stay_in_each_runs_range_when_distances_overflow():
    """A row whose squares overflow (finite, about 1e200) next to a centre as large has a
    NaN distance to it and infinite ones to the rest: it still gets a centre of its own
    run (the sparse sums index by label; one past the run's centres wrote past them)."""
    from dkicf._kmeans_tasks import _scan

    x = np.random.default_rng(0).normal(size=(50, 3))
    x[7] = 1e200
    centers = [x[[0, 1, 2]] + 0.0, x[[3, 7]] + 0.0]
    with np.errstate(over="ignore", invalid="ignore"):
        for with_sums in (True, False):
            labels, _, _ = _scan(x, 0, centers, with_sums=with_sums, check=False)
            for r, c in enumerate(centers):
                assert labels[r].min() >= 0 and labels[r].max() < c.shape[0]
                assert labels[r][7] == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_distances_that_overflow_are_an_error_not_a_nan_fit(algorithm):
    """Rows of about 1e160 (finite) have squares past float64: the fit used to return NaN
    inertia and arbitrary labels without a word."""
    from sklearn.datasets import make_blobs

    X, _ = make_blobs(600, 4, centers=3, random_state=0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match=r"overflow float64 .* Divide P by a constant"):
            kmeans(X * 1e160, 3, algorithm=algorithm, random_state=0)
        scaled = kmeans(X * 1e100, 3, algorithm=algorithm, random_state=0)
    assert np.isfinite(scaled.inertia)


def count_lloyd_passes(monkeypatch, backend) -> list[int]:
    """The runs in each Lloyd pass of ``backend``'s, appended as the passes are made."""
    passes = []
    real = backend.lloyd_pass

    def counted(self, centers, n_far):
        passes.append(len(centers))
        return real(self, centers, n_far)

    monkeypatch.setattr(backend, "lloyd_pass", counted)
    return passes


def test_the_runs_lloyd_iterations_share_their_passes(monkeypatch):
    """One pass over P per Lloyd iteration of all the runs, not one per run and iteration:
    the passes are the longest run's iterations and at most one pass that measures the
    runs stopped by ``tol``."""
    from dkicf import _kmeans_tasks

    passes = count_lloyd_passes(monkeypatch, _kmeans_tasks._NumpyBackend)
    seen: list[KMeansProgress] = []
    res = kmeans(overlapping(500), 4, algorithm="lloyd", n_init=5, tol=1e-3, random_state=1,
                 progress=seen.append)
    per_run = [sum(1 for p in seen if p.restart == r) for r in range(5)]
    assert max(per_run) <= len(passes) <= max(per_run) + 1
    assert sum(passes) >= sum(per_run) > len(passes)
    # Each run reports its last iteration once, as done.
    assert sorted(p.restart for p in seen if p.done) == list(range(5))
    assert res.n_steps_total == sum(per_run)


def test_a_summary_in_another_centre_order_is_the_summary_of_those_centres():
    """A run holding another run's centres in another order takes that run's chunk
    summaries reordered: the same sums, counts, inertia and farthest rows as a pass over
    its own centres."""
    from dkicf._kmeans_runs import _reordered, _same_centers
    from dkicf._kmeans_tasks import _chunk_lloyd

    X, _ = blobs()
    rng = np.random.default_rng(2)
    c = X[[0, 5, 9, 30]] + 0.0
    perm = rng.permutation(4)
    other = rng.normal(size=(4, 3))
    repeated = np.vstack([c[:3], c[:1]])  # a repeated centre: ties could go either way
    same = _same_centers([c, other, c[perm], repeated, c[perm][::-1].copy()])
    assert [j for j, _ in same] == [0, 1, 0, 3, 0]
    assert same[0][1] is None and same[3][1] is None
    for i in (2, 4):
        mine = [c, other, c[perm], repeated, c[perm][::-1]][i]
        order = same[i][1]
        assert_array_equal(mine, c[order])
        ref = _chunk_lloyd(X, 40, [mine], n_far=4)[0]
        got = _reordered(_chunk_lloyd(X, 40, [c], n_far=4)[0], order)
        assert set(got) == set(ref)
        for key in ref:
            assert_array_equal(got[key], ref[key])


def midpoints(seed=0):
    """Rows at 0, 1 and 2 (52, 71 and 59 of them), shuffled: with centres at 0 and 2,
    the 71 rows at 1 are as near to both, and go to the first of the two."""
    X = np.repeat([0.0, 1.0, 2.0], [52, 71, 59])[:, None]
    return X[np.random.default_rng(seed).permutation(X.shape[0])]


def test_a_chunk_reports_rows_as_near_to_two_centres():
    """The Lloyd and labels passes say, for each set of centres, whether some row is at
    its minimum distance from two of them (its label then depends on their order)."""
    from dkicf._kmeans_tasks import _chunk_assign, _chunk_lloyd

    X = midpoints()
    sets = [np.array([[0.0], [2.0]]), np.array([[0.0], [1.5]]), np.array([[2.0], [0.0]])]
    assert [summary["tied"] for summary in _chunk_lloyd(X, 0, sets, n_far=2)] == [
        True, False, True]
    labels, stats = _chunk_assign(X, 0, sets)
    assert [st["tied"] for st in stats] == [True, False, True]
    # Ties to the first centre in each set's own order.
    assert_array_equal([st["counts"] for st in stats][::2], [[123, 59], [130, 52]])
    assert_array_equal(labels, (X[:, 0] == 2).astype(np.int64))


@pytest.mark.parametrize("backend", ["numpy", "dask"])
def test_restarts_at_the_same_centres_in_another_order_keep_their_own_ties(
        km_client, monkeypatch, backend):
    """Two Lloyd restarts from the same centres in another order: the rows as near to
    both go to the first in each restart's own order, so they reach other partitions.
    Each run ends as the fit of one run from its centres does."""
    import dask.array as da

    from dkicf import _kmeans_runs

    X = midpoints()
    data, client = (X, None) if backend == "numpy" else (
        da.from_array(X, chunks=(50, 1)), km_client)
    starts = [np.array([[0.0], [2.0]]), np.array([[2.0], [0.0]])]
    kw = dict(algorithm="lloyd", tol=0.0, random_state=0, client=client)
    alone = [kmeans(data, 2, init=c, **kw) for c in starts]
    # The second start's rows at 1 go to its centre at 2: another partition, worse.
    assert alone[1].inertia > alone[0].inertia * 1.05
    given = iter(starts)
    monkeypatch.setattr(_kmeans_runs, "_initial_centers",
                        lambda cfg, rng, sample, candidates: (next(given), 1.0))
    res = kmeans(data, 2, n_init=2, **kw)
    assert res.inertias == [a.inertia for a in alone]
    assert_array_equal(res.cluster_centers, alone[0].cluster_centers)
    assert_array_equal(np.asarray(res.labels), np.asarray(alone[0].labels))


def test_only_runs_holding_tied_centres_in_another_order_are_computed_apart():
    from dkicf._kmeans_runs import _order_matters, _same_centers, _slots

    c = np.array([[0.0], [2.0], [5.0]])
    same = _same_centers([c, c.copy(), c[::-1].copy(), np.array([[1.0], [3.0], [4.0]])])
    slot = _slots(same)
    assert [j for j, _ in same] == [0, 0, 0, 3]
    assert _order_matters(same, slot, [True, False]) == [2]  # the same order: its own
    assert _order_matters(same, slot, [False, True]) == []


def test_the_labels_pass_counts_each_run_s_own_ties():
    """Runs measured in the labels pass, holding the same centres in another order:
    the rows as near to two centres count for the first in each run's own order."""
    from dkicf._kmeans_runs import _measure_and_label, _Position, _Run, _Runs
    from dkicf._kmeans_tasks import _NumpyBackend

    X = midpoints()
    runs = _Runs(seeds=[0, 1], restart=2, runs=[
        _Run(centers=np.array(c), tol_abs=0.0, n_iter=1, stop="max_iter")
        for c in ([[0.0], [2.0]], [[2.0], [0.0]])])
    backend = _NumpyBackend(X)
    try:
        labels = _measure_and_label(backend, runs, _Position(n_init=2))
    finally:
        backend.close()
    assert [run.inertia for run in runs.runs] == [71.0, 71.0]
    assert_array_equal(runs.runs[0].counts, [123, 59])
    assert_array_equal(runs.runs[1].counts, [130, 52])
    assert_array_equal(labels, (X[:, 0] == 2).astype(np.int64))


@pytest.mark.parametrize("algorithm", ["lloyd", "minibatch-lloyd"])
def test_restarts_at_the_same_centres_share_one_product(monkeypatch, algorithm):
    """Restarts that reach the same partition hold the same centres: the passes compute
    them once, and the fit is the fit that computes each of them (the same centres,
    labels, inertias and iterations)."""
    from dkicf import _kmeans_runs, _kmeans_tasks

    X, y = blobs(sizes=(300, 250, 200, 280))
    passes = count_lloyd_passes(monkeypatch, _kmeans_tasks._NumpyBackend)
    shared = kmeans(X, 4, algorithm=algorithm, n_init=5, random_state=0, tol=0.0)
    assert adjusted_rand_score(y, shared.labels) == 1.0
    counted = list(passes)
    passes.clear()
    monkeypatch.setattr(_kmeans_runs, "_same_centers",
                        lambda centers: [(i, None) for i in range(len(centers))])
    apart = kmeans(X, 4, algorithm=algorithm, n_init=5, random_state=0, tol=0.0)
    assert min(counted) < 5 and passes[-1] == 5 and len(passes) == len(counted)
    assert_array_equal(shared.labels, apart.labels)
    assert_array_equal(shared.cluster_centers, apart.cluster_centers)
    assert_allclose(shared.inertias, apart.inertias, rtol=1e-12)
    assert (shared.n_iter, shared.n_steps_total) == (apart.n_iter, apart.n_steps_total)


def count_full_passes(monkeypatch, backend) -> list[int]:
    """The sets of centres in each labels pass of ``backend``'s, as the passes are made."""
    passes = []
    real = backend.full_pass

    def counted(self, centers):
        passes.append(len(centers))
        return real(self, centers)

    monkeypatch.setattr(backend, "full_pass", counted)
    return passes


def final_centres(monkeypatch) -> list:
    """Every run's final centres, as the fit leaves them (filled when it measures them)."""
    from dkicf import _kmeans_runs

    found = []
    real = _kmeans_runs._measure_and_label

    def recorded(backend, runs, pos):
        found.extend(run.centers for run in runs.runs)
        return real(backend, runs, pos)

    monkeypatch.setattr(_kmeans_runs, "_measure_and_label", recorded)
    return found


def direct_inertia(X, centers) -> float:
    return float(((X[:, None, :] - centers[None]) ** 2).sum(-1).min(1).sum())


@pytest.mark.parametrize("backend", ["numpy", "dask"])
def test_runs_left_to_measure_are_measured_by_the_labels_pass(km_client, monkeypatch, backend):
    """Runs stopped by ``tol`` at the last Lloyd pass are measured in the pass that labels
    the rows for the run likely to be best (the lowest inertia so far): no pass of its
    own.  Every run's inertia is that of its final centres, the labels the best run's."""
    import dask.array as da

    from dkicf import _kmeans_tasks

    cls = _kmeans_tasks._NumpyBackend if backend == "numpy" else _kmeans_tasks._DaskBackend
    X = overlapping(700)
    data, client = (X, None) if backend == "numpy" else (
        da.from_array(X, chunks=(UNEVEN, 3)), km_client)
    lloyd, full = count_lloyd_passes(monkeypatch, cls), count_full_passes(monkeypatch, cls)
    centres = final_centres(monkeypatch)
    seen: list[KMeansProgress] = []
    res = kmeans(data, 4, algorithm="lloyd", n_init=5, tol=1e-3, random_state=1,
                 client=client, progress=seen.append)
    per_run = [sum(1 for p in seen if p.restart == r) for r in range(5)]
    assert len(lloyd) == max(per_run)  # no pass only to measure
    assert full[0] > 1 and full[1:] in ([], [1])  # a second pass only if the guess was wrong
    assert_allclose(res.inertias, [direct_inertia(X, c) for c in centres], rtol=1e-10)
    assert res.inertia == min(res.inertias)
    labels, inertia = assign(X, res.cluster_centers)
    assert_array_equal(np.asarray(res.labels), labels)
    assert res.inertia == pytest.approx(inertia, rel=1e-10)


def test_labels_are_computed_again_when_a_measured_run_turns_out_best(monkeypatch):
    """Mini-batch runs have no inertia until measured: the first is labelled with the
    measure of all five; when another turns out best, its labels take a pass of their own."""
    from dkicf import _kmeans_tasks

    X = overlapping(700)
    full = count_full_passes(monkeypatch, _kmeans_tasks._NumpyBackend)
    centres = final_centres(monkeypatch)
    bests = []
    for seed in range(3):
        full.clear()
        centres.clear()
        res = kmeans(X, 4, algorithm="minibatch", n_init=5, random_state=seed)
        best = res.inertias.index(res.inertia)
        bests.append(best)
        assert full == ([5] if best == 0 else [5, 1])
        assert_allclose(res.inertias, [direct_inertia(X, c) for c in centres], rtol=1e-10)
        assert_array_equal(res.cluster_centers, centres[best])
        labels, _ = assign(X, res.cluster_centers)
        assert_array_equal(res.labels, labels)
    assert any(bests)  # the second pass was taken


def test_a_lloyd_pass_sends_one_task_per_worker_thread(km_client, monkeypatch):
    """Eight chunks on 2 workers x 1 thread: each pass is 2 tasks, with the numpy result."""
    import dask.array as da
    from distributed import get_task_stream, wait

    from dkicf import _kmeans_tasks

    passes = count_lloyd_passes(monkeypatch, _kmeans_tasks._DaskBackend)
    P = overlapping(800)
    Pd = km_client.persist(da.from_array(P, chunks=(100, -1)))
    wait(Pd)  # held before the first pass: a chunk still in flight has no worker's group
    kw = {"algorithm": "lloyd", "init": "k-means++", "n_init": 2, "random_state": 0}
    with get_task_stream(km_client) as ts:
        res = kmeans(Pd, 3, client=km_client, **kw)
    keys = {rec["key"] for rec in ts.data
            if isinstance(rec["key"], str) and rec["key"].startswith("kmeans-lloyd-")}
    assert passes and len(keys) == 2 * len(passes)
    ref = kmeans(P, 3, **kw)
    assert_array_equal(res.labels.compute(), ref.labels)
    assert_allclose(res.inertias, ref.inertias, rtol=1e-12)


def test_chunks_left_misaligned_by_a_transfer_are_copied_once():
    from dkicf._services import _aligned, scratch

    buf = bytearray(8 * 60 + 1)
    odd = np.frombuffer(buf, dtype=np.float64, offset=1, count=60).reshape(20, 3)
    odd[...] = np.arange(60.0).reshape(20, 3)
    fixed = _aligned(odd)
    assert odd.ctypes.data % 8 != 0 and fixed.ctypes.data % 16 == 0
    assert_array_equal(fixed, odd)
    kept = np.arange(60.0).reshape(20, 3)
    fortran = kept.T
    assert _aligned(kept) is kept and _aligned(fortran) is fortran
    # A thread's scratch array is reused for the same slot, grown when asked for more.
    a = scratch("test", (4, 5))
    assert scratch("test", (2, 5)).base is a.base
    assert scratch("test", (40, 5)).shape == (40, 5)


def test_kmeans_parallel_draws_of_groups_come_back_in_chunk_order():
    """A worker's group can hold chunks 0 and 2 while another holds 1 and 3: the drawn rows
    are put back in chunk order, as the numpy backend concatenates them."""
    from dkicf._kmeans_tasks import _add_draws, _phi_totals

    rows = {j: [np.full((1, 2), 10.0 * j + r) for r in range(2)] for j in range(4)}
    cands = [np.zeros((1, 2)), np.ones((1, 2))]
    drawn, firsts, added = _add_draws(cands, [[rows[0], rows[2]], [rows[1], rows[3]]],
                                      order=[0, 2, 1, 3])
    assert [d[:, 0].tolist() for d in drawn] == [[0.0, 10.0, 20.0, 30.0], [1.0, 11.0, 21.0, 31.0]]
    assert firsts == [1, 1] and added[1][:, 0].tolist() == [1.0, 1.0, 11.0, 21.0, 31.0]
    # The runs' sums over the chunks, grouped or not, and 0 where nothing is left to draw.
    chunks = [[1e16, 0.0], [1.0, 0.0], [-1e16, 0.0]]
    assert _phi_totals(chunks) == _phi_totals([[chunks[0], chunks[2]], [chunks[1]]]) == [1.0, 0.0]


def test_a_fortran_ordered_p_gives_the_c_ordered_result_bit_for_bit():
    """A factorization's P is Fortran-ordered: the passes copy each row block into C order,
    so every product sees the same operands whichever order P has."""
    # 150 columns: BLAS rounds a Fortran-ordered block's products differently here.
    P = np.asfortranarray(np.random.default_rng(0).normal(size=(20000, 150)))
    kw = {"random_state": 0, "n_init": 2}
    f = kmeans(P, 5, **kw)
    c = kmeans(np.ascontiguousarray(P), 5, **kw)
    assert_array_equal(f.labels, c.labels)
    assert_array_equal(f.cluster_centers, c.cluster_centers)
    assert f.inertia == c.inertia and f.inertias == c.inertias


def test_k_means_parallel_draws_hash_each_row_index_with_splitmix64():
    """k-means||'s uniforms: SplitMix64 of ``key + index * golden``, as written out in
    plain Python integers, so a row's draw does not depend on its chunk."""
    from dkicf._kmeans_tasks import _uniform

    mask = (1 << 64) - 1

    def splitmix(key, i):
        z = (i * 0x9E3779B97F4A7C15 + key) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53

    index = np.array([0, 1, 2, 12345, 2**40 + 3, 10**15], dtype=np.int64)
    for key in (0, 7, 2**63 - 25):
        got = _uniform(key, index)
        assert got.tolist() == [splitmix(key, int(i)) for i in index]
        assert_array_equal(_uniform(key, index[3:]), got[3:])  # any chunk of rows
    u = _uniform(11, np.arange(100_000, dtype=np.int64))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005


def test_rows_are_copied_into_c_order_exactly_whatever_the_source_layout():
    """The passes' block copy (a column-major source goes a few columns at a time) gives
    the same values as a plain copy: every column, a partial last group, float32 widened."""
    from dkicf._kmeans_rows import _copy_rows

    rng = np.random.default_rng(3)
    for cols in (1, 8, 21):
        base = rng.normal(size=(300, cols + 3))
        for src in (np.asfortranarray(base)[50:250, 1:cols + 1],  # rows of a Fortran matrix
                    np.asfortranarray(base.astype(np.float32))[:, :cols],
                    base[:200, :cols]):  # C-ordered rows
            dst = np.full(src.shape, np.nan)
            _copy_rows(dst, src)
            assert_array_equal(dst, src.astype(np.float64))


def test_fetched_rows_written_into_a_given_array_equal_the_rows_asked_for():
    """Mini-batch fetches write into one array reused from fetch to fetch: the rows are
    those of plain indexing, repeats and any order included, from either layout of P and
    from the parts of several chunks."""
    from dkicf._kmeans_rows import _GATHER_ROWS, _place_rows, _take_rows

    rng = np.random.default_rng(5)
    P = rng.normal(size=(3 * _GATHER_ROWS, 7))
    index = rng.integers(0, P.shape[0], size=2 * _GATHER_ROWS + 11)  # repeats, unsorted
    for layout in (np.ascontiguousarray(P), np.asfortranarray(P),
                   np.asfortranarray(P.astype(np.float32))):
        out = np.full((index.shape[0], 7), np.nan)
        assert _take_rows(layout, index, out) is out
        assert_array_equal(out, layout[index].astype(np.float64))
    # The dask backend's parts: the unique rows, chunk by chunk, and where each goes.
    uniq, inverse = np.unique(index, return_inverse=True)
    parts = np.split(P[uniq], [5, 5, 900])  # an empty part among them
    out = np.full((index.shape[0], 7), np.nan)
    assert _place_rows(parts, inverse, out) is out
    assert_array_equal(out, P[index])


def test_a_block_of_rows_of_a_fortran_p_is_held_without_a_copy():
    """The dask backend keeps P's input chunks as the factorization hands them over (views
    of its Fortran-ordered buffer); a chunk that is neither is copied as before."""
    from dkicf._kmeans_rows import _take_rows
    from dkicf._kmeans_tasks import _aligned, _held_as_is, _row_blocks

    buf = np.asfortranarray(np.arange(4000.0).reshape(400, 10))
    rows = buf[100:300, :8]  # rows of a Fortran matrix, not contiguous
    assert not rows.flags.c_contiguous and not rows.flags.f_contiguous
    assert _held_as_is(rows) and _held_as_is(buf) and _held_as_is(np.ascontiguousarray(buf))
    # At an odd row of its buffer, or of a buffer with an odd number of rows: not aligned
    # to 16 bytes, still not copied (the factor of an odd number of rows).
    odd_rows = np.asfortranarray(np.arange(4010.0).reshape(401, 10))
    for view in (odd_rows[1:200], odd_rows[200:], buf[101:300]):
        assert view.ctypes.data % 16 or view.strides[1] % 16
        assert _held_as_is(view)
    odd = np.arange(4000.0).reshape(400, 10)[:, :8]  # C-ordered, not contiguous
    assert not _held_as_is(odd)
    kept = _aligned(odd)
    assert kept is not odd and kept.flags.c_contiguous
    assert_array_equal(kept, odd)
    # The passes and the row fetches read it as C-ordered float64 rows.
    blocks = [x.copy() for _, _, x in _row_blocks(rows, 0, 4, True)]
    assert all(b.flags.c_contiguous for b in blocks)
    assert_array_equal(np.concatenate(blocks), rows)
    taken = _take_rows(rows, np.array([5, 0, 199]))
    assert taken.flags.c_contiguous
    assert_array_equal(taken, rows[[5, 0, 199]])


def test_scikit_learn_is_imported_while_the_k_means_parallel_passes_run():
    """The first import of scikit-learn's k-means in a process (1-2 s) overlaps the
    k-means|| passes: it has not happened when they are sent, and has after the fit."""
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from dkicf import kmeans, _kmeans_tasks as kt
assert "sklearn.cluster" not in sys.modules
seen = []
sent = kt._NumpyBackend.parallel_candidates
def watched(self, *args, **kwargs):
    seen.append("sklearn.cluster" in sys.modules)
    return sent(self, *args, **kwargs)
kt._NumpyBackend.parallel_candidates = watched
kmeans(np.random.default_rng(0).normal(size=(500, 4)), 3, random_state=0)
print(seen, "sklearn.cluster" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[False]", "True"]


def test_fetched_rows_asked_in_no_order_land_in_their_places(rng):
    """A mini-batch fetch (rows in no order, repeated) is gathered in increasing order,
    in pieces, on threads or not, and each row lands where it was asked: the rows
    P[index] exactly, from a factorization's column-major P or a C-ordered one."""
    from concurrent.futures import ThreadPoolExecutor

    from dkicf._kmeans_rows import _GATHER_ROWS, _take_rows

    P = np.asfortranarray(rng.normal(size=(30_000, 7)))
    index = rng.integers(0, P.shape[0], 3 * _GATHER_ROWS + 17)
    index[:5] = [9, 9, 0, 29_999, 9]
    with ThreadPoolExecutor(2) as pool:
        for q in (P, np.ascontiguousarray(P), P[1000:]):
            want = q[index % q.shape[0]]
            for threads in (None, pool):
                out = np.full((index.shape[0] + 3, q.shape[1]), np.nan)
                got = _take_rows(q, index % q.shape[0], out[:index.shape[0]], threads)
                assert got.base is out or got is out or np.shares_memory(got, out)
                assert_array_equal(got, want)
                assert np.isnan(out[index.shape[0]:]).all()  # nothing past the fetch


def test_kmeans_parallel_update_takes_the_lowest_numbered_of_tied_candidates(rng):
    """k-means||'s float32 distances find each row's nearest candidate as a float64 argmin
    would: where two candidates are the same row, always the lower number; elsewhere
    the exact nearest one, and its squared distance to float32's precision."""
    from dkicf import _kmeans_tasks

    centres = rng.normal(scale=5.0, size=(3, 12))
    p = np.asfortranarray(centres[rng.integers(0, 3, 5000)] + rng.normal(size=(5000, 12)))
    two = p[[10, 20]] + 0.5
    cands = np.concatenate([two, two, centres])  # 0 and 2, 1 and 3 are the same row
    for q in (p, np.ascontiguousarray(p)):
        state, (total,) = _kmeans_tasks._chunk_nearest_update(q, 0, None, [cands], [7])
        ((d2, label),) = state.runs
        exact = ((q[:, None, :] - cands[None]) ** 2).sum(-1)
        assert set(np.unique(label)) <= {7, 8, 11, 12, 13}  # never the repeats 9 and 10
        ordered = np.sort(exact, axis=1)
        clear = ordered[:, 1] - ordered[:, 0] > 1e-3 * ordered[:, 0]  # no near tie
        clear |= np.isin(exact.argmin(1), [0, 1])  # a tie between a pair's copies only
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(label[clear], exact.argmin(1)[clear] + 7)
        np.testing.assert_allclose(d2, exact.min(1), rtol=1e-5, atol=1e-3)
        assert total == pytest.approx(exact.min(1).sum(), rel=1e-6)


@pytest.mark.parametrize("order", ["F", "C"])
def test_kmeans_parallel_first_pass_checks_p_as_the_full_check_does(order):
    """The first k-means|| pass looks for NaN and infinity only in row blocks whose sums of
    squares are not finite: it still names the first bad row, and finite rows whose squares
    overflow pass (as they pass ``_check_finite``); a later pass checks every block."""
    from dkicf import _kmeans_tasks

    rng = np.random.default_rng(3)
    p = rng.normal(size=(9000, 12))
    p[4321] = 1e200  # finite: its squares overflow to inf
    cands, firsts = [p[[5]], p[[77]]], [0, 0]
    with np.errstate(over="ignore", invalid="ignore"):
        state, _ = _kmeans_tasks._chunk_nearest_update(np.array(p, order=order), 500, None,
                                                       cands, firsts)
    assert state.x_sq[4321] == np.inf
    _kmeans_tasks._check_finite(p, 500)  # the full check agrees: no error
    p[4321] = 1.0
    for row, value in ((6001, np.nan), (6001, np.inf), (8999, -np.inf), (0, np.nan)):
        bad = np.array(p, order=order)
        bad[row, 11] = value
        with pytest.raises(ValueError, match=rf"first at row {row + 500}\."):
            _kmeans_tasks._chunk_nearest_update(bad, 500, None, cands, firsts)
        # Unchecked, the same pass goes through; a later checked pass finds the row.
        with np.errstate(invalid="ignore"):
            later, _ = _kmeans_tasks._chunk_nearest_update(bad, 500, None, cands, firsts,
                                                           check=False)
        with pytest.raises(ValueError, match=rf"first at row {row + 500}\."):
            _kmeans_tasks._chunk_nearest_update(bad, 500, later, [p[[9]], p[[10]]], [1, 1])


def test_kmeans_parallel_first_pass_with_one_candidate_a_run(rng):
    """k-means||'s first pass (one candidate a run) labels every row with that candidate
    and gives its squared distance; a row with NaN (P not checked) is never nearer."""
    from dkicf import _kmeans_tasks

    p = np.asfortranarray(rng.normal(size=(3000, 20)))
    p[17, 3] = np.nan
    cands = [p[[5]] + 0.25, p[[2900]] * 0.5]
    state, totals = _kmeans_tasks._chunk_nearest_update(p, 0, None, cands, [0, 0], check=False)
    ok = np.ones(3000, dtype=bool)
    ok[17] = False
    for (d2, label), c, total in zip(state.runs, cands, totals):
        np.testing.assert_array_equal(label, 0)
        exact = ((p - c) ** 2).sum(1)
        np.testing.assert_allclose(d2[ok], exact[ok], rtol=1e-5, atol=1e-4)
        assert d2[17] == np.inf and total == np.inf
    # A second pass moves rows only to a strictly nearer candidate, numbered from 1.
    more = [p[[10, 20]], np.empty((0, 20))]
    state2, _ = _kmeans_tasks._chunk_nearest_update(p, 0, state, more, [1, 1], check=False)
    (d2a, lab_a), (d2b, lab_b) = state2.runs
    exact = np.stack([((p - c) ** 2).sum(1) for c in (cands[0][0], p[10], p[20])], axis=1)
    np.testing.assert_array_equal(lab_a[ok], exact[ok].argmin(1))
    assert d2b is state.runs[1][0] and lab_b is state.runs[1][1]  # no new candidates: kept


def test_kmeans_parallel_update_and_labels_read_column_major_p_as_row_major(rng):
    """k-means||'s update and the labels pass read a factorization's P (rows of a
    Fortran-ordered buffer) by columns: each row's nearest candidate and its distance are
    those of the same rows in C order, up to the float32 products' rounding; NaN in P is
    named by its row."""
    from dkicf import _kmeans_rows, _kmeans_tasks

    centres = rng.normal(scale=6.0, size=(4, 30))
    buf = np.asfortranarray(centres[rng.integers(0, 4, 3000)] + rng.normal(size=(3000, 30)))
    p = buf[1000:2700]  # rows of the buffer: column-major, not Fortran-contiguous
    assert _kmeans_rows._column_major(p) and not p.flags.f_contiguous
    states = want = None
    for cands, firsts in (([centres[:3] + 0.1, centres[2:] - 0.1], [0, 0]),
                          ([centres[1:] * 0.97, centres[:2] * 1.02], [3, 2])):
        by_cols, sums_c = _kmeans_tasks._chunk_nearest_update(p, 1000, states, cands, firsts)
        by_rows, sums_r = _kmeans_tasks._chunk_nearest_update(
            np.ascontiguousarray(p), 1000, states, cands, firsts)
        for (d2_c, lab_c), (d2_r, lab_r) in zip(by_cols.runs, by_rows.runs):
            np.testing.assert_array_equal(lab_c, lab_r)
            np.testing.assert_allclose(d2_c, d2_r, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(sums_c, sums_r, rtol=1e-6)
        now = np.stack([((p[:, None, :] - c[None]) ** 2).sum(-1).min(1) for c in cands])
        want = now if want is None else np.minimum(want, now)
        np.testing.assert_allclose([d2 for d2, _ in by_cols.runs], want, rtol=1e-4, atol=1e-3)
        # The rows' squared norms, from the first pass, kept for the later ones.
        np.testing.assert_allclose(by_cols.x_sq, (p ** 2).sum(1), rtol=1e-12)
        assert states is None or by_cols.x_sq is states.x_sq
        states = by_cols
    # The labels pass reads it by columns too: the same labels and inertia.
    lab_c, (stats_c,) = _kmeans_tasks._chunk_assign(p, 1000, [centres])
    lab_r, (stats_r,) = _kmeans_tasks._chunk_assign(np.ascontiguousarray(p), 1000, [centres])
    np.testing.assert_array_equal(lab_c, lab_r)
    np.testing.assert_array_equal(lab_c, ((p[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1))
    np.testing.assert_allclose(stats_c["inertia"], stats_r["inertia"], rtol=1e-10)
    # With other sets to measure in the same pass, the first set's labels and inertia are
    # bit for bit those of a pass for it alone; the others', those of a direct computation.
    others = [centres + 0.25, centres[::-1] * 1.5]
    lab_m, stats_m = _kmeans_tasks._chunk_assign(p, 1000, [centres, *others])
    np.testing.assert_array_equal(lab_m, lab_c)
    assert stats_m[0]["inertia"] == stats_c["inertia"]
    for st, c in zip(stats_m[1:], others):
        d2 = ((p[:, None, :] - c[None]) ** 2).sum(-1)
        np.testing.assert_allclose(st["inertia"], d2.min(1).sum(), rtol=1e-10)
        np.testing.assert_array_equal(st["counts"], np.bincount(d2.argmin(1), minlength=len(c)))
    bad = buf.copy(order="F")
    bad[2345, 7] = np.nan
    with pytest.raises(ValueError, match="first at row 2345"):
        _kmeans_tasks._chunk_nearest_update(bad[1000:2700], 1000, None, cands, firsts)
    with pytest.raises(ValueError, match="first at row 2345"):
        _kmeans_tasks._chunk_assign(bad[1000:2700], 1000, [centres])
