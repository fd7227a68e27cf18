"""Synthetic clustering datasets, generated deterministically in row blocks.

Every dataset here is a function of ``(random_state, row index)`` only, so any
slice of rows can be produced without producing the rows before it, and a
dataset of any size can be written chunk by chunk (see :func:`dkicf.io.generate`)
without ever holding it whole.

How the rows are made
---------------------
* Labels are interleaved: row ``i`` belongs to class ``i % k``.  Any prefix or
  any run of consecutive rows is balanced to within one row per class.
* Each row consumes a fixed number of uniform random numbers.  Rows are grouped
  in internal blocks of 65536 rows; block ``b`` draws from its own PCG64 stream
  seeded by ``SeedSequence(random_state, spawn_key=(0, b))`` (numbers that do
  not depend on the caller's chunking), and a row inside a block skips to its
  own numbers with ``PCG64.advance``.  Gaussian noise comes from those uniforms
  by the Box-Muller transform, so the count per row is exact.
* Constants of a dataset (blob centres, the phase of each curve) come from a
  separate stream, ``SeedSequence(random_state, spawn_key=(1,))``.
* Points along the curves of the 2-D sets are placed by a golden-ratio
  (Kronecker) sequence in arc length: the ``j``-th point of a class sits at the
  fraction ``frac(phase + j * 0.618...)`` of its curve.  Any run of rows covers
  every curve evenly, which keeps the local point density flat; with uniform
  random positions the density fluctuates and kernel k-means at these small
  kernel widths then prefers to cut a class along a dense stretch.
* Noise on the 2-D sets is bounded (triangular, within ``+-noise`` on each
  coordinate), so the gap between classes holds for every ``n``, also 1e8.

The three 2-D sets of the paper
-------------------------------
``ring``, ``parabolic`` and ``zigzag`` are built for the Gaussian kernel
``exp(-gamma * ||x - y||^2)`` at ``gamma = 2**4``, ``2**1`` and ``2**3``, whose
length scale is ``h = 1 / sqrt(gamma)`` (0.25, 0.71 and 0.35).  Each has

* an *inner* class that is compact at that scale (diameter about ``2 h``),
* an *outer* class that wraps around it, so that no straight line separates
  them and plain k-means with two clusters cuts the outer class in two
  (accuracy about 0.7);
* a gap between the classes of at least 3 ``h`` for every ``n`` (with
  ``noise`` at its default), while a class is one connected piece at a far
  smaller scale: the longest edge of a spanning tree of a class is about
  ``h / 3`` at ``n = 1000`` and shrinks as ``n`` grows.

The compact inner class is deliberate.  Kernel k-means with a narrow Gaussian
kernel maximises the mean kernel density inside each cluster; two congruent
long curves (two interleaved zigzags of equal length, say) then form a flat
objective landscape on which Lloyd iterations stop at a cut across both
curves, and a denser long class gains by being cut.  A compact class opposite
a spread one is recovered from almost every start.

Examples
--------
>>> from dkicf.synthetic import generate_rows, make_ring
>>> X, y = make_ring(1000, random_state=0)
>>> X.shape, y[:4].tolist()
((1000, 2), [0, 1, 0, 1])
>>> Xs, ys = generate_rows("ring", 250, 260, n_total=1000, random_state=0)
>>> bool((Xs == X[250:260]).all())
True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._validation import check_seed

__all__ = [
    "KINDS",
    "generate_rows",
    "kind_info",
    "make_blobs",
    "make_parabolic",
    "make_ring",
    "make_spheres",
    "make_zigzag",
]

_BLOCK_ROWS = 65536
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

# Ring: inner circle radius, outer circle radius.
_RING_RADII = (0.2, 1.5)
# Parabolic: (a, half-width, vertical offset) of y = a x^2 + offset for each class.
_PARABOLAS = ((1.0, 0.6, 0.0), (0.2, 6.0, -2.5))
# Zigzag: the inner class is one tooth (a "V") of the outer class's shape.
_ZIGZAG_OUTER_HALF_WIDTH = 6.0
_ZIGZAG_PERIOD = 4.0
_ZIGZAG_INNER_HALF_WIDTH = 0.35
_ZIGZAG_INNER_LIFT = 1.7


@dataclass(frozen=True)
class _Kind:
    """How one kind of dataset is made (see the module docstring)."""

    defaults: dict[str, Any]
    check: Callable[[dict], dict]
    n_features: Callable[[dict], int]
    n_classes: Callable[[dict], int]
    n_uniforms: Callable[[dict], int]
    constants: Callable[[np.random.Generator, dict], dict]
    rows: Callable[[np.ndarray, np.ndarray, dict, dict], np.ndarray]


# --------------------------------------------------------------------------
# random numbers


def _row_uniforms(seed: int, start: int, stop: int, width: int) -> np.ndarray:
    """Uniforms in [0, 1) of shape (stop - start, width) for rows [start, stop)."""
    out = np.empty((stop - start, width), dtype=np.float64)
    if width == 0 or stop == start:
        return out
    for block in range(start // _BLOCK_ROWS, (stop - 1) // _BLOCK_ROWS + 1):
        lo = max(start, block * _BLOCK_ROWS)
        hi = min(stop, (block + 1) * _BLOCK_ROWS)
        bitgen = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(0, block)))
        # One double consumes exactly one 64-bit draw of PCG64.
        bitgen.advance((lo - block * _BLOCK_ROWS) * width)
        out[lo - start : hi - start] = np.random.Generator(bitgen).random((hi - lo, width))
    return out


def _constants_rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1,))))


def _normals(u: np.ndarray, count: int) -> np.ndarray:
    """``count`` standard normals per row from ``2 * ceil(count / 2)`` uniform columns."""
    pairs = (count + 1) // 2
    radius = np.sqrt(-2.0 * np.log1p(-u[:, :pairs]))
    angle = 2.0 * np.pi * u[:, pairs : 2 * pairs]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)[:, :count]


def _triangular(u: np.ndarray) -> np.ndarray:
    """Triangular noise on (-1, 1) from pairs of uniform columns: (m, 2q) -> (m, q)."""
    q = u.shape[1] // 2
    return u[:, :q] + u[:, q:] - 1.0


def _kronecker(j: np.ndarray, phase: float) -> np.ndarray:
    """Fractions ``frac(phase + j * golden)`` spread evenly over [0, 1) for any run of j."""
    return np.mod(phase + np.mod(j * _GOLDEN, 1.0), 1.0)


def _resolve_seed(random_state) -> int:
    """One integer seed from an int, None (fresh entropy) or a numpy Generator/RandomState."""
    if random_state is None:
        return int(np.random.SeedSequence().entropy % (2**63))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(2**63))
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(2**31 - 1))
    return check_seed(random_state)



# --------------------------------------------------------------------------
# parameter checks


def _check_noise(params: dict) -> dict:
    noise = params["noise"]
    if isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not noise >= 0:
        raise ValueError(f"noise must be a number >= 0, got {noise!r}.")
    if not math.isfinite(noise):
        raise ValueError(f"noise must be finite, got {noise!r}.")
    return {**params, "noise": float(noise)}


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}.")
    return int(value)


def _check_blobs(params: dict) -> dict:
    d = params["n_features"]
    if d is not None:
        d = _check_int(d, "n_features", 1)
    centers = params["centers"]
    if isinstance(centers, numbers.Integral) and not isinstance(centers, bool):
        k = _check_int(centers, "centers", 1)
        explicit = None
        d = 2 if d is None else d
    else:
        explicit = np.asarray(centers, dtype=np.float64)
        if explicit.ndim != 2 or 0 in explicit.shape or d not in (None, explicit.shape[1]):
            want = "k, n_features" if d is None else f"k, n_features={d}"
            raise ValueError(
                f"centers must be an integer or an array of shape ({want}), "
                f"got shape {explicit.shape}."
            )
        d = explicit.shape[1]
        if not np.isfinite(explicit).all():
            raise ValueError("centers contains NaN or infinity.")
        k = explicit.shape[0]
    std = np.asarray(params["cluster_std"], dtype=np.float64)
    if std.ndim > 1 or (std.ndim == 1 and std.shape[0] != k):
        raise ValueError(
            f"cluster_std must be a number or a sequence of {k} numbers (one per centre), "
            f"got shape {std.shape}."
        )
    if not (np.isfinite(std).all() and (std > 0).all()):
        raise ValueError(f"cluster_std must be > 0 and finite, got {params['cluster_std']!r}.")
    lo, hi = (float(v) for v in params["center_box"])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"center_box must be (low, high) with low < high, got {(lo, hi)}.")
    return {
        "n_features": d,
        "centers": k if explicit is None else explicit.tolist(),
        "cluster_std": float(std) if std.ndim == 0 else std.tolist(),
        "center_box": (lo, hi),
    }


def _blob_count(params: dict) -> int:
    c = params["centers"]
    return c if isinstance(c, int) else len(c)


def _check_spheres(params: dict) -> dict:
    out = _check_noise(params)
    out["n_features"] = _check_int(params["n_features"], "n_features", 1)
    out["shells"] = _check_int(params["shells"], "shells", 1)
    return out


# --------------------------------------------------------------------------
# the kinds


def _phases(rng: np.random.Generator, params: dict) -> dict:
    return {"phase": rng.random(2)}


def _curve_fractions(index: np.ndarray, consts: dict) -> tuple[np.ndarray, np.ndarray]:
    label = index % 2
    return label, _kronecker(index // 2, consts["phase"][label])


def _ring_rows(index, u, consts, params):
    label, t = _curve_fractions(index, consts)
    radius = np.asarray(_RING_RADII)[label]
    angle = 2.0 * np.pi * t
    X = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return X + params["noise"] * _triangular(u)


def _parabola_x(fraction: np.ndarray, a: float, half_width: float) -> np.ndarray:
    """x on y = a x^2 whose arc length from -half_width is ``fraction`` of the whole."""
    grid = np.linspace(-half_width, half_width, 4097)
    arc = np.concatenate([[0.0], np.cumsum(np.hypot(np.diff(grid), a * np.diff(grid**2)))])
    return np.interp(fraction * arc[-1], arc, grid)


def _parabolic_rows(index, u, consts, params):
    label, t = _curve_fractions(index, consts)
    X = np.empty((index.shape[0], 2))
    for c, (a, half_width, offset) in enumerate(_PARABOLAS):
        mask = label == c
        x = _parabola_x(t[mask], a, half_width)
        X[mask, 0] = x
        X[mask, 1] = a * x**2 + offset
    return X + params["noise"] * _triangular(u)


def _tooth(x: np.ndarray, period: float) -> np.ndarray:
    """Triangle wave of slope +-1: 0 at multiples of ``period``, ``period / 2`` between."""
    return np.abs(np.mod(x / period + 0.5, 1.0) - 0.5) * period


def _zigzag_rows(index, u, consts, params):
    label, t = _curve_fractions(index, consts)
    half_width = np.where(label == 0, _ZIGZAG_INNER_HALF_WIDTH, _ZIGZAG_OUTER_HALF_WIDTH)
    x = (2.0 * t - 1.0) * half_width
    y = np.where(label == 0, np.abs(x) + _ZIGZAG_INNER_LIFT, _tooth(x, _ZIGZAG_PERIOD))
    return np.stack([x, y], axis=1) + params["noise"] * _triangular(u)


def _blob_constants(rng: np.random.Generator, params: dict) -> dict:
    centers = params["centers"]
    if isinstance(centers, int):
        lo, hi = params["center_box"]
        centers = rng.uniform(lo, hi, size=(centers, params["n_features"]))
    return {"centers": np.asarray(centers, dtype=np.float64)}


def _blob_rows(index, u, consts, params):
    centers = consts["centers"]
    label = index % centers.shape[0]
    std = np.asarray(params["cluster_std"], dtype=np.float64)
    scale = std[label, None] if std.ndim == 1 else std
    return centers[label] + scale * _normals(u, centers.shape[1])


def _sphere_rows(index, u, consts, params):
    d = params["n_features"]
    label = index % params["shells"]
    z = _normals(u[:, : 2 * ((d + 1) // 2)], d)
    norm = np.maximum(np.linalg.norm(z, axis=1, keepdims=True), np.finfo(np.float64).tiny)
    radius = 1.0 + label + params["noise"] * _triangular(u[:, -2:])[:, 0]
    return z / norm * radius[:, None]


def _no_constants(rng, params):
    return {}


KINDS: dict[str, _Kind] = {
    "ring": _Kind(
        defaults={"noise": 0.05},
        check=_check_noise,
        n_features=lambda p: 2,
        n_classes=lambda p: 2,
        n_uniforms=lambda p: 4,
        constants=_phases,
        rows=_ring_rows,
    ),
    "parabolic": _Kind(
        defaults={"noise": 0.1},
        check=_check_noise,
        n_features=lambda p: 2,
        n_classes=lambda p: 2,
        n_uniforms=lambda p: 4,
        constants=_phases,
        rows=_parabolic_rows,
    ),
    "zigzag": _Kind(
        defaults={"noise": 0.05},
        check=_check_noise,
        n_features=lambda p: 2,
        n_classes=lambda p: 2,
        n_uniforms=lambda p: 4,
        constants=_phases,
        rows=_zigzag_rows,
    ),
    "blobs": _Kind(
        defaults={
            "n_features": None,
            "centers": 3,
            "cluster_std": 1.0,
            "center_box": (-10.0, 10.0),
        },
        check=_check_blobs,
        n_features=lambda p: p["n_features"],
        n_classes=_blob_count,
        n_uniforms=lambda p: 2 * ((p["n_features"] + 1) // 2),
        constants=_blob_constants,
        rows=_blob_rows,
    ),
    "spheres": _Kind(
        defaults={"n_features": 3, "shells": 2, "noise": 0.1},
        check=_check_spheres,
        n_features=lambda p: p["n_features"],
        n_classes=lambda p: p["shells"],
        n_uniforms=lambda p: 2 * ((p["n_features"] + 1) // 2) + 2,
        constants=_no_constants,
        rows=_sphere_rows,
    ),
}
"""The dataset kinds by name; :func:`generate_rows` looks them up here."""


def _resolve(kind: str, params: dict) -> tuple[_Kind, dict]:
    try:
        spec = KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown synthetic dataset kind {kind!r}; valid kinds: {', '.join(sorted(KINDS))}."
        ) from None
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        valid = ", ".join(sorted(spec.defaults)) or "none"
        raise TypeError(
            f"unknown parameter(s) {', '.join(unknown)} for kind {kind!r}; valid: {valid}."
        )
    return spec, spec.check({**spec.defaults, **params})


def kind_info(kind: str, **params) -> dict[str, Any]:
    """Shape facts and resolved parameters of a dataset kind, without generating rows.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    **params
        Parameters of that kind; missing ones take their defaults.

    Returns
    -------
    info : dict
        ``n_features``, ``n_classes`` and ``params`` (all parameters, JSON-ready).

    Examples
    --------
    >>> kind_info("blobs", n_features=5, centers=4)["n_features"]
    5
    """
    spec, resolved = _resolve(kind, params)
    return {
        "n_features": spec.n_features(resolved),
        "n_classes": spec.n_classes(resolved),
        "params": {k: list(v) if isinstance(v, tuple) else v for k, v in resolved.items()},
    }


def generate_rows(
    kind: str,
    start: int,
    stop: int,
    *,
    n_total: int,
    random_state: int = 0,
    **params,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of the synthetic dataset ``kind`` of ``n_total`` rows.

    The result equals ``make_<kind>(n_total, ...)[start:stop]`` for every split
    of the rows; generating a slice costs time proportional to its length only.

    Parameters
    ----------
    kind : str
        One of ``"ring"``, ``"parabolic"``, ``"zigzag"``, ``"blobs"``, ``"spheres"``.
    start, stop : int
        The half-open row range, ``0 <= start <= stop <= n_total``.
    n_total : int
        Rows of the whole dataset (the range is checked against it).
    random_state : int, default=0
        Seed of the dataset; a non-negative integer, the same for every slice.
    **params
        Parameters of the kind (see the ``make_<kind>`` functions).

    Returns
    -------
    X : ndarray of shape (stop - start, n_features), float64
    y : ndarray of shape (stop - start,), int64
        Class of each row, ``row_index % n_classes``.

    Examples
    --------
    >>> X, y = generate_rows("blobs", 0, 6, n_total=6, random_state=1, centers=3)
    >>> X.shape, y.tolist()
    ((6, 2), [0, 1, 2, 0, 1, 2])
    """
    spec, resolved = _resolve(kind, params)
    seed = check_seed(random_state)
    n_total = _check_int(n_total, "n_total", 0)
    start = _check_int(start, "start", 0)
    stop = _check_int(stop, "stop", 0)
    if not start <= stop <= n_total:
        raise ValueError(
            f"need 0 <= start <= stop <= n_total, got start={start}, stop={stop}, "
            f"n_total={n_total}."
        )
    index = np.arange(start, stop, dtype=np.int64)
    consts = spec.constants(_constants_rng(seed), resolved)
    u = _row_uniforms(seed, start, stop, spec.n_uniforms(resolved))
    X = np.ascontiguousarray(spec.rows(index, u, consts, resolved), dtype=np.float64)
    y = (index % spec.n_classes(resolved)).astype(np.int64)
    return X, y


def _make(kind: str, n: int, random_state, params: dict) -> tuple[np.ndarray, np.ndarray]:
    n = _check_int(n, "n", 0)
    return generate_rows(
        kind, 0, n, n_total=n, random_state=_resolve_seed(random_state), **params
    )


def make_ring(n: int, *, random_state=0, noise: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Two concentric rings in 2-D (class 0 inside, class 1 outside).

    Class 0 lies on the circle of radius 0.2 around the origin, class 1 on the
    circle of radius 1.5, each point moved by bounded noise of at most
    ``noise`` per coordinate.  Made for a Gaussian kernel with ``gamma = 2**4``
    (length scale 0.25): the inner ring is compact at that scale (a wider one
    is cut in two by kernel k-means), the gap between the rings is at least
    ``1.3 - 2 sqrt(2) noise`` (1.16 by default), and plain 2-means splits both
    rings by a line (accuracy about 0.7).

    Parameters
    ----------
    n : int
        Number of points; row ``i`` has class ``i % 2``.
    random_state : int, None, or numpy Generator, default=0
        Seed; a Generator or None is turned into one integer seed first.
    noise : float, default=0.05
        Half-width of the triangular noise on each coordinate.

    Returns
    -------
    X : ndarray of shape (n, 2)
    y : ndarray of shape (n,), int64

    Examples
    --------
    >>> X, y = make_ring(1000)
    >>> round(float(abs(X[y == 1]).max()), 1)
    1.5
    """
    return _make("ring", n, random_state, {"noise": noise})


def make_parabolic(
    n: int, *, random_state=0, noise: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """Two nested parabolas in 2-D (class 0 inside, class 1 around it).

    Class 0 lies on ``y = x^2`` for ``|x| <= 0.6``, class 1 on the wider
    ``y = 0.2 x^2 - 2.5`` for ``|x| <= 6``, whose arms rise past class 0 on
    both sides.  Points are evenly spread in arc length and moved by bounded
    noise of at most ``noise`` per coordinate.  Made for a Gaussian kernel with
    ``gamma = 2**1`` (length scale 0.71): the inner parabola is compact at that
    scale, the gap is at least ``2.45 - 2 sqrt(2) noise`` (2.16 by default), and
    plain 2-means cuts the outer parabola in halves (accuracy about 0.7).

    Parameters
    ----------
    n : int
        Number of points; row ``i`` has class ``i % 2``.
    random_state : int, None, or numpy Generator, default=0
        Seed; a Generator or None is turned into one integer seed first.
    noise : float, default=0.1
        Half-width of the triangular noise on each coordinate.

    Returns
    -------
    X : ndarray of shape (n, 2)
    y : ndarray of shape (n,), int64

    Examples
    --------
    >>> X, y = make_parabolic(1000)
    >>> bool(X[y == 0, 1].min() > X[y == 1, 1].min())
    True
    """
    return _make("parabolic", n, random_state, {"noise": noise})


def make_zigzag(n: int, *, random_state=0, noise: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaved zigzag bands in 2-D: a small tooth inside a long zigzag.

    Class 1 is a zigzag of slope +-1 over ``|x| <= 6`` with troughs at
    ``x = 0, +-4`` (height 0) and peaks at ``x = +-2, +-6`` (height 2).
    Class 0 is one tooth of the same slope, ``y = |x| + 1.7`` for
    ``|x| <= 0.35``, sitting in the central trough between two peaks of
    class 1.  Points are evenly spread along each band and moved by bounded
    noise of at most ``noise`` per coordinate.  Made for a Gaussian kernel with
    ``gamma = 2**3`` (length scale 0.35): the tooth is compact at that scale,
    the gap is at least ``1.2 - 2 sqrt(2) noise`` (1.06 by default), and plain
    2-means cuts the long zigzag in halves (accuracy about 0.7).

    Parameters
    ----------
    n : int
        Number of points; row ``i`` has class ``i % 2``.
    random_state : int, None, or numpy Generator, default=0
        Seed; a Generator or None is turned into one integer seed first.
    noise : float, default=0.05
        Half-width of the triangular noise on each coordinate.

    Returns
    -------
    X : ndarray of shape (n, 2)
    y : ndarray of shape (n,), int64

    Examples
    --------
    >>> X, y = make_zigzag(1000)
    >>> bool(abs(X[y == 0, 0]).max() < 0.5)
    True
    """
    return _make("zigzag", n, random_state, {"noise": noise})


def make_blobs(
    n: int,
    *,
    random_state=0,
    n_features: int | None = None,
    centers=3,
    cluster_std=1.0,
    center_box: tuple[float, float] = (-10.0, 10.0),
) -> tuple[np.ndarray, np.ndarray]:
    """Isotropic Gaussian blobs in ``n_features`` dimensions.

    Parameters
    ----------
    n : int
        Number of points; row ``i`` belongs to blob ``i % k``.
    random_state : int, None, or numpy Generator, default=0
        Seed; a Generator or None is turned into one integer seed first.
    n_features : int, optional
        Dimension; by default that of ``centers`` when it is an array, else 2.
    centers : int or array-like of shape (k, n_features), default=3
        Number of blobs, with centres drawn uniformly from ``center_box``, or
        the centres themselves.
    cluster_std : float or sequence of k floats, default=1.0
        Standard deviation of each blob.
    center_box : (float, float), default=(-10, 10)
        Range of the random centres on each coordinate.

    Returns
    -------
    X : ndarray of shape (n, n_features)
    y : ndarray of shape (n,), int64

    Examples
    --------
    >>> X, y = make_blobs(300, n_features=4, centers=[[0] * 4, [5] * 4], cluster_std=0.5)
    >>> bool(abs(X[y == 1].mean(axis=0) - 5).max() < 0.2)
    True
    """
    params = {
        "n_features": n_features,
        "centers": centers,
        "cluster_std": cluster_std,
        "center_box": center_box,
    }
    return _make("blobs", n, random_state, params)


def make_spheres(
    n: int, *, random_state=0, n_features: int = 3, shells: int = 2, noise: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """Concentric spherical shells in ``n_features`` dimensions.

    Shell ``c`` (``c = 0 .. shells - 1``) has radius ``1 + c``; directions are
    uniform on the sphere and the radius carries bounded triangular noise of at
    most ``noise``, so neighbouring shells are at least ``1 - 2 noise`` apart.

    Parameters
    ----------
    n : int
        Number of points; row ``i`` is on shell ``i % shells``.
    random_state : int, None, or numpy Generator, default=0
        Seed; a Generator or None is turned into one integer seed first.
    n_features : int, default=3
        Dimension.
    shells : int, default=2
        Number of shells (classes).
    noise : float, default=0.1
        Half-width of the radial noise.

    Returns
    -------
    X : ndarray of shape (n, n_features)
    y : ndarray of shape (n,), int64

    Examples
    --------
    >>> import numpy as np
    >>> X, y = make_spheres(100, n_features=5, shells=3, noise=0.0)
    >>> np.allclose(np.linalg.norm(X, axis=1), 1 + y)
    True
    """
    params = {"n_features": n_features, "shells": shells, "noise": noise}
    return _make("spheres", n, random_state, params)
