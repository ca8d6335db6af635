"""Uploading a step's large files while they are still being written.

A save to object storage writes the step into the local mirror, then uploads it; done one after
the other, the save costs the write plus the upload. Here the upload starts with the write: every
file larger than a part is a multipart upload opened when its writer opens it, and each part is
sent as soon as all of its bytes are in the file (the writer reports each range it writes,
:func:`orbit_pt._format.direct_io.watching`). The reported bytes are copied into part buffers on
their way, so nothing is read back; the buffers are few (:class:`PartBuffers`), and a writer that
would need more waits for a sent part to return its buffer, which keeps the write at the
upload's pace.

What the writer did not report is sent at the end, when every rank has written: the bytes other
ranks wrote into a shared file, headers written outside the writer, small files. A range written
again after its part was sent (no writer does that today) marks the part to be sent again, so
the object is always the file as it stands at the commit. Nothing is visible in the store until
each upload is completed, which happens only at the commit, after the replaced steps are moved
aside; a failed save aborts every upload, and a crash leaves incomplete uploads that the next
writer aborts.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from orbit_pt._format import direct_io as _direct_io
from orbit_pt._storage.objects import MAX_PARTS
from orbit_pt.errors import CheckpointError

if TYPE_CHECKING:
    from orbit_pt._storage.objects import Body, PartUpload
    from orbit_pt._storage.remote import RemoteRoot
    from orbit_pt.metadata import StepMetadata

logger = logging.getLogger(__name__)

PART_SIZE = 8 * 2**20
"""The parts of streamed files; files of at most one part are uploaded whole at the commit.

8 MiB (boto3's default, in AWS's recommended 8-16 MiB), not the store's 16 MiB: on the loopback
server a 268 MB save took 1.90 s in 8 MiB parts against 2.55 s in 16 MiB ones (the server spent
2.09 against 2.64 CPU-seconds on the same bytes; boto3's upload 1.83 s), and the part buffers
(``max_concurrency + 2`` of them) hold half the memory. Files up to 10,000 parts (78 GiB)
stream; larger ones are uploaded at the commit."""


class PartBuffers:
    """The memory a step's parts are assembled in: at most ``limit`` buffers of ``part_size``.

    A writer asking for a buffer when all are out waits if some are out only to be sent (they
    come back when their send is over). When every buffer out holds a part still being
    assembled, nothing would bring one back: :meth:`take` returns None, and that part is read
    from the file when it is sent.
    """

    def __init__(self, limit: int, part_size: int) -> None:
        self.limit = max(1, limit)
        self.part_size = part_size
        self._out = 0
        self._sending = 0
        self._spare: list[bytearray] = []
        self._retired = False
        self._changed = threading.Condition()

    def take(self) -> bytearray | None:
        with self._changed:
            while self._out >= self.limit:
                if self._sending == 0:
                    return None
                self._changed.wait()
            self._out += 1
            return self._spare.pop() if self._spare else bytearray(self.part_size)

    def hand_over(self) -> None:
        """A buffer out is now a part queued for sending: it comes back on its own."""
        with self._changed:
            self._sending += 1

    def give(self, buffer: bytearray, *, sent: bool) -> None:
        with self._changed:
            self._out -= 1
            if sent:
                self._sending -= 1
            if not self._retired:
                self._spare.append(buffer)
            self._changed.notify_all()

    def retire(self) -> None:
        """The writes are over: free buffers as they come back instead of keeping them."""
        with self._changed:
            self._retired = True
            self._spare.clear()


class FileParts:
    """One file's multipart upload, fed as the file's bytes are written.

    The file is cut into parts of ``part_size`` bytes (the last shorter). The bytes a writer
    reports are copied into the part's buffer; a part is sent once the writes reported cover
    all of it. :meth:`finish` sends the rest, read from the file, and completes the upload.
    """

    def __init__(
        self, upload: PartUpload, path: Path, size: int, part_size: int, buffers: PartBuffers
    ) -> None:
        self.upload = upload
        self.path = path
        self.size = size
        self.part_size = part_size
        self.count = -(-size // part_size)
        self._pool = buffers
        self._covered: list[list[tuple[int, int]]] = [[] for _ in range(self.count)]
        self._buffers: dict[int, bytearray] = {}  # parts being assembled in memory
        self._from_file: set[int] = set()  # parts that got no buffer: read when sent
        self._sent: set[int] = set()
        self._stale: set[int] = set()  # sent, then written again
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDONLY)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.part_size
        return start, min(self.size, start + self.part_size)

    def written(self, offset: int, data: memoryview) -> None:
        """The writer put ``data`` at ``offset``: keep its bytes, send every part now whole."""
        data = data.cast("B")
        end = min(offset + data.nbytes, self.size)
        if end <= offset:
            return
        indices = range(offset // self.part_size, (end - 1) // self.part_size + 1)
        with self._lock:
            new = [i for i in indices if not self._has_home(i)]
        taken = {i: self._pool.take() for i in new}  # may wait: outside the lock
        ready: list[tuple[int, bytearray | None]] = []
        with self._lock:
            for index in indices:
                buffer = taken.pop(index, None)
                if index in new and not self._has_home(index):
                    if buffer is None:
                        self._from_file.add(index)
                    else:
                        self._buffers[index] = buffer
                elif buffer is not None:
                    self._pool.give(buffer, sent=False)  # another writer got here first
                if index in self._sent:
                    self._stale.add(index)
                    continue
                start, stop = self.bounds(index)
                a, z = max(offset, start), min(end, stop)
                held = self._buffers.get(index)
                if held is not None:
                    _copy(held, a - start, data[a - offset : z - offset])
                if _add(self._covered[index], a, z) == [(start, stop)]:
                    self._sent.add(index)
                    ready.append((index, self._buffers.pop(index, None)))
        for index, held in ready:
            self._send(index, held)

    def _has_home(self, index: int) -> bool:
        return index in self._buffers or index in self._from_file or index in self._sent

    def _send(self, index: int, held: bytearray | None) -> None:
        start, stop = self.bounds(index)
        length = stop - start
        if held is not None:
            buffer = held
            self._pool.hand_over()
            try:
                self.upload.send(
                    index + 1,
                    lambda: buffer if len(buffer) == length else bytes(buffer[:length]),
                    lambda: self._pool.give(buffer, sent=True),
                )
            except BaseException:
                # Not queued, so never coming back on its own: a writer waiting for a buffer
                # would wait forever.
                self._pool.give(buffer, sent=True)
                raise
            return

        def read() -> Body:
            data = os.pread(self._fd, length, start)
            if len(data) != length:
                raise CheckpointError(
                    f"{self.path} ended at {start + len(data)} bytes while part {index + 1} was "
                    f"read for upload; it should hold {self.size}"
                )
            return data

        self.upload.send(index + 1, read)

    def finish(self) -> int:
        """Send the parts not sent (or written again since) from the file, then complete the
        upload; returns how many parts were sent here rather than while the file was written."""
        with self._lock:
            late = sorted(set(range(self.count)) - self._sent | self._stale)
            self._sent.update(late)
            self._stale.clear()
            partial, self._buffers = self._buffers, {}
        for buffer in partial.values():  # bytes other ranks wrote complete these parts
            self._pool.give(buffer, sent=False)
        for index in late:
            self._send(index, None)
        self.upload.finish(self.size)
        return len(late)

    def close(self) -> None:
        os.close(self._fd)


class StreamingUpload:
    """The uploads of one step's files, started while the step is written into ``folder``.

    Used by the rank that uploads (rank 0, or the only rank): :meth:`watching` around the write,
    :meth:`upload` at the commit, :meth:`abort` if the save fails before it.
    """

    def __init__(
        self, remote: RemoteRoot, step: int, folder: Path, *, part_size: int | None = None
    ) -> None:
        self.remote = remote
        self.step = step
        self.folder = folder
        self.part_size = part_size if part_size is not None else PART_SIZE
        self._files: dict[str, FileParts] = {}
        self._lock = threading.Lock()
        # Enough buffers to keep every part slot of the client busy while one is assembled.
        self._buffers = PartBuffers(remote.store.max_concurrency + 2, self.part_size)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Stream the files of ``folder`` that writers open in this context."""
        with _direct_io.watching(self._watch):
            yield

    def _watch(self, path: Path, size: int) -> _direct_io.Written | None:
        if size <= self.part_size:
            return None  # one request at the commit costs less than a multipart upload
        if size > self.part_size * MAX_PARTS:
            return None  # needs larger parts than the buffers: uploaded whole at the commit
        try:
            rel = path.absolute().relative_to(self.folder.absolute()).as_posix()
        except ValueError:
            return None  # not a file of this step
        with self._lock:
            parts = self._files.get(rel)
            if parts is None:
                upload = self.remote.store.open_upload(self.remote.step_key(self.step, rel))
                parts = self._files[rel] = FileParts(
                    upload, path, size, self.part_size, self._buffers
                )
        if parts.size != size:
            return None  # reopened at another size: the commit uploads it whole (see upload)
        return parts.written

    def upload(self, meta: StepMetadata) -> None:
        """Upload the step's files: complete the streamed ones, send the others whole.

        Not yet the commit: the marker goes after. Each upload's size is confirmed.
        """
        from orbit_pt._storage.remote import each_in_parallel

        self.remote.check_lease()
        self._buffers.retire()
        with self._lock:
            streamed = dict(self._files)
        late: list[int] = []  # per streamed file, the parts sent only now

        def one(rel: str) -> None:
            parts = streamed.get(rel)
            path = self.folder / rel
            if parts is not None and parts.size == path.stat().st_size:
                late.append(parts.finish())
            else:
                self.remote.upload_file(self.step, rel, path)

        try:
            each_in_parallel(one, sorted(meta.files))
        except BaseException:
            self.abort()
            raise
        # Files opened by a writer but not part of the step (none today) leave no upload behind.
        for rel in sorted(set(streamed) - set(meta.files)):
            streamed[rel].upload.abort()
        self._close()
        if streamed:
            total = sum(p.count for p in streamed.values())
            logger.debug(
                "step %d: %d of %d parts sent while the files were written",
                self.step, total - sum(late), total,
            )  # fmt: skip

    def abort(self) -> None:
        """Abort every upload started (the save failed or was interrupted); never raises."""
        with self._lock:
            streamed = dict(self._files)
        for parts in streamed.values():
            parts.upload.abort()
        self._close()

    def _close(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
        for parts in files.values():
            with contextlib.suppress(OSError):
                parts.close()


def _add(covered: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """Merge ``[start, end)`` into the sorted disjoint intervals ``covered`` (in place)."""
    if start >= end:
        return covered
    merged: list[tuple[int, int]] = []
    for a, b in covered:
        if b < start or a > end:
            merged.append((a, b))
        else:
            start, end = min(a, start), max(b, end)
    merged.append((start, end))
    merged.sort()
    covered[:] = merged
    return covered


def _copy(target: bytearray, at: int, source: memoryview) -> None:
    """``target[at:at + len(source)] = source``, without the GIL where the source allows it."""
    address = _direct_io.address_of(source)
    if address is None:
        target[at : at + source.nbytes] = source
        return
    base = ctypes.addressof(ctypes.c_char.from_buffer(target))
    ctypes.memmove(base + at, address, source.nbytes)
