"""The Zarr layout: dkicf's attributes under one key with a schema, and dimension names.

Every node dkicf writes has the attributes ``{"dkicf": {"schema": 2, "kind": ...,
"created_by": ..., ...}}`` and its arrays have ``dimension_names``; see
docs/zarr-layout.md.  Stores of the layout before schema 2 (attributes at the top
level) are read through :func:`_read_layout`, which translates them.
"""

from __future__ import annotations

from .._version import LAYOUT_SCHEMA, __version__
from ._stores import DkicfIOError

# The attribute that holds all of dkicf's attributes of a node.
_KEY = "dkicf"

# Dimension names of the arrays dkicf writes, by array name: "row" is a data
# point, "feature" a column of X, "column" a column of P (one per pivot, in the
# order they were chosen), "pivot" a pivot as a row of the Cholesky factor.
_DIMENSIONS = {
    "X": ("row", "feature"),
    "y": ("row",),
    "labels": ("row",),
    "P": ("row", "column"),
    "cluster_centers": ("cluster", "column"),
    "pivots": ("column",),
    "pivot_rows": ("column", "feature"),
    "cholesky_factor": ("pivot", "column"),
    "trace_errors": ("column",),
}

# Schema 1 for datasets, models and labels: attributes at the top level, the
# kind named by "format" (with "format_version" 1 for models) or, for a
# dataset, by the presence of "source_format".
_LEGACY_FORMATS = {"dkicf-model": "model", "dkicf-labels": "labels",
                   "dkicf-fit-in-progress": "fit-in-progress"}


def _created_by() -> str:
    """The ``created_by`` attribute of what this version of dkicf writes."""
    return f"dkicf {__version__}"


def _dims(name: str, ndim: int) -> tuple[str, ...] | None:
    """The dimension names of array ``name``, if the layout names it with ``ndim`` dimensions."""
    names = _DIMENSIONS.get(name)
    return names if names is not None and len(names) == ndim else None


def _layout_attrs(kind: str, attrs: dict) -> dict:
    """The attributes of a node of ``kind`` holding ``attrs`` (already JSON values)."""
    for reserved in ("schema", "kind"):
        if reserved in attrs:
            raise DkicfIOError(
                f"the attribute {reserved!r} is set by dkicf (the layout's {reserved}); "
                "store that value under another name."
            )
    meta = {"schema": LAYOUT_SCHEMA, "kind": kind, **attrs}
    meta.setdefault("created_by", _created_by())
    return {_KEY: meta}


def _read_layout(raw: dict, where: str) -> tuple[str | None, dict]:
    """The kind of a node and its dkicf attributes (without schema and kind).

    Attributes of schema 1 are translated; a node of a later schema than this
    dkicf reads is refused.  The kind is None for a node dkicf did not write.
    """
    if _KEY not in raw:
        return _read_legacy(raw, where)
    meta = raw[_KEY]
    if not isinstance(meta, dict):
        raise DkicfIOError(
            f"refusing {where}: its attribute {_KEY!r} is {str(meta)[:60]}, not the dict of "
            "dkicf's attributes. The store is damaged: restore it or write it again."
        )
    schema = meta.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise DkicfIOError(
            f"refusing {where}: its dkicf attributes have schema {str(schema)[:60]}, not a "
            "version number. The store is damaged: restore it or write it again."
        )
    if schema > LAYOUT_SCHEMA:
        raise DkicfIOError(_newer_message(where, f"schema {schema}"))
    payload = {k: v for k, v in meta.items() if k not in ("schema", "kind")}
    kind = meta.get("kind")
    return (kind if isinstance(kind, str) else None), payload


def _read_legacy(raw: dict, where: str) -> tuple[str | None, dict]:
    """Attributes at the top level (schema 1): kind from ``format`` or ``source_format``."""
    fmt = raw.get("format")
    if isinstance(fmt, str) and fmt in _LEGACY_FORMATS:
        payload = {k: v for k, v in raw.items() if k not in ("format", "format_version")}
        version = raw.get("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool):
            raise DkicfIOError(
                f"refusing {where}: its attribute format_version is {str(version)[:60]}, not "
                "an integer. The store is damaged: restore it or write it again."
            )
        if version > 1:
            raise DkicfIOError(_newer_message(where, f"{fmt} format {version}"))
        return _LEGACY_FORMATS[fmt], payload
    if "source_format" in raw:
        return "dataset", dict(raw)
    return None, dict(raw)


def _newer_message(where: str, what: str) -> str:
    return (
        f"{where} was written by a newer dkicf ({what}); this dkicf {__version__} reads the "
        f"Zarr layout up to schema {LAYOUT_SCHEMA}. Upgrade dkicf to read it."
    )
