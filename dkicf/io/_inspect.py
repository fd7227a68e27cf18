"""What a store is: a dataset, a model, a checkpoint, labels."""

from __future__ import annotations

import os

import numpy as np
import zarr

from ._layout import _read_layout
from ._reading import open_array, open_dataset
from ._stores import _group_arrays, _join, _probe, _store


def inspect(url, *, storage_options: dict | None = None) -> tuple[str, dict]:
    """What is at ``url``: ``("dataset" | "model" | "checkpoint" | "labels" | "group", details)``.

    Details are JSON-ready: shape, chunks, dtype and sizes for a dataset;
    kernel, rank and sizes for a model; for a fit's checkpoint, how far the
    factorization and k-means got and where P lives.
    """
    url = os.fspath(url)
    node = _probe(url, storage_options)
    if node.kind == "array":
        arr = open_array(url, storage_options=storage_options)
        return "dataset", _array_details(arr)
    names = _group_arrays(url, storage_options)
    group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r",
                            zarr_format=node.zarr_format)
    kind, attrs = _read_layout(dict(group.attrs), url)
    if kind == "icf-checkpoint":
        return "checkpoint", _checkpoint_details(url, attrs, storage_options)
    if kind == "model":
        details = {
            "kernel": attrs.get("kernel"),
            "n_clusters": attrs.get("params", {}).get("n_clusters"),
            "rank": attrs.get("rank"),
            "n_features": attrs.get("n_features_in"),
            "stop_reason": attrs.get("stop_reason"),
            "arrays": names,
        }
        if "P" in names:
            p = group["P"]
            details["P"] = f"shape {list(p.shape)}, chunks {list(p.chunks)}"
        if "input" in attrs:
            details["input"] = attrs["input"].get("url")
        return "model", details
    if "X" in names:
        X, y, info = open_dataset(url, storage_options=storage_options)
        details = _array_details(group["X"])
        if y is not None:
            details["labels"] = f"y, {len(info.get('label_values') or [])} classes"
        return "dataset", details
    if kind == "labels":
        return "labels", {"arrays": names, "model": attrs.get("model")}
    return "group", {"arrays": names}


def _checkpoint_details(url: str, meta: dict, storage_options: dict | None) -> dict:
    """How far the checkpointed fit at ``url`` got (see :mod:`dkicf.checkpoint`)."""
    fingerprint = meta.get("fingerprint") or {}
    params = dict(fingerprint.get("params") or {})
    data = fingerprint.get("input") or {}
    layout = meta.get("layout") or {}
    commit = meta.get("commit")
    capacity = layout.get("capacity", params.get("max_rank"))
    kernel = {k: params[k] for k in ("kernel", "gamma", "degree", "coef0") if k in params}
    details: dict = {"input": f"shape {data.get('shape')}, row chunks {data.get('chunks')}",
                     "kernel": kernel, "pivoting": params.get("pivoting")}
    if not commit:
        details["factorization"] = f"started, nothing committed yet (rank up to {capacity})"
    else:
        done = "finished" if commit.get("finished") else "in progress"
        line = (f"{done}: iteration {commit['iteration']}, rank {commit['rank']} of at most "
                f"{capacity}")
        if commit.get("stop_reason"):
            line += f", stopped by {commit['stop_reason']}"
        if commit.get("trace_errors"):
            line += f", trace error {commit['trace_errors'][-1]:.6g}"
        details["factorization"] = line
        where = commit.get("p_storage") or layout.get("p_storage") or "zarr"
        details["P"] = ("in worker memory, its columns copied here at each commit"
                        if where == "memory" else "held here (Zarr)")
    details["k-means"] = _kmeans_checkpoint_line(_join(url, "kmeans"), storage_options)
    if not (commit and commit.get("finished")) or "not started" in details["k-means"]:
        details["resume"] = (f"dkicf fit <the same data> --checkpoint {url} --resume, with the "
                             "same parameters")
    return details


def _kmeans_checkpoint_line(url: str, storage_options: dict | None) -> str:
    """The state of the k-means checkpoint that a fit keeps beside its factorization."""
    try:
        group = zarr.open_group(store=_store(url, storage_options, read_only=True), mode="r",
                                zarr_format=3)
        meta = dict(group.attrs).get("dkicf") or {}
    except Exception:  # no such subgroup: k-means has not started
        return "not started"
    commit = meta.get("commit")
    if not isinstance(commit, dict):
        return "started, nothing committed yet"
    state = commit.get("state") or {}
    n_init = (meta.get("fingerprint") or {}).get("params", {}).get("n_init")
    best = state.get("best") or {}
    if commit.get("finished"):
        line = f"finished: {n_init} run(s)"
    else:
        line = f"in progress: run {int(state.get('restart', 0)) + 1} of {n_init}"
    if best.get("inertia") is not None:
        line += f", best inertia {best['inertia']:.6g}"
    return line


def _array_details(arr) -> dict:
    nbytes = int(np.prod(arr.shape)) * np.dtype(arr.dtype).itemsize
    return {
        "shape": list(arr.shape),
        "chunks": list(arr.chunks),
        "dtype": str(arr.dtype),
        "size": f"{nbytes / 2**20:.1f} MiB",
        "n_chunks": int(np.prod([-(-s // c) for s, c in zip(arr.shape, arr.chunks)])),
    }
