"""Moving shard files between ranks over the manager's gloo group.

Each transfer is a stream of files whose names, sizes and checksums both sides already agreed
on; the bytes go as uint8 tensors in chunks of at most :data:`CHUNK` bytes (point-to-point sends
and receives, all of a rank's streams advancing together so that two ranks sending to each
other never wait on each other). The receiver writes each file into a fresh folder and checks
its checksum on arrival; a mismatch is a :class:`CorruptCheckpointError` naming the sender.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from orbit_pt._control.collective import Collective, _with_peers
from orbit_pt._format import checksum as _checksum
from orbit_pt._format.safetensors import tensor_bytes
from orbit_pt.errors import CorruptCheckpointError

CHUNK = 32 << 20


@dataclass(frozen=True)
class Outgoing:
    """Files this rank sends to ``peer`` (read from ``folder``), in ``files``' sorted order.

    ``shard`` (whose shard the files are) is the messages' tag: two streams between the same
    pair of ranks never take each other's chunks.
    """

    peer: int
    folder: Path
    files: Mapping[str, Mapping[str, Any]]  # rel -> {"size", "checksum"}
    shard: int


@dataclass(frozen=True)
class Incoming:
    """Files this rank receives from ``peer`` into ``folder`` (``shard``: as for Outgoing)."""

    peer: int
    folder: Path
    files: Mapping[str, Mapping[str, Any]]
    shard: int


class _Reader:
    def __init__(self, out: Outgoing) -> None:
        self.out = out
        self.names = sorted(out.files)
        self.index, self.offset = 0, 0
        self.handle: BinaryIO | None = None
        self.error: Exception | None = None

    def next_chunk(self) -> torch.Tensor | None:
        while self.index < len(self.names):
            rel = self.names[self.index]
            size = int(self.out.files[rel]["size"])
            if self.offset >= size:
                self._next_file()
                continue
            if self.handle is None:
                self.handle = open(self.out.folder / rel, "rb")  # noqa: SIM115
            n = min(CHUNK, size - self.offset)
            data = self.handle.read(n)
            if len(data) != n and self.error is None:
                # Still send the agreed number of bytes: the receiver must not wait forever.
                self.error = CorruptCheckpointError(
                    f"{self.out.folder / rel} is shorter than its marker's {size} bytes"
                )
            data = data.ljust(n, b"\0")
            self.offset += n
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return None

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.handle, self.offset = None, 0
        self.index += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


class _Writer:
    def __init__(self, inc: Incoming) -> None:
        self.inc = inc
        self.names = sorted(inc.files)
        self.index, self.offset = 0, 0
        self.handle: BinaryIO | None = None
        self.checksum: Any = None
        self.error: Exception | None = None
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.index < len(self.names):
            rel = self.names[self.index]
            if int(self.inc.files[rel]["size"]) != 0:
                return
            (self.inc.folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.inc.folder / rel).write_bytes(b"")
            self._check(rel, _checksum.of_bytes(b""))
            self.index += 1

    def next_size(self) -> int | None:
        if self.index >= len(self.names):
            return None
        size = int(self.inc.files[self.names[self.index]]["size"])
        return min(CHUNK, size - self.offset)

    def take(self, chunk: torch.Tensor) -> None:
        rel = self.names[self.index]
        size = int(self.inc.files[rel]["size"])
        if self.handle is None:
            path = self.inc.folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = open(path, "xb")  # noqa: SIM115
            self.checksum = _checksum.Checksum()
        handle = self.handle
        assert handle is not None
        view = tensor_bytes(chunk)  # numpy is not a dependency
        handle.write(view)
        self.checksum.update(view)
        self.offset += chunk.numel()
        if self.offset >= size:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            self.handle, self.offset = None, 0
            self._check(rel, self.checksum.value())
            self.index += 1
            self._skip_empty()

    def _check(self, rel: str, actual: str) -> None:
        recorded = self.inc.files[rel]["checksum"]
        expected_algorithm = _checksum.algorithm_of(recorded)
        if expected_algorithm != _checksum.ALGORITHM:
            actual = _checksum.of_file(self.inc.folder / rel, expected_algorithm)
        if actual != recorded and self.error is None:
            # Recorded, not raised: the rest of the stream is still received, so that the
            # sender is never left waiting on a receive that will not come.
            self.error = CorruptCheckpointError(
                f"{rel} received from rank {self.inc.peer} has checksum {actual}, but the "
                f"sender's marker records {recorded}: the copy is corrupt and is not kept"
            )

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def exchange(
    collective: Collective,
    outgoing: Sequence[Outgoing],
    incoming: Sequence[Incoming],
    *,
    corrupt: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Send and receive every stream; each received file is checked on arrival.

    Every rank named as a peer must call this at the same point with the matching streams.
    ``corrupt`` is a test hook applied to each chunk before it is sent.
    """
    if not outgoing and not incoming:
        return
    readers = [_Reader(o) for o in outgoing]
    writers = [_Writer(i) for i in incoming]
    group = collective.group
    assert group is not None, "exchange() needs a collective with a process group"
    try:
        with _with_peers(collective.timeout):
            while True:
                works = []
                received = []
                for reader in readers:
                    chunk = reader.next_chunk()
                    if chunk is None:
                        continue
                    if corrupt is not None:
                        corrupt(chunk)
                    peer = dist.get_global_rank(group, reader.out.peer)
                    works.append(dist.isend(chunk, dst=peer, group=group, tag=reader.out.shard))
                for writer in writers:
                    size = writer.next_size()
                    if size is None:
                        continue
                    buffer = torch.empty(size, dtype=torch.uint8)
                    peer = dist.get_global_rank(group, writer.inc.peer)
                    works.append(dist.irecv(buffer, src=peer, group=group, tag=writer.inc.shard))
                    received.append((writer, buffer))
                if not works:
                    break
                for work in works:
                    if work is not None:
                        work.wait()
                for writer, buffer in received:
                    writer.take(buffer)
    finally:
        for reader in readers:
            reader.close()
        for writer in writers:
            writer.close()
    for error in [r.error for r in readers] + [w.error for w in writers]:
        if error is not None:
            raise error
