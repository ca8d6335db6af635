"""Uploading a step's large files while they are written (orbit_pt/_storage/streaming.py).

Against moto's S3 server on loopback. The unit tests feed one file's parts in the orders writers
produce (in order, out of order, overlapping, rewritten after a part was sent, with bytes no
write reported); the object must always equal the file. The save tests check that a real save
streams its large files, that a failure at any point leaves no object and no incomplete upload,
and that a rollback's new step replaces the old one only at the commit.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from _distributed import run_ranks
from _s3 import FaultProxy, S3Root

from orbit_pt import CheckpointManager, CheckpointManagerOptions, CheckpointSaveError
from orbit_pt._storage import streaming
from orbit_pt._storage.objects import MiB, ObjectStore, open_store
from orbit_pt._storage.streaming import FileParts, PartBuffers

pytest.importorskip("s3fs", reason="needs the s3 extra: pip install -e .[test]")

PART = 5 * MiB  # the smallest part S3 takes
READER = CheckpointManagerOptions(read_only=True)


@pytest.fixture
def store(s3_root: S3Root) -> Iterator[tuple[ObjectStore, str]]:
    opened, prefix = open_store(s3_root.url, s3_root.storage_options)
    yield opened, prefix
    opened.close()


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 5 MiB, so that a model of a few MB streams in several parts."""
    monkeypatch.setattr(streaming, "PART_SIZE", PART)


def _file(tmp_path: Path, size: int, seed: int) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"file-{seed}"
    with open(path, "wb") as f:
        f.truncate(size)  # as a writer's file is created: at full size, a hole
    return path, data


def _write(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _stored(store: ObjectStore, key: str) -> bytes:
    return store.get(key)


def _open_uploads(s3: S3Root) -> list[str]:
    """The incomplete multipart uploads under the root (listed with boto3 directly)."""
    client = boto3.client("s3")  # the fixtures point the AWS_* environment at the server
    answer = client.list_multipart_uploads(Bucket=s3.server.bucket, Prefix=s3.prefix)
    return [u["Key"] for u in answer.get("Uploads", [])]


@contextlib.contextmanager
def _parts(
    upload: Any, path: Path, size: int, pool: PartBuffers | None = None
) -> Iterator[FileParts]:
    """A FileParts for ``path``, closed after; 4 buffers of its own unless ``pool``."""
    parts = FileParts(upload, path, size, PART, pool or PartBuffers(4, PART))
    try:
        yield parts
    finally:
        parts.close()


def _feed(
    store: ObjectStore,
    key: str,
    path: Path,
    data: bytes,
    writes: list[tuple[int, int]],
    *,
    buffers: int = 4,
) -> tuple[FileParts, int]:
    """Write ``writes`` ((offset, length) of ``data``) to ``path``, reporting each to a
    FileParts; finish it. Returns it and how many parts were sent only at the finish."""
    with _parts(store.open_upload(key), path, len(data), PartBuffers(buffers, PART)) as parts:
        for offset, length in writes:
            _write(path, offset, data[offset : offset + length])
            parts.written(offset, memoryview(data)[offset : offset + length])
        late = parts.finish()
    return parts, late


# --------------------------------------------------------------------------------- one file


def test_in_order_writes_send_every_part_before_the_finish(
    store: tuple[ObjectStore, str], tmp_path: Path
) -> None:
    s3, prefix = store
    path, data = _file(tmp_path, 3 * PART + 1234, seed=1)
    chunk = 3 * MiB  # writes that do not line up with parts
    writes = [(o, min(chunk, len(data) - o)) for o in range(0, len(data), chunk)]
    parts, late = _feed(s3, f"{prefix}/in-order", path, data, writes)
    assert (parts.count, late) == (4, 0)
    assert _stored(s3, f"{prefix}/in-order") == data


def test_out_of_order_and_overlapping_writes(
    store: tuple[ObjectStore, str], tmp_path: Path
) -> None:
    s3, prefix = store
    path, data = _file(tmp_path, 4 * PART, seed=2)
    rng = random.Random(0)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(30))})
    writes = [(a, b - a) for a, b in itertools.pairwise(cuts)]
    rng.shuffle(writes)
    writes += [(PART - 100, 200), (0, 50)]  # the same bytes again, after their parts went
    _, late = _feed(s3, f"{prefix}/shuffled", path, data, writes, buffers=8)
    assert late == 1 + 1  # the two parts written again are sent again at the finish
    assert _stored(s3, f"{prefix}/shuffled") == data


def test_a_part_rewritten_after_it_was_sent_is_sent_again(
    store: tuple[ObjectStore, str], tmp_path: Path
) -> None:
    s3, prefix = store
    path, data = _file(tmp_path, 2 * PART, seed=3)
    first = bytearray(data)
    first[10:20] = b"0123456789"  # what the part held when it was first sent
    with _parts(s3.open_upload(f"{prefix}/rewritten"), path, len(data)) as parts:
        _write(path, 0, bytes(first))
        parts.written(0, memoryview(first))
        _write(path, 0, data[:PART])  # rewritten: the file now holds ``data``
        parts.written(0, memoryview(data)[:PART])
        assert parts.finish() == 1
    assert _stored(s3, f"{prefix}/rewritten") == data


def test_bytes_no_write_reported_are_read_from_the_file(
    store: tuple[ObjectStore, str], tmp_path: Path
) -> None:
    # As in a file shared by several ranks: rank 0 sees only its own writes.
    s3, prefix = store
    path, data = _file(tmp_path, 3 * PART, seed=4)
    with _parts(s3.open_upload(f"{prefix}/shared"), path, len(data)) as parts:
        for offset in range(0, len(data), 2 * MiB):  # "rank 0" writes every other 1 MiB
            piece = data[offset : offset + MiB]
            _write(path, offset, piece)
            parts.written(offset, memoryview(piece))
        for offset in range(MiB, len(data), 2 * MiB):  # "rank 1", unseen
            _write(path, offset, data[offset : offset + MiB])
        assert parts.finish() == 3
    assert _stored(s3, f"{prefix}/shared") == data


def test_when_no_buffer_can_come_back_parts_are_read_from_the_file(
    store: tuple[ObjectStore, str], tmp_path: Path
) -> None:
    # One buffer, held by a part that is never completed by reported writes: the other parts
    # must not wait for it (nothing would return it) and go from the file instead.
    s3, prefix = store
    path, data = _file(tmp_path, 3 * PART, seed=5)
    pool = PartBuffers(1, PART)
    with _parts(s3.open_upload(f"{prefix}/starved"), path, len(data), pool) as parts:
        _write(path, 0, data[:MiB])
        parts.written(0, memoryview(data)[:MiB])  # part 1 holds the only buffer
        _write(path, MiB, data[MiB:])
        parts.written(PART, memoryview(data)[PART:])  # parts 2 and 3: no buffer, no wait
        assert parts.finish() == 1  # part 1: its bytes past 1 MiB were never reported
    assert _stored(s3, f"{prefix}/starved") == data


def test_the_buffers_bound_memory_and_come_back(tmp_path: Path) -> None:
    pool = PartBuffers(2, 16)
    a, b = pool.take(), pool.take()
    assert a is not None
    assert b is not None
    assert pool.take() is None  # both held by parts being assembled: no waiting
    pool.hand_over()  # ``a`` is now a part queued for sending
    pool.give(a, sent=True)
    c = pool.take()
    assert c is a  # reused, not a new allocation


def test_a_send_that_cannot_be_queued_returns_its_buffer(tmp_path: Path) -> None:
    # If queueing a part fails at once, nothing would ever return its buffer, and the next
    # writer needing one would wait forever.
    class Refusing:
        def send(self, number: int, read: Any, done: Any = None) -> None:
            raise RuntimeError("the client's event loop is gone")

        def finish(self, size: int) -> None: ...

        def abort(self) -> None: ...

    path, data = _file(tmp_path, 2 * PART, seed=6)
    pool = PartBuffers(1, PART)
    with _parts(Refusing(), path, len(data), pool) as parts:
        with pytest.raises(RuntimeError, match="event loop is gone"):
            parts.written(0, memoryview(data)[:PART])
        assert pool.take() is not None  # the buffer came back: no wait, no None


# ----------------------------------------------------------------------------------- saves


def _big_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 512))  # 25 MB


def _options(s3: S3Root, tmp_path: Path, mirror: str = "mirror") -> dict[str, Any]:
    return {**s3.storage_options, "cache_dir": str(tmp_path / mirror)}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_save_streams_its_large_files(
    s3_root: S3Root, tmp_path: Path, small_parts: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = _big_model(0)
    with (
        caplog.at_level(logging.DEBUG, logger="orbit_pt._storage.streaming"),
        CheckpointManager(s3_root.url, storage_options=_options(s3_root, tmp_path)) as mgr,
    ):
        mgr.save(1, {"model": model})
        local = mgr.step_dir(1) / "model" / "model.safetensors"
        assert local.stat().st_size > 4 * PART
    sent = [r.getMessage() for r in caplog.records if "parts sent while" in r.getMessage()]
    assert len(sent) == 1
    assert sent[0].startswith("step 1: 5 of 5 parts"), sent
    s3, prefix = open_store(s3_root.url, s3_root.storage_options)
    try:
        assert s3.get(f"{prefix}/step_00000001/model/model.safetensors") == local.read_bytes()
    finally:
        s3.close()
    fresh = _big_model(1)
    other = _options(s3_root, tmp_path, "other-machine")
    with CheckpointManager(s3_root.url, storage_options=other, options=READER) as reader:
        reader.restore(1, {"model": fresh})
    assert _same(fresh, model)


def test_an_async_save_streams_from_its_staging_buffers(
    s3_root: S3Root, tmp_path: Path, small_parts: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = _big_model(0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    options = CheckpointManagerOptions(async_save=True)
    with (
        caplog.at_level(logging.DEBUG, logger="orbit_pt._storage.streaming"),
        CheckpointManager(
            s3_root.url, options=options, storage_options=_options(s3_root, tmp_path)
        ) as mgr,
    ):
        mgr.save(1, {"model": model})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # training goes on: the step holds the values at the save
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
    assert any("step 1: 5 of 5 parts" in r.getMessage() for r in caplog.records)
    fresh = _big_model(1)
    other = _options(s3_root, tmp_path, "other-machine")
    with CheckpointManager(s3_root.url, storage_options=other, options=READER) as reader:
        reader.restore(1, {"model": fresh})
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


def test_failing_parts_fail_the_save_and_leave_no_upload(
    s3_faults: tuple[FaultProxy, S3Root], tmp_path: Path, small_parts: None
) -> None:
    proxy, s3 = s3_faults
    model = _big_model(0)
    with CheckpointManager(s3.url, storage_options=_options(s3, tmp_path)) as mgr:
        mgr.save(1, {"model": _big_model(2)})
        proxy.fail("error", 10_000, query="partNumber", status=500)  # every part, every retry
        with pytest.raises(CheckpointSaveError, match="nothing of step 2 was committed"):
            mgr.save(2, {"model": model})
        proxy.clear()
        assert mgr.all_steps() == [1]
        assert _open_uploads(s3) == []
        mgr.save(3, {"model": model})
        assert mgr.all_steps() == [1, 3]


def test_a_write_that_fails_after_parts_went_aborts_them(
    s3_root: S3Root, tmp_path: Path, small_parts: None
) -> None:
    model = _big_model(0)
    real_fsync = os.fsync
    sent: list[int] = []
    real_send = FileParts._send

    def counting_send(self: FileParts, index: int, held: Any) -> None:
        sent.append(index)
        real_send(self, index, held)

    def failing_fsync(fd: int) -> None:
        if Path(f"/proc/self/fd/{fd}").readlink().name == "model.safetensors":
            raise OSError(5, "Input/output error (injected)")
        real_fsync(fd)

    with CheckpointManager(s3_root.url, storage_options=_options(s3_root, tmp_path)) as mgr:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(FileParts, "_send", counting_send)
            patch.setattr(os, "fsync", failing_fsync)  # the file is written, then fails
            with pytest.raises(CheckpointSaveError, match="Input/output error"):
                mgr.save(1, {"model": model})
        assert sent  # parts had gone up before the failure
        assert mgr.all_steps() == []
        assert _open_uploads(s3_root) == []
        mgr.save(1, {"model": model})
        assert mgr.all_steps() == [1]


def test_a_rollback_replaces_the_step_only_at_the_commit(
    s3_root: S3Root, tmp_path: Path, small_parts: None
) -> None:
    old, new = _big_model(0), _big_model(1)
    options = _options(s3_root, tmp_path)
    with CheckpointManager(s3_root.url, storage_options=options) as mgr:
        mgr.save(1, {"model": old})
        mgr.save(2, {"model": old})
        mgr.save(2, {"model": new})  # a rollback: the old step 2 is superseded
        assert mgr.all_steps() == [1, 2]
    fresh = _big_model(2)
    other = _options(s3_root, tmp_path, "other-machine")
    with CheckpointManager(s3_root.url, storage_options=other, options=READER) as reader:
        reader.restore(2, {"model": fresh})
    assert _same(fresh, new)


def _fsdp_save(rank: int, world_size: int, url: str, options: dict[str, Any], out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    streaming.PART_SIZE = PART  # in this rank's process
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 8192, bias=False))  # 34 MB: 7 parts
    fully_shard(model)
    messages: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("orbit_pt._storage.streaming")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, {"model": model})
    if rank == 0:  # some parts hold rank 0's rows alone and went while it wrote; not all
        (message,) = [m for m in messages if "parts sent while" in m]
        # Parts 1-3 hold the header and rank 0's rows; part 4 both ranks' rows; 5-7 rank 1's.
        assert message.startswith("step 1: 3 of 7 parts"), message
    else:
        assert messages == []  # only rank 0 uploads
    full = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, out)
    dist.barrier()


def test_a_shared_mirror_streams_rank_0s_rows_and_sends_the_rest_at_the_commit(
    s3_root: S3Root, tmp_path: Path
) -> None:
    # Two ranks write one file in rows; rank 0 uploads it. It can stream only what it wrote
    # itself: the parts holding rank 1's rows go when every rank has written.
    out = str(tmp_path / "want.pt")
    run_ranks(2, _fsdp_save, s3_root.url, _options(s3_root, tmp_path), out, timeout=240)
    want = torch.load(out)
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 8192, bias=False))
    other = _options(s3_root, tmp_path, "other-machine")
    with CheckpointManager(s3_root.url, storage_options=other, options=READER) as reader:
        reader.restore(1, {"model": fresh})
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert _open_uploads(s3_root) == []


_KILLED_WHILE_STREAMING = textwrap.dedent(
    """
    import os, signal, sys, torch
    from orbit_pt import CheckpointManager
    from orbit_pt._storage import streaming
    url, options = sys.argv[1], eval(sys.argv[2])
    streaming.PART_SIZE = 5 * 2**20
    mgr = CheckpointManager(url, storage_options=options)
    mgr.save(1, {"w": torch.arange(1000.0)})
    real = streaming.FileParts.finish
    def die_before_completing(self):
        self.upload.finish = lambda size: os.kill(os.getpid(), signal.SIGKILL)
        return real(self)  # parts are up; the upload is never completed
    streaming.FileParts.finish = die_before_completing
    mgr.save(2, {"w": torch.randn(3_000_000)})
    """
)


def test_a_writer_killed_while_streaming_leaves_uploads_the_next_writer_aborts(
    s3_root: S3Root, tmp_path: Path
) -> None:
    options = {**_options(s3_root, tmp_path), "lease_seconds": 1}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_STREAMING, s3_root.url, repr(options)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _open_uploads(s3_root) != []  # what the crash left
    time.sleep(1.5)  # the dead writer's lease expires
    other = _options(s3_root, tmp_path, "other-machine")
    with CheckpointManager(s3_root.url, storage_options=other) as successor:
        assert successor.all_steps() == [1]
        assert torch.equal(successor.restore(1, ["w"])["w"], torch.arange(1000.0))
    assert _open_uploads(s3_root) == []


class _Exploding:
    def state_dict(self) -> dict[str, Any]:
        raise OSError("disk on fire")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _fsdp_save_one_rank_fails(
    rank: int, world_size: int, url: str, options: dict[str, Any], out: str
) -> None:
    from torch.distributed.fsdp import fully_shard

    streaming.PART_SIZE = PART
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 8192, bias=False))
    fully_shard(model)
    sent: list[int] = []
    real_send = FileParts._send

    def counting_send(self: FileParts, index: int, held: Any) -> None:
        sent.append(index)
        real_send(self, index, held)

    FileParts._send = counting_send  # type: ignore[method-assign]
    # "model" is written first (rank 0 streams its parts), then rank 1 fails on "z".
    other = _Exploding() if rank == 1 else {"v": torch.zeros(2)}
    with CheckpointManager(url, storage_options=options) as mgr:
        with pytest.raises(CheckpointSaveError, match="disk on fire"):
            mgr.save(1, {"model": model, "z": other})
        assert mgr.all_steps() == []
    if rank == 0:
        assert sent  # parts had gone up before rank 1's failure
        Path(out).write_text("ok")


def test_a_rank_failing_while_rank_0_streams_leaves_no_upload(
    s3_root: S3Root, tmp_path: Path
) -> None:
    out = tmp_path / "rank0.txt"
    run_ranks(
        2, _fsdp_save_one_rank_fails, s3_root.url, _options(s3_root, tmp_path), str(out),
        timeout=240,
    )  # fmt: skip
    assert out.read_text() == "ok"
    assert _open_uploads(s3_root) == []
    client = boto3.client("s3")
    listed = client.list_objects_v2(Bucket=s3_root.server.bucket, Prefix=s3_root.prefix)
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert not [k for k in keys if "/step_" in k], keys
