"""The command line end to end (subprocess), its errors, and an out-of-core fit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _tied import tied_popen

from dkicf.synthetic import make_ring


def dkicf(*args, cwd, timeout=300):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "dkicf.cli", *map(str, args)], cwd=cwd, capture_output=True,
        text=True, timeout=timeout, env=env,
    )


CLUSTER = ("--workers", "2", "--threads", "1", "--memory-limit", "1GiB", "--quiet")


def run_main(capsys, *args, cwd=None):
    """``dkicf ARGS`` in this process (no interpreter to start): (status, stdout, stderr)."""
    from dkicf.cli import main

    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ring_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    X, y = make_ring(3000, random_state=0)
    np.savez(tmp / "ring.npz", X=X, y=y)
    proc = dkicf("convert", tmp / "ring.npz", tmp / "ring.zarr", "--dtype", "float64",
                 "--chunk-rows", "700", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp


def test_convert_fit_predict_info_plot(ring_store):
    tmp = ring_store
    fit = dkicf("fit", "ring.zarr", "--clusters", "2", "--gamma", "2^4", "--rank", "50",
                "--out", "model.zarr", *CLUSTER, cwd=tmp)
    assert fit.returncode == 0, fit.stderr
    report = dict(line.split(": ", 1) for line in fit.stdout.splitlines() if ": " in line)
    assert float(report["accuracy"]) == 1.0
    # Block greedy, the default: the paper's 50 pivots in fewer than its 51 passes.
    assert report["rank"] == "50" and 1 < int(report["n_passes"]) < 51

    import zarr

    group = zarr.open_group(str(tmp / "model.zarr"), mode="r")
    for name in ("labels", "P", "pivots", "pivot_rows", "cholesky_factor", "cluster_centers",
                 "trace_errors"):
        assert name in group, name
    assert group["labels"].chunks == (700,)
    assert group["P"].shape == (3000, 50)
    attrs = group.attrs["dkicf"]
    assert attrs["kind"] == "model"
    assert attrs["kernel"] == {"kernel": "gaussian", "gamma": 16.0}
    assert attrs["input"]["shape"] == [3000, 2]
    assert "dkicf" in attrs["versions"]
    L = group["cholesky_factor"][...]
    np.testing.assert_array_equal(np.triu(L, 1), 0)
    np.testing.assert_allclose(group["P"][...][group["pivots"][...]], L)

    pred = dkicf("predict", "model.zarr", "ring.zarr", "--out", "labels.zarr", *CLUSTER,
                 cwd=tmp)
    assert pred.returncode == 0, pred.stderr
    np.testing.assert_array_equal(zarr.open_group(str(tmp / "labels.zarr"))["labels"][...],
                                  group["labels"][...])

    info = dkicf("info", "ring.zarr", cwd=tmp)
    assert info.returncode == 0, info.stderr
    assert "shape: [3000, 2]" in info.stdout and "one task" in info.stdout
    info = dkicf("info", "model.zarr", cwd=tmp)
    assert info.returncode == 0 and "model" in info.stdout and "rank: 50" in info.stdout

    plot = dkicf("plot", "model.zarr", "--data", "ring.zarr", "--out-dir", "plots", cwd=tmp)
    assert plot.returncode == 0, plot.stderr
    import matplotlib.image

    for name in ("trace_error.png", "cluster_sizes.png", "clusters.png"):
        image = matplotlib.image.imread(tmp / "plots" / name)
        assert image.ndim == 3 and image.shape[0] > 100


@pytest.mark.parametrize("p_storage", ["memory", "zarr"])
def test_a_model_without_p_predicts_the_same(ring_store, tmp_path, p_storage, client, capsys):
    """--no-save-p leaves P out of the output (also when the fit kept it there in Zarr)."""
    import zarr

    tmp = ring_store
    # In this process, on the session's cluster: no interpreter or cluster to start.
    on = ("--scheduler", client.scheduler.address, "--quiet")
    args = ("fit", tmp / "ring.zarr", "--clusters", "2", "--gamma", "2^4", "--rank", "30",
            "--p-storage", p_storage, *on)
    full = run_main(capsys, *args, "--out", tmp_path / "full.zarr", cwd=tmp_path)
    slim = run_main(capsys, *args, "--out", tmp_path / "slim.zarr", "--no-save-p",
                    cwd=tmp_path)
    assert full[0] == 0 and slim[0] == 0, slim[2]
    with_p = zarr.open_group(str(tmp_path / "full.zarr"), mode="r")
    without = zarr.open_group(str(tmp_path / "slim.zarr"), mode="r")
    assert "P" in with_p and "P" not in without
    assert not (tmp_path / "slim.zarr" / "P").exists()
    np.testing.assert_array_equal(without["labels"][...], with_p["labels"][...])
    for name in ("pivots", "cholesky_factor", "cluster_centers"):
        np.testing.assert_array_equal(without[name][...], with_p[name][...])
    pred = run_main(capsys, "predict", tmp_path / "slim.zarr", tmp / "ring.zarr", "--out",
                    tmp_path / "labels.zarr", *on, cwd=tmp_path)
    assert pred[0] == 0, pred[2]
    labels = zarr.open_group(str(tmp_path / "labels.zarr"), mode="r")["labels"][...]
    np.testing.assert_array_equal(labels, with_p["labels"][...])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.zarr", "labels.zarr",
                                                          "slim.zarr"]


def test_existing_output_is_refused_and_left_intact(ring_store, capsys):
    tmp = ring_store
    out = tmp / "keep.zarr"
    out.mkdir()
    (out / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                               "attributes": {"mine": 1}}))
    before = (out / "zarr.json").read_bytes()
    code, _, err = run_main(capsys, "fit", "ring.zarr", "--clusters", "2", "--out", out,
                            *CLUSTER, cwd=tmp)
    assert code == 2
    assert "already exists" in err and "overwrite" in err
    assert "Traceback" not in err
    assert (out / "zarr.json").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["zarr.json"]


@pytest.mark.parametrize(
    "args, message, status",
    [
        (("fit", "missing.zarr", "--clusters", "2", "--out", "o.zarr"), "no Zarr store", 1),
        (("info", "missing.zarr"), "no Zarr store", 1),
        (("fit", "ring.zarr", "--clusters", "0", "--out", "o.zarr"), "expected an integer >= 1",
         2),
        (("fit", "ring.zarr", "--clusters", "2", "--gamma", "-1", "--out", "o.zarr"),
         "gamma must be > 0", 2),
        # Options for remote stores given with local paths only would be ignored.
        (("fit", "ring.zarr", "--clusters", "2", "--out", "o.zarr", "--storage-option",
          "anon=true"), "--storage-option applies to stores named by URL (s3://", 2),
        (("info", "ring.zarr", "--storage-options-file", "opts.json"),
         "--storage-options-file applies to stores named by URL", 2),
        (("generate", "ring", "g.zarr", "--n", "100", "--storage-option", "anon=true"),
         "every path here is local (g.zarr)", 2),
    ],
)
def test_errors_are_one_line_with_status_2_for_usage_and_1_for_the_rest(
        ring_store, args, message, status, capsys, monkeypatch):
    from dkicf.cli import main

    monkeypatch.chdir(ring_store)
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == status, err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2


def test_group_where_array_expected_and_debug_traceback(ring_store, tmp_path, capsys):
    import zarr

    from dkicf.io import DkicfIOError

    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w")
    g.create_group("sub")
    code, _, err = run_main(capsys, "fit", tmp_path / "g.zarr", "--clusters", "2", "--out",
                            tmp_path / "o.zarr", *CLUSTER, cwd=tmp_path)
    assert code == 1 and "without an array X" in err
    with pytest.raises(DkicfIOError, match="no Zarr store"):  # --debug: the exception itself
        run_main(capsys, "--debug", "info", tmp_path / "missing.zarr", cwd=tmp_path)


def test_labels_of_the_wrong_length_are_refused(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", X=np.zeros((10, 2)), y=np.zeros(9, dtype=int))
    code, _, err = run_main(capsys, "convert", tmp_path / "bad.npz", tmp_path / "bad.zarr",
                            cwd=tmp_path)
    assert code == 1 and "Traceback" not in err
    assert "9" in err and "10" in err
    assert not (tmp_path / "bad.zarr").exists()


def test_memory_limit_too_small_for_a_chunk_is_refused(tmp_path):
    from dkicf.pipeline import plan_fit

    with pytest.raises(MemoryError, match="--memory-limit"):
        plan_fit((10**6, 5000), 65536, 8, 1000, worker_memory=64 * 2**20)
    plan = plan_fit((10**6, 64), 65536, 4, 50, worker_memory=2 * 2**30)
    assert not plan.rechunked and plan.chunk_rows == 65536
    plan = plan_fit((10**6, 64), 65536, 4, 50, worker_memory=64 * 2**20)
    assert plan.rechunked and plan.chunk_rows < 65536
    assert plan.task_bytes <= 0.5 * 64 * 2**20


def test_generate_writes_chunk_by_chunk(tmp_path):
    proc = dkicf("generate", "spheres", tmp_path / "s.zarr", "--n", "5000", "--features", "5",
                 "--classes", "3", "--chunk-rows", "1000", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import zarr

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    assert g["X"].shape == (5000, 5) and g["X"].chunks == (1000, 5)
    assert sorted(np.unique(g["y"][...])) == [0, 1, 2]


@pytest.mark.slow
def test_out_of_core_fit_stays_within_worker_memory(tmp_path, monkeypatch):
    """X is twice the worker's memory limit; the fit completes and the worker stays below it."""
    import dask
    import distributed  # noqa: F401  (its configuration must be loaded before we set it)

    from dkicf import io, local_cluster
    from dkicf.pipeline import fit_store

    n, d = 1_000_000, 128
    io.generate("blobs", str(tmp_path / "big.zarr"), n, n_features=d, centers=4,
                chunk_rows=16384, dtype="float32", random_state=0)
    data_bytes = n * d * 4
    limit = 256 * 2**20
    # The workers, spawned with this sys.path, import the sampler by name too.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _rss import rss_sampler_peak, start_rss_sampler

    # No pausing or spilling: if memory grew with the data the worker would be
    # killed (and this test fail) instead of the fit hanging or spilling to disk.
    with dask.config.set({"distributed.worker.memory.pause": False,
                          "distributed.worker.memory.spill": False,
                          "distributed.worker.memory.target": False}):
        client = local_cluster(1, 1, memory_limit=limit)
    try:
        client.run(start_rss_sampler)
        report = fit_store(
            str(tmp_path / "big.zarr"), str(tmp_path / "out.zarr"),
            dict(n_clusters=4, gamma="median", rank=4, random_state=0, n_init=1),
            client=client, persist="no",
        )
        peaks = client.run(rss_sampler_peak)
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
    assert data_bytes > 1.8 * limit
    assert not report["x_in_memory"]
    assert report["accuracy"] > 0.99
    assert max(peaks.values()) < 0.95 * limit, peaks


def test_the_plan_never_holds_what_the_fit_would_refuse():
    """plan_fit keeps P in memory only where check_worker_memory lets the fit
    start: P and its vectors below dask's spill threshold, as configured."""
    import dask

    from dkicf._memory import check_worker_memory
    from dkicf.pipeline import plan_fit

    class Cluster:  # what check_worker_memory asks of a client
        def __init__(self, limit, n):
            self.workers = {f"w{k}": {"memory_limit": limit, "nthreads": 1} for k in range(n)}

        def scheduler_info(self, n_workers=-1):
            return {"workers": self.workers}

    limit, n_workers, d, s = 2**30, 2, 8, 50
    for spill in (0.7, 0.45):
        with dask.config.set({"distributed.worker.memory.spill": spill}):
            for n in np.linspace(2e5, 5e6, 60).astype(int):
                plan = plan_fit((int(n), d), 16384, 4, s, worker_memory=limit,
                                n_workers=n_workers)
                if plan.p_storage == "memory":
                    chunks = (plan.chunk_rows,) * (int(n) // plan.chunk_rows)
                    chunks += (int(n) - sum(chunks),) if int(n) % plan.chunk_rows else ()
                    check_worker_memory(Cluster(limit, n_workers), chunks, d, np.float32, s,
                                        None, plan.persist_x)
    # P alone just under 60% of the cluster, its vectors over: kept in Zarr.
    n = int(0.59 * n_workers * limit / (8 * s))
    assert plan_fit((n, d), 16384, 4, s, worker_memory=limit,
                    n_workers=n_workers).p_storage == "zarr"


def test_p_forced_into_memory_that_cannot_hold_it_is_refused_by_the_plan():
    from dkicf.pipeline import plan_fit

    with pytest.raises(MemoryError, match=r"does not fit below 60% of the cluster's 2.00 GiB"
                       r".*the k-means's state of every row \(136 bytes a row\).*"
                       r"--p-storage zarr"):
        plan_fit((10**7, 8), 16384, 4, 50, worker_memory=2**30, n_workers=2,
                 p_storage="memory")
    plan = plan_fit((10**5, 8), 16384, 4, 50, worker_memory=2**30, n_workers=2,
                    p_storage="memory")
    assert plan.p_storage == "memory"


# ---------------------------------------------------------------- outputs that are inputs


def _tree(path):
    """Every file under ``path`` with its bytes: what must survive a refused command."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("make_args, victim", [
    (lambda t: ("fit", t / "in.zarr", "--clusters", "2", "--out", t / "in.zarr"), "in.zarr"),
    (lambda t: ("fit", t / "in.zarr", "--clusters", "2", "--out", t / "in.zarr" / "m"),
     "in.zarr"),
    (lambda t: ("fit", t / "in.zarr", "--clusters", "2", "--out", t), "in.zarr"),
    (lambda t: ("fit", t / "in.zarr", "--clusters", "2", "--out", t / "in.zarr" / ".." /
                "in.zarr"), "in.zarr"),
    (lambda t: ("predict", t / "model.zarr", t / "in.zarr", "--out", t / "model.zarr"),
     "model.zarr"),
    (lambda t: ("predict", t / "model.zarr", t / "in.zarr", "--out", t / "in.zarr"), "in.zarr"),
])
def test_an_output_that_is_an_input_is_refused_even_with_overwrite(tmp_path, make_args, victim,
                                                                   capsys):
    import zarr

    for name in ("in.zarr", "model.zarr"):
        g = zarr.open_group(str(tmp_path / name), mode="w")
        g.create_array("X", data=np.arange(12.0).reshape(6, 2))
    before = {name: _tree(tmp_path / name) for name in ("in.zarr", "model.zarr")}
    code, _, err = run_main(capsys, *make_args(tmp_path), "--overwrite", *CLUSTER,
                            cwd=tmp_path)
    assert code == 2, err
    assert "would replace data this run reads" in err and "Traceback" not in err
    assert victim in err
    for name, tree in before.items():
        assert _tree(tmp_path / name) == tree


def test_resume_without_checkpoint_is_refused(ring_store, capsys):
    code, _, err = run_main(capsys, "fit", "ring.zarr", "--clusters", "2", "--resume", "--out",
                            "r.zarr", *CLUSTER, cwd=ring_store)
    assert code == 2 and "--resume" in err and "--checkpoint" in err
    assert not (ring_store / "r.zarr").exists()


def test_hints_are_spelled_as_the_commands_flags(tmp_path):
    import zarr

    from dkicf import checkpoint, io
    from dkicf.cli import _cli_message

    url = str(tmp_path / "ck.zarr")
    zarr.open_group(url, mode="w").attrs["dkicf"] = {"kind": checkpoint._CHECKPOINT}
    with pytest.raises(FileExistsError) as info:
        checkpoint._claim(url, checkpoint._CHECKPOINT, overwrite=False, resume=False,
                          what="checkpoint")
    assert "resume=True" in str(info.value)  # the Python API's spelling ...
    text = _cli_message(info.value)  # ... and the command line's
    assert "--resume" in text and "--checkpoint" in text and "=True" not in text
    with pytest.raises(io.OutputExistsError) as info:
        io.check_writable(url)
    assert "pass --overwrite to replace it" in _cli_message(info.value)


def _generate_then_sigterm(command: list, n: int, cwd, settle: float = 0.0):
    """Run ``command`` (a Python command line ending in dkicf's arguments) as ``dkicf
    generate blobs big.zarr`` of ``n`` rows; SIGTERM it ``settle`` seconds after its
    first chunk is written.  Returns its exit status and stderr."""
    import signal
    import time

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = tied_popen(
        [sys.executable, *command, "--quiet", "generate", "blobs", "big.zarr",
         "--n", str(n), "--features", "8", "--chunk-rows", "100000"],
        cwd=cwd, stderr=subprocess.PIPE, text=True, env=env,
    )
    deadline = time.monotonic() + 60
    while not list(cwd.glob(".big.zarr.dkicf-tmp-*/X/c/*")):
        assert proc.poll() is None and time.monotonic() < deadline, "no chunk written in time"
        time.sleep(0.02)
    time.sleep(settle)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    returncode, err = _generate_then_sigterm(["-m", "dkicf.cli"], 40_000_000, tmp_path)
    assert returncode == 143, err
    assert "terminated" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written left


_SLOW_LAST_WRITE = """
import asyncio, sys, time
import dkicf.io._stores as stores
from zarr.core.sync import loop

original = stores._put_below

def put_below(root, key, data, exclusive):
    if "/c/" in key and (root / "X" / "c").exists():
        # A chunk after the first: under way when SIGTERM comes, it ends just after
        # the staging folder is removed.
        while root.exists():
            time.sleep(0.005)
        time.sleep(0.05)
    return original(root, key, data, exclusive)

stores._put_below = put_below
from dkicf.cli import main
status = main(sys.argv[1:])

async def pending():
    return sum(not t.done() for t in asyncio.all_tasks()) - 1

print("PENDING", asyncio.run_coroutine_threadsafe(pending(), loop[0]).result(), file=sys.stderr)
sys.exit(status)
"""


def test_sigterm_lets_a_write_under_way_end_before_the_process_exits(tmp_path):
    """A chunk write under way at SIGTERM ends (failing, its folder gone) before the
    command returns: at exit, zarr stopped its loop with it pending, and asyncio printed
    "Task was destroyed but it is pending!" and a traceback after "terminated"."""
    # 0.1 s after the first chunk, the next chunk's write has begun.
    returncode, err = _generate_then_sigterm(["-c", _SLOW_LAST_WRITE], 400_000, tmp_path,
                                             settle=0.1)
    assert returncode == 143, err
    assert "PENDING 0" in err and "Traceback" not in err and "destroyed" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_a_finalizer_swallowed_still_stops_the_fit(ring_store, tmp_path,
                                                                 monkeypatch, capsys):
    """Python drops an exception raised inside an object's ``__del__`` (a dask future's
    release, say): a Ctrl-C landing there is raised again after the next pass, and the
    fit stops as for any Ctrl-C, its staged output removed."""
    import signal

    from dkicf import _cli_commands
    from dkicf.cli import main

    class Finalizer:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler raises here, inside __del__
            self.after = True  # Python prints "Exception ignored" and carries on

    calls = []
    original = _cli_commands._Progress.__call__

    def progress(self, info):
        calls.append(type(info).__name__)
        if len(calls) == 3:
            Finalizer()  # dropped at once: its __del__ swallows the KeyboardInterrupt
            calls.append("survived")
        return original(self, info)

    monkeypatch.setattr(_cli_commands._Progress, "__call__", progress)
    out = tmp_path / "m.zarr"
    before = signal.getsignal(signal.SIGINT)
    code = main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--gamma", "16",
                 "--rank", "60", "--tol", "0", "--pivoting", "greedy", "--out", str(out),
                 "--quiet"])
    err = capsys.readouterr().err
    assert "survived" in calls  # the interrupt did not come out of the finalizer
    assert code == 130, err
    assert "dkicf: interrupted" in err
    assert not out.exists() and not list(tmp_path.glob(".m.zarr.dkicf-tmp-*"))
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", ["2", "5"])
def test_ctrl_c_mid_fit_is_one_line(ring_store, tmp_path, workers):
    """Ctrl-C reaches the whole foreground process group, local workers included: only
    the driver reports it, and the staged output is removed.  With 5 workers the
    scheduler and nannies run in processes of their own, which the driver closes."""
    import signal
    import time

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = tied_popen(
        [sys.executable, "-m", "dkicf.cli", "fit", str(ring_store / "ring.zarr"), "--clusters",
         "2", "--gamma", "16", "--rank", "2000", "--tol", "0", "--pivoting", "greedy",
         "--out", str(tmp_path / "m.zarr"), *CLUSTER, "--workers", workers],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=env,
    )
    # The staged output appears once the cluster is up and the factorization starts.
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".m.zarr.dkicf-tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the fit did not start"
        time.sleep(0.05)
    time.sleep(3)  # into the factorization's passes
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "dkicf: interrupted", err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], err


def test_the_python_pipeline_refuses_an_output_that_is_an_input(tmp_path):
    import zarr

    from dkicf.io import DkicfIOError
    from dkicf.pipeline import fit_store, predict_store

    g = zarr.open_group(str(tmp_path / "in.zarr"), mode="w")
    g.create_array("X", data=np.arange(12.0).reshape(6, 2))
    before = _tree(tmp_path)
    with pytest.raises(DkicfIOError, match="is the dataset"):
        fit_store(str(tmp_path / "in.zarr"), str(tmp_path / "in.zarr"), {"n_clusters": 2},
                  client=None, overwrite=True)
    with pytest.raises(DkicfIOError, match="contains the model"):
        predict_store(str(tmp_path / "in.zarr"), str(tmp_path / "in.zarr" / "X"), str(tmp_path),
                      client=None, overwrite=True)
    assert _tree(tmp_path) == before


def test_checkpoint_every_without_checkpoint_is_refused(ring_store, capsys):
    from dkicf.cli import main

    code = main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--checkpoint-every",
                 "5", "--out", str(ring_store / "ce.zarr"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--checkpoint-every" in err and "--checkpoint URL" in err
    assert not (ring_store / "ce.zarr").exists()


def test_python_dash_m_dkicf_is_the_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dkicf", "--version"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    from dkicf import __version__

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dkicf {__version__}"


def _run_then_list_imported(commands: str, modules: tuple, cwd, timeout: float):
    """Run ``commands`` (Python, with ``dkicf.cli.main`` as ``main``) in a fresh process,
    which then prints which of ``modules`` it imported (``HEAVY [...]`` on stderr)."""
    code = ("import sys\nfrom dkicf.cli import main\n" + commands
            + f"print('HEAVY', sorted(m for m in {modules!r} if m in sys.modules), "
              "file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_help_and_version_import_neither_scikit_learn_nor_the_cluster(tmp_path):
    """What made ``dkicf --help`` take seconds: imports it does not need (scikit-learn,
    distributed, zarr; the parser reads the k-means names from dkicf.kmeans, with scipy)."""
    proc = _run_then_list_imported(
        "for argv in (['--version'], ['--help'], ['fit', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n",
        ("sklearn", "distributed", "zarr"), tmp_path, timeout=60)
    assert "HEAVY []" in proc.stderr, proc.stderr


def test_info_and_convert_do_without_scikit_learn(tmp_path):
    """``dkicf info`` took 5-6 s, most of it importing scikit-learn (through the
    benchmark module and the estimator), which describing a store does not need."""
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(300, 3)))
    proc = _run_then_list_imported(
        "assert main(['convert', 'x.npy', 'x.zarr', '--quiet']) == 0\n"
        "assert main(['info', 'x.zarr']) == 0\n",
        ("sklearn", "dkicf.estimator", "dkicf.bench"), tmp_path, timeout=120)
    assert "shape: [300, 3]" in proc.stdout, proc.stdout
    assert "HEAVY []" in proc.stderr, proc.stderr


def test_predict_and_plot_read_the_model_without_scikit_learn(ring_store, tmp_path, capsys):
    """``dkicf predict`` and ``dkicf plot`` imported the estimator, and with it
    scikit-learn (1.5-3 s of their 5-7 s), only to read the saved model."""
    import zarr

    from dkicf.cli import main

    assert main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--gamma", "16",
                 "--rank", "30", "--out", str(tmp_path / "m.zarr"), "--quiet"]) == 0
    capsys.readouterr()
    proc = _run_then_list_imported(
        f"assert main(['predict', 'm.zarr', {str(ring_store / 'ring.zarr')!r}, "
        "'--out', 'labels.zarr', '--quiet']) == 0\n"
        "assert main(['plot', 'm.zarr', '--out-dir', 'plots', '--quiet']) == 0\n",
        ("sklearn", "dkicf.estimator"), tmp_path, timeout=180)
    assert "HEAVY []" in proc.stderr, proc.stderr
    assert "accuracy: 1" in proc.stdout, proc.stdout  # the rings, told apart as by the fit
    fitted = zarr.open_array(tmp_path / "m.zarr" / "labels")[:]
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "labels.zarr" / "labels")[:],
                                  fitted)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "cluster_sizes.png", "trace_error.png"]


def test_the_package_api_resolves_lazily():
    import dkicf
    import dkicf.kmeans  # the submodule: dkicf.kmeans stays the function

    assert callable(dkicf.kmeans) and dkicf.kmeans.__module__ == "dkicf.kmeans"
    for name in dkicf.__all__:
        assert getattr(dkicf, name) is not None, name
    assert dkicf.KernelKMeans.__module__ == "dkicf.estimator"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dkicf.nope  # noqa: B018


def test_help_shows_every_default(capsys):
    from dkicf.cli import main

    for command in ("fit", "predict", "convert", "generate", "info", "plot", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "-v, --verbose" in text
        if command in ("fit", "predict", "demo"):
            for default in ("--workers WORKERS local or kubernetes workers (default: auto, "
                            "dask config dkicf.cluster.workers; auto: one a core of this "
                            "machine, 2 kubernetes pods)",
                            "--threads THREADS threads per worker (default: 1, dask config "
                            "dkicf.cluster.threads)",
                            "--jobs JOBS batch jobs (slurm/pbs; default: 1)",
                            "--timeout TIMEOUT seconds to wait for a scheduler",
                            "--name NAME cluster name (kubernetes) (default: dkicf)"):
                assert default in text, (command, default)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "1 failure while running" in " ".join(capsys.readouterr().out.split())


def test_verbose_shows_dkicf_info_logs(tmp_path):
    """-v: dkicf's INFO logs reach stderr; without it, only warnings."""
    code = (
        "import logging, sys\n"
        "from dkicf.cli import main\n"
        "main(sys.argv[1:] + ['info', 'missing.zarr'])\n"
        "logging.getLogger('dkicf.probe').info('probe message')\n"
        "logging.getLogger('distributed.probe').info('distributed chatter')\n"
    )
    for flags, shown in (([], False), (["-v"], True), (["--verbose"], True)):
        proc = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert ("INFO dkicf.probe: probe message" in proc.stderr) is shown, proc.stderr
        assert "distributed chatter" not in proc.stderr


def test_a_scheduler_that_does_not_answer_is_a_runtime_failure(ring_store, capsys):
    import socket

    from dkicf.cli import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--out",
                 str(ring_store / "nowhere.zarr"), "--scheduler", f"tcp://127.0.0.1:{port}",
                 "--timeout", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_small_data_run_in_process_and_report_json(ring_store, tmp_path):
    """No cluster flag and data that fit in memory: fit and predict run in this process
    (no LocalCluster), with the same model format, and --json prints one object."""
    import zarr

    fit = dkicf("-v", "fit", ring_store / "ring.zarr", "--clusters", "2", "--gamma", "16",
                "--rank", "50", "--out", tmp_path / "m.zarr", "--quiet", "--json", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr
    report = json.loads(fit.stdout)
    assert report["where"] == "in-process" and report["accuracy"] == 1.0
    assert report["rank"] == 50 and report["out"] == str(tmp_path / "m.zarr")
    assert "running in this process on numpy" in fit.stderr
    assert "distributed" not in fit.stderr
    group = zarr.open_group(str(tmp_path / "m.zarr"), mode="r")
    assert group["labels"].chunks == (700,) and group["P"].shape == (3000, 50)
    pred = dkicf("predict", tmp_path / "m.zarr", ring_store / "ring.zarr", "--out",
                 tmp_path / "l.zarr", "--json", cwd=tmp_path)
    assert pred.returncode == 0, pred.stderr
    assert json.loads(pred.stdout)["where"] == "in-process"
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "l.zarr"))["labels"][...],
                                  group["labels"][...])
    info = dkicf("info", tmp_path / "m.zarr", "--json", cwd=tmp_path)
    details = json.loads(info.stdout)
    assert details["kind"] == "model" and details["rank"] == 50
    info = dkicf("info", ring_store / "ring.zarr", "--json", "--rank", "20", cwd=tmp_path)
    details = json.loads(info.stdout)
    assert details["shape"] == [3000, 2] and details["fit_estimate"]["rank"] == 20
    # The k-means's estimate: its state of every row (k-means||: a distance and a label
    # per run, and the squared norms, twice) and a mini-batch fetch (at most every row of P).
    fetch = 3000 * 8 * 20
    assert details["fit_estimate"]["kmeans_bytes"] == 3000 * 2 * (5 * 12 + 8) + fetch
    info = dkicf("info", ring_store / "ring.zarr", "--json", "--rank", "20", "--n-init", "10",
                 cwd=tmp_path)
    assert json.loads(info.stdout)["fit_estimate"]["kmeans_bytes"] == 3000 * 2 * 128 + fetch
    info = dkicf("info", ring_store / "ring.zarr", "--json", "--rank", "20", "--init",
                 "k-means++", cwd=tmp_path)
    assert json.loads(info.stdout)["fit_estimate"]["kmeans_bytes"] == 3000 * 8 + fetch
    info = dkicf("info", ring_store / "ring.zarr", "--json", "--rank", "20", "--algorithm",
                 "lloyd", cwd=tmp_path)  # Lloyd alone fetches no mini-batch rows
    assert json.loads(info.stdout)["fit_estimate"]["kmeans_bytes"] == 3000 * 2 * 68


def test_refusals_come_before_any_cluster_starts(ring_store, tmp_path, capsys, monkeypatch):
    import dkicf.deploy
    from dkicf.cli import main

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(dkicf.deploy, "start_cluster", no_cluster)
    store = str(ring_store / "ring.zarr")
    code = main(["fit", store, "--clusters", "3001", "--out", str(tmp_path / "o.zarr"),
                 "--cluster", "local", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "n_samples=3000 should be >= n_clusters=3001" in err
    np.save(tmp_path / "wide.npy", np.zeros((10, 3)))
    from dkicf import io

    io.convert(tmp_path / "wide.npy", tmp_path / "wide.zarr")
    main(["fit", store, "--clusters", "2", "--rank", "5", "--out", str(tmp_path / "m.zarr"),
          "--quiet"])
    capsys.readouterr()
    code = main(["predict", str(tmp_path / "m.zarr"), str(tmp_path / "wide.zarr"), "--out",
                 str(tmp_path / "l.zarr"), "--cluster", "local", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "has 3 features but the model" in err and "fitted on 2" in err
    assert not (tmp_path / "o.zarr").exists() and not (tmp_path / "l.zarr").exists()


def test_a_bad_workers_setting_is_a_usage_error_before_any_cluster_starts(
        ring_store, tmp_path, capsys, monkeypatch):
    import dask

    import dkicf.deploy
    from dkicf.cli import main

    started = []

    def start_cluster(kind, **options):
        started.append(options)
        raise RuntimeError("no cluster here")

    monkeypatch.setattr(dkicf.deploy, "start_cluster", start_cluster)
    store = str(ring_store / "ring.zarr")
    with dask.config.set({"dkicf.cluster.workers": "many"}):
        code = main(["fit", store, "--clusters", "3", "--out", str(tmp_path / "o.zarr"),
                     "--cluster", "local", "--quiet"])
        assert code == 2 and started == []
        assert ("the dask setting dkicf.cluster.workers is 'many': it must be an integer >= 1 "
                "or 'auto' (or pass --workers).") in capsys.readouterr().err
        # --workers overrides the setting.
        code = main(["fit", store, "--clusters", "3", "--out", str(tmp_path / "o.zarr"),
                     "--workers", "3", "--quiet"])
        assert code == 1 and "no cluster here" in capsys.readouterr().err
    assert started == [{"workers": 3, "threads": 1, "memory_limit": "auto", "dashboard": False}]


def test_demo_writes_to_a_temporary_folder_and_says_where_and_how_much(tmp_path):
    proc = dkicf("demo", "--n", "2000", "--rank", "10", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    first = proc.stdout.splitlines()[0]
    assert first.startswith("data, model and plots go to ")
    work = first.rsplit(" ", 1)[1]
    try:
        last = proc.stdout.splitlines()[-1]
        assert last.startswith(f"{work} holds ") and last.endswith(f"rm -r {work}")
        assert "where: in-process" in proc.stdout
    finally:
        import shutil

        shutil.rmtree(work)


def test_nan_on_a_local_cluster_is_one_line_without_worker_dumps(tmp_path):
    """The workers' "Compute Failed" dump of an error dkicf reports itself is dropped, and
    distributed's INFO logs stay out of stderr."""
    import zarr

    X = np.random.default_rng(0).normal(size=(2000, 2))
    X[1500, 1] = np.nan
    zarr.open_group(str(tmp_path / "nan.zarr"), mode="w").create_array(
        "X", data=X, chunks=(500, 2))
    proc = dkicf("fit", "nan.zarr", "--clusters", "2", "--gamma", "1", "--out", "m.zarr",
                 "--cluster", "local", "--workers", "1", "--quiet", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "dkicf fit: error: X contains NaN or infinity: first at row 1500 (chunk 3). Remove or "
        "impute those rows before clustering."
    ]


def test_worker_filter_drops_only_dkicf_errors():
    import logging

    from dkicf._worker_preload import _OwnErrorsFilter

    def record(exception_text):
        return logging.LogRecord("distributed.worker", logging.ERROR, "w.py", 1,
                                 "Compute Failed\nKey: %s\nState: %s\nTask: %s\nException: %r\n",
                                 ("k", "executing", "task", exception_text), None)

    keep = _OwnErrorsFilter().filter
    assert not keep(record("NonFiniteError('X contains NaN')"))
    assert not keep(record("MissingChunkError('chunk c/1/0 ...')"))
    assert keep(record("ZeroDivisionError('division by zero')"))
    assert keep(logging.LogRecord("distributed.worker", logging.ERROR, "w.py", 1, "other",
                                  (), None))


def test_worker_filter_drops_sends_to_a_closed_peer_only():
    """The worker's traceback of a result it could not send to a worker whose connection
    closed (the cluster closing after Ctrl-C) stays out of the command's stderr."""
    import logging
    import signal

    from dkicf import _worker_preload
    from dkicf._worker_preload import _PeerGoneFilter

    try:
        raise OSError("Stream is closed")
    except OSError:
        info = sys.exc_info()
    keep = _PeerGoneFilter().filter
    assert not keep(logging.LogRecord("distributed.worker", logging.ERROR, "w.py", 1,
                                      "failed during get data with %s -> %s",
                                      ("tcp://a", "tcp://b"), info))
    assert keep(logging.LogRecord("distributed.worker", logging.ERROR, "w.py", 1,
                                  "failed to communicate with scheduler", (), info))
    # The preload puts it on the workers' logger.
    log = logging.getLogger("distributed.worker")
    before, handler = list(log.filters), signal.getsignal(signal.SIGINT)
    try:
        _worker_preload.dask_setup(None)
        assert any(isinstance(f, _PeerGoneFilter) for f in log.filters)
    finally:
        log.filters[:] = before
        signal.signal(signal.SIGINT, handler)


def test_overwrite_replaces_only_what_the_command_writes(ring_store, tmp_path, capsys):
    """convert --overwrite onto a model is refused; onto a dataset it replaces it."""
    from dkicf.cli import main

    model = tmp_path / "m.zarr"
    assert main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--rank", "5",
                 "--out", str(model), "--quiet"]) == 0
    before = _tree(model)
    np.save(tmp_path / "x.npy", np.ones((4, 2)))
    capsys.readouterr()
    code = main(["convert", str(tmp_path / "x.npy"), str(model), "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a model, and --overwrite replaces only a dataset" in err
    code = main(["generate", "ring", str(model), "--n", "10", "--overwrite", "--quiet"])
    assert code == 2 and _tree(model) == before
    data = tmp_path / "d.zarr"
    assert main(["convert", str(tmp_path / "x.npy"), str(data), "--quiet"]) == 0
    assert main(["generate", "ring", str(data), "--n", "10", "--overwrite", "--quiet"]) == 0
    code = main(["fit", str(ring_store / "ring.zarr"), "--clusters", "2", "--out", str(data),
                 "--overwrite", "--quiet"])
    assert code == 2 and "holds a dataset, and --overwrite replaces only a model" in (
        capsys.readouterr().err)


def test_convert_columns_flags(tmp_path, capsys):
    from dkicf.cli import main

    (tmp_path / "t.csv").write_text("id,a,b,name\n7,1,2,x\n8,3,4,y\n")
    code = main(["convert", str(tmp_path / "t.csv"), str(tmp_path / "t.zarr"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "line 2, column 4 (name): 'x' is not a number" in err
    assert "leave the column out with --drop-columns" in err
    assert main(["convert", str(tmp_path / "t.csv"), str(tmp_path / "t.zarr"),
                 "--drop-columns", "id,name", "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "t.csv"), str(tmp_path / "u.zarr"),
                 "--columns", "b,a", "--quiet"]) == 0
    from dkicf import io

    np.testing.assert_array_equal(io.open_dataset(str(tmp_path / "t.zarr"))[0].compute(),
                                  [[1, 2], [3, 4]])
    np.testing.assert_array_equal(io.open_dataset(str(tmp_path / "u.zarr"))[0].compute(),
                                  [[2, 1], [4, 3]])


def test_fit_takes_every_registered_kernel_name_and_its_hyperparameters():
    """--kernel and the hyper-parameter flags come from dkicf.kernels' registry."""
    from dkicf.cli import build_parser
    from dkicf.kernels import HYPERPARAMETERS, KERNELS, Kernel, kernel_names, register_kernel

    base = ["fit", "d.zarr", "--clusters", "2", "--out", "o.zarr"]
    assert {"gaussian", "rbf", "laplacian", "polynomial", "poly", "linear"} <= set(kernel_names())
    for name in kernel_names():
        args = build_parser(["fit"]).parse_args(base + ["--kernel", name])
        assert args.kernel == name
        for key in KERNELS[name].hyperparameters:
            assert getattr(args, key) == HYPERPARAMETERS[key].default
    args = build_parser(["fit"]).parse_args(base + ["--kernel", "poly", "--gamma", "2^-2",
                                                    "--degree", "2", "--coef0", "0.5"])
    assert (args.gamma, args.degree, args.coef0) == (0.25, 2, 0.5)

    class TestOnlyKernel(Kernel):
        name = "test-only"
        aliases = ("test-only-alias",)
        hyperparameters = ("gamma",)

        def __init__(self, gamma):
            self.gamma = float(gamma)

        def diag(self, X, aux=None):
            return np.ones(len(X))

        def block(self, A, B, a_aux=None, b_aux=None):
            return np.exp(-self.gamma * np.abs(A[:, None, 0] - B[None, :, 0]))

    saved = dict(KERNELS)
    try:
        register_kernel(TestOnlyKernel)
        for name in ("test-only", "test-only-alias"):
            args = build_parser(["fit"]).parse_args(base + ["--kernel", name, "--gamma", "3"])
            assert (args.kernel, args.gamma) == (name, 3.0)
    finally:
        KERNELS.clear()
        KERNELS.update(saved)
    with pytest.raises(SystemExit):
        build_parser(["fit"]).parse_args(base + ["--kernel", "test-only"])
