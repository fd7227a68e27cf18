"""``smallmem://``: an in-memory fsspec filesystem with a capacity, full like a small disk.

A write that would take it over ``capacity`` bytes raises
``OSError(ENOSPC)``, as a full disk does; raising the capacity frees space.
Shared by everything in the process (dask workers in threads included).
"""

from __future__ import annotations

import errno

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class SmallMemoryFileSystem(MemoryFileSystem):
    protocol = "smallmem"
    store: dict = {}
    pseudo_dirs = [""]
    capacity = 1 << 40

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("smallmem://"):
            path = path[len("smallmem://"):]
        return super()._strip_protocol(path)

    def used(self) -> int:
        return sum(f.getbuffer().nbytes for f in self.store.values())

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        key = self._strip_protocol(path)
        old = self.store[key].getbuffer().nbytes if key in self.store else 0
        if self.used() - old + len(value) > type(self).capacity:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        super().pipe_file(path, value, mode=mode, **kwargs)

    @classmethod
    def reset(cls, capacity: int = 1 << 40) -> None:
        cls.store.clear()
        del cls.pseudo_dirs[1:]
        cls.capacity = capacity


fsspec.register_implementation("smallmem", SmallMemoryFileSystem, clobber=True)
