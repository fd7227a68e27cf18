"""The /proc/self/smaps entry of a mapping: what is resident of an array's memory."""

from __future__ import annotations


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding ``address``: its fields, in kB."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.split()
    return fields
