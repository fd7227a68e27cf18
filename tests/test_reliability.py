"""Reliability: damaged metadata, outputs over inputs, concurrent and refused writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr
from _tied import tied_popen

from dkicf import io
from dkicf.io import DkicfIOError

ROOT = Path(__file__).resolve().parents[1]

# The address space a child may use: the imports need well under this, and a
# structure sized by a metadata shape of 10**13 rows needs far more.
_CHILD_ADDRESS_SPACE = 3 << 30


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _claim_rows(array_dir: Path, rows: int) -> None:
    meta_path = array_dir / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = rows
    meta_path.write_text(json.dumps(meta))


def _swollen_dataset(path: Path, chunks: int = 400, rows: int = 10**13) -> Path:
    """A dataset group whose X and y claim ``rows`` rows; ``chunks`` chunks of 5 rows exist."""
    group = zarr.open_group(str(path), mode="w")
    X = np.arange(chunks * 10.0).reshape(chunks * 5, 2)
    group.create_array("X", data=X, chunks=(5, 2))
    group.create_array("y", data=np.zeros(chunks * 5, dtype=np.int64), chunks=(5,))
    _claim_rows(path / "X", rows)
    _claim_rows(path / "y", rows)
    return path


def _run_limited(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child limited to a few GiB of address space."""
    prelude = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_ADDRESS_SPACE}, {_CHILD_ADDRESS_SPACE}))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------
# metadata is input: checked before anything sized by it is allocated


def test_a_shape_the_chunks_do_not_back_is_refused_before_allocating(tmp_path):
    store = _swollen_dataset(tmp_path / "big.zarr")
    before = _tree(store)
    proc = _run_limited("""
        from dkicf import io, pipeline
        from dkicf.io import DkicfIOError
        for name, call in [
            ("open_dataset", lambda: io.open_dataset("big.zarr")),
            ("as_dask", lambda: io.as_dask("big.zarr/X")),
            ("info", lambda: pipeline.describe("big.zarr")),
            ("fit", lambda: pipeline.fit_store("big.zarr", "out.zarr", {"n_clusters": 2},
                                               client=None)),
        ]:
            try:
                call()
            except DkicfIOError as exc:
                print(name, "REFUSED", exc)
            else:
                print(name, "ACCEPTED")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    for line in lines:
        assert "REFUSED" in line, line
        assert f"chunk 'c/400/0' of the Zarr array {store / 'X'} is missing" in line
        assert "claims shape (10000000000000, 2) in 2,000,000,000,000 chunk(s) of (5, 2)" in line
        assert "the store holds 400 chunk(s): the metadata does not match the data" in line
        assert "restore it" in line
    assert not (tmp_path / "out.zarr").exists()
    assert _tree(store) == before


def test_a_shape_no_graph_could_hold_is_refused_where_chunks_are_not_listed(tmp_path,
                                                                            monkeypatch):
    """On object stores only the last chunk is looked for; the graph size is bounded too."""
    import fsspec

    store = _swollen_dataset(tmp_path / "big.zarr")
    fs = fsspec.filesystem("memory")
    fs.put(str(store), "/swollen/big.zarr", recursive=True)
    monkeypatch.setattr(io._checks, "_LISTED_PROTOCOLS", frozenset())
    url = "memory://swollen/big.zarr"
    try:
        # Seen as an s3:// store would be: its last chunk is missing.
        with pytest.raises(io.MissingChunkError,
                           match=r"chunk 'c/1999999999999/0' of the Zarr array memory://swollen/"
                                 r"big.zarr/X is missing from the store \(its metadata claims "
                                 r"shape \(10000000000000, 2\).*it is the last of them\)"):
            io.open_dataset(url)
        # Now the last chunk is there too: 2e12 chunks make a graph no machine holds.
        fs.pipe("/swollen/big.zarr/X/c/1999999999999/0",
                (store / "X" / "c" / "0" / "0").read_bytes())
        with pytest.raises(DkicfIOError, match=r"a task graph over that many chunks needs at "
                                               r"least [0-9.e+]+ GiB, more than the"):
            io.open_dataset(url)
    finally:
        fs.rm("/swollen", recursive=True)


def test_a_model_array_larger_than_memory_is_refused_before_reading(tmp_path):
    io.write_group(tmp_path / "m.zarr", {"centers": np.ones((3, 2)), "w": np.ones(4)}, {})
    _claim_rows(tmp_path / "m.zarr" / "centers", 10**13)
    meta_path = tmp_path / "m.zarr" / "centers" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 10**13
    meta_path.write_text(json.dumps(meta))
    proc = _run_limited("""
        from dkicf import io
        try:
            io.read_group("m.zarr")
        except io.DkicfIOError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED refusing m.zarr/centers: its "
                                  "metadata claims shape (10000000000000, 2) of float64"), \
        proc.stdout
    assert "restore the group or fit again" in proc.stdout


def test_complete_stores_pass_the_extent_checks(tmp_path):
    """v2, sharded and in-memory stores whose chunks are all there open as before."""
    X = np.arange(60.0).reshape(30, 2)
    zarr.create_array(str(tmp_path / "v2.zarr"), data=X, chunks=(7, 2), zarr_format=2)
    zarr.create_array(str(tmp_path / "sh.zarr"), data=X, chunks=(5, 2), shards=(10, 2))
    for url in (tmp_path / "v2.zarr", tmp_path / "sh.zarr", f"file://{tmp_path / 'sh.zarr'}"):
        np.testing.assert_array_equal(io.as_dask(url).compute(scheduler="synchronous"), X)
    io.write_group("memory://extent/d.zarr", {"X": X}, {})
    in_memory = io.as_dask("memory://extent/d.zarr/X")
    np.testing.assert_array_equal(in_memory.compute(scheduler="synchronous"), X)
    # One chunk file gone: refused at opening, naming the count, not at the read.
    (tmp_path / "v2.zarr" / "4.0").unlink()
    with pytest.raises(io.MissingChunkError, match=r"chunk '4.0' .* in 5 chunk\(s\) of \(7, 2\), "
                                                   r"but the store holds 4 chunk\(s\)"):
        io.open_array(tmp_path / "v2.zarr")


# --------------------------------------------------------------------------
# an output never replaces an input, the checkpoint included


@pytest.mark.parametrize("out_of", [lambda ck: ck, lambda ck: ck / "model.zarr",
                                    lambda ck: ck.parent])
def test_an_output_over_its_checkpoint_is_refused_even_with_overwrite(tmp_path, out_of):
    from dkicf import cli, pipeline

    io.generate("ring", tmp_path / "data.zarr", 40)
    ck = tmp_path / "run" / "ck.zarr"
    io.write_group(ck, {"P": np.ones((4, 2))}, {"dkicf": {"kind": "icf-checkpoint"}})
    before = {name: _tree(tmp_path / name) for name in ("data.zarr", "run")}
    out = out_of(ck)
    with pytest.raises(DkicfIOError, match=rf"the output {out} (is|is inside|contains) the "
                                           rf"checkpoint {ck}; writing it would replace data"):
        pipeline.fit_store(str(tmp_path / "data.zarr"), str(out), {"n_clusters": 2},
                           client=None, overwrite=True, checkpoint=str(ck), resume=True)
    code = cli.main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out", str(out),
                     "--checkpoint", str(ck), "--overwrite", "--quiet"])
    assert code == 2
    for name, tree in before.items():
        assert _tree(tmp_path / name) == tree


# --------------------------------------------------------------------------
# concurrent use: one run at a time writes a location


def _child(code: str, cwd: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return tied_popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_of_runs_racing_for_a_location_exactly_one_claims_it(tmp_path):
    import time

    n = 3
    racers = [_child(f"""
        import os, time
        from dkicf import io
        open("ready-{i}", "w").close()
        while not os.path.exists("go"):
            time.sleep(0.005)
        try:
            with io.claimed({{"the output": "model.zarr"}}):
                print("WON", flush=True)
                while not os.path.exists("done"):
                    time.sleep(0.01)
        except io.ClaimedError as exc:
            print("REFUSED", exc, flush=True)
    """, tmp_path) for i in range(n)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (tmp_path / "go").touch()
    # The winner holds its claim until every other racer has been answered.
    while sum(p.poll() is not None for p in racers) < n - 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (tmp_path / "done").touch()
    outs = [p.communicate(timeout=60)[0] for p in racers]
    assert sum(out.startswith("WON") for out in outs) == 1, outs
    for out in outs:
        if out.startswith("REFUSED"):
            assert f"the output {tmp_path / 'model.zarr'} is being written by another dkicf " \
                   "run (pid" in out
            assert "Wait for that run to end, or choose another location." in out
    assert not (tmp_path / ".model.zarr.dkicf-claim").exists()


def test_the_claim_of_a_killed_run_is_stale_and_taken_over_only_when_asked(tmp_path):
    proc = _child("""
        import os, signal
        from dkicf import io
        with io.claimed({"the checkpoint": "ck.zarr"}):
            os.kill(os.getpid(), signal.SIGKILL)
    """, tmp_path)
    proc.communicate(timeout=60)
    assert proc.returncode == -9
    claim = tmp_path / ".ck.zarr.dkicf-claim"
    assert json.loads(claim.read_text())["pid"] == proc.pid
    with pytest.raises(io.ClaimedError, match=rf"the checkpoint {tmp_path / 'ck.zarr'} was "
                       rf"claimed by a dkicf run that is no longer running \(pid {proc.pid} on "
                       r".*Pass resume=True \(dkicf fit: --resume\)") as err:
        with io.claimed({"the checkpoint": tmp_path / "ck.zarr"}):
            pass
    assert err.value.stale
    assert json.loads(claim.read_text())["pid"] == proc.pid
    with io.claimed({"the checkpoint": tmp_path / "ck.zarr"}, take_over=True):
        assert json.loads(claim.read_text())["pid"] == os.getpid()
    assert not claim.exists()


def test_a_reused_pid_is_stale_and_another_hosts_claim_is_never_taken(tmp_path):
    import socket

    claim = tmp_path / ".out.zarr.dkicf-claim"
    # This process's pid, but a start time that is not this process's: the pid was reused.
    claim.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": 1.0, "since": 1.0}))
    with pytest.raises(io.ClaimedError, match="no longer running"):
        with io.claimed({"the output": tmp_path / "out.zarr"}):
            pass
    with io.claimed({"the output": tmp_path / "out.zarr"}, take_over=True):
        pass
    claim.write_text(json.dumps({"pid": 1, "host": "elsewhere.example", "started": 1.0,
                                 "since": 1.0}))
    with pytest.raises(io.ClaimedError, match=rf"on another host \(pid 1 on elsewhere.example"
                                              rf".*If it has ended, remove {claim}"):
        with io.claimed({"the output": tmp_path / "out.zarr"}, take_over=True):
            pass
    claim.write_text("{not json")
    os.utime(claim, (1.0, 1.0))  # old enough not to be a claim being written
    with pytest.raises(io.ClaimedError, match="claim file that is not readable"):
        with io.claimed({"the output": tmp_path / "out.zarr"}):
            pass
    with io.claimed({"the output": tmp_path / "out.zarr"}, take_over=True):
        pass
    assert not claim.exists()


_PARAMS = {"n_clusters": 3, "gamma": 0.5, "rank": 12, "n_init": 1, "random_state": 0,
           "pivoting": "greedy", "max_iter": 30}


def _fit_child(address: str, cwd: Path, *, out: str, checkpoint: str, hold: bool = False,
               kill_at: int | None = None) -> subprocess.Popen:
    """A fit in another process on the test cluster.

    With ``hold``, it waits at its first progress report until the file
    ``release`` exists; with ``kill_at``, it SIGKILLs itself at that rank.
    """
    return _child(f"""
        import os, signal, time
        from distributed import Client
        from dkicf import pipeline

        def progress(p):
            rank = getattr(p, "rank", None)
            if rank is not None and {kill_at!r} is not None and rank >= {kill_at!r}:
                os.kill(os.getpid(), signal.SIGKILL)
            while {hold!r} and not os.path.exists("release"):
                time.sleep(0.05)

        with Client({address!r}) as client:
            pipeline.fit_store("data.zarr", {out!r}, {_PARAMS!r}, client=client,
                               checkpoint={checkpoint!r}, checkpoint_every=2, progress=progress)
        print("DONE", flush=True)
    """, cwd)


def _model(path: Path) -> dict[str, np.ndarray]:
    arrays, _ = io.read_group(path)
    return arrays


def test_a_second_fit_on_the_same_output_or_checkpoint_is_refused(client, tmp_path):
    import time

    from dkicf import cli, pipeline

    io.generate("blobs", tmp_path / "data.zarr", 1200, chunk_rows=300, centers=3)
    address = client.scheduler.address
    first = _fit_child(address, tmp_path, out="a.zarr", checkpoint="ck.zarr", hold=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / ".ck.zarr.dkicf-claim").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    for out, ck, what in [("a.zarr", None, "the output"), ("b.zarr", "ck.zarr", "the checkpoint")]:
        with pytest.raises(io.ClaimedError, match=rf"{what} {tmp_path / (ck or out)} is being "
                                                  rf"written by another dkicf run \(pid "
                                                  rf"{first.pid} "):
            pipeline.fit_store(str(tmp_path / "data.zarr"), str(tmp_path / out), _PARAMS,
                               client=client, overwrite=True, resume=ck is not None,
                               checkpoint=None if ck is None else str(tmp_path / ck))
    args = ["fit", str(tmp_path / "data.zarr"), "--clusters", "3", "--out",
            str(tmp_path / "c.zarr"), "--checkpoint", str(tmp_path / "ck.zarr"), "--resume",
            "--scheduler", address, "--quiet"]
    assert cli.main(args) == 1  # a failure while running: the location is busy
    assert not (tmp_path / "b.zarr").exists() and not (tmp_path / "c.zarr").exists()
    (tmp_path / "release").touch()
    out, err = first.communicate(timeout=300)
    assert "DONE" in out, err[-3000:]
    assert not (tmp_path / ".ck.zarr.dkicf-claim").exists()
    assert not (tmp_path / ".a.zarr.dkicf-claim").exists()
    # The fit that ran was not disturbed: it equals one run alone.
    pipeline.fit_store(str(tmp_path / "data.zarr"), str(tmp_path / "alone.zarr"), _PARAMS,
                       client=client)
    for name, value in _model(tmp_path / "alone.zarr").items():
        np.testing.assert_array_equal(_model(tmp_path / "a.zarr")[name], value, err_msg=name)


def test_a_killed_fit_is_resumed_by_taking_over_its_claims(client, tmp_path):
    from dkicf import pipeline

    io.generate("blobs", tmp_path / "data.zarr", 1200, chunk_rows=300, centers=3)
    killed = _fit_child(client.scheduler.address, tmp_path, out="m.zarr", checkpoint="ck.zarr",
                        kill_at=6)
    killed.communicate(timeout=300)
    assert killed.returncode == -9
    assert not (tmp_path / "m.zarr").exists()
    data, out, ck = (str(tmp_path / name) for name in ("data.zarr", "m.zarr", "ck.zarr"))
    with pytest.raises(io.ClaimedError, match=rf"no longer running \(pid {killed.pid} "):
        pipeline.fit_store(data, out, _PARAMS, client=client, checkpoint=ck)
    report = pipeline.fit_store(data, out, _PARAMS, client=client, checkpoint=ck, resume=True)
    assert report["resumed_from_rank"] >= 2
    pipeline.fit_store(data, str(tmp_path / "alone.zarr"), _PARAMS, client=client)
    alone = _model(tmp_path / "alone.zarr")
    resumed = _model(tmp_path / "m.zarr")
    for name in ("pivots", "cluster_centers", "cholesky_factor", "trace_errors"):
        np.testing.assert_array_equal(resumed[name], alone[name], err_msg=name)
    labels = io.open_member(out, "labels").compute()
    np.testing.assert_array_equal(labels, io.open_member(tmp_path / "alone.zarr",
                                                         "labels").compute())
    assert not list(tmp_path.glob(".*.dkicf-claim"))


# --------------------------------------------------------------------------
# test hygiene: processes started by tests end with the test run, even a killed one


def test_dask_processes_of_a_killed_test_run_end_with_it(tmp_path):
    """A stand-in for a test run starts a scheduler and a worker, then is SIGKILLed."""
    import signal
    import time

    import psutil

    runner = _child(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from _tied import tied_popen
        dask = lambda role: [sys.executable, "-m", f"distributed.cli.dask_{{role}}"]
        s = tied_popen(dask("scheduler") + ["--host", "127.0.0.1", "--port", "0",
                                            "--no-dashboard", "--scheduler-file", "s.json"])
        while True:
            try:
                open("s.json").close()
                break
            except FileNotFoundError:
                time.sleep(0.05)
        w = tied_popen(dask("worker") + ["--scheduler-file", "s.json", "--nworkers", "1",
                                         "--nthreads", "1", "--no-dashboard",
                                         "--host", "127.0.0.1"])
        print(s.pid, w.pid, flush=True)
        time.sleep(600)
    """, tmp_path)
    pids = [int(p) for p in runner.stdout.readline().split()]
    assert len(pids) == 2, runner.stderr.read() if runner.poll() is not None else ""
    # Wait for the worker's own process (the nanny's child): the whole tree is up.
    deadline = time.monotonic() + 120
    while not psutil.Process(pids[1]).children():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    tree = [psutil.Process(pid) for pid in pids]
    tree += [child for proc in tree for child in proc.children(recursive=True)]
    assert len(tree) >= 3
    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=30)
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


# --------------------------------------------------------------------------
# what the fuzzing found, kept as plain regression tests


def test_an_svmlight_index_too_large_for_memory_is_refused_before_allocating(tmp_path):
    src = tmp_path / "wide.svm"
    # The largest index that the svmlight parser takes (int32): 2e9 columns.
    src.write_text("1 1:0.5\n-1 2:1 2000000000:680\n")
    proc = _run_limited("""
        from dkicf import io
        try:
            io.convert("wide.svm", "wide.zarr")
        except io.DkicfIOError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED cannot convert wide.svm: it has 2,000,000,000 "
                                  "columns"), proc.stdout
    assert not (tmp_path / "wide.zarr").exists()


def test_damaged_npy_and_npz_files_are_refused_by_name(tmp_path):
    import io as bytes_io
    import zipfile

    good = tmp_path / "good.npy"
    np.save(good, np.ones((4, 2)))
    cases = {"empty.npy": b"", "cut.npy": good.read_bytes()[:60]}
    buf = bytes_io.BytesIO()
    np.savez(buf, X=np.ones((2, 2)), y=np.array([1, "a"], dtype=object))
    cases["objects.npz"] = buf.getvalue()
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DkicfIOError, match=rf"cannot read {tmp_path / name}: (the \.npy "
                                               r"file|its member y\.npy) is damaged or not a "
                                               r"plain numeric \.npy array"):
            io.convert(tmp_path / name, tmp_path / "out.zarr")
        assert not (tmp_path / "out.zarr").exists()
    assert zipfile.is_zipfile(tmp_path / "objects.npz")


def test_a_chunk_linked_from_outside_the_store_is_refused(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=10)
    io.generate("ring", tmp_path / "other.zarr", 40, chunk_rows=10, random_state=7)
    chunk = tmp_path / "d.zarr" / "X" / "c" / "1" / "0"
    chunk.unlink()
    chunk.symlink_to(tmp_path / "other.zarr" / "X" / "c" / "1" / "0")
    for call in (io.open_dataset, lambda s: io.as_dask(s / "X"),
                 lambda s: io.fingerprint(s / "X")):
        with pytest.raises(DkicfIOError, match=rf"{chunk} is a symbolic link to "
                                               rf"{tmp_path / 'other.zarr'}.*outside the store"):
            call(tmp_path / "d.zarr")
    # A link that stays inside the store, and a store reached through a link, are fine.
    chunk.unlink()
    (tmp_path / "d.zarr" / "X" / "c" / "spare").write_bytes(
        (tmp_path / "d.zarr" / "X" / "c" / "0" / "0").read_bytes())
    chunk.symlink_to(tmp_path / "d.zarr" / "X" / "c" / "spare")
    (tmp_path / "link.zarr").symlink_to(tmp_path / "d.zarr")
    X, _, _ = io.open_dataset(tmp_path / "link.zarr")
    np.testing.assert_array_equal(X[10:20].compute(), X[0:10].compute())


def test_chunk_data_that_does_not_decode_is_an_error_naming_the_rows(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=10)
    (tmp_path / "d.zarr" / "X" / "c" / "2" / "0").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    X, _, _ = io.open_dataset(tmp_path / "d.zarr")
    with pytest.raises(DkicfIOError, match=rf"cannot read rows 20:30 of the Zarr array "
                                           rf"{tmp_path / 'd.zarr' / 'X'}: the chunk data does "
                                           r"not decode .*restore it"):
        X.compute(scheduler="synchronous")


@pytest.mark.parametrize("kw, stored", [
    ({"chunks": (10, 2)}, [10, 2]),
    ({"chunks": (10, 2), "shards": (20, 2)}, [20, 2]),  # the shards are the stored grid
    ({"chunks": (10, 2), "zarr_format": 2}, [10, 2]),
])
def test_the_chunk_grid_is_checked_as_the_store_writes_it(tmp_path, kw, stored):
    """The declared chunk lengths come from the stored metadata document, not from the
    opened array: newer zarr versions read an invalid length (0) as a valid one when
    they open the array, which would slip past the check."""
    from dkicf.io._checks import _stored_grid

    arr = zarr.create_array(store=str(tmp_path / "a.zarr"), shape=(40, 2), dtype="f8", **kw)
    assert _stored_grid(arr) == stored
    name = ".zarray" if kw.get("zarr_format") == 2 else "zarr.json"
    doc_path = tmp_path / "a.zarr" / name
    doc = json.loads(doc_path.read_text())
    if name == ".zarray":
        doc["chunks"] = [0, 2]
    else:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [0, 2]
    doc_path.write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr 3.4 warns that it reads the 0 as 1
        reopened = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    assert _stored_grid(reopened) == [0, 2]


def test_zero_chunks_and_label_values_of_the_wrong_type_are_refused(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=10)
    meta = tmp_path / "d.zarr" / "X" / "zarr.json"
    original = meta.read_text()
    _edit = json.loads(original)
    _edit["chunk_grid"]["configuration"]["chunk_shape"] = [0, 2]
    meta.write_text(json.dumps(_edit))
    with pytest.raises(DkicfIOError, match=r"declares chunks \(0, 2\) for shape \(40, 2\)"):
        io.open_dataset(tmp_path / "d.zarr")
    meta.write_text(original)
    from dkicf import pipeline

    group_meta = tmp_path / "d.zarr" / "zarr.json"
    group = json.loads(group_meta.read_text())
    group["attributes"]["dkicf"]["label_values"] = 5
    group_meta.write_text(json.dumps(group))
    for call in (io.open_dataset, pipeline.describe):
        with pytest.raises(DkicfIOError, match="its attribute label_values is 5, not a list"):
            call(str(tmp_path / "d.zarr"))


@pytest.mark.parametrize("tamper, match", [
    (lambda a, t: a.update(cholesky_factor=a["cholesky_factor"].T.copy()),
     "cholesky_factor is not lower triangular"),
    (lambda a, t: a["cluster_centers"].__setitem__((1, 0), np.nan),
     "cluster_centers holds NaN or infinity"),
    (lambda a, t: a["pivots"].__setitem__(0, 60), r"pivots range over .*\.\.60, outside 0\.\.59"),
    (lambda a, t: a["pivots"].__setitem__(0, -1), r"pivots range over -1\.\."),
    (lambda a, t: a.pop("pivot_rows"), r"the array\(s\) pivot_rows are missing"),
    (lambda a, t: a.update(pivot_rows=a["pivot_rows"][:, :2].copy()),
     r"pivot_rows has shape \(8, 2\), not \(8, 3\)"),
    (lambda a, t: t.update(rank="8"), "the attribute 'rank' is 8, not a non-negative integer"),
    (lambda a, t: t.update(kernel={"kernel": "nope"}), "its kernel .* cannot be made"),
])
def test_a_tampered_model_is_refused_by_load_naming_the_problem(tmp_path, tamper, match):
    from dkicf import KernelKMeans, load

    X = np.random.default_rng(5).normal(size=(60, 3))
    model = KernelKMeans(n_clusters=3, gamma=0.5, rank=8, n_init=1, random_state=0).fit(X)
    from dkicf.estimator import _model_arrays_attrs

    arrays, attrs = _model_arrays_attrs(model)
    arrays = {k: np.array(v) for k, v in arrays.items()}
    attrs["input"] = {"shape": [60, 3]}
    tamper(arrays, attrs)
    io.write_group(tmp_path / "m.zarr", arrays, attrs, kind="model")
    with pytest.raises(DkicfIOError, match=rf"m\.zarr is not a valid dkicf model: {match}"):
        load(tmp_path / "m.zarr")


# --------------------------------------------------------------------------
# full disks, refused writes, a checkpoint removed mid-fit


@pytest.fixture
def small_memory_fs():
    from _smallfs import SmallMemoryFileSystem

    SmallMemoryFileSystem.reset()
    yield SmallMemoryFileSystem
    SmallMemoryFileSystem.reset()


@pytest.fixture
def thread_client():
    """Workers in this process: they see the in-memory filesystem the test fills.

    The default client while the test runs (so that every computation goes to
    it), closed at the end so that later tests get theirs back.
    """
    from distributed import Client

    # processes=False: the scheduler and workers talk in-process (inproc://), no sockets.
    with Client(processes=False, n_workers=1, threads_per_worker=2,
                dashboard_address=None) as c:
        yield c


_DISK_PARAMS = {"n_clusters": 3, "gamma": 0.5, "rank": 24, "n_init": 1, "random_state": 0,
                "pivoting": "greedy", "max_iter": 30}


def _arrays_at(url: str) -> dict:
    arrays, _ = io.read_group(url)
    arrays["labels"] = io.open_member(url, "labels").compute(scheduler="synchronous")
    return arrays


@pytest.mark.parametrize("where", ["output", "checkpoint", "P in the output"])
def test_a_full_disk_ends_in_an_error_naming_the_path_and_the_fit_resumes(
        tmp_path, small_memory_fs, thread_client, where):
    from dkicf import pipeline

    io.generate("blobs", tmp_path / "data.zarr", 2000, chunk_rows=500, centers=3)
    data = str(tmp_path / "data.zarr")
    before = _tree(tmp_path / "data.zarr")
    pipeline.fit_store(data, str(tmp_path / "alone.zarr"), _DISK_PARAMS, client=thread_client)
    alone = _arrays_at(str(tmp_path / "alone.zarr"))
    out = "smallmem://disk/out.zarr"
    ck = "smallmem://disk/ck.zarr" if where == "checkpoint" else None
    kw = {"checkpoint": ck, "checkpoint_every": 4} if ck else {}
    if where == "P in the output":
        kw["p_storage"] = "zarr"
    # Room for the start but not for P (2000 x 24 float64, 375 KiB); with a
    # checkpoint, room for its first commit (about 400 KB) but not its second.
    small_memory_fs.capacity = 415_000 if ck else 150_000
    with pytest.raises(DkicfIOError, match=r"no space left to write /disk/.* \(No space left "
                                           r"on device\)") as err:
        pipeline.fit_store(data, out, _DISK_PARAMS, client=thread_client, **kw)
    message = str(err.value)
    what = f"the checkpoint {ck}" if ck else f"the output {out}"
    assert f"{what} takes about " in message and "Nothing was published" in message
    assert "free now" not in message  # unknown on an object store
    fs = small_memory_fs()
    assert not fs.exists("/disk/out.zarr")
    assert _tree(tmp_path / "data.zarr") == before
    small_memory_fs.capacity = 1 << 40  # space is freed
    if ck:
        assert "run again with resume=True" in message
        report = pipeline.fit_store(data, out, _DISK_PARAMS, client=thread_client,
                                    resume=True, **kw)
        assert report.get("resumed_from_rank", 0) >= 4
    else:
        pipeline.fit_store(data, out, _DISK_PARAMS, client=thread_client, **kw)
    resumed = _arrays_at(out)
    for name in ("pivots", "cluster_centers", "cholesky_factor", "labels"):
        np.testing.assert_array_equal(resumed[name], alone[name], err_msg=name)


def test_a_checkpoint_removed_mid_fit_stops_the_fit_cleanly(tmp_path, thread_client):
    import shutil as sh

    from dkicf import pipeline

    io.generate("blobs", tmp_path / "data.zarr", 2000, chunk_rows=500, centers=3)
    ck, out = tmp_path / "ck.zarr", tmp_path / "out.zarr"

    def remove_checkpoint(p):
        if getattr(p, "rank", 0) >= 6 and ck.exists():
            sh.rmtree(ck)

    with pytest.raises(DkicfIOError, match=rf"the checkpoint at '{ck}' was removed or replaced "
                                           r"while the fit ran"):
        pipeline.fit_store(str(tmp_path / "data.zarr"), str(out), _DISK_PARAMS,
                           client=thread_client, checkpoint=str(ck), checkpoint_every=4,
                           progress=remove_checkpoint)
    assert not out.exists() and not ck.exists()
    assert not [p.name for p in tmp_path.iterdir() if ".dkicf-" in p.name]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A mounted tmpfs of 1 MiB (root only: skipped where it cannot be mounted)."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)

    try:
        yield mount, remount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.parametrize("where", ["output", "checkpoint"])
def test_a_full_local_disk_names_path_and_free_space_and_the_checkpoint_resumes(
        tmp_path, small_tmpfs, client, where):
    from dkicf import pipeline

    mount, remount = small_tmpfs
    io.generate("blobs", tmp_path / "data.zarr", 8000, chunk_rows=2000, centers=3)
    data = str(tmp_path / "data.zarr")
    before = _tree(tmp_path / "data.zarr")
    pipeline.fit_store(data, str(tmp_path / "alone.zarr"), _DISK_PARAMS, client=client)
    alone = _arrays_at(str(tmp_path / "alone.zarr"))
    # P is 8000 x 24 float64, 1.5 MiB: it cannot fit in 1 MiB.
    out = mount / "out.zarr"
    ck = mount / "ck.zarr" if where == "checkpoint" else None
    kw = {"checkpoint": str(ck), "checkpoint_every": 4} if ck else {}
    # The path is the file being written when the OSError names it, else the location.
    with pytest.raises(DkicfIOError, match=rf"no space left to write {mount}/.*\(No space left "
                                           r"on device\): the .* takes about 1\.\d+ MiB in all, "
                                           r"[0-9.]+ MiB free now") as err:
        pipeline.fit_store(data, str(out if ck is None else tmp_path / "out.zarr"),
                           _DISK_PARAMS, client=client, **kw)
    assert not out.exists() and not (tmp_path / "out.zarr").exists()
    assert not [p.name for p in mount.iterdir() if ".dkicf-tmp" in p.name or "claim" in p.name]
    assert _tree(tmp_path / "data.zarr") == before
    remount("size=16m")  # space is freed
    if ck is None:
        pipeline.fit_store(data, str(out), _DISK_PARAMS, client=client)
        resumed = _arrays_at(str(out))
    else:
        assert "run again with resume=True" in str(err.value)
        pipeline.fit_store(data, str(tmp_path / "out.zarr"), _DISK_PARAMS, client=client,
                           resume=True, **kw)
        resumed = _arrays_at(str(tmp_path / "out.zarr"))
    for name in ("pivots", "cluster_centers", "cholesky_factor", "labels"):
        np.testing.assert_array_equal(resumed[name], alone[name], err_msg=name)


def test_read_only_locations_are_refused_naming_them(tmp_path, small_tmpfs, client):
    from dkicf import pipeline

    mount, remount = small_tmpfs
    remount("ro")
    io.generate("blobs", tmp_path / "data.zarr", 400, chunk_rows=100, centers=3)
    data = str(tmp_path / "data.zarr")
    with pytest.raises(DkicfIOError, match=rf"cannot write {mount}/.*Read-only file system.*"
                                           rf"the output {mount / 'out.zarr'} must be on a "
                                           r"writable filesystem"):
        pipeline.fit_store(data, str(mount / "out.zarr"), _DISK_PARAMS, client=client)
    with pytest.raises(DkicfIOError, match=rf"cannot write {mount}/.*Read-only file "
                                           r"system.*the checkpoint .* must be on a writable"):
        pipeline.fit_store(data, str(tmp_path / "out.zarr"), _DISK_PARAMS, client=client,
                           checkpoint=str(mount / "ck.zarr"))
    assert not (tmp_path / "out.zarr").exists()


def test_only_this_fits_own_writes_are_reported_as_refused_writes(tmp_path):
    import errno

    from dkicf.pipeline import _write_errors

    data, out = str(tmp_path / "data.zarr"), str(tmp_path / "out.zarr")
    io.generate("ring", data, 40)
    unreadable = PermissionError(errno.EACCES, "Permission denied", f"{data}/X/c/0/0")
    with pytest.raises(PermissionError) as err:
        with _write_errors(data, out, None, {"rank": 4}, True, None):
            raise unreadable
    assert err.value is unreadable
    staged = f"{tmp_path}/.out.zarr.dkicf-tmp-0123456789ab/P/c/0/0"
    with pytest.raises(DkicfIOError, match=rf"cannot write {staged} \(Permission denied\): "
                                           rf"the output {out} must be on a writable"):
        with _write_errors(data, out, None, {"rank": 4}, True, None):
            raise PermissionError(errno.EACCES, "Permission denied", staged)
    with pytest.raises(DkicfIOError, match=r"no space left to write .* the output .* takes "
                                           r"about 0\.00\d+ MiB in all, [0-9.e+]+ MiB free now"):
        with _write_errors(data, out, None, {"rank": 4}, True, None):
            raise OSError(errno.ENOSPC, "No space left on device", staged)


def test_lengths_past_int64_and_fill_values_out_of_range_are_refused(tmp_path):
    io.generate("ring", tmp_path / "d.zarr", 40, chunk_rows=10)
    meta = tmp_path / "d.zarr" / "X" / "zarr.json"
    original = json.loads(meta.read_text())
    edited = json.loads(meta.read_text())
    edited["chunk_grid"]["configuration"]["chunk_shape"] = [2**64, 2]
    meta.write_text(json.dumps(edited))
    with pytest.raises(DkicfIOError, match=r"declares chunks \(18446744073709551616, 2\).*no "
                                           r"length may pass"):
        io.open_dataset(tmp_path / "d.zarr")
    edited = dict(original, data_type="int64", fill_value=1e308)
    meta.write_text(json.dumps(edited))
    with pytest.raises(DkicfIOError, match="cannot open the Zarr array at .*d.zarr/X"):
        io.open_dataset(tmp_path / "d.zarr")


def test_the_placement_lookup_takes_a_task_that_no_worker_holds():
    """The scheduler keeps ``who_has`` None (not empty) for a task held nowhere: the lookup
    of where X's chunks live answers None for it instead of failing on the scheduler."""
    from types import SimpleNamespace

    from dkicf._services import _who_holds

    def worker(address):
        return SimpleNamespace(address=address)

    tasks = {"lost": SimpleNamespace(who_has=None),
             "held": SimpleNamespace(who_has=[worker("tcp://b:2"), worker("tcp://a:1")])}
    assert _who_holds(["lost", "held", "forgotten"], SimpleNamespace(tasks=tasks)) == [
        [], ["tcp://a:1", "tcp://b:2"], []]
