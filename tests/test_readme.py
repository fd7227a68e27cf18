"""The README's examples run as written (as scripts and commands, like a user would run them)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(),
                      re.MULTILINE | re.DOTALL)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env=env)


def test_readme_has_the_two_python_examples():
    blocks = _blocks("python")
    assert len(blocks) == 2
    assert "KernelKMeans" in blocks[0] and "local_cluster" in blocks[1]


def test_readme_numpy_example(tmp_path):
    proc = _run(_blocks("python")[0], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "1.0"  # the accuracy its comment promises


@pytest.mark.timeout(300)
def test_readme_dask_example(tmp_path):
    """It makes its own data: nothing has to exist before it runs."""
    from dkicf.metrics import clustering_accuracy

    proc = _run(_blocks("python")[1], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = np.array(proc.stdout.strip().strip("[]").split(), dtype=int)
    import zarr

    y = zarr.open_group(str(tmp_path / "ring.zarr"), mode="r")["y"][:10]
    assert labels.shape == (10,)
    assert clustering_accuracy(y, labels) == 1.0


@pytest.mark.timeout(300)
def test_readme_command_line_example(tmp_path):
    """The CLI block, line by line in a fresh folder: every file it reads it made first."""
    (block,) = [b for b in _blocks("bash") if "dkicf generate" in b]
    outputs = []
    for line in block.splitlines():
        command = shlex.split(line.split("#", 1)[0])
        assert command[0] == "dkicf", line
        proc = subprocess.run([sys.executable, "-m", "dkicf", "--quiet", *command[1:]],
                              cwd=tmp_path, capture_output=True, text=True, timeout=240,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
        outputs.append(proc.stdout)
    report = json.loads(outputs[4])  # predict --json
    assert report["n_samples"] == 5000 and report["accuracy"] == 1.0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "cluster_sizes.png", "clusters.png", "trace_error.png"]


def test_readme_opens_with_the_demo_and_the_test_command_that_ci_runs():
    first, second = _blocks("bash")[:2]
    # The demo is called by its path: it needs no activated environment.
    assert first.strip().endswith(".venv/bin/dkicf demo"), first
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert second.strip() == ci
    assert "source .venv/bin/activate" in README.read_text()
