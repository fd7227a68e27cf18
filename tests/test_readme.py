"""The README's Python examples run as written (as scripts, like a user would run them)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env=env)


def test_readme_has_the_two_python_examples():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "KernelKMeans" in blocks[0] and "local_cluster" in blocks[1]


def test_readme_numpy_example(tmp_path):
    proc = _run(_python_blocks()[0], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "1.0"  # the accuracy its comment promises


@pytest.mark.timeout(300)
def test_readme_dask_example(tmp_path):
    from dkicf import io
    from dkicf.metrics import clustering_accuracy

    io.generate("ring", tmp_path / "ring.zarr", 20_000, random_state=0)
    proc = _run(_python_blocks()[1], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = np.array(proc.stdout.strip().strip("[]").split(), dtype=int)
    import zarr

    y = zarr.open_group(str(tmp_path / "ring.zarr"), mode="r")["y"][:10]
    assert labels.shape == (10,)
    assert clustering_accuracy(y, labels) == 1.0
