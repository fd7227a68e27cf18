"""K-means checkpoints: a crashed driver resumes bit-identically; other fits are refused."""

import json
import logging
import shutil
import subprocess
import sys
import textwrap

import dask.array as da
import numpy as np
import pytest

import dkicf._commit as ck
from dkicf.errors import CheckpointMismatchError
from dkicf.kmeans import kmeans

CHUNK = 150
MINIBATCH = {"algorithm": "minibatch", "batch_size": 32, "max_no_improvement": 8, "tol": 0.0,
             "init": "k-means++"}
LLOYD = {"algorithm": "lloyd", "tol": 1e-6, "init": "k-means++"}
# The default: k-means|| then mini-batch steps then Lloyd iterations.
HYBRID = {"algorithm": "minibatch-lloyd", "batch_size": 32, "max_no_improvement": 4,
          "tol": 1e-9}
# Mini-batch runs stop on no improvement after 14, 10 and 25 steps; Lloyd runs on tol
# after 6 and 28 iterations, or at max_iter.  Commits every 4 steps and after each run.
CASES = {
    ("numpy", "minibatch"): dict(MINIBATCH, n_init=3, max_iter=60),
    ("numpy", "lloyd"): dict(LLOYD, n_init=3, max_iter=30),
    ("dask", "minibatch"): dict(MINIBATCH, n_init=2, max_iter=24),
    ("dask", "lloyd"): dict(LLOYD, n_init=2, max_iter=10),
    ("numpy", "minibatch-lloyd"): dict(HYBRID, n_init=2, max_iter=30),
    ("dask", "minibatch-lloyd"): dict(HYBRID, n_init=2, max_iter=30),
}
COMMON = {"random_state": 0, "checkpoint_every": 4}


def make_P():
    return np.random.default_rng(2).normal(size=(600, 4))


def as_input(kind):
    P = make_P()
    return da.from_array(P, chunks=CHUNK) if kind == "dask" else P


def fit(kind, algorithm, client=None, **kw):
    return kmeans(as_input(kind), 3, client=client, **dict(CASES[kind, algorithm], **COMMON, **kw))


def assert_same_result(res, ref):
    """Bit-identical fits: centres, labels, inertias, step counts."""
    np.testing.assert_array_equal(res.cluster_centers, ref.cluster_centers)
    np.testing.assert_array_equal(np.asarray(res.labels), np.asarray(ref.labels))
    assert res.inertia == ref.inertia and res.inertias == ref.inertias
    assert (res.n_iter, res.n_steps_total, res.stop_reason) == (
        ref.n_iter, ref.n_steps_total, ref.stop_reason)


@pytest.fixture(scope="module")
def references(client, tmp_path_factory):
    """Uninterrupted checkpointed fits: result, the commits' steps and the checkpoint."""
    out = {}
    for kind, algorithm in CASES:
        url = str(tmp_path_factory.mktemp("ref") / "km")
        commits = []

        def record(phase, step, commits=commits):
            if phase == "commit":
                commits.append(step)

        ck._fault_hook = record
        try:
            res = fit(kind, algorithm, client, checkpoint=url)
        finally:
            ck._fault_hook = None
        out[kind, algorithm] = res, commits, url
    return out


@pytest.mark.parametrize("algorithm", ["minibatch", "lloyd", "minibatch-lloyd"])
def test_checkpoints_do_not_change_the_fit(references, algorithm):
    ref, _, _ = references["numpy", algorithm]
    assert ref.info["resumed_from"] is None and not ref.info["already_finished"]
    assert_same_result(ref, fit("numpy", algorithm))


# ----------------------------------------------------------------- driver crash and resume

CRASH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import dkicf._commit as ck
    from dkicf.kmeans import kmeans

    url, kind, address, where, restart, at, params = sys.argv[1:]
    restart, at, params = int(restart), int(at), json.loads(params)

    def crash(phase, step):
        if (phase, step) == (where, at):
            os._exit(3)

    def progress(p):
        if where == "step" and (p.restart, p.step) == (restart, at):
            os._exit(3)

    ck._fault_hook = crash
    P = np.random.default_rng(2).normal(size=(600, 4))
    client, chunk = None, params.pop("chunk")
    if kind == "dask":
        import dask.array as da
        from distributed import Client

        client = Client(address)
        P = da.from_array(P, chunks=chunk)
    kmeans(P, 3, client=client, checkpoint=url, progress=progress, **params)
    os._exit(0)
    """
)


def crash_driver(url, kind, algorithm, client, where, restart, at):
    """Run the fit in a subprocess that os._exit()s after a write phase or at a step."""
    address = client.scheduler.address if kind == "dask" else ""
    params = dict(CASES[kind, algorithm], **COMMON, chunk=CHUNK)
    args = [sys.executable, "-c", CRASH_SCRIPT, url, kind, address, where, str(restart),
            str(at), json.dumps(params)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]


def crash_in_process(url, kind, algorithm, client, where, restart, at, monkeypatch):
    """The same crash, raised in this process: the checkpoint is left as os._exit leaves it."""

    def crash(phase, step):
        if (phase, step) == (where, at):
            raise KeyboardInterrupt

    def progress(p):
        if where == "step" and (p.restart, p.step) == (restart, at):
            raise KeyboardInterrupt

    monkeypatch.setattr(ck, "_fault_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        fit(kind, algorithm, client, checkpoint=url, progress=progress)
    monkeypatch.setattr(ck, "_fault_hook", None)


@pytest.mark.parametrize(
    "in_subprocess, kind, algorithm, where, restart, at, resumed_from",
    [
        # Between commits, 3 steps after the second run's commit at its step 4: inside a
        # prefetch of 60 batches, which the resumed run draws again.
        (True, "numpy", "minibatch", "step", 1, 7, {"restart": 1, "step": 4}),
        # Arrays written at the second run's step 8, not committed: it resumes from step 4,
        # and the first run is read back from the checkpoint.
        (True, "dask", "minibatch", "arrays", -1, 22, {"restart": 1, "step": 4}),
        # The runs' shared Lloyd passes (restart == n_init), committed every 4 iterations:
        # arrays written at iteration 8 (steps 6 + 8), resumed from iteration 4.
        (False, "dask", "lloyd", "arrays", -1, 14, {"restart": 2, "step": 4}),
        # Iteration 16 (6 + 16 + 16 steps) not committed: resumed from iteration 12.
        (False, "numpy", "lloyd", "arrays", -1, 38, {"restart": 3, "step": 12}),
        # The first run's initialisation is committed before the second run starts.
        (False, "numpy", "lloyd", "commit", -1, 0, {"restart": 1, "step": 0}),
        # The default, between the shared passes' commits at iterations 12 and 16: the
        # first run's Lloyd report 14 (its mini-batch phase ended at step 10).
        (True, "numpy", "minibatch-lloyd", "step", 0, 14, {"restart": 2, "step": 12}),
        # Arrays of iteration 20 (steps 16 + 20 + 11) written, not committed: from 16.
        (False, "dask", "minibatch-lloyd", "arrays", -1, 47, {"restart": 2, "step": 16}),
        (False, "dask", "minibatch", "commit", -1, 8, {"restart": 0, "step": 8}),
        (False, "dask", "minibatch", "step", 1, 3, {"restart": 1, "step": 0}),
    ],
)
def test_driver_crash_then_resume_is_bit_identical(
    client, tmp_path, references, monkeypatch, in_subprocess, kind, algorithm, where, restart,
    at, resumed_from,
):
    ref, commits, _ = references[kind, algorithm]
    assert where == "step" or at in commits
    url = str(tmp_path / "km")
    if in_subprocess:
        crash_driver(url, kind, algorithm, client, where, restart, at)
    else:
        crash_in_process(url, kind, algorithm, client, where, restart, at, monkeypatch)
    res = fit(kind, algorithm, client, checkpoint=url, resume=True)
    assert res.info["resumed_from"] == resumed_from and not res.info["already_finished"]
    assert_same_result(res, ref)


@pytest.mark.parametrize("phase", ["arrays", "commit"])
def test_every_commit_of_a_minibatch_fit_resumes_exactly(tmp_path, references, phase,
                                                        monkeypatch):
    ref, commits, _ = references["numpy", "minibatch"]
    for at in commits[1::3]:
        url = str(tmp_path / f"km{at}")
        crash_in_process(url, "numpy", "minibatch", None, phase, -1, at, monkeypatch)
        assert_same_result(fit("numpy", "minibatch", checkpoint=url, resume=True), ref)


@pytest.mark.parametrize("kind", ["numpy", "dask"])
def test_every_commit_of_the_default_fit_resumes_exactly(client, tmp_path, references, kind,
                                                         monkeypatch):
    """Commits in the mini-batch phase and in the Lloyd phase resume bit-identically
    (every commit on numpy; every other one and the last on dask, whose fits of these
    600 rows take a second each in round trips)."""
    import zarr

    ref, commits, _ = references[kind, "minibatch-lloyd"]
    if kind == "dask":
        commits = sorted(set(commits[::2]) | {commits[-1]})
    phases = set()
    for at in commits:
        url = str(tmp_path / f"km{at}")
        crash_in_process(url, kind, "minibatch-lloyd", client, "commit", -1, at, monkeypatch)
        state = zarr.open_group(url).attrs["dkicf"]["commit"]["state"]
        phases.add(state["run"]["phase"] if state["run"] else
                   "lloyd" if state["lloyd"] else None)
        assert_same_result(fit(kind, "minibatch-lloyd", client, checkpoint=url, resume=True),
                           ref)
    assert {"minibatch", "lloyd"} <= phases


def test_a_fit_without_seed_resumes_with_the_seeds_it_saved(tmp_path, monkeypatch):
    url = tmp_path / "km"
    monkeypatch.setitem(COMMON, "random_state", None)
    crash_in_process(str(url), "numpy", "minibatch", None, "commit", -1, 8, monkeypatch)
    shutil.copytree(url, tmp_path / "copy")
    one = fit("numpy", "minibatch", checkpoint=str(url), resume=True)
    two = fit("numpy", "minibatch", checkpoint=str(tmp_path / "copy"), resume=True)
    assert_same_result(one, two)


# ----------------------------------------------------------------- refusals and no-ops


def test_a_commit_of_the_earlier_run_by_run_layout_is_refused_untouched(tmp_path, monkeypatch):
    """Commits made before the restarts shared their Lloyd passes hold one run's state at a
    time: resuming one is refused, naming the fix, and the checkpoint is left as it was."""
    import zarr

    url = str(tmp_path / "km")
    crash_in_process(url, "numpy", "minibatch", None, "commit", -1, 8, monkeypatch)
    group = zarr.open_group(url)
    meta = group.attrs["dkicf"]
    del meta["commit"]["state"]["layout"]  # as the earlier layout wrote it
    group.attrs["dkicf"] = meta
    with pytest.raises(CheckpointMismatchError, match=r"earlier version of dkicf.*overwrite=True"):
        fit("numpy", "minibatch", checkpoint=url, resume=True)
    assert zarr.open_group(url).attrs["dkicf"] == meta




@pytest.mark.parametrize(
    "change, match",
    [
        ({"n_clusters": 4}, r"n_clusters: checkpoint 3, this call 4"),
        ({"batch_size": 64}, r"batch_size: checkpoint 32, this call 64"),
        ({"random_state": 1}, r"random_state: checkpoint 0, this call 1"),
        ({"algorithm": "lloyd"}, r"algorithm: checkpoint 'minibatch', this call 'lloyd'"),
        ({"data": True}, r"the data differ in 1 row chunk\(s\), first chunk 0 \(rows 0-599\)"),
        ({"shape": True}, r"shape: checkpoint \[600, 4\], this call \[599, 4\]"),
    ],
)
def test_resume_with_other_data_or_parameters_is_refused(references, change, match):
    _, _, url = references["numpy", "minibatch"]
    P = make_P()
    if change.pop("data", False):
        P[333, 1] += 1e-9
    if change.pop("shape", False):
        P = P[:-1]
    k = change.pop("n_clusters", 3)
    kw = dict(CASES["numpy", "minibatch"], **COMMON)
    with pytest.raises(CheckpointMismatchError, match=match):
        kmeans(P, k, checkpoint=url, resume=True, **dict(kw, **change))


def test_resume_of_dask_P_names_the_chunk_that_differs(client, references):
    _, _, url = references["dask", "lloyd"]
    P = make_P()
    P[333, 1] += 1e-9
    with pytest.raises(CheckpointMismatchError, match=r"first chunk 2 \(rows 300-449\)"):
        kmeans(da.from_array(P, chunks=CHUNK), 3, client=client, checkpoint=url, resume=True,
               **CASES["dask", "lloyd"], **COMMON)


def test_resuming_a_finished_fit_does_nothing(client, references, caplog):
    ref, _, url = references["dask", "lloyd"]
    steps = []
    with caplog.at_level(logging.INFO, logger="dkicf.kmeans"):
        res = fit("dask", "lloyd", client, checkpoint=url, resume=True, progress=steps.append)
    assert res.info["already_finished"] is True and steps == []
    assert "holds a finished fit" in caplog.text and "nothing to do" in caplog.text
    assert_same_result(res, ref)


def test_an_existing_checkpoint_needs_resume_or_overwrite(tmp_path):
    url = str(tmp_path / "km")
    kw = dict(LLOYD, n_init=1, max_iter=2, random_state=0)
    first = kmeans(make_P(), 3, checkpoint=url, **kw)
    with pytest.raises(FileExistsError, match="resume=True to continue it, overwrite=True"):
        kmeans(make_P(), 3, checkpoint=url, **kw)
    again = kmeans(make_P(), 3, checkpoint=url, overwrite=True, **kw)
    assert not again.info["already_finished"] and again.info["resumed_from"] is None
    assert_same_result(again, first)


def test_foreign_data_at_the_location_is_never_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("keep")
    for flags in ({}, {"resume": True}, {"overwrite": True}):
        with pytest.raises(FileExistsError, match="not a dkicf kmeans checkpoint"):
            kmeans(make_P(), 3, checkpoint=str(tmp_path), **flags)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"resume": True}, ValueError, "resume=True needs checkpoint="),
        ({"resume": 1, "checkpoint": "x"}, TypeError, "resume must be True or False"),
        ({"checkpoint_every": 0, "checkpoint": "x"}, ValueError, "checkpoint_every must be >= 1"),
    ],
)
def test_bad_checkpoint_arguments_are_refused(tmp_path, kw, error, match):
    if "checkpoint" in kw:
        kw["checkpoint"] = str(tmp_path / kw["checkpoint"])
    with pytest.raises(error, match=match):
        kmeans(make_P(), 3, **kw)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------ the fit command


def test_fit_command_resumes_kmeans_after_a_crash(client, tmp_path):
    import zarr

    from dkicf import io
    from dkicf.pipeline import fit_store

    # Absolute paths: the workers of an existing cluster do not share the cwd.
    data, ck_url, out = (str(tmp_path / name) for name in ("data.zarr", "ck", "out.zarr"))
    io.generate("ring", data, 800, chunk_rows=200, random_state=0)
    params = {"n_clusters": 2, "gamma": 16.0, "rank": 8, "n_init": 2, "batch_size": 64,
              "max_iter": 30, "random_state": 1}
    ref = fit_store(data, str(tmp_path / "ref.zarr"), params, client=client)

    def crash(info):
        if type(info).__name__ == "KMeansProgress" and (info.restart, info.step) == (1, 3):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit_store(data, out, params, client=client, checkpoint=ck_url, progress=crash)
    assert zarr.open_group(ck_url + "/kmeans").attrs["dkicf"]["commit"]["state"]["restart"] == 1
    resumed = subprocess.run(
        [sys.executable, "-m", "dkicf.cli", "fit", data, "--clusters", "2", "--gamma", "16",
         "--rank", "8", "--n-init", "2", "--batch-size", "64", "--max-iter", "30",
         "--seed", "1", "--out", out, "--checkpoint", ck_url, "--resume",
         "--scheduler", client.scheduler.address, "--quiet"],
        capture_output=True, text=True, timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed_from_rank: 8" in resumed.stdout
    assert "kmeans_resumed_from: {'restart': 1, 'step': 0}" in resumed.stdout
    assert f"inertia: {ref['inertia']:.6g}" in resumed.stdout
    expected, res = zarr.open_group(str(tmp_path / "ref.zarr")), zarr.open_group(out)
    for name in ("labels", "cluster_centers", "P"):
        np.testing.assert_array_equal(res[name][...], expected[name][...])
