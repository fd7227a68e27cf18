"""Zarr in and out: opening arrays safely, dataset stores, conversion, model groups.

Stores are Zarr v3 (v2 is read too) at a local path or at an fsspec URL
(``file://``, ``memory://``, ``s3://``, ...; remote protocols need their fsspec
package, e.g. ``s3fs``).

Locations
    A relative local path means a path under this process's working
    directory.  Every function here, and every dkicf entry point that takes a
    location, makes it absolute (:func:`absolute_location`) before opening
    anything, so dask workers that run in another directory read and write
    the same files.  URLs with a scheme are left as they are.

Reading
    :func:`open_array`, :func:`as_dask` and :func:`open_dataset` read the
    store's metadata first and refuse it (:class:`DkicfIOError`) before any
    chunk is read when it declares a pickle or object codec, or a dtype that is
    not a real number.  Chunks are never unpickled.  The shape in the metadata
    is checked before anything sized by it is built: a data array must have
    every chunk its shape needs in the store (counted where listing is cheap,
    the last one looked for elsewhere), and no array may need a task graph or
    a read larger than the memory available.

Dataset layout
    A dataset store is a Zarr group holding ``X`` of shape
    ``(n_samples, n_features)``, chunked by rows with all columns in one
    chunk, and optionally ``y`` of shape ``(n_samples,)``, int64, with the same
    row chunks.  Class values ``0 .. c-1`` in ``y`` stand for the original
    labels listed in ``label_values``, one of the dkicf attributes.

Attributes and dimension names
    dkicf keeps its attributes of a node under the one attribute ``dkicf``,
    with the layout's ``schema`` and the node's ``kind`` (``"dataset"``,
    ``"model"``, ``"labels"``, ...), and names the dimensions of the arrays
    it writes (``X``: ``("row", "feature")``, ...); docs/zarr-layout.md has
    the whole layout.  Stores of earlier schemas are read; a later schema is
    refused with a message to upgrade dkicf.

Writing
    :func:`convert`, :func:`generate` and :func:`write_group` refuse an
    existing destination unless ``overwrite=True``.  At a local path (or
    ``file://`` URL) they write a temporary sibling directory and move it into
    place only once it is complete, so a failed write leaves no store behind,
    and with ``overwrite=True`` the old store is moved away only after the new
    one is complete.  At other URLs there is no rename: the store is written in
    place, an old one is cleared first (only with ``overwrite=True``), and a
    failed write removes what it wrote.  An existing path that is not a Zarr
    store is never replaced.

Modules, each importing only those above it
    ``_stores`` (errors, locations, stores, metadata probes), ``_checks``
    (metadata safety checks), ``_layout`` (attributes and dimension names of
    the Zarr layout), ``_reading`` (arrays and datasets as dask),
    ``_staging`` (destination checks, staged writes, attributes), ``_claims``
    (one run per location), ``_groups`` (models and labels),
    ``_inspect``; and for conversion ``_sources`` (labels, .npy/.npz,
    Parquet), ``_text`` (delimited and svmlight text), ``_convert``.
"""

from ._checks import check_store_safe
from ._claims import ClaimedError, claimed
from ._convert import convert, generate
from ._groups import read_group, write_dask, write_group, write_members
from ._groups import remove_member as remove_member
from ._inspect import inspect
from ._reading import as_dask, fingerprint, open_array, open_dataset, open_member
from ._staging import check_not_input, check_writable, staged_group
from ._stores import (
    DkicfIOError,
    MissingChunkError,
    OutputExistsError,
    absolute_location,
)
from ._stores import _join as _join
from ._stores import _local_path as _local_path
from ._stores import _probe as _probe

# ``remove_member``, ``_join``, ``_local_path`` and ``_probe`` (imported "as"
# themselves above) are for other dkicf modules, not part of the public API.
__all__ = [
    "ClaimedError",
    "DkicfIOError",
    "MissingChunkError",
    "OutputExistsError",
    "absolute_location",
    "as_dask",
    "check_not_input",
    "check_store_safe",
    "check_writable",
    "claimed",
    "convert",
    "fingerprint",
    "generate",
    "open_array",
    "open_dataset",
    "inspect",
    "open_member",
    "read_group",
    "staged_group",
    "write_dask",
    "write_group",
    "write_members",
]

# The errors are named, pickled and printed as ``dkicf.io.<name>``, wherever they are defined.
for _error in (ClaimedError, DkicfIOError, MissingChunkError, OutputExistsError):
    _error.__module__ = __name__
del _error
