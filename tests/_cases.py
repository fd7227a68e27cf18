"""Random, often degenerate rows for the property tests and the campaign that reruns them."""

from __future__ import annotations

import numpy as np

KINDS = ("normal", "duplicates", "blobs", "grid")


def random_rows(kind: str, n: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows of ``s`` features of one of :data:`KINDS`: normal rows, a few distinct
    rows each many times, tight blobs far apart, or a small integer grid (ties between
    mirror images)."""
    if kind == "normal":
        return rng.standard_normal((n, s))
    if kind == "duplicates":  # a few distinct rows, each many times
        base = rng.standard_normal((int(rng.integers(1, 15)), s))
        return base[rng.integers(0, base.shape[0], n)]
    if kind == "blobs":
        centres = rng.standard_normal((int(rng.integers(1, 8)), s)) * 10
        return centres[rng.integers(0, centres.shape[0], n)] + rng.standard_normal((n, s)) / 10
    return rng.integers(0, 3, (n, s)).astype(np.float64)  # a grid: ties everywhere
