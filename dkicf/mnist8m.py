"""Write MNIST-like deformed digits (:mod:`dkicf.digits`) to a dataset store, chunk by chunk.

The base images are the 60,000 MNIST training images (``mnist.npz`` as found
by :func:`dkicf.datasets.load_dataset`, raw grey values 0..255) or any
``.npz`` with ``X`` (n_images x 784) and ``y`` (digits 0..9).  The rows are
made by dask tasks, one per chunk, each writing its own Zarr chunk; only the
chunks under way are in memory.  X is stored as uint8, its grey values 0..255:
a Gaussian kernel width meant for pixels divided by 255 (as LIBSVM's
``mnist.scale``, on which the paper's ``gamma = 2**-6`` is set) becomes
``gamma / 255**2`` on these values, exactly, since
``exp(-g ||x/255 - z/255||^2) = exp(-(g / 255**2) ||x - z||^2)``.

Examples
--------
>>> import os, tempfile
>>> import numpy as np
>>> d = tempfile.mkdtemp()
>>> rng = np.random.default_rng(0)
>>> np.savez(os.path.join(d, "base.npz"), X=rng.integers(0, 256, (50, 784)), y=np.arange(50) % 10)
>>> info = generate_digits(os.path.join(d, "digits.zarr"), 300, source=os.path.join(d, "base.npz"),
...                        chunk_rows=128)
>>> info["shape"], info["dtype"], info["chunks"]
([300, 784], 'uint8', [128, 784])
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
from dask.callbacks import Callback

from . import datasets, digits, io
from ._validation import check_positive_int

__all__ = ["DEFAULT_CHUNK_ROWS", "MNIST_GAMMA_RAW", "generate_digits", "load_source"]

#: Rows per chunk by default: 12.25 MiB of uint8 (see :data:`dkicf.digits.CHUNK_ROWS`).
DEFAULT_CHUNK_ROWS = digits.CHUNK_ROWS

#: The paper's MNIST kernel width (2**-6 on pixels / 255) on raw grey values 0..255.
MNIST_GAMMA_RAW = datasets.PAPER_GAMMA["mnist"] / 255.0**2


def load_source(source=None) -> tuple[np.ndarray, np.ndarray]:
    """The base images and labels, checked (:func:`dkicf.digits.check_source`).

    Parameters
    ----------
    source : str or path-like, optional
        An ``.npz`` holding ``X`` (n_images x 784, grey values 0..255 or 0..1)
        and ``y`` (digits 0..9).  Default: MNIST's training set from
        :func:`dkicf.datasets.load_dataset` (a local ``mnist.npz``, else the
        LIBSVM download).

    Returns
    -------
    images : ndarray of shape (n_images, 784), uint8
    labels : ndarray of shape (n_images,), int64

    Raises
    ------
    FileNotFoundError
        For a ``source`` that does not exist.
    ValueError
        For a file that is not an ``.npz`` with ``X`` and ``y``, or whose arrays
        :func:`~dkicf.digits.check_source` refuses.
    """
    if source is None:
        X, y = datasets.load_dataset("mnist", scale=False)
        return digits.check_source(X, y)
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the source {path} does not exist (or is not a file); pass an .npz with X "
            "(n_images x 784) and y (digits 0..9), or leave --source out to use MNIST."
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("X", "y") if k not in f.files]
            if missing:
                raise ValueError(
                    f"the source {path} has no array {' or '.join(missing)} (it holds: "
                    f"{', '.join(f.files) or 'nothing'}); it needs X (n_images x 784) and "
                    "y (digits 0..9)."
                )
            X, y = f["X"], f["y"]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(
            f"the source {path} is not a readable .npz ({exc}); save X and y with "
            "numpy.savez(path, X=X, y=y)."
        ) from None
    try:
        return digits.check_source(X, y)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


class _RowsDone(Callback):
    """Reports ``progress(rows, n)`` as the tasks of a local dask computation finish."""

    def __init__(self, progress: Callable[[int, int], None], n: int):
        super().__init__()
        self.progress, self.n = progress, n
        self.total = self.done = 0

    def _start_state(self, dsk, state):
        self.total = max(1, sum(len(state[k]) for k in ("ready", "waiting")))

    def _posttask(self, key, result, dsk, state, worker_id):
        self.done += 1
        self.progress(min(self.n - 1, self.n * self.done // self.total), self.n)


def generate_digits(
    dst,
    n: int,
    *,
    source=None,
    chunk_rows: int | None = None,
    random_state: int = 0,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write ``n`` deformed digits as a dataset group (``X`` uint8, ``y`` int64).

    Everything is checked (the output, ``n``, the source) before a chunk is
    made; the group appears at ``dst`` only when complete.

    Parameters
    ----------
    dst : str or path-like
        The dataset store to create.
    n : int
        Number of rows, at least 1.
    source : str or path-like, optional
        The base images (see :func:`load_source`); default MNIST's training set.
    chunk_rows : int, optional
        Rows per chunk (default :data:`DEFAULT_CHUNK_ROWS`).  The rows do not
        depend on it.
    random_state : int, default=0
        Seed of the dataset.
    overwrite : bool, default=False
        Replace an existing dataset at ``dst``.
    storage_options : dict, optional
        Passed to fsspec for a ``dst`` URL.
    progress : callable, optional
        Called as ``progress(rows_done, n)`` while the rows are made.

    Returns
    -------
    info : dict
        ``url``, ``kind`` ("mnist8m"), ``shape``, ``chunks``, ``n_samples``,
        ``n_features``, ``dtype``, ``chunk_rows``, ``labels``,
        ``label_values`` and ``n_classes``.
    """
    dst = os.fspath(dst)
    n = check_positive_int(n, "n")
    rows = min(check_positive_int(DEFAULT_CHUNK_ROWS if chunk_rows is None else chunk_rows,
                                  "chunk_rows"), n)
    io.check_writable(dst, overwrite=overwrite, storage_options=storage_options)
    images, labels = load_source(source)
    X, y = digits.digits_dask(images, labels, n, chunk_rows=rows, random_state=random_state)
    seed = int(random_state)
    label_values = list(range(10))
    attrs = {
        "source": "synthetic:mnist8m",
        "source_format": "synthetic",
        "synthetic": {
            "kind": "mnist8m",
            "random_state": seed,
            "params": {
                "base": "mnist" if source is None else os.path.abspath(os.fspath(source)),
                "n_images": int(images.shape[0]),
                "alpha": digits.ALPHA,
                "sigma": digits.SIGMA,
            },
        },
        "dtype": "uint8",
        "shape": [n, digits.IMAGE_SIDE**2],
        "label_values": label_values,
    }
    with io.staged_group(dst, overwrite=overwrite, storage_options=storage_options) as target:
        io.write_members(target, {}, attrs, kind="dataset", storage_options=storage_options)
        with _RowsDone(progress, n) if progress is not None else contextlib.nullcontext():
            io.write_dask(target, "X", X, storage_options=storage_options)
        io.write_dask(target, "y", y, storage_options=storage_options)
    if progress is not None:
        progress(n, n)
    d = digits.IMAGE_SIDE**2
    return {
        "url": dst, "kind": "mnist8m", "shape": [n, d], "chunks": [rows, d], "n_samples": n,
        "n_features": d, "dtype": "uint8", "chunk_rows": rows, "labels": True,
        "label_values": label_values, "n_classes": len(label_values),
    }
