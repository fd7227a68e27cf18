"""The version of dkicf and of the Zarr layout it writes, in a module any module can import."""

__version__ = "0.1.0"

# The schema of dkicf's Zarr attributes (docs/zarr-layout.md); readers accept
# this one and older ones.
LAYOUT_SCHEMA = 2
