"""Input checks shared by the public functions: clear errors before any heavy work."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["is_dask_array", "check_array_2d", "check_dtype", "check_seed"]


def is_dask_array(X) -> bool:
    """True for a dask array (without importing dask when it is not one)."""
    return type(X).__module__.startswith("dask.") and hasattr(X, "chunks") and hasattr(X, "dask")


def check_dtype(dtype, name: str = "X") -> None:
    """Refuse dtypes that are not real numbers (object, complex, structured, text)."""
    dtype = np.dtype(dtype)
    if dtype.fields is not None:
        raise TypeError(f"{name} has a structured dtype {dtype}; pass a plain 2-D numeric array.")
    if dtype.kind == "c":
        raise TypeError(
            f"{name} has complex dtype {dtype}; kernels here are defined on real data. "
            "Split real and imaginary parts into separate features."
        )
    if dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must hold real numbers, got dtype {dtype}. "
            "Convert it with X.astype('float64') after removing non-numeric columns."
        )


def check_array_2d(X, name: str = "X", *, allow_empty: bool = False):
    """Validate X as a 2-D real array: numpy arrays are converted, dask arrays checked.

    Numpy input is checked for NaN and infinity here (naming the first bad row);
    dask input is checked chunk by chunk by the first pass over the data.
    """
    if is_dask_array(X):
        check_dtype(X.dtype, name)
        if X.ndim != 2:
            raise ValueError(
                f"{name} must be 2-D (n_samples, n_features), got {X.ndim}-D with shape {X.shape}."
            )
        if any(isinstance(s, float) and np.isnan(s) for s in X.shape):
            raise ValueError(
                f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first."
            )
        if not allow_empty and (X.shape[0] == 0 or X.shape[1] == 0):
            raise ValueError(
                f"{name} is empty: shape {X.shape}; it needs at least one row and column."
            )
        if X.numblocks[1] != 1:
            X = X.rechunk({1: -1})
        return X
    if hasattr(X, "iloc") or hasattr(X, "to_numpy"):
        X = X.to_numpy()
    arr = np.asarray(X)
    check_dtype(arr.dtype, name)
    if arr.ndim != 2:
        hint = " Reshape a single feature with X.reshape(-1, 1)." if arr.ndim == 1 else ""
        raise ValueError(
            f"{name} must be 2-D (n_samples, n_features), got {arr.ndim}-D with shape "
            f"{arr.shape}.{hint}"
        )
    if not allow_empty and (arr.shape[0] == 0 or arr.shape[1] == 0):
        raise ValueError(
            f"{name} is empty: shape {arr.shape}; it needs at least one row and column."
        )
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
        raise ValueError(
            f"{name} contains NaN or infinity: first at row {bad}. "
            "Remove or impute those rows before clustering."
        )
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    return arr


def check_positive_int(value, name: str, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}.")
    return int(value)


def check_seed(random_state) -> int:
    """A seed of generated data: a non-negative integer, from which every row or chunk
    derives its random numbers (so they do not depend on the chunking)."""
    if isinstance(random_state, bool) or not isinstance(random_state, numbers.Integral):
        raise TypeError(
            "random_state must be a non-negative integer (every row derives its numbers "
            f"from it), got {random_state!r} of type {type(random_state).__name__}."
        )
    if random_state < 0:
        raise ValueError(f"random_state must be >= 0, got {random_state}.")
    return int(random_state)
