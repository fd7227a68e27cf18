"""Behaviours that a changed line must not slip past: each test here fails on a named mutation.

The mutations (a one-line change each) and the test that catches it:

* ``block_delta`` ignored by block-greedy pivoting: ``test_block_delta_changes_the_blocks``;
* the stop rule ``trace <= tol`` made strict: ``test_a_trace_error_equal_to_tol_stops``;
* codecs nested inside a sharding codec left unchecked:
  ``test_pickle_nested_in_sharding_is_refused_by_dkicf_itself``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dkicf import io
from dkicf.icf import incomplete_cholesky
from dkicf.io import DkicfIOError


def test_block_delta_changes_the_blocks(rng):
    X = rng.normal(size=(800, 3))
    exact = incomplete_cholesky(X, gamma=0.5, max_rank=150, tol=0, pivoting="block-greedy")
    loose = incomplete_cholesky(X, gamma=0.5, max_rank=150, tol=0, pivoting="block-greedy",
                                block_delta=0.5)
    # The exact rule takes one pivot in the first block (nothing is known of the
    # other rows yet); within a factor 0.5 of the bound many candidates qualify.
    assert exact.info["block_sizes"][0] == 1
    assert loose.info["block_sizes"][0] > 1
    assert loose.n_passes < exact.n_passes
    assert loose.rank == exact.rank == 150
    assert np.all(np.diff(loose.trace_errors) <= 1e-12)
    assert not np.array_equal(loose.pivots, exact.pivots)


@pytest.mark.parametrize("pivoting", ["greedy", "block-greedy", "rpcholesky"])
@pytest.mark.parametrize("k", [0, 7, 20])
def test_a_trace_error_equal_to_tol_stops(pivoting, k):
    """tol set to the trace error reached after k pivots: the fit stops there, at rank k.

    The greedy loop reads every trace error as the residual's sum after a pass,
    so the fit with ``tol`` repeats the reference's values exactly.  The block
    rules compute a trace error inside a block from the sum at the block's end
    and the block's later columns, and a block cut short by ``tol`` ends
    elsewhere than the reference's: the value can then differ from the
    reference's in its last bits (one unit in the last place on a machine with
    AVX-512), and the fit stops one pivot later.  What must hold for every
    rule is the sequential stop on the fit's own trace errors: the first one
    ``<= tol`` ends it.
    """
    X = np.random.default_rng(3).normal(size=(300, 3))
    ref = incomplete_cholesky(X, gamma=0.5, max_rank=40, tol=0, pivoting=pivoting,
                              random_state=0)
    tol = ref.initial_trace if k == 0 else ref.trace_errors[k - 1]
    res = incomplete_cholesky(X, gamma=0.5, max_rank=40, tol=tol, pivoting=pivoting,
                              random_state=0)
    assert res.stop_reason == "tol"
    np.testing.assert_array_equal(res.pivots, ref.pivots[:res.rank])
    if res.rank:
        assert res.trace_errors[-1] <= tol
    assert np.all(res.trace_errors[:-1] > tol)
    if pivoting == "greedy":
        assert res.rank == k
        if k:
            assert res.trace_errors[-1] == tol
    elif res.rank == k:
        if k:  # equal, or rounding put it just below
            np.testing.assert_allclose(res.trace_errors[-1], tol, rtol=1e-13)
    else:  # one pivot later, only because rounding put the trace after k just above tol
        assert res.rank == k + 1
        np.testing.assert_allclose(res.trace_errors[k - 1], tol, rtol=1e-13)
        assert res.trace_errors[k - 1] > tol


def _nest_in_sharding(array_dir, inner: list[dict], index: list[dict] | None = None) -> None:
    """Rewrite a v3 array's codecs as one sharding codec holding ``inner``."""
    path = array_dir / "zarr.json"
    meta = json.loads(path.read_text())
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    meta["codecs"] = [{
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": chunk,
            "codecs": inner,
            "index_codecs": index or [{"name": "bytes", "configuration": {"endian": "little"}},
                                      {"name": "crc32c"}],
            "index_location": "end",
        },
    }]
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("where", ["codecs", "index_codecs", "nested"])
def test_pickle_nested_in_sharding_is_refused_by_dkicf_itself(tmp_path, where):
    """zarr refuses pickle in v3 today; dkicf must find it itself, wherever it is nested."""
    io.write_group(tmp_path / "g.zarr", {"X": np.ones((4, 2))}, {})
    pickle_codec = {"name": "numcodecs.pickle", "configuration": {"protocol": 4}}
    plain = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if where == "codecs":
        _nest_in_sharding(tmp_path / "g.zarr" / "X", [pickle_codec] + plain)
    elif where == "index_codecs":
        _nest_in_sharding(tmp_path / "g.zarr" / "X", plain, [pickle_codec] + plain)
    else:
        inner = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [1, 1], "codecs": [pickle_codec] + plain,
            "index_codecs": plain, "index_location": "end"}}]
        _nest_in_sharding(tmp_path / "g.zarr" / "X", inner)
    # dkicf's own refusal (naming the codec and why), not zarr's failure to open it.
    message = r"refusing .*g\.zarr/X: its metadata declares the codec 'numcodecs\.pickle'"
    for call in (io.open_array, io.as_dask, io.fingerprint):
        with pytest.raises(DkicfIOError, match=message):
            call(tmp_path / "g.zarr" / "X")
    for call in (io.open_dataset, io.read_group):
        with pytest.raises(DkicfIOError, match=message):
            call(tmp_path / "g.zarr")
