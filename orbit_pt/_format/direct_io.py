"""Fast durable writes: O_DIRECT for the aligned middle of a byte range, plain pwrite at its edges.

For large ranges the page cache costs more than it saves when every byte must reach the disk
anyway: on one project machine O_DIRECT writes + fsync ran at 2.2-2.5 GB/s against 0.5-1.0 GB/s
buffered, on another (a slower disk) 0.47 against 0.37 GB/s for one 512 MiB range. Ranges under
``_DIRECT_MIN`` are written buffered: there the per-range set-up costs more than it saves.
O_DIRECT needs the file offset, the length and the memory address aligned to the device's
block size, which tensor memory is not; so bytes are packed into a few page-aligned bounce
buffers (a memcpy at ~10 GB/s) that writer threads hand to the disk while the next fills. The
unaligned first and last bytes of a range go through ordinary ``pwrite``: they may share a
block with a neighbour's range (another tensor, another rank) and the page cache merges those
correctly.

Where O_DIRECT is not supported (tmpfs, some network filesystems) everything is written with
``pwrite``, which is correct, only slower. Some filesystems accept the O_DIRECT open and then
refuse the writes with EINVAL; such a writer redoes the refused bytes with ``pwrite`` and stays
buffered from then on.

A caller may watch the writes (:func:`watching`): each range is reported once its bytes are in
the file, which is how a save to object storage sends a file's parts while the rest of it is
still being written.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from orbit_pt._format import progress as _progress
from orbit_pt._format.checksum import Hasher

logger = logging.getLogger(__name__)

_BUFFER_BYTES = 16 << 20
_BUFFERS = 4
_WRITERS = 2
# A range fills each bounce buffer with about an eighth of its bytes, between these bounds
# (a multiple of _MAX_ALIGN, so every full fill stays aligned). The disk idles while the first
# fill is copied and gets one write at a time while the last ones drain, and both cost the
# time of one fill: 16 MiB fills made a 0.09 GB state's save 1.15x safetensors' save_file +
# fsync, 4 MiB fills 0.96-1.03x, while 16 MiB fills stay the fastest for GB-sized files
# (benchmarks/small_state.py, docs/performance.md).
_MIN_FILL = 4 << 20
# Ranges smaller than this are written buffered. Each direct range starts and joins its writer
# threads and idles the disk while its first fill is copied; for the 4 MiB ranges of 528 MiB of
# FSDP state on 4 ranks that made the save 0.88x DCP's against 0.99x buffered (their fsync at
# the close costs the same), while one 512 MiB range still writes at 0.47 GB/s direct against
# 0.37 GB/s buffered (benchmarks/fsdp_vs_dcp.py, docs/performance.md).
_DIRECT_MIN = 64 << 20
# A power of two, so it divides _BUFFER_BYTES: every full bounce buffer stays aligned.
_MAX_ALIGN = 1 << 20
# Runs (RangeWriter.write_runs) shorter than this are copied into a mapping of the file, at most
# this window of it at a time: its pages count as the process's resident memory while mapped.
_MAPPED_RUN_MAX = 1 << 20
_RUN_WINDOW = 4 << 20
# Faulting the window's pages in with one call rather than a fault per page (measured within
# noise of plain faults here: 7.5 against 8.3 ms per 4 MiB box).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def fill_bytes(size: int) -> int:
    """How many bytes of each bounce buffer a direct write of ``size`` bytes fills."""
    eighth = size // 8 // _MAX_ALIGN * _MAX_ALIGN
    return max(_MIN_FILL, min(_BUFFER_BYTES, eighth))


_refusal_lock = threading.Lock()
_refusal_logged = False

Written = Callable[[int, memoryview], None]
"""Told ``(offset, bytes)`` of each range once the bytes are in the file (the view is valid only
during the call); thread-safe. It may block, which holds up the writer."""
Watch = Callable[[Path, int], "Written | None"]
"""Given a file a writer opens and the file's size, what to tell of its writes, or None."""

_watch: contextvars.ContextVar[Watch | None] = contextvars.ContextVar(
    "orbit_pt_write_watch", default=None
)


@contextlib.contextmanager
def watching(watch: Watch) -> Iterator[None]:
    """Report the writes of every :class:`RangeWriter` opened in this context to ``watch``."""
    token = _watch.set(watch)
    try:
        yield
    finally:
        _watch.reset(token)


def report(path: Path, size: int, offset: int, data: memoryview) -> None:
    """Report a write made without a :class:`RangeWriter` (``size``: the file's) to the watch."""
    watch = _watch.get()
    written = watch(path, size) if watch is not None else None
    if written is not None:
        written(offset, data)


def _alignment(fd: int) -> int:
    """The granularity of O_DIRECT offsets and lengths for ``fd``'s file.

    Linux wants the device's logical block size, which Python cannot ask for (statx's
    STATX_DIOALIGN is not in ``os``); the filesystem's block size and the page size are multiples
    of it (64 KiB pages exist on aarch64 and ppc64le), so the largest of them is safe. Rounded up
    to a power of two so it divides the bounce buffers, and capped: network filesystems report
    their transfer size as their block size, and a larger alignment only sends more bytes through
    the buffered edges. Memory needs only the logical block size, which the page-aligned bounce
    buffers always meet. Should a filesystem want more, its EINVAL makes the writer fall back.
    """
    try:
        st = os.fstatvfs(fd)
        block = max(st.f_bsize, st.f_frsize)
    except OSError:
        block = 0
    size = max(mmap.PAGESIZE, block)
    return min(1 << (size - 1).bit_length(), _MAX_ALIGN)


def address_of(view: memoryview) -> int | None:
    """The address of a writable contiguous buffer (None when it is read-only)."""
    if view.readonly or not view.contiguous:
        return None
    if len(view) == 0:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class RangeWriter:
    """Writes byte streams at offsets of one existing file, then fsyncs it on :meth:`close`."""

    def __init__(self, path: Path, *, direct: bool = True) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)
        watch = _watch.get()
        self._written = watch(path, os.fstat(self._fd).st_size) if watch is not None else None
        self._direct_fd: int | None = None
        self._mapped_fd: int | None = None  # opened by the first write_runs
        self._refused = False  # the filesystem refused an O_DIRECT write (EINVAL)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self._direct_fd = None  # not supported on this filesystem
        # The granularity of this file's O_DIRECT offsets and lengths.
        self.alignment = _alignment(self._fd)

    @property
    def uses_direct_io(self) -> bool:
        return self._direct_fd is not None and not self._refused

    def write(
        self,
        offset: int,
        views: Iterable[memoryview],
        checksum: Hasher | None = None,
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
        if not self.uses_direct_io or size < _DIRECT_MIN:
            self._pwrite(offset, stream.take(size), checksum)
            return
        head = (-offset) % self.alignment
        body = (size - head) // self.alignment * self.alignment
        self._pwrite(offset, stream.take(head), checksum)
        self._write_direct(offset + head, body, stream.take(body), checksum)
        self._pwrite(offset + head + body, stream.take(size - head - body), checksum)

    def write_runs(self, starts: Sequence[int], run: int, data: memoryview) -> None:
        """Write consecutive ``run``-byte pieces of ``data`` at ``starts`` (ascending).

        For a tensor box that is not whole rows, whose runs are a few KiB: copied into a shared
        mapping of the file, a window at a time. A ``pwrite`` per run would cost a system call
        each, serialized on the file with the other ranks writing theirs (measured here with 4
        ranks writing 4 KiB runs: 1.6 s against 0.95 s mapped, 0.6-1.1 s for the same bytes
        as whole rows). The mapping's pages are the page cache's, which :meth:`close` fsyncs.
        """
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if len(view) != run * len(starts):
            raise ValueError(f"{len(view)} bytes are not {len(starts)} runs of {run}")
        if run >= _MAPPED_RUN_MAX:
            for k, at in enumerate(starts):
                self._pwrite(at, iter([view[k * run : (k + 1) * run]]), None)
            return
        if self._mapped_fd is None:
            self._mapped_fd = os.open(self.path, os.O_RDWR)  # a shared mapping must be readable
        source = address_of(view)
        k = 0
        while k < len(starts):
            base = starts[k] - starts[k] % mmap.ALLOCATIONGRANULARITY
            last = k + 1
            while last < len(starts) and starts[last] + run - base <= _RUN_WINDOW:
                last += 1
            end = starts[last - 1] + run
            with mmap.mmap(self._mapped_fd, end - base, flags=_MAP_FLAGS, offset=base) as mapped:
                if source is not None:
                    anchor = ctypes.c_char.from_buffer(mapped)
                    target = ctypes.addressof(anchor)
                    for i in range(k, last):
                        ctypes.memmove(target + starts[i] - base, source + i * run, run)
                    del anchor  # the mapping cannot close while a pointer into it exists
                else:
                    for i in range(k, last):
                        at = starts[i] - base
                        mapped[at : at + run] = view[i * run : (i + 1) * run]
            if self._written is not None:
                for i in range(k, last):
                    self._written(starts[i], view[i * run : (i + 1) * run])
            _progress.advance((last - k) * run)
            k = last

    def _pwrite(self, offset: int, chunks: Iterator[memoryview], checksum: Hasher | None) -> None:
        for chunk in chunks:
            if checksum is not None:
                checksum.update(chunk)
            _pwrite_all(self._fd, chunk, offset)
            if self._written is not None:
                self._written(offset, chunk)
            offset += len(chunk)
            _progress.advance(len(chunk))

    def _write_direct(
        self, offset: int, size: int, chunks: Iterator[memoryview], checksum: Hasher | None
    ) -> None:
        """Write ``chunks`` (``size`` bytes, a multiple of the alignment) at the aligned
        ``offset``.

        This thread copies the bytes into bounce buffers while writer threads write full ones.
        Every buffer goes back to the process-wide pool whatever fails, or later writes would
        wait for it forever.
        """
        free = _BouncePool.get()
        fill = fill_bytes(size)
        jobs: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue()
        errors: list[BaseException] = []
        stop = threading.Event()  # the range failed: skip the buffers still queued

        def writer() -> None:
            while (job := jobs.get()) is not None:
                buffer, at, length = job
                try:
                    if not stop.is_set():
                        with memoryview(buffer) as whole, whole[:length] as view:
                            self._write_buffer(view, at)
                            if self._written is not None:
                                self._written(at, view)
                        _progress.advance(length)
                except BaseException as exc:
                    errors.append(exc)
                    stop.set()
                finally:
                    free.put(buffer)

        started: list[threading.Thread] = []
        held: mmap.mmap | None = None  # the buffer this thread is filling
        try:
            for _ in range(_WRITERS):
                # Threads do not inherit context variables; the copy carries the progress display.
                context = contextvars.copy_context()
                thread = threading.Thread(target=context.run, args=(writer,), daemon=True)
                thread.start()
                started.append(thread)
            held = free.get()
            base = ctypes.addressof(ctypes.c_char.from_buffer(held))
            filled = 0
            position = offset
            for chunk in chunks:
                if checksum is not None:
                    checksum.update(chunk)
                while len(chunk) and not stop.is_set():
                    n = min(len(chunk), fill - filled)
                    source = address_of(chunk)
                    if source is not None:
                        ctypes.memmove(base + filled, source, n)  # releases the GIL
                    else:
                        held[filled : filled + n] = chunk[:n]
                    filled += n
                    chunk = chunk[n:]
                    if filled == fill:
                        full, held = held, None
                        jobs.put((full, position, filled))
                        position += filled
                        filled = 0
                        # Never waits forever: writers return every buffer, even when they fail.
                        held = free.get()
                        base = ctypes.addressof(ctypes.c_char.from_buffer(held))
                if stop.is_set():
                    break
            if filled and not stop.is_set():
                last, held = held, None
                jobs.put((last, position, filled))  # a multiple of the alignment
        except BaseException:
            stop.set()
            raise
        finally:
            if held is not None:
                free.put(held)
            for _ in started:
                jobs.put(None)
            for thread in started:
                thread.join()
        if errors:
            raise errors[0]

    def _write_buffer(self, view: memoryview, offset: int) -> None:
        """Write one bounce buffer with O_DIRECT, or buffered once the filesystem refused it."""
        if self._direct_fd is not None and not self._refused:
            try:
                _pwrite_all(self._direct_fd, view, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refuse_direct_io()
        _pwrite_all(self._fd, view, offset)  # all of it again: part may have gone before EINVAL

    def _refuse_direct_io(self) -> None:
        global _refusal_logged
        self._refused = True
        with _refusal_lock:
            if _refusal_logged:
                return
            _refusal_logged = True
        logger.warning(
            "%s: the filesystem refused an O_DIRECT write (EINVAL); writing with buffered I/O "
            "instead, which is correct but slower",
            self.path,
        )

    def close(self) -> None:
        """fsync the file (one fsync covers every descriptor and mapping) and close it."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._direct_fd is not None:
                os.close(self._direct_fd)
            if self._mapped_fd is not None:
                os.close(self._mapped_fd)


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
