"""Fits on an S3-compatible object store: moto's server on 127.0.0.1, reached through s3fs.

The same paths as on local disks (staging, overwrite, checkpoints, resume),
with a write that fails partway: nothing half-written may remain, the input
must be untouched, and the checkpoint's last commit must resume to the
undisturbed fit.  Nothing here needs the network.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dkicf import io, pipeline
from dkicf.io import OutputExistsError

moto_server = pytest.importorskip(
    "moto.server", reason="moto's server (pip install 'moto[server]') runs the S3 stand-in")
s3fs = pytest.importorskip("s3fs", reason="s3fs opens s3:// URLs")

BUCKET = "dkicf-test"
PARAMS = {"n_clusters": 3, "gamma": 0.5, "rank": 12, "n_init": 1, "random_state": 0,
          "pivoting": "greedy", "max_iter": 30}
COMPARED = ("pivots", "cholesky_factor", "cluster_centers", "pivot_rows", "trace_errors",
            "labels", "P")


@pytest.fixture(scope="module")
def s3():
    """An S3 server on a free port of 127.0.0.1 with one bucket; the options that reach it."""
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     **credentials).create_bucket(Bucket=BUCKET)
        yield {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    finally:
        server.stop()


def _fs(options: dict):
    """A filesystem of its own, with no listings cached from earlier calls."""
    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def _objects(options: dict, prefix: str) -> dict[str, bytes]:
    return _objects_in(options, f"{BUCKET}/{prefix}")


def _objects_in(options: dict, path: str) -> dict[str, bytes]:
    fs = _fs(options)
    return {key: fs.cat_file(key) for key in sorted(fs.find(path))}


def _arrays(url: str, options: dict | None = None) -> dict:
    arrays, _ = io.read_group(url, storage_options=options)
    for name in ("labels", "P"):
        arrays[name] = io.open_member(url, name, storage_options=options).compute(
            scheduler="synchronous")
    return arrays


def _assert_same(result: dict, reference: dict) -> None:
    for name in COMPARED:
        np.testing.assert_array_equal(result[name], reference[name], err_msg=name)


@pytest.fixture(scope="module")
def thread_client():
    """Workers in this process, so that a fault injected on s3fs reaches their writes too.

    The default client while the module runs: every computation goes to it.
    """
    from distributed import Client

    with Client(processes=False, n_workers=1, threads_per_worker=2,
                dashboard_address=None) as c:
        yield c


@pytest.fixture(scope="module")
def dataset(s3, thread_client, tmp_path_factory):
    """The input on the object store, and the undisturbed fit of it written to a local disk."""
    url = f"s3://{BUCKET}/data.zarr"
    io.generate("blobs", url, 1000, chunk_rows=250, centers=3, storage_options=s3)
    local = tmp_path_factory.mktemp("s3ref") / "alone.zarr"
    pipeline.fit_store(url, str(local), PARAMS, client=thread_client, storage_options=s3)
    return url, _arrays(str(local))


class _FailingPuts:
    """Make the ``after + 1``-th upload under ``prefix`` (and every later one) fail, once armed.

    The error is the one s3fs gives for a server's ``InternalError`` reply:
    raised inside s3fs's own retry loop and translated by it.
    """

    def __init__(self, prefix: str, after: int, armed: bool = True):
        self.prefix, self.after, self.armed = prefix, after, armed
        self.seen = self.failed = 0
        self.lock = threading.Lock()

    def __call__(self, original):
        from botocore.exceptions import ClientError
        from s3fs.core import _error_wrapper

        faults = self

        async def _call_s3(fs, method, *args, **kwargs):
            key = f"{kwargs.get('Bucket')}/{kwargs.get('Key', '')}"
            if method in ("put_object", "upload_part") and key.startswith(faults.prefix):
                with faults.lock:
                    fail = faults.armed and faults.seen >= faults.after
                    faults.seen += faults.armed
                    faults.failed += fail
                if fail:
                    async def refused(**_):
                        raise ClientError({"Error": {"Code": "InternalError",
                                                     "Message": "injected failure"}},
                                          "PutObject")
                    return await _error_wrapper(refused, kwargs={}, retries=fs.retries)
            return await original(fs, method, *args, **kwargs)

        return _call_s3


class _Keys:
    """Record the keys of the object store's requests (s3fs's ``_call_s3``)."""

    def __init__(self):
        self.keys, self.reads = [], []

    def __call__(self, original):
        keys, reads = self.keys, self.reads

        async def _call_s3(fs, method, *args, **kwargs):
            keys.append(kwargs.get("Key") or kwargs.get("Prefix") or "")
            if method == "get_object":
                reads.append(keys[-1])
            return await original(fs, method, *args, **kwargs)

        return _call_s3


def test_a_fit_on_the_object_store_equals_the_local_fit_and_overwrites_only_when_asked(
        s3, dataset, thread_client, monkeypatch):
    url, reference = dataset
    before = _objects(s3, "data.zarr")
    out, ck = f"s3://{BUCKET}/fit.zarr", f"s3://{BUCKET}/fit-ck.zarr"
    seen = _Keys()
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", seen(s3fs.S3FileSystem._call_s3))
    pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3,
                       checkpoint=ck, checkpoint_every=4)
    monkeypatch.undo()
    # Every node here is Zarr v3 (and dkicf writes no other): no request looks for the
    # metadata of Zarr v2, each one a round trip to the store.
    v2 = [key for key in seen.keys if key.rstrip("/").rsplit("/", 1)[-1]
          in (".zgroup", ".zarray", ".zattrs", ".zmetadata")]
    assert seen.keys and not v2, sorted(set(v2))
    # The checkpoint's arrays are opened once for its three commits, not at each one.
    for name in ("L", "pivot_rows", "pivot_aux"):
        assert seen.reads.count(f"fit-ck.zarr/{name}/zarr.json") == 1, name
    _assert_same(_arrays(out, s3), reference)
    written = _objects(s3, "fit.zarr")
    with pytest.raises(OutputExistsError, match=f"{out} already exists; pass overwrite=True"):
        pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3)
    assert _objects(s3, "fit.zarr") == written
    # A finished checkpoint resumes to the same fit, over the old output.
    report = pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3,
                                checkpoint=ck, checkpoint_every=4, resume=True, overwrite=True)
    assert report["resumed_from_rank"] == PARAMS["rank"]
    _assert_same(_arrays(out, s3), reference)
    assert _objects(s3, "data.zarr") == before


@pytest.mark.parametrize("where", ["checkpoint", "labels", "P", "labels over an old output"])
def test_a_write_failing_partway_leaves_no_partial_output_and_the_checkpoint_resumes(
        s3, dataset, thread_client, monkeypatch, where):
    url, reference = dataset
    name = {"checkpoint": "ck", "labels over an old output": "old"}.get(where, where)
    out, ck = f"s3://{BUCKET}/{name}-out.zarr", f"s3://{BUCKET}/{name}-ck.zarr"
    old = None
    if where.endswith("old output"):
        pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3)
        old = _objects(s3, f"{name}-out.zarr")
    before = _objects(s3, "data.zarr")
    if where == "checkpoint":
        # Armed after the first commit (rank 4): a later commit fails after one upload.
        faults = _FailingPuts(f"{BUCKET}/{name}-ck.zarr/", after=1, armed=False)
    else:
        # The array's first chunk is written, its second fails.
        faults = _FailingPuts(f"{BUCKET}/{name}-out.zarr/{where.split()[0]}/c/", after=1)

    def arm(p):
        if getattr(p, "rank", None) is not None and p.rank >= 6:
            faults.armed = True

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", faults(s3fs.S3FileSystem._call_s3))
    with pytest.raises(OSError, match="injected failure"):
        pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3,
                           checkpoint=ck, checkpoint_every=4, p_storage="memory",
                           overwrite=old is not None, progress=arm)
    assert faults.failed >= 1 and faults.seen > faults.after
    monkeypatch.undo()
    # Absent, or (an old output) complete and as it was: never half-written.
    left = _objects(s3, f"{name}-out.zarr")
    assert left in ({}, old), sorted(left)
    assert _objects(s3, "data.zarr") == before
    report = pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=s3,
                                checkpoint=ck, checkpoint_every=4, resume=True,
                                overwrite=bool(left))
    assert report.get("resumed_from_rank", 0) >= 4
    _assert_same(_arrays(out, s3), reference)
    assert _objects(s3, "data.zarr") == before


def test_a_server_that_goes_away_mid_fit_leaves_at_most_a_marked_output_and_the_fit_resumes(
        dataset, thread_client, tmp_path):
    """The server stops in the factorization: the fit fails, its output cannot be removed
    then; once the server is back, what is left is marked as a fit in progress (not a
    model), the input is as it was, and the checkpoint resumes to the undisturbed fit."""
    import boto3

    from dkicf import load

    _, reference = dataset
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    stopped: list[int] = []
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # One try per request in botocore (s3fs still tries 5 times), so that the fit fails
    # within seconds once the server has gone.
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing"
                     ).create_bucket(Bucket="dkicf-outage")
        url = "s3://dkicf-outage/data.zarr"
        io.generate("blobs", url, 1000, chunk_rows=250, centers=3, storage_options=options)
        before = _objects_in(options, "dkicf-outage/data.zarr")
        out, ck = "s3://dkicf-outage/out.zarr", "s3://dkicf-outage/ck.zarr"

        def stop(p):
            if getattr(p, "rank", None) is not None and p.rank >= 6 and not stopped:
                server.stop()
                stopped.append(p.rank)

        # The server's absence, not a checkpoint "removed while the fit ran".
        with pytest.raises(Exception, match="Could not connect to the endpoint URL"):
            pipeline.fit_store(url, out, PARAMS, client=thread_client, storage_options=options,
                               checkpoint=ck, checkpoint_every=4, progress=stop)
        assert stopped
    finally:
        if not stopped:
            server.stop()
    # The same port, and the same objects: moto keeps them in this process.
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        left = _objects_in(options, "dkicf-outage/out.zarr")
        if left:  # the removal failed with the server gone
            # Marked as a fit in progress: read as that kind, refused as a model.
            io.read_group(out, storage_options=options, names=[], kind="fit-in-progress")
            with pytest.raises(ValueError, match="is not a dkicf model"):
                load(out, storage_options=options)
        assert _objects_in(options, "dkicf-outage/data.zarr") == before
        report = pipeline.fit_store(url, out, PARAMS, client=thread_client,
                                    storage_options=options, checkpoint=ck, checkpoint_every=4,
                                    resume=True, overwrite=bool(left))
        assert report.get("resumed_from_rank", 0) >= 4
        _assert_same(_arrays(out, options), reference)
    finally:
        server.stop()
