"""MNIST-like digits: random elastic and affine deformations of base images, by row index.

Row ``i`` of a dataset made here is one base image (a 28 x 28 digit of a
source such as the 60,000 MNIST training images), chosen at random, then
deformed as in Simard, Steinkraus and Platt, "Best practices for
convolutional neural networks applied to visual document analysis"
(ICDAR 2003): a displacement field of independent uniform values in
``[-1, 1]`` per pixel and axis, smoothed by a Gaussian of width ``sigma``
(:data:`SIGMA` = 4 pixels) and scaled by ``alpha`` (:data:`ALPHA` = 34),
combined with a small random affine map (rotation, scale, shear and a
translation of up to 2 pixels), then resampled bilinearly.  The label of the
row is the label of its base image.  This is the kind of data of the
MNIST8M set (Loosli, Canu and Bottou, 2007), made anew here; it is not that
file.

Determinism
-----------
Every row's numbers depend on ``(random_state, row index)`` only, so rows
``[start, stop)`` can be made without the rows before them, by any number of
tasks in any order, and the stored dataset does not depend on its chunking.
Rows are grouped in fixed blocks of :data:`BLOCK_ROWS`; block ``b`` draws
from PCG64 streams seeded by ``SeedSequence(random_state, spawn_key=(stream,
b))`` (stream 0: the choice of the base image, one number per row; stream 1:
the deformation, a fixed count per row), and a row skips to its own numbers
with ``PCG64.advance``.  The labels can thus be computed without the images.

Speed
-----
The Gaussian smoothing of a 28 x 28 field with zero padding (what
``scipy.ndimage.gaussian_filter(..., mode="constant")`` computes) is the
linear map ``G U G^T`` for a 28 x 28 matrix ``G``, applied here to a whole
batch of fields as two matrix products; the bilinear resampling gathers the
four neighbours of every output pixel of the batch at once (what
``scipy.ndimage.map_coordinates(..., order=1, mode="constant")`` computes).

Examples
--------
>>> import numpy as np
>>> from dkicf.digits import deform_rows, check_source
>>> rng = np.random.default_rng(0)
>>> base, labels = check_source(rng.integers(0, 256, (20, 784)), np.arange(20) % 10)
>>> X, y = deform_rows(base, labels, 5, 9, random_state=1)
>>> X.shape, X.dtype, y.tolist() == deform_rows(base, labels, 0, 9, random_state=1)[1][5:].tolist()
((4, 784), dtype('uint8'), True)
"""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
from scipy.ndimage import gaussian_filter1d

from ._validation import check_dtype, check_seed

__all__ = [
    "ALPHA",
    "BLOCK_ROWS",
    "CHUNK_ROWS",
    "IMAGE_SIDE",
    "SIGMA",
    "check_source",
    "deform_rows",
    "digit_labels",
    "digits_dask",
]

#: Side of the square images, in pixels (784 = 28 * 28 features).
IMAGE_SIDE = 28
#: Scale of the smoothed displacement field, in pixels (Simard et al. 2003).
ALPHA = 34.0
#: Width of the Gaussian that smooths the displacement field, in pixels.
SIGMA = 4.0
#: Rows per block of random numbers (see the module docstring).
BLOCK_ROWS = 4096
#: Rows per chunk that waste no work: a multiple of the rows deformed at once,
#: which are always whole aligned batches (see :func:`deform_rows`).
CHUNK_ROWS = 16384

# The affine part, each drawn uniformly: rotation (radians), relative scale,
# shear (x moves by shear * y) and translation (pixels, per axis).
_MAX_ROTATION = np.deg2rad(10.0)
_MAX_SCALE = 0.1
_MAX_SHEAR = 0.1
_MAX_SHIFT = 2.0

_PIXELS = IMAGE_SIDE * IMAGE_SIDE
# Uniforms per row of the deformation stream: two fields, then the five affine numbers.
_N_AFFINE = 5
_N_DEFORM = 2 * _PIXELS + _N_AFFINE
# Rows deformed at once inside a call: bounds the float32 temporaries to a few tens of MB.
_BATCH = CHUNK_ROWS // 8
# Padded images: one zero row/column before, two after, so every bilinear
# neighbour of a clipped coordinate lies inside and outside pixels read zero.
_PAD_SIDE = IMAGE_SIDE + 3



def check_source(X, y) -> tuple[np.ndarray, np.ndarray]:
    """Check base images and their labels; return them as uint8 pixels and int64 digits.

    Parameters
    ----------
    X : array-like of shape (n_images, 784)
        Row-major 28 x 28 grey images, with values in ``[0, 255]`` or, when
        none exceeds 1, in ``[0, 1]`` (multiplied by 255 here).  Integer or
        floating point; rounded to the nearest integer.
    y : array-like of shape (n_images,)
        The digit of each image, integers ``0..9``.

    Returns
    -------
    X : ndarray of shape (n_images, 784), uint8
    y : ndarray of shape (n_images,), int64

    Raises
    ------
    ValueError
        For a shape other than ``(n_images, 784)`` with ``n_images >= 1``, NaN
        or infinite values, values outside ``[0, 255]``, or labels that are not
        integers ``0..9`` (one per image).  The message names the problem and
        what the source must hold.
    TypeError
        For a non-numeric (or boolean) dtype.
    """
    X = np.asarray(X)
    y = np.asarray(y)
    if X.dtype.kind == "b":
        raise TypeError("the source images X are boolean; pass grey values 0..255 or 0..1.")
    check_dtype(X.dtype, "the source images X")
    if X.ndim != 2 or X.shape[1] != _PIXELS or X.shape[0] < 1:
        raise ValueError(
            f"the source images X have shape {X.shape}; they must be (n_images, {_PIXELS}): "
            f"one row-major {IMAGE_SIDE} x {IMAGE_SIDE} image per row, at least one row "
            "(MNIST's training set is 60000 x 784)."
        )
    if X.dtype.kind == "f" and not np.isfinite(X).all():
        row = int(np.flatnonzero(~np.isfinite(X).all(axis=1))[0])
        raise ValueError(f"the source images X hold NaN or infinity (first at row {row}).")
    low, high = X.min(), X.max()
    if low < 0 or high > 255:
        raise ValueError(
            f"the source images X have values in [{low}, {high}]; grey values must lie in "
            "[0, 255] (or in [0, 1])."
        )
    if y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(
            f"the source labels y have shape {y.shape}; they must be ({X.shape[0]},): one "
            "digit per image of X."
        )
    if y.dtype.kind not in "iuf" or not np.array_equal(y, np.round(y)) or not (
        (y >= 0) & (y <= 9)
    ).all():
        raise ValueError(
            f"the source labels y must be the digits 0..9 as integers; got dtype {y.dtype} "
            f"with values {np.unique(y)[:10].tolist()}."
        )
    scale = 255.0 if high <= 1 and X.dtype.kind == "f" else 1.0
    pixels = np.rint(np.asarray(X, dtype=np.float64) * scale).astype(np.uint8)
    return pixels, y.astype(np.int64)


def _uniforms(seed: int, stream: int, start: int, stop: int, width: int) -> np.ndarray:
    """Uniforms in [0, 1) of shape (stop - start, width) for rows [start, stop) of a stream."""
    out = np.empty((stop - start, width), dtype=np.float64)
    for block in range(start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS + 1 if stop > start else 0):
        lo = max(start, block * BLOCK_ROWS)
        hi = min(stop, (block + 1) * BLOCK_ROWS)
        bitgen = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream, block)))
        bitgen.advance((lo - block * BLOCK_ROWS) * width)  # one double = one 64-bit draw
        out[lo - start : hi - start] = np.random.Generator(bitgen).random((hi - lo, width))
    return out


def _base_index(seed: int, start: int, stop: int, n_images: int) -> np.ndarray:
    u = _uniforms(seed, 0, start, stop, 1)[:, 0]
    return np.minimum((u * n_images).astype(np.int64), n_images - 1)


def digit_labels(labels: np.ndarray, start: int, stop: int, *, random_state: int) -> np.ndarray:
    """Labels of rows ``[start, stop)``, without making their images.

    Parameters
    ----------
    labels : ndarray of shape (n_images,)
        The labels of the base images (as returned by :func:`check_source`).
    start, stop : int
        The half-open row range.
    random_state : int
        Seed of the dataset.

    Returns
    -------
    y : ndarray of shape (stop - start,), int64
    """
    seed = check_seed(random_state)
    return np.asarray(labels, dtype=np.int64)[_base_index(seed, start, stop, len(labels))]


def _smoothing_matrix(sigma: float) -> np.ndarray:
    """G with ``G @ U == gaussian_filter1d(U, sigma, axis=0, mode="constant")``."""
    eye = np.eye(IMAGE_SIDE)
    return gaussian_filter1d(eye, sigma, axis=0, mode="constant").astype(np.float32)


def _source_coordinates(u: np.ndarray, alpha: float, sigma: float) -> tuple[np.ndarray, ...]:
    """Row and column coordinates (m, 28, 28) in the base image of each output pixel."""
    m = u.shape[0]
    G = _smoothing_matrix(sigma)
    fields = (2.0 * u[:, : 2 * _PIXELS] - 1.0).astype(np.float32)
    # G F G^T for every field F: right product by G^T, transpose, right product again.
    fields = fields.reshape(2 * m * IMAGE_SIDE, IMAGE_SIDE) @ G.T
    fields = fields.reshape(2 * m, IMAGE_SIDE, IMAGE_SIDE).transpose(0, 2, 1)
    fields = (fields.reshape(2 * m * IMAGE_SIDE, IMAGE_SIDE) @ G.T)
    # That leaves (G F G^T)^T per field: transpose back.
    fields = (alpha * fields).reshape(2, m, IMAGE_SIDE, IMAGE_SIDE).transpose(0, 1, 3, 2)
    a = u[:, 2 * _PIXELS :].astype(np.float32)
    angle = (2.0 * a[:, 0] - 1.0) * _MAX_ROTATION
    scale = 1.0 + (2.0 * a[:, 1] - 1.0) * _MAX_SCALE
    shear = (2.0 * a[:, 2] - 1.0) * _MAX_SHEAR
    shift = (2.0 * a[:, 3:5] - 1.0) * _MAX_SHIFT
    cos, sin = np.cos(angle) / scale, np.sin(angle) / scale
    # Output pixel p (row r, column c) about the centre reads the base image at
    # R(angle) S(shear) p / scale + centre + shift + displacement.
    centre = (IMAGE_SIDE - 1) / 2.0
    r = np.arange(IMAGE_SIDE, dtype=np.float32)[:, None] - centre
    c = np.arange(IMAGE_SIDE, dtype=np.float32)[None, :] - centre
    cs = c[None] + shear[:, None, None] * r[None]  # sheared column
    rows = (cos[:, None, None] * r[None] - sin[:, None, None] * cs
            + (centre + shift[:, 0])[:, None, None] + fields[0])
    cols = (sin[:, None, None] * r[None] + cos[:, None, None] * cs
            + (centre + shift[:, 1])[:, None, None] + fields[1])
    return rows, cols


def _bilinear(images: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Images (m, 784) uint8 sampled at (m, 28, 28) coordinates, zero outside: (m, 784) float32."""
    m = images.shape[0]
    padded = np.zeros((m, _PAD_SIDE, _PAD_SIDE), dtype=np.float32)
    padded[:, 1 : IMAGE_SIDE + 1, 1 : IMAGE_SIDE + 1] = images.reshape(m, IMAGE_SIDE, IMAGE_SIDE)
    flat = padded.reshape(-1)
    # Coordinates past -1 or 28 read zeros only; clipping keeps the gathers in bounds.
    rows = np.clip(rows, -1.0, float(IMAGE_SIDE))
    cols = np.clip(cols, -1.0, float(IMAGE_SIDE))
    r0, c0 = np.floor(rows), np.floor(cols)
    fr, fc = rows - r0, cols - c0
    base = (np.arange(m, dtype=np.int64) * _PAD_SIDE * _PAD_SIDE)[:, None, None]
    idx = base + (r0.astype(np.int64) + 1) * _PAD_SIDE + (c0.astype(np.int64) + 1)
    top = flat[idx] * (1.0 - fc) + flat[idx + 1] * fc
    bottom = flat[idx + _PAD_SIDE] * (1.0 - fc) + flat[idx + _PAD_SIDE + 1] * fc
    return (top * (1.0 - fr) + bottom * fr).reshape(m, _PIXELS)


def deform_rows(
    images: np.ndarray,
    labels: np.ndarray,
    start: int,
    stop: int,
    *,
    random_state: int,
    alpha: float = ALPHA,
    sigma: float = SIGMA,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of the deformed-digits dataset of ``random_state``.

    Parameters
    ----------
    images : ndarray of shape (n_images, 784), uint8
        The base images, as returned by :func:`check_source`.
    labels : ndarray of shape (n_images,)
        Their digits.
    start, stop : int
        The half-open row range, ``0 <= start <= stop``.
    random_state : int
        Seed of the dataset; a non-negative integer, the same for every range.
    alpha, sigma : float
        Scale and smoothing width of the elastic displacement, in pixels.

    Returns
    -------
    X : ndarray of shape (stop - start, 784), uint8
        The deformed images, rounded to the nearest grey value.
    y : ndarray of shape (stop - start,), int64
        The digit of each row (that of its base image).
    """
    seed = check_seed(random_state)
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}.")
    index = _base_index(seed, start, stop, images.shape[0])
    out = np.empty((stop - start, _PIXELS), dtype=np.uint8)
    # Whole aligned batches, always of _BATCH rows: the matrix products then see
    # the same operands whatever the range asked for, so a row's pixels do not
    # depend on the chunking (BLAS may round differently for other shapes).
    for first in range(start - start % _BATCH, stop if stop > start else start, _BATCH):
        lo, hi = max(start, first), min(stop, first + _BATCH)
        u = _uniforms(seed, 1, first, first + _BATCH, _N_DEFORM)
        rows, cols = _source_coordinates(u, alpha, sigma)
        del u
        keep = slice(lo - first, hi - first)
        values = _bilinear(images[index[lo - start : hi - start]], rows[keep], cols[keep])
        np.rint(values, out=values)
        out[lo - start : hi - start] = np.clip(values, 0, 255)
    return out, np.asarray(labels, dtype=np.int64)[index]


def _chunk_images(images, labels, start, stop, seed):
    return deform_rows(images, labels, start, stop, random_state=seed)[0]


def _chunk_labels(labels, start, stop, seed):
    return digit_labels(labels, start, stop, random_state=seed)


def digits_dask(images: np.ndarray, labels: np.ndarray, n: int, *, chunk_rows: int,
                random_state: int):
    """The dataset of ``n`` rows as lazy dask arrays, one task per row chunk.

    Parameters
    ----------
    images, labels : ndarray
        Base images and labels, as returned by :func:`check_source`.
    n : int
        Number of rows, at least 1.
    chunk_rows : int
        Rows per chunk (the last one may be shorter).
    random_state : int
        Seed of the dataset.

    Returns
    -------
    X : dask.array.Array of shape (n, 784), uint8
    y : dask.array.Array of shape (n,), int64
        Their values are those of :func:`deform_rows` over all rows, whatever
        ``chunk_rows`` and the scheduler.
    """
    seed = check_seed(random_state)
    # The base images go into the graph once, not once per task.
    images_d = dask.delayed(images, pure=True)
    labels_d = dask.delayed(labels, pure=True)
    make_x = dask.delayed(_chunk_images, pure=True)
    make_y = dask.delayed(_chunk_labels, pure=True)
    xs, ys = [], []
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        xs.append(da.from_delayed(make_x(images_d, labels_d, lo, hi, seed),
                                  shape=(hi - lo, _PIXELS), dtype=np.uint8))
        ys.append(da.from_delayed(make_y(labels_d, lo, hi, seed), shape=(hi - lo,),
                                  dtype=np.int64))
    return da.concatenate(xs), da.concatenate(ys)
