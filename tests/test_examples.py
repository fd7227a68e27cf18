"""Every example script runs at a small size, so none of them rots."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(args, cwd, timeout=240):
    proc = subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart(tmp_path):
    out = _run([EXAMPLES / "quickstart.py", "--n", "1000"], tmp_path)
    assert "kernel k-means accuracy: 1.000" in out


def test_save_and_predict(tmp_path):
    out = _run([EXAMPLES / "save_and_predict.py", "--n", "800", "--model",
                tmp_path / "m.zarr"], tmp_path)
    assert "predicts identically: True" in out
    # A second run does not replace the saved model unless told to.
    before = (tmp_path / "m.zarr" / "zarr.json").read_bytes()
    proc = subprocess.run([sys.executable, EXAMPLES / "save_and_predict.py", "--n", "800",
                           "--model", tmp_path / "m.zarr"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert (tmp_path / "m.zarr" / "zarr.json").read_bytes() == before


def test_out_of_core(tmp_path):
    out = _run([EXAMPLES / "out_of_core.py", "--n", "20000", "--workdir", tmp_path,
                "--memory-limit", "1GiB"], tmp_path)
    assert "accuracy:" in out
    acc = float(out.split("accuracy:")[1].split()[0])
    assert acc > 0.95


@pytest.fixture
def scheduler_address():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=None, memory_limit="1GiB") as cluster:
        yield cluster.scheduler_address


def test_existing_scheduler(tmp_path, scheduler_address):
    out = _run([EXAMPLES / "existing_scheduler.py", scheduler_address, "--n", "2000"], tmp_path)
    assert "2 workers; accuracy 1.000" in out
