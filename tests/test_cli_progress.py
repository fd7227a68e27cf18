"""The CLI's k-means progress bar: it counts runs and phases, and a finished fit ends at 100%."""

from __future__ import annotations

import re

import numpy as np

from dkicf._cli_commands import _Progress
from dkicf.kmeans import kmeans


def bar_lines(err: str) -> list[str]:
    return [line.strip() for line in re.split(r"[\r\n]", err) if line.strip()]


def test_kmeans_bar_counts_runs_and_ends_at_100_percent(capsys):
    rng = np.random.default_rng(0)
    P = np.concatenate([rng.normal(c, 0.3, size=(200, 2)) for c in (0.0, 4.0, 8.0)])
    progress = _Progress(quiet=False)
    res = kmeans(P, 3, n_init=4, batch_size=32, random_state=0, progress=progress)
    before = bar_lines(capsys.readouterr().err)
    progress.finish()
    after = bar_lines(capsys.readouterr().err)
    # Runs stop early (here on convergence): a run's share fills when it reports its last
    # iteration, so the bar reaches 100% with the last run's last iteration, not before.
    assert res.stop_reason == "converged"
    full = [line.startswith("k-means: 100%") for line in before]
    assert True in full and all(full[full.index(True):])
    assert any("Lloyd pass" in line for line in before[:full.index(True)])
    assert any("run 4/4, Lloyd pass" in line for line in before)
    assert any("run 1/4, mini-batch step" in line for line in before)
    assert after[-1].startswith("k-means: 100%") and "4 runs done" in after[-1]
    assert not re.search(r"\d[GMk]row/s", " ".join(before + after))


def test_quiet_progress_prints_nothing(capsys):
    progress = _Progress(quiet=True)
    kmeans(np.arange(20.0).reshape(10, 2), 2, random_state=0, progress=progress)
    progress.finish()
    assert capsys.readouterr().err == ""


def test_rows_bar_rate_counts_from_its_creation(capsys):
    import time

    from dkicf._cli_commands import _rows_bar

    update = _rows_bar("write")
    time.sleep(0.25)
    update(1000, 1000)  # all rows reported at once, 0.25 s after the bar was made
    line = bar_lines(capsys.readouterr().err)[-1]
    rate = re.search(r"([\d.]+)([kMG]?)row/s", line)
    assert rate is not None, line
    value = float(rate.group(1)) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[rate.group(2)]
    assert value <= 4000.0, line


def test_main_in_process_leaves_the_environment_and_log_levels_as_it_found_them(tmp_path):
    """Quieting the cluster's logs is for the command only: processes started later (a
    test's stand-in batch jobs, a user's own cluster) still log as configured."""
    import logging
    import os

    from dkicf.cli import main

    os.environ.pop("DASK_LOGGING__DISTRIBUTED", None)
    level = logging.getLogger("distributed").level
    assert main(["info", str(tmp_path / "absent.zarr")]) == 1
    assert "DASK_LOGGING__DISTRIBUTED" not in os.environ
    assert logging.getLogger("distributed").level == level
