"""Reliability: damaged metadata, outputs over inputs, concurrent and refused writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr

from dkicf import io
from dkicf.io import DkicfIOError

ROOT = Path(__file__).resolve().parents[1]

# The address space a child may use: the imports need well under this, and a
# structure sized by a metadata shape of 10**13 rows needs far more.
_CHILD_ADDRESS_SPACE = 3 << 30


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _claim_rows(array_dir: Path, rows: int) -> None:
    meta_path = array_dir / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = rows
    meta_path.write_text(json.dumps(meta))


def _swollen_dataset(path: Path, chunks: int = 400, rows: int = 10**13) -> Path:
    """A dataset group whose X and y claim ``rows`` rows; ``chunks`` chunks of 5 rows exist."""
    group = zarr.open_group(str(path), mode="w")
    X = np.arange(chunks * 10.0).reshape(chunks * 5, 2)
    group.create_array("X", data=X, chunks=(5, 2))
    group.create_array("y", data=np.zeros(chunks * 5, dtype=np.int64), chunks=(5,))
    _claim_rows(path / "X", rows)
    _claim_rows(path / "y", rows)
    return path


def _run_limited(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child limited to a few GiB of address space."""
    prelude = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({_CHILD_ADDRESS_SPACE}, {_CHILD_ADDRESS_SPACE}))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------
# metadata is input: checked before anything sized by it is allocated


def test_a_shape_the_chunks_do_not_back_is_refused_before_allocating(tmp_path):
    store = _swollen_dataset(tmp_path / "big.zarr")
    before = _tree(store)
    proc = _run_limited("""
        from dkicf import io, pipeline
        from dkicf.io import DkicfIOError
        for name, call in [
            ("open_dataset", lambda: io.open_dataset("big.zarr")),
            ("as_dask", lambda: io.as_dask("big.zarr/X")),
            ("info", lambda: pipeline.describe("big.zarr")),
            ("fit", lambda: pipeline.fit_store("big.zarr", "out.zarr", {"n_clusters": 2},
                                               client=None)),
        ]:
            try:
                call()
            except DkicfIOError as exc:
                print(name, "REFUSED", exc)
            else:
                print(name, "ACCEPTED")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    for line in lines:
        assert "REFUSED" in line, line
        assert f"chunk 'c/400/0' of the Zarr array {store / 'X'} is missing" in line
        assert "claims shape (10000000000000, 2) in 2,000,000,000,000 chunk(s) of (5, 2)" in line
        assert "the store holds 400 chunk(s): the metadata does not match the data" in line
        assert "restore it" in line
    assert not (tmp_path / "out.zarr").exists()
    assert _tree(store) == before


def test_a_shape_no_graph_could_hold_is_refused_where_chunks_are_not_listed(tmp_path,
                                                                            monkeypatch):
    """On object stores only the last chunk is looked for; the graph size is bounded too."""
    import fsspec

    store = _swollen_dataset(tmp_path / "big.zarr")
    fs = fsspec.filesystem("memory")
    fs.put(str(store), "/swollen/big.zarr", recursive=True)
    monkeypatch.setattr(io, "_LISTED_PROTOCOLS", frozenset())
    url = "memory://swollen/big.zarr"
    try:
        # Seen as an s3:// store would be: its last chunk is missing.
        with pytest.raises(io.MissingChunkError,
                           match=r"chunk 'c/1999999999999/0' of the Zarr array memory://swollen/"
                                 r"big.zarr/X is missing from the store \(its metadata claims "
                                 r"shape \(10000000000000, 2\).*it is the last of them\)"):
            io.open_dataset(url)
        # Now the last chunk is there too: 2e12 chunks make a graph no machine holds.
        fs.pipe("/swollen/big.zarr/X/c/1999999999999/0",
                (store / "X" / "c" / "0" / "0").read_bytes())
        with pytest.raises(DkicfIOError, match=r"a task graph over that many chunks needs at "
                                               r"least [0-9.e+]+ GiB, more than the"):
            io.open_dataset(url)
    finally:
        fs.rm("/swollen", recursive=True)


def test_a_model_array_larger_than_memory_is_refused_before_reading(tmp_path):
    io.write_group(tmp_path / "m.zarr", {"centers": np.ones((3, 2)), "w": np.ones(4)}, {})
    _claim_rows(tmp_path / "m.zarr" / "centers", 10**13)
    meta_path = tmp_path / "m.zarr" / "centers" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 10**13
    meta_path.write_text(json.dumps(meta))
    proc = _run_limited("""
        from dkicf import io
        try:
            io.read_group("m.zarr")
        except io.DkicfIOError as exc:
            print("REFUSED", exc)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED refusing m.zarr/centers: its "
                                  "metadata claims shape (10000000000000, 2) of float64"), \
        proc.stdout
    assert "restore the group or fit again" in proc.stdout


def test_complete_stores_pass_the_extent_checks(tmp_path):
    """v2, sharded and in-memory stores whose chunks are all there open as before."""
    X = np.arange(60.0).reshape(30, 2)
    zarr.create_array(str(tmp_path / "v2.zarr"), data=X, chunks=(7, 2), zarr_format=2)
    zarr.create_array(str(tmp_path / "sh.zarr"), data=X, chunks=(5, 2), shards=(10, 2))
    for url in (tmp_path / "v2.zarr", tmp_path / "sh.zarr", f"file://{tmp_path / 'sh.zarr'}"):
        np.testing.assert_array_equal(io.as_dask(url).compute(), X)
    io.write_group("memory://extent/d.zarr", {"X": X}, {})
    np.testing.assert_array_equal(io.as_dask("memory://extent/d.zarr/X").compute(), X)
    # One chunk file gone: refused at opening, naming the count, not at the read.
    (tmp_path / "v2.zarr" / "4.0").unlink()
    with pytest.raises(io.MissingChunkError, match=r"chunk '4.0' .* in 5 chunk\(s\) of \(7, 2\), "
                                                   r"but the store holds 4 chunk\(s\)"):
        io.open_array(tmp_path / "v2.zarr")


# --------------------------------------------------------------------------
# an output never replaces an input, the checkpoint included


@pytest.mark.parametrize("out_of", [lambda ck: ck, lambda ck: ck / "model.zarr",
                                    lambda ck: ck.parent])
def test_an_output_over_its_checkpoint_is_refused_even_with_overwrite(tmp_path, out_of):
    from dkicf import cli, pipeline

    io.generate("ring", tmp_path / "data.zarr", 40)
    ck = tmp_path / "run" / "ck.zarr"
    io.write_group(ck, {"P": np.ones((4, 2))}, {"dkicf": {"kind": "icf-checkpoint"}})
    before = {name: _tree(tmp_path / name) for name in ("data.zarr", "run")}
    out = out_of(ck)
    with pytest.raises(DkicfIOError, match=rf"the output {out} (is|is inside|contains) the "
                                           rf"checkpoint {ck}; writing it would replace data"):
        pipeline.fit_store(str(tmp_path / "data.zarr"), str(out), {"n_clusters": 2},
                           client=None, overwrite=True, checkpoint=str(ck), resume=True)
    code = cli.main(["fit", str(tmp_path / "data.zarr"), "--clusters", "2", "--out", str(out),
                     "--checkpoint", str(ck), "--overwrite", "--quiet"])
    assert code == 2
    for name, tree in before.items():
        assert _tree(tmp_path / name) == tree
