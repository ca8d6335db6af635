"""Several tensors read at once when their bytes come by ranged requests (remote_files.for_each)."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest
import torch

from orbit_pt._format import remote_files

_marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")


def test_remote_reads_run_at_once_with_the_callers_context_and_no_grad() -> None:
    seen: list[tuple[str, bool, int]] = []
    lock = threading.Lock()
    running = [0, 0]  # now, most at once
    parameter = torch.nn.Parameter(torch.zeros(8))

    def read(index: int) -> None:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.05)  # a request's round trip
        parameter.data[index] = index  # an in-place write into a parameter, as a restore does
        parameter[index : index + 1].copy_(torch.tensor([float(index)]))  # needs no_grad
        with lock:
            running[0] -= 1
            seen.append((_marker.get(), torch.is_grad_enabled(), index))

    token = _marker.set("the caller's")
    try:
        remote_files.for_each(list(range(8)), read, remote=True)
    finally:
        _marker.reset(token)
    assert sorted(i for _, _, i in seen) == list(range(8))
    assert {(m, g) for m, g, _ in seen} == {("the caller's", False)}
    assert running[1] > 1  # they overlapped
    assert torch.equal(parameter.detach(), torch.arange(8.0))


def test_local_reads_stay_in_order_on_the_callers_thread() -> None:
    threads: list[int] = []
    order: list[int] = []

    def read(index: int) -> None:
        threads.append(threading.get_ident())
        order.append(index)

    remote_files.for_each([3, 1, 2], read, remote=False)
    assert order == [3, 1, 2]
    assert set(threads) == {threading.get_ident()}


def test_the_first_failure_in_order_is_raised_and_later_reads_are_dropped() -> None:
    started: list[int] = []

    def read(index: int) -> None:
        started.append(index)
        if index in (1, 2):
            time.sleep(0.05 if index == 1 else 0.0)
            raise OSError(f"range {index} failed")
        time.sleep(0.2)

    with pytest.raises(OSError, match="range 1 failed"):
        remote_files.for_each(list(range(40)), read, remote=True)
    assert len(started) < 40  # the queued reads were cancelled, not all run


# ------------------------------------------------------------- small tensors read in runs


class _Object:
    """A remote file held in memory that counts the requests it serves (and can fail them)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.requests: list[tuple[int, int]] = []
        self.failures = 0
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return "s3://bucket/model.safetensors"

    @property
    def size(self) -> int:
        return len(self.data)

    def read_into(self, offset: int, view: memoryview) -> None:
        with self._lock:
            self.requests.append((offset, offset + len(view)))
            failing, self.failures = self.failures > 0, max(0, self.failures - 1)
        time.sleep(0.01)  # a round trip: other threads arrive meanwhile
        if self.gate is not None:
            assert self.gate.wait(timeout=10)
        if failing:
            raise OSError("connection reset")
        view[:] = self.data[offset : offset + len(view)]


def _read(file: remote_files.RemoteFile, start: int, end: int) -> bytes:
    buffer = bytearray(end - start)
    file.read_into(start, memoryview(buffer))
    return bytes(buffer)


def test_runs_take_consecutive_small_tensors_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_files, "SMALL_TENSOR", 100)
    monkeypatch.setattr(remote_files, "RUN_BYTES", 250)
    monkeypatch.setattr(remote_files, "RUN_GAP", 8)
    spans = [
        (0, 100), (100, 150), (150, 160),  # small, back to back: one run
        (160, 400),  # large: alone
        (400, 450),  # small, but its neighbours are large: alone
        (450, 1000),
        (1000, 1080), (1088, 1180), (1180, 1260),  # a gap of 8 is padding; the run is full at 260
        (1260, 1300), (1400, 1450),  # a gap of 100 ends a run
    ]  # fmt: skip
    assert remote_files._runs_of(reversed(spans)) == [(0, 160), (1000, 1180), (1180, 1300)]


def test_each_run_is_fetched_once_however_many_threads_read_in_it() -> None:
    data = bytes(range(256)) * 64
    file = _Object(data)
    small = [(i * 64, i * 64 + 64) for i in range(100)]  # a run of 100 small tensors
    large = (6400, 6400 + remote_files.SMALL_TENSOR + 1)
    data += bytes(large[1] - len(data))
    file.data = data
    reads = remote_files.CoalescedReads(file, [*small, large])
    got: dict[tuple[int, int], bytes] = {}

    def read(span: tuple[int, int]) -> None:
        start, end = span
        got[span] = _read(reads, start + 3, end - 5)  # part of a tensor, as an FSDP rank reads

    remote_files.for_each([*small, large], read, remote=True)
    assert all(got[(a, b)] == data[a + 3 : b - 5] for a, b in got)
    assert sorted(file.requests) == [(0, 6400), (large[0] + 3, large[1] - 5)]


def test_a_failed_run_fails_its_readers_and_is_fetched_again_later() -> None:
    data = bytes(range(200))
    file = _Object(data)
    file.gate = threading.Event()  # the first request hangs until the second reader waits on it
    reads = remote_files.CoalescedReads(file, [(0, 50), (50, 100), (100, 200)])
    file.failures = 1
    errors: list[BaseException] = []

    def read(start: int, end: int) -> None:
        try:
            _read(reads, start, end)
        except OSError as exc:
            errors.append(exc)

    first = threading.Thread(target=read, args=(0, 50))
    first.start()
    while not file.requests:
        time.sleep(0.001)
    second = threading.Thread(target=read, args=(50, 100))
    second.start()
    time.sleep(0.5)  # the second reader is now waiting for the first one's request
    file.gate.set()
    first.join(timeout=10)
    second.join(timeout=10)
    assert [str(e) for e in errors] == ["connection reset"] * 2
    assert _read(reads, 50, 100) == data[50:100]  # the failure was not kept
    assert file.requests == [(0, 200), (0, 200)]


def test_kept_runs_are_bounded_and_an_evicted_one_is_fetched_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_files, "SMALL_TENSOR", 10)
    monkeypatch.setattr(remote_files, "RUN_BYTES", 100)
    monkeypatch.setattr(remote_files, "KEPT_RUN_BYTES", 200)
    data = bytes(i % 251 for i in range(1000))
    file = _Object(data)
    reads = remote_files.CoalescedReads(file, [(i, i + 10) for i in range(0, 1000, 10)])
    for start in range(0, 1000, 10):  # in file order: each run once
        assert _read(reads, start, start + 10) == data[start : start + 10]
    assert file.requests == [(i, i + 100) for i in range(0, 1000, 100)]
    assert reads._kept_bytes <= 200
    assert len(reads._kept) == 2
    file.requests.clear()
    assert _read(reads, 0, 10) == data[:10]  # evicted long ago: read again, still right
    assert _read(reads, 900, 910) == data[900:910]  # still kept: no request
    assert file.requests == [(0, 100)]
