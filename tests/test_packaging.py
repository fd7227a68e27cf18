"""What the package declares: dependency floors, extras, entry points, shipped configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(names) -> dict:
    from packaging.requirements import Requirement

    found = {}
    for text in names:
        req = Requirement(text)
        found[req.name] = req
    return found


def test_zarr_floor_allows_only_versions_with_atomic_local_commits():
    """A checkpoint's commit is one rewrite of the group's zarr.json, atomic on local disk
    from zarr 3.1.3 on: no older zarr may be installed with dkicf."""
    from packaging.version import Version

    zarr = _requirements(_pyproject()["project"]["dependencies"])["zarr"]
    for version, allowed in (("3.0.8", False), ("3.1.2", False), ("3.1.3", True),
                             ("3.2.0", True)):
        assert zarr.specifier.contains(Version(version)) is allowed, (version, zarr)
