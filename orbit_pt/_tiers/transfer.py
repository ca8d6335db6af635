"""Moving shard files between ranks over the manager's gloo group.

Each transfer is a stream of files whose names, sizes and checksums both sides already agreed
on, cut by both sides alike into chunks of at most :data:`CHUNK` bytes that travel as uint8
tensors (point-to-point sends and receives). All of a rank's streams advance together, chunk by
chunk, so that two ranks sending to each other never wait on each other; a receiver writes the
chunks of one round to disk while the next round is on the wire. Each received file is checked
against the sender's checksum on arrival; a mismatch is a :class:`CorruptCheckpointError` naming
the sender, raised once the whole stream is in (a sender is never left waiting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orbit_pt._control.collective import Collective, _with_peers
from orbit_pt._format import checksum as _checksum
from orbit_pt._format.direct_io import RangeWriter
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


@dataclass(frozen=True)
class _Chunk:
    rel: str
    offset: int
    size: int
    last: bool  # the file's last chunk


def _chunks(files: Mapping[str, Mapping[str, Any]]) -> list[_Chunk]:
    """The chunks of a stream, the same on both sides (empty files have none)."""
    out = []
    for rel in sorted(files):
        size = int(files[rel]["size"])
        for offset in range(0, size, CHUNK):
            n = min(CHUNK, size - offset)
            out.append(_Chunk(rel, offset, n, offset + n == size))
    return out


@dataclass
class _Sender:
    out: Outgoing
    chunks: list[_Chunk] = field(init=False)
    error: Exception | None = None

    def __post_init__(self) -> None:
        self.chunks = _chunks(self.out.files)

    def read(self, index: int) -> torch.Tensor:
        """The chunk's bytes. A file that cannot be read, or is short, is recorded as this
        stream's error and zeros are sent instead: the receiver must not wait forever."""
        chunk = self.chunks[index]
        data = b""
        try:
            with open(self.out.folder / chunk.rel, "rb") as f:
                f.seek(chunk.offset)
                data = f.read(chunk.size)
        except OSError as exc:
            if self.error is None:
                self.error = exc
        if len(data) != chunk.size and self.error is None:
            self.error = CorruptCheckpointError(
                f"{self.out.folder / chunk.rel} is shorter than its marker's "
                f"{self.out.files[chunk.rel]['size']} bytes"
            )
        return torch.frombuffer(bytearray(data.ljust(chunk.size, b"\0")), dtype=torch.uint8)


@dataclass
class _Receiver:
    inc: Incoming
    chunks: list[_Chunk] = field(init=False)
    error: Exception | None = None
    _writer: RangeWriter | None = None
    _checksum: Any = None

    def __post_init__(self) -> None:
        self.chunks = _chunks(self.inc.files)
        try:
            self.inc.folder.mkdir(parents=True, exist_ok=True)
            for rel, recorded in sorted(self.inc.files.items()):
                if int(recorded["size"]) == 0:
                    path = self.inc.folder / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(b"")
                    self._check(rel, _checksum.of_bytes(b""))
        except OSError as exc:  # kept: the stream is still received (and dropped)
            self.error = exc

    def take(self, index: int, data: torch.Tensor) -> None:
        """Write a received chunk. A failure (a full disk) is kept, not raised, and the rest of
        the stream is still received: the sender is never left waiting."""
        if self.error is not None:
            return
        try:
            self._write(index, data)
        except (OSError, AssertionError) as exc:
            self.error = exc

    def _write(self, index: int, data: torch.Tensor) -> None:
        chunk = self.chunks[index]
        if chunk.offset == 0:
            path = self.inc.folder / chunk.rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as f:
                f.truncate(int(self.inc.files[chunk.rel]["size"]))
            # O_DIRECT where the filesystem allows it, as a save writes: buffered writes of a
            # large shard stall on the page cache's dirty-page limit.
            self._writer = RangeWriter(path)
            self._checksum = _checksum.Checksum()
        writer = self._writer
        assert writer is not None
        writer.write(chunk.offset, [tensor_bytes(data)], self._checksum)
        if chunk.last:
            self._writer = None
            writer.close()  # fsyncs the file
            self._check(chunk.rel, self._checksum.value())

    def _check(self, rel: str, actual: str) -> None:
        recorded = self.inc.files[rel]["checksum"]
        algorithm = _checksum.algorithm_of(recorded)
        if algorithm != _checksum.ALGORITHM:
            actual = _checksum.of_file(self.inc.folder / rel, algorithm)
        if actual != recorded and self.error is None:
            # Recorded, not raised: the rest of the stream is still received, so that the
            # sender is never left waiting on a receive that will not come.
            self.error = CorruptCheckpointError(
                f"{rel} received from rank {self.inc.peer} has checksum {actual}, but the "
                f"sender's marker records {recorded}: the copy is corrupt and is not kept"
            )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


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
    group = collective.group
    assert group is not None, "exchange() needs a collective with a process group"
    senders = [_Sender(o) for o in outgoing]
    receivers = [_Receiver(i) for i in incoming]
    rounds = max([len(s.chunks) for s in senders] + [len(r.chunks) for r in receivers])
    pending: list[tuple[_Receiver, int, torch.Tensor]] = []
    try:
        with _with_peers(collective.timeout):
            for index in range(rounds):
                works = []
                arriving = []
                for sender in senders:
                    if index < len(sender.chunks):
                        data = sender.read(index)
                        if corrupt is not None:
                            corrupt(data)
                        peer = dist.get_global_rank(group, sender.out.peer)
                        works.append(dist.isend(data, peer, group, tag=sender.out.shard))
                for receiver in receivers:
                    if index < len(receiver.chunks):
                        buffer = torch.empty(receiver.chunks[index].size, dtype=torch.uint8)
                        peer = dist.get_global_rank(group, receiver.inc.peer)
                        works.append(dist.irecv(buffer, peer, group, tag=receiver.inc.shard))
                        arriving.append((receiver, index, buffer))
                for receiver, done, buffer in pending:  # to disk while this round travels
                    receiver.take(done, buffer)
                for work in works:
                    if work is not None:
                        work.wait()
                pending = arriving
            for receiver, done, buffer in pending:
                receiver.take(done, buffer)
    finally:
        for receiver in receivers:
            receiver.close()
    for error in [s.error for s in senders] + [r.error for r in receivers]:
        if error is not None:
            raise error
