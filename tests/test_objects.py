"""The object-store layer (orbit_pt/_storage/objects.py) against moto's S3 server on loopback.

Faults come from the proxy in tests/_s3.py: 503 SlowDown, 500, a connection reset before the
server sees a request, and one after it acted (the answer is lost). Every retry test runs with
millisecond backoff, so each is bounded by a few attempts of a few milliseconds.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _s3 import FaultProxy, S3Root

from orbit_pt._storage import objects
from orbit_pt._storage.objects import (
    _ABORT_ROUNDS,
    MiB,
    MissingClientError,
    ObjectNotFoundError,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailedError,
    RetryPolicy,
    open_store,
    parse_url,
)
from orbit_pt.errors import CheckpointError, CheckpointValueError

pytest.importorskip("s3fs", reason="needs the s3 extra: pip install -e .[test]")

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01)
PART = 5 * MiB  # the smallest part S3 takes


@pytest.fixture
def opened() -> Iterator[Callable[..., tuple[ObjectStore, str]]]:
    """``open_store`` that closes every store it opened when the test ends."""
    stores: list[ObjectStore] = []

    def open_(
        url: str, options: dict[str, Any] | None = None, **kw: Any
    ) -> tuple[ObjectStore, str]:
        store, prefix = open_store(url, options, **kw)
        stores.append(store)
        return store, prefix

    yield open_
    for store in stores:
        store.close()


def payload(size: int, seed: int = 0) -> bytes:
    """Bytes that differ from part to part, so that a misplaced part cannot go unnoticed."""
    block = bytes((seed + i) % 251 for i in range(251))
    return (block * (size // len(block) + 1))[:size]


# ---------------------------------------------------------------------------- the operations


def test_put_get_head_list_delete(s3_root: S3Root, opened: Callable[..., Any]) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    assert prefix == s3_root.prefix
    store.put(f"{prefix}/a", b"alpha")
    store.put(f"{prefix}/sub/b", memoryview(b"beta"))
    store.put(f"{prefix}/empty", b"")

    assert store.get(f"{prefix}/a") == b"alpha"
    assert store.get(f"{prefix}/empty") == b""
    info = store.head(f"{prefix}/sub/b")
    assert info is not None
    assert (info.key, info.size) == (f"{prefix}/sub/b", 4)
    assert info.etag
    assert not info.etag.startswith('"')
    assert info.mtime is not None
    assert store.head(f"{prefix}/missing") is None
    with pytest.raises(ObjectNotFoundError) as caught:
        store.get(f"{prefix}/missing")
    assert isinstance(caught.value, FileNotFoundError)

    listed = store.list(f"{prefix}/")
    assert [(i.key, i.size) for i in listed] == [
        (f"{prefix}/a", 5),
        (f"{prefix}/empty", 0),
        (f"{prefix}/sub/b", 4),
    ]
    store.delete([f"{prefix}/a", f"{prefix}/sub/b", f"{prefix}/never-there"])
    assert [i.key for i in store.list(f"{prefix}/")] == [f"{prefix}/empty"]
    store.delete([])


def test_listing_and_deletion_go_in_pages(
    s3_root: S3Root, opened: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # S3 lists 1000 keys a page and deletes 1000 a request; 7 shows the paging as well.
    monkeypatch.setattr(objects, "_LIST_PAGE", 7)
    monkeypatch.setattr(objects, "_DELETE_BATCH", 7)
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    keys = [f"{prefix}/k{i:02d}" for i in range(30)]
    with ThreadPoolExecutor(8) as pool:  # one store, shared by the threads
        list(pool.map(lambda k: store.put(k, k.encode()), keys))
    assert [i.key for i in store.list(prefix + "/")] == keys
    store.delete(keys)
    assert store.list(prefix + "/") == []


def test_read_range_into(s3_root: S3Root, opened: Callable[..., Any]) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    data = payload(1000)
    store.put(f"{prefix}/r", data)
    buffer = bytearray(300)
    store.read_range_into(f"{prefix}/r", 650, memoryview(buffer)[:200])
    assert bytes(buffer[:200]) == data[650:850]
    assert bytes(buffer[200:]) == bytes(100)  # only the view was written
    store.read_range_into(f"{prefix}/r", 0, memoryview(bytearray()))  # nothing to read
    with pytest.raises(ObjectStoreError, match="ends before the range"):
        store.read_range_into(f"{prefix}/r", 900, memoryview(bytearray(200)))


def test_conditional_put_is_refused_the_second_time(
    s3_root: S3Root, opened: Callable[..., Any]
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    store.put(f"{prefix}/lease", b"first", if_absent=True)
    with pytest.raises(PreconditionFailedError) as caught:
        store.put(f"{prefix}/lease", b"second", if_absent=True)
    assert isinstance(caught.value, FileExistsError)
    assert isinstance(caught.value, CheckpointError)
    assert store.get(f"{prefix}/lease") == b"first"
    store.put(f"{prefix}/lease", b"third")  # an unconditional put still replaces it
    assert store.get(f"{prefix}/lease") == b"third"


def test_put_if_match_is_a_compare_and_swap(s3_root: S3Root, opened: Callable[..., Any]) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    store.put(f"{prefix}/lease", b"v1")
    first = store.head(f"{prefix}/lease")
    assert first is not None
    assert first.etag is not None
    store.put(f"{prefix}/lease", b"v2", if_match=first.etag)  # still v1: replaced
    with pytest.raises(PreconditionFailedError):
        store.put(f"{prefix}/lease", b"v3", if_match=first.etag)  # v2 now: refused
    assert store.get(f"{prefix}/lease") == b"v2"
    with pytest.raises(CheckpointValueError, match="not both"):
        store.put(f"{prefix}/lease", b"v4", if_absent=True, if_match=first.etag)


def test_a_download_pinned_to_a_stale_etag_fails(
    s3_root: S3Root, opened: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    store.put(f"{prefix}/moving", b"new bytes")
    # As if the object were replaced between the download's HEAD and its ranged GETs.
    stale = objects.ObjectInfo(f"{prefix}/moving", 9, "0" * 32, None)
    monkeypatch.setattr(store, "head", lambda key: stale)
    with pytest.raises(ObjectStoreError, match="changed while it was read"):
        store.get_file(f"{prefix}/moving", tmp_path / "moving")


def test_multipart_upload_equals_the_source(
    s3_root: S3Root, opened: Callable[..., Any], tmp_path: Path
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    data = payload(3 * PART + 12345, seed=7)
    source = tmp_path / "source"
    source.write_bytes(data)
    store.put_file(f"{prefix}/big", source, part_size=PART)
    info = store.head(f"{prefix}/big")
    assert info is not None
    assert info.size == len(data)
    assert info.etag is not None
    assert info.etag.endswith("-4")  # four parts

    target = tmp_path / "target"
    target.write_bytes(b"old and longer than nothing")
    store.get_file(f"{prefix}/big", target, part_size=PART)
    assert target.read_bytes() == data
    middle = bytearray(2 * PART)
    store.read_range_into(f"{prefix}/big", PART // 2, memoryview(middle))
    assert bytes(middle) == data[PART // 2 : PART // 2 + 2 * PART]
    assert store.abort_multipart_uploads(prefix + "/") == 0  # nothing was left open


def test_put_of_a_large_buffer_goes_up_in_parts(
    s3_root: S3Root, opened: Callable[..., Any]
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    data = payload(objects.DEFAULT_PART_SIZE + 3, seed=3)
    store.put(f"{prefix}/buffer", memoryview(bytearray(data)))
    info = store.head(f"{prefix}/buffer")
    assert info is not None
    assert info.etag is not None
    assert info.etag.endswith("-2")
    assert store.get(f"{prefix}/buffer") == data


def test_conditional_multipart_put_is_refused_and_aborted(
    s3_root: S3Root, opened: Callable[..., Any], tmp_path: Path
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    source = tmp_path / "source"
    source.write_bytes(payload(PART + 1))
    store.put(f"{prefix}/taken", b"already here")
    with pytest.raises(PreconditionFailedError):
        store.put_file(f"{prefix}/taken", source, part_size=PART, if_absent=True)
    assert store.get(f"{prefix}/taken") == b"already here"
    assert store.abort_multipart_uploads(prefix + "/") == 0  # the failed upload was aborted


def test_abort_multipart_uploads_under_a_prefix(
    s3_root: S3Root, opened: Callable[..., Any]
) -> None:
    import boto3

    store, prefix = opened(s3_root.url, s3_root.storage_options)
    client = boto3.client("s3")  # the fixture's AWS_* environment points it at the server
    for key in (f"{prefix}/step/a", f"{prefix}/step/b", f"{prefix}-other/c"):
        upload = client.create_multipart_upload(Bucket=s3_root.server.bucket, Key=key)
        client.upload_part(
            Bucket=s3_root.server.bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=b"crashed writer",
        )
    assert store.abort_multipart_uploads(f"{prefix}/") == 2
    assert store.abort_multipart_uploads(f"{prefix}/") == 0
    assert store.abort_multipart_uploads(f"{prefix}-other/") == 1
    client.close()


def test_copy_whole_and_in_parts(
    s3_root: S3Root, opened: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, prefix = opened(s3_root.url, s3_root.storage_options)
    data = payload(2 * PART + 99, seed=5)
    store.put(f"{prefix}/source", data)
    store.copy(f"{prefix}/source", f"{prefix}/whole")
    assert store.get(f"{prefix}/whole") == data
    # Objects above 5 GiB are copied with UploadPartCopy over byte ranges; shrink the limits.
    monkeypatch.setattr(objects, "_COPY_OBJECT_LIMIT", PART)
    monkeypatch.setattr(objects, "_COPY_PART_SIZE", PART)
    store.copy(f"{prefix}/source", f"{prefix}/parts")
    info = store.head(f"{prefix}/parts")
    assert info is not None
    assert info.etag is not None
    assert info.etag.endswith("-3")
    assert store.get(f"{prefix}/parts") == data
    with pytest.raises(ObjectNotFoundError):
        store.copy(f"{prefix}/missing", f"{prefix}/nowhere")


def test_environment_credentials_need_no_storage_options(
    s3_root: S3Root, opened: Callable[..., Any]
) -> None:
    store, prefix = opened(s3_root.url)  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... only
    store.put(f"{prefix}/env", b"from the environment")
    assert store.get(f"{prefix}/env") == b"from the environment"


def test_missing_bucket_says_so(s3_root: S3Root, opened: Callable[..., Any]) -> None:
    store, _ = opened("s3://no-such-bucket-here/x", s3_root.storage_options, retry=FAST)
    with pytest.raises(ObjectStoreError, match=r"NoSuchBucket.*create the bucket"):
        store.put("x/y", b"1")


# ---------------------------------------------------------------------------------- the faults


def test_slowdown_for_the_first_three_requests_is_retried(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    proxy.fail("slowdown", 3)
    store.put(f"{prefix}/a", b"through")
    assert [action for action, _, _ in proxy.injected] == ["slowdown"] * 3
    assert len(proxy.requests) == 4
    assert store.get(f"{prefix}/a") == b"through"


def test_a_dropped_part_is_retried(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any], tmp_path: Path
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    data = payload(2 * PART + 1, seed=11)
    (tmp_path / "source").write_bytes(data)
    proxy.fail("drop", 1, method="PUT", query="partNumber")
    store.put_file(f"{prefix}/big", tmp_path / "source", part_size=PART)
    assert [action for action, _, _ in proxy.injected] == ["drop"]
    part_puts = [t for m, t in proxy.requests if m == "PUT" and "partNumber" in t]
    assert len(part_puts) == 4  # three parts, one of them sent twice
    proxy.fail("drop", 1, method="GET")  # and a dropped range on the way back
    store.get_file(f"{prefix}/big", tmp_path / "back", part_size=PART)
    assert (tmp_path / "back").read_bytes() == data
    assert len(proxy.injected) == 2


def test_a_lost_answer_to_a_conditional_put_is_recognised(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    # The server stores the object, the answer is lost, the resend gets 412: it was ours.
    proxy.fail("drop_answer", 1, method="PUT")
    store.put(f"{prefix}/lease", b"mine", if_absent=True)
    assert [action for action, _, _ in proxy.injected] == ["drop_answer"]
    with pytest.raises(PreconditionFailedError):  # another writer's attempt is still refused
        store.put(f"{prefix}/lease", b"theirs", if_absent=True)


def test_a_lost_answer_to_the_completion_is_recognised(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any], tmp_path: Path
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    data = payload(PART + 7, seed=13)
    (tmp_path / "source").write_bytes(data)
    proxy.fail("drop_answer", 1, method="POST", query="uploadId")  # CompleteMultipartUpload
    store.put_file(f"{prefix}/big", tmp_path / "source", part_size=PART, if_absent=True)
    assert len(proxy.injected) == 1
    assert store.get(f"{prefix}/big") == data


def test_a_persistent_500_fails_after_the_bounded_attempts(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    store.put(f"{prefix}/a", b"stored")
    proxy.fail("error", 1000)
    with pytest.raises(ObjectStoreError) as caught:
        store.get(f"{prefix}/a")
    error = caught.value
    assert isinstance(error, CheckpointError)
    assert isinstance(error, OSError)
    assert error.attempts == FAST.max_attempts
    assert len(proxy.injected) == FAST.max_attempts
    assert "HTTP 500 InternalError" in str(error)
    assert "RetryPolicy(max_attempts=" in str(error)
    assert type(error.__cause__).__name__ == "ClientError"  # the client's error, chained


def test_a_part_that_keeps_failing_fails_the_upload_and_aborts_it(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any], tmp_path: Path
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    (tmp_path / "source").write_bytes(payload(2 * PART))
    proxy.fail("error", 1000, method="PUT", query="partNumber", status=503)
    with pytest.raises(ObjectStoreError, match="upload part"):
        store.put_file(f"{prefix}/big", tmp_path / "source", part_size=PART)
    proxy.clear()
    assert store.head(f"{prefix}/big") is None
    assert store.abort_multipart_uploads(prefix + "/") == 0  # aborted on the way out


@pytest.mark.parametrize(
    ("failing", "aborts", "left_open"),
    [
        # One round's retries all fail; the next round's single request goes through.
        (FAST.max_attempts + 1, FAST.max_attempts + 2, 0),
        # A store that keeps failing: the first round is retried as any request, the later
        # rounds send one request each, then the upload is left to the next writer's cleanup
        # -- a store that is down must not hold a failing save for rounds x the retry policy.
        (1000, FAST.max_attempts + _ABORT_ROUNDS - 1, 1),
    ],
    ids=["repeated-until-gone", "gives-up"],
)
def test_a_failing_abort_is_repeated_a_bounded_number_of_times(
    s3_faults: tuple[FaultProxy, S3Root],
    opened: Callable[..., Any],
    tmp_path: Path,
    failing: int,
    aborts: int,
    left_open: int,
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    (tmp_path / "source").write_bytes(payload(2 * PART))
    proxy.fail("error", 1000, method="PUT", query="partNumber", status=503)
    proxy.fail("error", failing, method="DELETE", query="uploadId")
    with pytest.raises(ObjectStoreError, match="upload part"):
        store.put_file(f"{prefix}/big", tmp_path / "source", part_size=PART)
    sent = [r for r in proxy.requests if r[0] == "DELETE" and "uploadId" in r[1]]
    assert len(sent) == aborts
    proxy.clear()
    assert store.abort_multipart_uploads(prefix + "/") == left_open


def test_a_streamed_upload_aborted_with_parts_in_flight_leaves_nothing(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    proxy.fail("error", 1, method="DELETE", query="uploadId")
    data = payload(3 * PART)
    for _ in range(3):
        upload = store.open_upload(f"{prefix}/streamed")
        for number in (1, 2, 3):
            chunk = data[(number - 1) * PART : number * PART]
            upload.send(number, lambda chunk=chunk: chunk)
        upload.abort()  # while the parts are being sent
    assert store.head(f"{prefix}/streamed") is None
    assert store.abort_multipart_uploads(prefix + "/") == 0


def test_an_upload_aborted_while_it_is_being_created_is_aborted_not_orphaned(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    # The store creates the upload but its answer is late: the abort comes while the client
    # still waits for the id. Cancelling the sends used to cancel the creation too, leaving
    # an upload nobody knew the id of (its parts billed until a cleanup of the whole prefix).
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    proxy.fail("late_answer", 1, method="POST", query="uploads", seconds=0.5)
    upload = store.open_upload(f"{prefix}/late")
    upload.send(1, lambda: payload(PART))
    deadline = time.monotonic() + 30
    while not proxy.injected:  # the creation reached the proxy, whose answer is held back
        assert time.monotonic() < deadline, "the upload's creation never reached the proxy"
        time.sleep(0.005)
    upload.abort()
    assert [a for a, _, _ in proxy.injected] == ["late_answer"]
    assert store.abort_multipart_uploads(prefix + "/") == 0  # it was aborted, by its id


def test_a_4xx_is_not_retried(
    s3_faults: tuple[FaultProxy, S3Root], opened: Callable[..., Any]
) -> None:
    proxy, root = s3_faults
    store, prefix = opened(root.url, root.storage_options, retry=FAST)
    proxy.fail("error", 10, status=403)
    with pytest.raises(ObjectStoreError, match="check the credentials") as caught:
        store.put(f"{prefix}/a", b"1")
    assert caught.value.attempts == 1
    assert len(proxy.injected) == 1


# --------------------------------------------------------------------------- opening a store


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket", ("s3", "bucket", "")),
        ("s3://bucket/", ("s3", "bucket", "")),
        ("s3://my.bucket-1/runs/exp1", ("s3", "my.bucket-1", "runs/exp1")),
        ("S3://bucket/runs/exp1/", ("s3", "bucket", "runs/exp1")),
    ],
)
def test_parse_url(url: str, expected: tuple[str, str, str]) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("bucket/prefix", "not an object storage URL"),
        ("s3://", "not a valid bucket name"),
        ("s3://Bucket/x", "not a valid bucket name"),
        ("s3://b/x", "not a valid bucket name"),
        ("s3://bucket/a//b", "empty, '.' or '..' segment"),
        ("s3://bucket/a/../b", "empty, '.' or '..' segment"),
        ("s3://bucket/a?versionId=1", "no query string"),
        ("http://bucket/x", "unsupported URL scheme 'http'"),
        ("gs://bucket/x", "gs:// and az:// are not supported"),
        ("az://container/x", "gs:// and az:// are not supported"),
    ],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(CheckpointValueError, match=message.replace("?", r"\?")):
        open_store(url, {})


def test_unknown_storage_option_lists_the_accepted_ones(s3_root: S3Root) -> None:
    options = {**s3_root.storage_options, "endpoint": "http://typo"}
    with pytest.raises(CheckpointValueError) as caught:
        open_store(s3_root.url, options)
    message = str(caught.value)
    assert "unknown storage_options ['endpoint']" in message
    for accepted in ("endpoint_url", "key", "secret", "client_kwargs", "max_concurrency"):
        assert accepted in message
    with pytest.raises(CheckpointValueError, match=r"\['loop'\] are set by orbit_pt"):
        open_store(s3_root.url, {"loop": None})
    with pytest.raises(CheckpointValueError, match="max_concurrency"):
        open_store(s3_root.url, {**s3_root.storage_options, "max_concurrency": 0})


@pytest.mark.parametrize(
    ("options", "env", "unsigned"),
    [
        ({}, {}, True),  # AWS itself: https
        ({"endpoint_url": "https://minio.example:9000"}, {}, True),
        ({"endpoint_url": "http://127.0.0.1:9000"}, {}, False),
        ({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}, {}, False),
        ({}, {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}, False),
        ({"use_ssl": False}, {}, False),
        ({"config_kwargs": {"s3": {"payload_signing_enabled": True}}}, {}, False),  # the caller's
    ],
)
def test_bodies_are_signed_unless_tls_and_a_checksum_protect_them(
    options: dict[str, Any], env: dict[str, str], unsigned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store, _ = open_store("s3://bucket", options)  # nothing is sent until a request is made
    config = store._fs.config_kwargs  # type: ignore[attr-defined]
    assert (config.get("s3", {}).get("payload_signing_enabled") is False) is unsigned
    assert config["retries"] == {"total_max_attempts": 1}  # orbit_pt's retries only
    store.close()


def test_a_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(MissingClientError, match=r"pip install 'orbit_pt\[s3\]'") as caught:
        open_store("s3://bucket/x", {})
    assert isinstance(caught.value, ImportError)


def test_the_module_imports_no_client() -> None:
    code = (
        "import sys, orbit_pt._storage.objects\n"
        "loaded = {'s3fs', 'botocore', 'aiobotocore', 'fsspec'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_errors_survive_pickling() -> None:
    for error in (
        ObjectStoreError("upload", "s3://b/k", "HTTP 500", attempts=3),
        ObjectNotFoundError("download", "s3://b/k", "no such object"),
        PreconditionFailedError("upload", "s3://b/k", "HTTP 412"),
    ):
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error)
        assert str(clone) == str(error)
        assert (clone.url, clone.attempts) == (error.url, error.attempts)


def test_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=5, initial_backoff=0.5, max_backoff=3.0)
    ceilings = [policy.backoff(n, lambda low, high: high) for n in range(1, 6)]
    assert ceilings == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.backoff(4, lambda low, high: low) == 0.0  # full jitter: anywhere from 0
    with pytest.raises(CheckpointValueError, match="max_attempts must be >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(CheckpointValueError, match="initial_backoff <= max_backoff"):
        RetryPolicy(initial_backoff=2.0, max_backoff=1.0)
