"""The O_DIRECT range writer: exact bytes at any offset, the right checksum, a lazy stream."""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import mmap
import os
import shutil
import tempfile
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from orbit_pt._format import checksum as _checksum
from orbit_pt._format import direct_io as _direct_io
from orbit_pt._format import progress as _progress
from orbit_pt._format.direct_io import RangeWriter
from orbit_pt._format.safetensors import tensor_bytes

MB = 1 << 20


@pytest.fixture(autouse=True)
def _direct_from_4_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path's mechanics, at sizes a test can afford (the default starts at 64 MiB)."""
    monkeypatch.setattr(_direct_io, "_DIRECT_MIN", 4 * MB)


def _views() -> list[memoryview]:
    torch.manual_seed(0)
    # Sizes that straddle the aligned body: tiny, odd, several bounce buffers' worth.
    tensors = [torch.randn(n) for n in (3, 1_250_001, 9 * MB // 4, 7, 5 * MB)]
    return [memoryview(b"header!" * 177), *(tensor_bytes(t) for t in tensors)]


def _pattern(size: int) -> bytes:
    """Bytes whose period (251) is coprime with every alignment: misplaced bytes show."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def _supports_direct(directory: Path) -> bool:
    probe = directory / ".o-direct-probe"
    try:
        probe.write_bytes(b"")
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A directory for the test's files, on a filesystem with O_DIRECT where there is one.

    ``tmp_path`` may be on tmpfs, which has no O_DIRECT; then a temporary directory elsewhere.
    """
    if _supports_direct(tmp_path):
        yield tmp_path
        return
    for parent in (Path("/var/tmp"), Path.home(), Path(__file__).parent):
        try:
            directory = Path(tempfile.mkdtemp(prefix="orbit-pt-direct-", dir=parent))
        except OSError:
            continue
        try:
            if _supports_direct(directory):
                yield directory
                return
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    yield tmp_path


@pytest.fixture
def direct_disk(disk: Path) -> Path:
    if not _supports_direct(disk):
        pytest.skip("no filesystem reachable from here supports O_DIRECT")
    return disk


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _patch_direct_pwrite(
    monkeypatch: pytest.MonkeyPatch, code: int | None = None, *, after: int = 0
) -> list[tuple[int, int]]:
    """Log ``os.pwrite`` calls on O_DIRECT descriptors as (offset, length); from the call after
    ``after`` on, make them raise ``OSError(code)`` (when a code is given)."""
    real = os.pwrite
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if _is_direct(fd):
            with lock:
                calls.append((offset, len(data)))
                failing = code is not None and len(calls) > after
            if failing:
                assert code is not None
                raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return calls


def _within(seconds: float, work: Callable[[], None]) -> None:
    """Run ``work`` in a thread; fail, rather than hang the suite, if it never finishes."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds} s (waiting for a leaked bounce buffer?)")
    if raised:
        raise raised[0]


def _write(
    path: Path, offset: int, data: bytes, checksum: _checksum.Checksum | None = None
) -> None:
    writer = RangeWriter(path)
    try:
        writer.write(offset, [memoryview(data)], checksum)
    finally:
        writer.close()


@pytest.mark.parametrize(("blocks", "extra"), [(0, 0), (0, 1), (1, -1), (1, 0), (3, 17)])
def test_bytes_and_checksum_at_any_offset(disk: Path, blocks: int, extra: int) -> None:
    views = _views()
    expected = b"".join(bytes(v) for v in views)
    path = disk / "f"
    path.write_bytes(b"")
    writer = RangeWriter(path)
    try:
        offset = blocks * writer.alignment + extra
        prefix = b"\xab" * offset  # a neighbour's bytes before the range must survive
        path.write_bytes(prefix + b"\0" * len(expected) + b"tail")
        checksum = _checksum.Checksum()
        writer.write(offset, views, checksum)
    finally:
        writer.close()
    data = path.read_bytes()
    assert data[:offset] == prefix
    assert data[offset : offset + len(expected)] == expected
    assert data[offset + len(expected) :] == b"tail"
    assert checksum.value() == _checksum.of_bytes(expected)


def test_lazy_stream_with_size(disk: Path) -> None:
    views = _views()
    size = sum(len(v) for v in views)
    path = disk / "f"
    path.write_bytes(b"\0" * size)
    writer = RangeWriter(path)
    try:
        writer.write(0, iter(views), size=size)
    finally:
        writer.close()
    assert path.read_bytes() == b"".join(bytes(v) for v in views)


def test_a_short_stream_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100)
    writer = RangeWriter(path)
    try:
        with pytest.raises(ValueError, match="short"):
            writer.write(0, iter([memoryview(b"abc")]), size=10)
    finally:
        writer.close()


def test_direct_io_is_used_where_the_filesystem_allows(disk: Path) -> None:
    path = disk / "f"
    path.write_bytes(b"")
    writer = RangeWriter(path)
    writer.close()
    assert writer.uses_direct_io == _supports_direct(disk)
    fallback = RangeWriter(path, direct=False)
    fallback.close()
    assert not fallback.uses_direct_io


class _BrokenError(Exception):
    pass


def _breaking_stream(good: int, error: BaseException) -> Iterator[memoryview]:
    """``good`` bytes in 1 MiB pieces, then ``error``."""
    for start in range(0, good, MB):
        yield memoryview(bytearray(min(MB, good - start)))
    raise error


class _FailingChecksum(_checksum.Checksum):
    def __init__(self, after: int) -> None:
        super().__init__()
        self._left = after

    def update(self, data: bytes | memoryview) -> None:
        if self._left == 0:
            raise _BrokenError("checksum")
        self._left -= 1
        super().update(data)


def test_failed_streams_return_every_bounce_buffer(direct_disk: Path) -> None:
    """Defect 1: a write whose input stream (or checksum) raised kept its bounce buffer, so after
    four failures every later write blocked forever waiting for one."""
    size = 40 * MB  # more than two bounce buffers
    path = direct_disk / "f"
    path.write_bytes(b"")
    os.truncate(path, size)

    def work() -> None:
        for _ in range(3):
            for good, error in [
                (20 * MB, _BrokenError("after more than a buffer")),
                (MB, _BrokenError("in the first buffer")),
                (0, _BrokenError("at once")),
                (20 * MB, KeyboardInterrupt()),
            ]:
                writer = RangeWriter(path)
                try:
                    assert writer.uses_direct_io
                    with pytest.raises(type(error)):
                        writer.write(0, _breaking_stream(good, error), size=size)
                finally:
                    writer.close()
            for after in (0, 3, 25):  # checksum updates (1 MiB pieces) before it raises
                writer = RangeWriter(path)
                try:
                    stream = _breaking_stream(size, _BrokenError())
                    with pytest.raises(_BrokenError):
                        writer.write(0, stream, _FailingChecksum(after), size=size)
                finally:
                    writer.close()
        data = _pattern(size)
        _write(path, 0, data)
        assert path.read_bytes() == data

    _within(60, work)
    assert _direct_io._BouncePool.get().qsize() == _direct_io._BUFFERS


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_failed_disk_writes_return_every_bounce_buffer(
    direct_disk: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Defect 1: a writer thread's failure (ENOSPC, EIO from pwrite) reaches the caller, blocks no
    thread and returns every bounce buffer to the pool."""
    size = 50 * MB
    path = direct_disk / "f"
    path.write_bytes(b"")
    os.truncate(path, size)
    data = _pattern(size)

    def work() -> None:
        with monkeypatch.context() as patch:
            for after in (0, 1, 2) * 3:  # direct writes that succeed before the disk fails
                _patch_direct_pwrite(patch, code, after=after)
                with pytest.raises(OSError, match=os.strerror(code)) as failure:
                    _write(path, 0, data)
                assert failure.value.errno == code
        _write(path, 0, data)
        assert path.read_bytes() == data

    _within(60, work)
    assert _direct_io._BouncePool.get().qsize() == _direct_io._BUFFERS


@pytest.mark.parametrize(
    ("page", "block", "expected"),
    [
        (4096, 4096, 4096),
        (65536, 4096, 65536),  # 64 KiB pages (aarch64, ppc64le)
        (4096, 65536, 65536),  # 64 KiB filesystem blocks
        (4096, 12288, 16384),  # not a power of two: rounded up
        (4096, 0, 4096),
        (4096, 64 * MB, 1 * MB),  # a network filesystem's transfer size: capped
    ],
)
def test_alignment_comes_from_the_filesystem_and_page_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: int, block: int, expected: int
) -> None:
    """Defect 2: the O_DIRECT alignment was hard-coded to 4096, too small for 64 KiB pages or
    filesystem blocks."""
    path = tmp_path / "f"
    path.write_bytes(b"")
    monkeypatch.setattr(mmap, "PAGESIZE", page)
    statvfs = types.SimpleNamespace(f_bsize=block, f_frsize=block)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: statvfs)
    writer = RangeWriter(path)
    writer.close()
    assert writer.alignment == expected
    assert _direct_io._BUFFER_BYTES % writer.alignment == 0


@pytest.mark.parametrize("offset", [3 * 4096, 3 * 65536 - 5, 1])
def test_direct_writes_follow_a_64k_alignment(
    direct_disk: Path, monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    """Defect 2: on a filesystem with 64 KiB blocks every O_DIRECT write must be 64 KiB aligned
    in offset and length; the hard-coded 4096 sent 4 KiB aligned ones."""
    statvfs = types.SimpleNamespace(f_bsize=65536, f_frsize=65536)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: statvfs)
    calls = _patch_direct_pwrite(monkeypatch)
    expected = _pattern(37 * MB + 12345)
    path = direct_disk / "f"
    path.write_bytes(b"\xab" * offset + b"\0" * len(expected))
    checksum = _checksum.Checksum()
    _write(path, offset, expected, checksum)
    assert path.read_bytes() == b"\xab" * offset + expected
    assert checksum.value() == _checksum.of_bytes(expected)
    assert calls
    assert all(at % 65536 == 0 and n % 65536 == 0 for at, n in calls), calls


@pytest.mark.parametrize(
    ("size", "fill"),
    [
        (0, 4 * MB),
        (20 * MB, 4 * MB),  # small ranges: the smallest fill
        (40 * MB, 5 * MB),  # an eighth, in whole MiB
        (47 * MB, 5 * MB),
        (128 * MB, 16 * MB),
        (1 << 34, 16 * MB),  # large ranges: a whole bounce buffer
    ],
)
def test_a_range_fills_its_bounce_buffers_with_an_eighth_of_its_bytes(size: int, fill: int) -> None:
    assert _direct_io.fill_bytes(size) == fill
    assert fill % _direct_io._MAX_ALIGN == 0  # so every full buffer stays aligned


@pytest.mark.parametrize(("size", "fill"), [(19 * MB, 4 * MB), (40 * MB + 3, 5 * MB)])
def test_direct_writes_are_fills_of_the_bounce_buffers(
    direct_disk: Path, monkeypatch: pytest.MonkeyPatch, size: int, fill: int
) -> None:
    """A small state's ranges are written in small fills (the disk starts sooner and its
    queue drains faster at the end); the bytes are the same."""
    calls = _patch_direct_pwrite(monkeypatch)
    expected = _pattern(size)
    path = direct_disk / "f"
    path.write_bytes(b"\0" * size)
    probe = RangeWriter(path)
    probe.close()
    _write(path, 0, expected)
    assert path.read_bytes() == expected
    lengths = sorted(n for _, n in calls)
    assert lengths[-1] == fill
    # Every aligned byte went through the bounce buffers; only the unaligned tail did not.
    assert sum(lengths) == size // probe.alignment * probe.alignment


@pytest.mark.parametrize("after", [0, 1])
def test_einval_from_o_direct_falls_back_to_buffered_writes(
    direct_disk: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    after: int,
) -> None:
    """Defect 3: a filesystem that opens files with O_DIRECT and then refuses the writes (EINVAL)
    failed the save; the refused bytes must be redone buffered, once, with one warning."""
    monkeypatch.setattr(_direct_io, "_refusal_logged", False, raising=False)
    calls = _patch_direct_pwrite(monkeypatch, errno.EINVAL, after=after)
    views = _views()
    expected = b"".join(bytes(v) for v in views)
    path = direct_disk / "f"
    path.write_bytes(b"\xab" + b"\0" * (2 * len(expected)))
    checksum = _checksum.Checksum()
    other = direct_disk / "g"
    other.write_bytes(b"\0" * len(expected))
    writer = RangeWriter(path)
    direct_at_first = writer.uses_direct_io
    try:
        with caplog.at_level(logging.WARNING, logger="orbit_pt._format.direct_io"):
            writer.write(1, views, checksum)
            direct_after_einval = writer.uses_direct_io
            tried = len(calls)
            writer.write(1 + len(expected), [memoryview(expected)])
            assert len(calls) == tried  # buffered for the rest of the writer's life
            _write(other, 0, expected)  # another file refused too: no second warning
    finally:
        writer.close()
    assert direct_at_first
    assert not direct_after_einval
    assert path.read_bytes() == b"\xab" + expected + expected
    assert other.read_bytes() == expected
    assert checksum.value() == _checksum.of_bytes(expected)
    warnings = [r for r in caplog.records if r.name == "orbit_pt._format.direct_io"]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage()
    assert "O_DIRECT" in warnings[0].getMessage()


def test_progress_counts_the_bytes_of_writer_threads(direct_disk: Path) -> None:
    """Defect 4: the bytes written by the writer threads never reached the progress display (a
    thread does not inherit the caller's context variables)."""
    data = _pattern(40 * MB + 3)
    path = direct_disk / "f"
    path.write_bytes(b"\0" * (1 + len(data)))
    progress = _progress.Progress("saving", stream=io.StringIO(), min_bytes=1 << 40)
    token = _progress._current.set(progress)
    try:
        writer = RangeWriter(path)
        try:
            assert writer.uses_direct_io
            writer.write(1, [memoryview(data)])
        finally:
            writer.close()
    finally:
        _progress._current.reset(token)
    assert progress.done == len(data)


@pytest.mark.parametrize(
    ("run", "window", "readonly"),
    [(4096, 16 << 20, False), (1000, 8192, False), (1000, 8192, True), (1 << 20, 16 << 20, False)],
)
def test_runs_land_at_their_offsets_and_leave_the_gaps_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int, window: int, readonly: bool
) -> None:
    """A box written run by run (mapped windows, several of them when the window is small;
    ``pwrite`` for long runs): every run at its offset, every byte between them untouched, and
    each run reported to the watch once."""
    monkeypatch.setattr(_direct_io, "_RUN_WINDOW", window)
    count, stride, first = 9, 3 * run + 5, 123  # runs neither aligned nor a page apart
    starts = [first + k * stride for k in range(count)]
    data = bytes(range(256)) * (run * count // 256 + 1)
    data = data[: run * count]
    path = tmp_path / "f"
    size = starts[-1] + run + 77
    path.write_bytes(b"\xee" * size)  # the other ranks' bytes
    reported: list[tuple[int, bytes]] = []
    with _direct_io.watching(lambda p, n: lambda at, view: reported.append((at, bytes(view)))):
        writer = RangeWriter(path)
        try:
            view = memoryview(data) if readonly else memoryview(bytearray(data))
            writer.write_runs(starts, run, view)
        finally:
            writer.close()
    expected = bytearray(b"\xee" * size)
    for k, at in enumerate(starts):
        expected[at : at + run] = data[k * run : (k + 1) * run]
    assert path.read_bytes() == bytes(expected)
    assert sorted(reported) == [(at, data[k * run : (k + 1) * run]) for k, at in enumerate(starts)]
    with pytest.raises(ValueError, match="are not 9 runs"):
        RangeWriter(path).write_runs(starts, run, memoryview(data[:-1]))
