"""Benchmark scripts use only names dkicf has: a module that moves fails a test, not a run."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))


def _dkicf_names(tree: ast.AST):
    """``(line, module, name)`` for every dkicf name the script imports or reads off a
    dkicf module (``from dkicf.x import y``, ``import dkicf.x as m`` then ``m.y``, and
    ``sys.modules["dkicf.x"]`` then ``.y``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dkicf"):
            for a in node.names:
                yield node.lineno, node.module, a.name
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dkicf"):
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or "dkicf"
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)
              and isinstance(node.value, ast.Subscript)
              and isinstance(node.value.slice, ast.Constant)
              and str(node.value.slice.value).startswith("dkicf")):
            aliases[node.targets[0].id] = node.value.slice.value
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            yield node.lineno, aliases[node.value.id], node.attr


def _exists(module: str, name: str) -> bool:
    try:
        found = importlib.import_module(module)
    except ImportError:  # "from dkicf.a import b" names a module b, or a.b is a class
        parent, _, attr = module.rpartition(".")
        found = getattr(importlib.import_module(parent), attr, None)
        return found is not None and hasattr(found, name)
    if hasattr(found, name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
        return True
    except ImportError:
        return False


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_dkicf_name_a_benchmark_uses_exists(script):
    tree = ast.parse(script.read_text())
    missing = [f"line {line}: {module}.{name}" for line, module, name in _dkicf_names(tree)
               if not _exists(module, name)]
    assert not missing, f"{script.name} uses names dkicf no longer has: {missing}"


def test_the_check_finds_a_moved_name():
    tree = ast.parse('import sys\nkm = sys.modules["dkicf.kmeans"]\nkm._NumpyBackend\n'
                     "from dkicf.kmeans import kmeans\n")
    names = list(_dkicf_names(tree))
    assert (3, "dkicf.kmeans", "_NumpyBackend") in names
    assert not _exists("dkicf.kmeans", "_NumpyBackend")  # it lives in dkicf._kmeans_tasks
    assert _exists("dkicf._kmeans_tasks", "_NumpyBackend") and _exists("dkicf.kmeans", "kmeans")


def test_the_k_means_defaults_benchmark_measures_a_setting_end_to_end():
    """bench_kmeans_defaults times k-means|| by wrapping a backend method; the wrapper must
    pass every argument on (it once dropped a keyword one and the script failed), time
    something, and leave the method as it found it."""
    import importlib.util

    import numpy as np

    from dkicf import _kmeans_tasks

    spec = importlib.util.spec_from_file_location(
        "bench_kmeans_defaults", Path(__file__).parents[1] / "benchmarks" /
        "bench_kmeans_defaults.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    original = _kmeans_tasks._NumpyBackend.parallel_candidates
    rng = np.random.default_rng(0)
    P = np.concatenate([rng.normal(size=(200, 3)), rng.normal(size=(200, 3)) + 6])
    factors = [("two blobs", P, 2, float(((P - P.mean(0)) ** 2).sum()))]
    misses, fits, worst, found, total, kmpar = bench._measure(
        {}, 3, 2, factors, 2, 1, P)
    assert fits == 2 and 0 <= misses <= fits and 0 < worst <= 1.0  # better than one centre
    assert found in (0, 1) and 0 < kmpar <= total
    assert _kmeans_tasks._NumpyBackend.parallel_candidates is original
