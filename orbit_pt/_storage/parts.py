"""Which rank uploads which bytes of a file that several ranks wrote in ranges.

On an object store a file is one object, and a large object is one multipart upload whose parts
may come from different processes. So the ranks of an FSDP save that wrote the rows of one
safetensors file into their own local folders upload those rows themselves, as parts of one
upload: nobody gathers the file.

S3 wants every part but the last to be at least 5 MiB, and a rank's bytes in a file are not
always that long: a layer norm split over 8 ranks is a few KB per rank, between other tensors'
rows. :func:`plan_parts` cuts the file into parts so that every part is either *direct* (all its
bytes are one rank's: that rank reads them from its own file and sends them) or *mixed* (short
runs of several ranks, together at least 5 MiB and less than twice that: the rank holding most
of it sends it, after the others hand it their few bytes). Large runs make direct parts of up
to ``part_size``; mixed parts take only what is needed to reach the minimum, so the bytes that
change hands are bounded by the short runs, never a rank's shard.

A plan is computed once, by rank 0, from the byte ranges every rank reported writing, and sent
to every rank as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orbit_pt.errors import CheckpointError

MIN_PART_SIZE = 5 * 2**20  # S3's smallest part, except the last
PART_SIZE = 64 * 2**20
MAX_PARTS = 10_000  # S3's most parts per upload

Run = tuple[int, int, int]  # [start, end) written by a rank


@dataclass(frozen=True)
class Part:
    """One part of a multipart upload: the file's bytes ``[start, end)``.

    ``pieces`` are the runs it is made of, in order, each ``(start, end, rank)``; ``uploader``
    sends the part (the rank that holds most of it).
    """

    number: int
    start: int
    end: int
    uploader: int
    pieces: tuple[Run, ...]

    @property
    def mixed(self) -> bool:
        return any(rank != self.uploader for _, _, rank in self.pieces)

    def to_json(self) -> list:
        return [self.number, self.start, self.end, self.uploader, [list(p) for p in self.pieces]]

    @classmethod
    def from_json(cls, doc: Sequence) -> Part:
        number, start, end, uploader, pieces = doc
        return cls(number, start, end, uploader, tuple((s, e, r) for s, e, r in pieces))


def runs_of(by_rank: Mapping[int, Sequence[Sequence[int]]]) -> list[Run]:
    """Every rank's ``[start, end)`` intervals as one sorted list of runs, a rank's adjacent
    runs merged."""
    runs: list[Run] = []
    everything = sorted((iv[0], iv[1], rank) for rank, ivs in by_rank.items() for iv in ivs)
    for start, end, rank in everything:
        if runs and runs[-1][2] == rank and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, rank)
        else:
            runs.append((start, end, rank))
    return runs


def plan_parts(
    size: int,
    runs: Sequence[Run],
    *,
    min_part: int = MIN_PART_SIZE,
    part_size: int = PART_SIZE,
) -> list[Part]:
    """Cut ``[0, size)``, covered exactly by ``runs``, into upload parts (see the module)."""
    if size == 0:
        return []
    # S3 allows 10,000 parts: a file that would need more gets larger parts.
    part_size = max(part_size, min_part, -(-size // (MAX_PARTS // 2)))
    min_part = max(min_part, -(-size // (MAX_PARTS // 2)))
    parts: list[Part] = []
    pending: list[Run] = []  # short runs waiting to make up a mixed part
    pending_bytes = 0

    def emit(pieces: Sequence[Run]) -> None:
        held: dict[int, int] = {}
        for start, end, rank in pieces:
            held[rank] = held.get(rank, 0) + end - start
        uploader = min(held, key=lambda rank: (-held[rank], rank))
        number = len(parts) + 1
        parts.append(Part(number, pieces[0][0], pieces[-1][1], uploader, tuple(pieces)))

    position = 0
    for start, end, rank in runs:
        if start != position:
            raise CheckpointError(f"the ranks' ranges do not tile the file at byte {position}")
        while start < end:
            if pending:
                # Fill the mixed part up to the minimum, and no further.
                take = min(end - start, min_part - pending_bytes)
                pending.append((start, start + take, rank))
                pending_bytes += take
                start += take
                if pending_bytes >= min_part:
                    emit(pending)
                    pending, pending_bytes = [], 0
            elif end - start >= min_part:
                # A direct part; a tail shorter than the minimum stays with it.
                take = end - start if end - start < part_size + min_part else part_size
                emit([(start, start + take, rank)])
                start += take
            else:
                pending, pending_bytes = [(start, end, rank)], end - start
                start = end
        position = end
    if position != size:
        raise CheckpointError(f"the ranks' ranges end at byte {position}, the file at {size}")
    if pending:
        emit(pending)  # the last part may be short
    return parts
