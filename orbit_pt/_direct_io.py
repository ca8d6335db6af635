"""Fast durable writes: O_DIRECT for the aligned middle of a byte range, plain pwrite at its edges.

Measured on the project machines, O_DIRECT writes of large aligned blocks followed by fsync run
at 2.2-2.5 GB/s while buffered writes + fsync manage 0.5-1.0 GB/s: the page cache costs more than
it saves when every byte must reach the disk anyway. O_DIRECT needs the file offset, the length
and the memory address aligned to the device's block size, which tensor memory is not; so bytes
are packed into a few page-aligned bounce buffers (a memcpy at ~10 GB/s) that writer threads
hand to the disk while the next buffer fills. The unaligned first and last bytes of a range go
through ordinary ``pwrite``: they may share a block with a neighbour's range (another tensor,
another rank) and the page cache merges those correctly.

Where O_DIRECT is not supported (tmpfs, some network filesystems) everything is written with
``pwrite``, which is correct, only slower.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from orbit_pt import _progress
from orbit_pt._checksum import Checksum

ALIGN = 4096
_BUFFER_BYTES = 16 << 20
_BUFFERS = 4
_WRITERS = 2
# Ranges smaller than this are not worth the bounce buffers.
_DIRECT_MIN = 4 << 20


def _address(view: memoryview) -> int | None:
    """The address of a writable contiguous buffer (None when it is read-only)."""
    if view.readonly or not view.contiguous:
        return None
    if len(view) == 0:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class RangeWriter:
    """Writes byte streams at offsets of one existing file, then fsyncs it on :meth:`close`."""

    def __init__(self, path: Path, *, direct: bool = True) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)
        self._direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self._direct_fd = None  # not supported on this filesystem

    @property
    def uses_direct_io(self) -> bool:
        return self._direct_fd is not None

    def write(
        self,
        offset: int,
        views: Iterable[memoryview],
        checksum: Checksum | None = None,
        *,
        size: int | None = None,
    ) -> None:
        """Write the concatenation of ``views`` at ``offset``; feed the bytes to ``checksum``.

        ``views`` may be a lazy iterable (each view produced only when the writer reaches it,
        so converted copies never pile up); then ``size``, their total length, is required.
        """
        if size is None:
            views = list(views)
            size = sum(len(v) for v in views)
        stream = _Stream(iter(views))
        if self._direct_fd is None or size < _DIRECT_MIN:
            self._pwrite(offset, stream.take(size), checksum)
            return
        head = (-offset) % ALIGN
        body = (size - head) // ALIGN * ALIGN
        self._pwrite(offset, stream.take(head), checksum)
        _write_direct(self._direct_fd, offset + head, stream.take(body), checksum)
        self._pwrite(offset + head + body, stream.take(size - head - body), checksum)

    def _pwrite(self, offset: int, chunks: Iterator[memoryview], checksum: Checksum | None) -> None:
        for chunk in chunks:
            if checksum is not None:
                checksum.update(chunk)
            done = 0
            while done < len(chunk):
                done += os.pwrite(self._fd, chunk[done:], offset + done)
            offset += len(chunk)
            _progress.advance(len(chunk))

    def close(self) -> None:
        """fsync the file (one fsync covers both descriptors) and close it."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._direct_fd is not None:
                os.close(self._direct_fd)


class _Stream:
    """Consumes an iterator of buffers as one byte stream, in pieces."""

    def __init__(self, views: Iterator[memoryview]) -> None:
        self._views = views
        self._current = memoryview(b"")

    def take(self, n: int) -> Iterator[memoryview]:
        while n > 0:
            if not self._current:
                try:
                    view = next(self._views)
                except StopIteration:
                    raise ValueError(f"the stream ended {n} bytes short") from None
                self._current = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                continue
            piece = self._current[:n]
            self._current = self._current[len(piece) :]
            n -= len(piece)
            yield piece


class _BouncePool:
    """Page-aligned buffers, allocated once per process and shared by every write."""

    _lock = threading.Lock()
    _free: queue.Queue[mmap.mmap] | None = None

    @classmethod
    def get(cls) -> queue.Queue[mmap.mmap]:
        with cls._lock:
            if cls._free is None:
                cls._free = queue.Queue()
                for _ in range(_BUFFERS):
                    cls._free.put(mmap.mmap(-1, _BUFFER_BYTES))
            return cls._free


def _write_direct(
    fd: int, offset: int, chunks: Iterator[memoryview], checksum: Checksum | None
) -> None:
    """Write ``chunks`` (a multiple of ALIGN bytes in all) at the aligned ``offset``."""
    free = _BouncePool.get()
    jobs: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue()
    errors: list[BaseException] = []

    def writer() -> None:
        while (job := jobs.get()) is not None:
            buffer, at, length = job
            try:
                if not errors:
                    view = memoryview(buffer)[:length]
                    done = 0
                    while done < length:
                        done += os.pwrite(fd, view[done:], at + done)
                    view.release()
                    _progress.advance(length)
            except BaseException as exc:
                errors.append(exc)
            finally:
                free.put(buffer)

    threads = [threading.Thread(target=writer, daemon=True) for _ in range(_WRITERS)]
    for t in threads:
        t.start()
    try:
        buffer = free.get()
        base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        filled = 0
        position = offset
        for chunk in chunks:
            if checksum is not None:
                checksum.update(chunk)
            while len(chunk):
                n = min(len(chunk), _BUFFER_BYTES - filled)
                source = _address(chunk)
                if source is not None:
                    ctypes.memmove(base + filled, source, n)  # releases the GIL
                else:
                    buffer[filled : filled + n] = chunk[:n]
                filled += n
                chunk = chunk[n:]
                if filled == _BUFFER_BYTES:
                    jobs.put((buffer, position, filled))
                    position += filled
                    buffer = free.get()
                    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
                    filled = 0
            if errors:
                break
        if filled:
            jobs.put((buffer, position, filled))  # a multiple of ALIGN by construction
        else:
            free.put(buffer)
    finally:
        for _ in threads:
            jobs.put(None)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
