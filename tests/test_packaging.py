"""What the package declares: dependency floors, extras, entry points, shipped configuration."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(names) -> dict:
    from packaging.requirements import Requirement

    found = {}
    for text in names:
        req = Requirement(text)
        found[req.name] = req
    return found


def test_the_python_floor_is_one_the_zarr_floor_installs_on():
    """zarr 3.0 and later need Python 3.11: declaring 3.10 let pip on 3.10 fail to find
    zarr instead of saying that dkicf needs a newer Python."""
    from packaging.specifiers import SpecifierSet

    python = SpecifierSet(_pyproject()["project"]["requires-python"])
    assert not python.contains("3.10.14") and python.contains("3.11.0")
    assert python.contains("3.12.1") and python.contains("3.13.0")


def test_zarr_floor_allows_only_versions_with_atomic_local_commits():
    """A checkpoint's commit is one rewrite of the group's zarr.json, atomic on local disk
    from zarr 3.1.3 on: no older zarr may be installed with dkicf."""
    from packaging.version import Version

    zarr = _requirements(_pyproject()["project"]["dependencies"])["zarr"]
    for version, allowed in (("3.0.8", False), ("3.1.2", False), ("3.1.3", True),
                             ("3.2.0", True)):
        assert zarr.specifier.contains(Version(version)) is allowed, (version, zarr)


def test_the_dkicf_section_of_dask_config_is_shipped_and_overridable(tmp_path):
    """Defaults from the shipped YAML; DASK_DKICF__ and DKICF_ variables and a user's own
    YAML file override them, as for any dask setting."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    shipped = yaml.safe_load((REPO / "dkicf" / "dkicf.yaml").read_text())["dkicf"]
    assert shipped["cluster"] == {"workers": "auto", "threads": 1, "memory-limit": "auto",
                                  "separate-processes": "auto", "worker-timeout": 3600,
                                  "worker-profiler": False, "tick-interval": "1s"}
    assert shipped["fit"] == {"rank": 100, "pivoting": "block-greedy"}
    code = ("import json; from dkicf._config import get; "
            "print(json.dumps([get('cluster.workers'), get('cluster.threads'), "
            "get('fit.rank'), get('fit.pivoting')]))")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "site.yaml").write_text("dkicf:\n  fit:\n    pivoting: greedy\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DKICF_", "DASK_DKICF__", "DASK_CONFIG"))}
    for extra, expected in (
        ({}, ["auto", 1, 100, "block-greedy"]),
        ({"DKICF_CLUSTER__WORKERS": "6"}, [6, 1, 100, "block-greedy"]),
        ({"DASK_DKICF__CLUSTER__THREADS": "4", "DKICF_FIT__RANK": "40"},
         ["auto", 4, 40, "block-greedy"]),
        ({"DASK_DKICF__CLUSTER__WORKERS": "7", "DKICF_CLUSTER__WORKERS": "5"},
         [7, 1, 100, "block-greedy"]),
        ({"DASK_CONFIG": str(tmp_path / "conf")}, ["auto", 1, 100, "greedy"]),
    ):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, **extra}, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == expected, extra


def test_dkicf_settings_outlive_a_dask_config_set_entered_before_their_first_read():
    """dask.config.set({"dkicf.x": ...}) removes the whole dkicf section on exit when it
    was not there yet: the defaults (and DKICF_ variables) read inside must come back."""
    import json
    import os
    import subprocess
    import sys

    code = ("import dask, json; from dkicf._config import get\n"
            "with dask.config.set({'dkicf.cluster.workers': 5}):\n"
            "    inside = get('cluster.workers')\n"
            "print(json.dumps([inside, get('cluster.workers'), get('cluster.threads')]))")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DKICF_", "DASK_DKICF__", "DASK_CONFIG"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "DKICF_CLUSTER__THREADS": "3"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [5, "auto", 3]


def test_the_cli_takes_its_cluster_and_fit_defaults_from_dask_config(tmp_path, monkeypatch,
                                                                     capsys):
    import dask
    import numpy as np

    import dkicf.deploy
    from dkicf import io
    from dkicf.cli import main

    seen = {}

    def start_cluster(kind, **options):
        seen.update(options, kind=kind)
        raise ConnectionError("stop here")

    monkeypatch.setattr(dkicf.deploy, "start_cluster", start_cluster)
    io.write_group(str(tmp_path / "d.zarr"), {"X": np.zeros((50, 2))}, {})
    with dask.config.set({"dkicf.cluster.workers": 5, "dkicf.cluster.threads": 3,
                          "dkicf.cluster.memory-limit": "3GiB"}):
        code = main(["fit", str(tmp_path / "d.zarr"), "--clusters", "2", "--out",
                     str(tmp_path / "o.zarr"), "--cluster", "local", "--quiet"])
    assert code == 1 and "stop here" in capsys.readouterr().err
    assert seen == {"kind": "local", "workers": 5, "threads": 3, "memory_limit": "3GiB",
                    "dashboard": False}
    with dask.config.set({"dkicf.fit.rank": 7}):
        from dkicf.cli import build_parser

        args = build_parser(["fit"]).parse_args(["fit", "d.zarr", "--clusters", "2",
                                                 "--out", "o.zarr"])
    assert args.rank == 7


def test_extras_split_parquet_from_datasets():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert "data" not in extras
    assert set(_requirements(extras["parquet"])) == {"pyarrow"}
    assert set(_requirements(extras["datasets"])) == {"pooch"}
    # What the messages tell users to install exists.
    import re

    modules = [REPO / "dkicf" / "datasets.py", *sorted((REPO / "dkicf" / "io").glob("*.py"))]
    for module in modules:
        text = module.read_text()
        for extra in re.findall(r"dkicf\[(\w+)\]", text):
            assert extra in extras, (module.name, extra)
