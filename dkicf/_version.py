"""The version of dkicf, in a module of its own so that any module can read it."""

__version__ = "0.1.0"
