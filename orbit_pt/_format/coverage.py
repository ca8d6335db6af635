"""Which bytes of each file every rank wrote, and the check that together they cover it once.

A file written piecewise (rank 0 creates it with its header and a hole for the data, then each
rank ``pwrite``\\ s its rows) reads back as zeros wherever no rank wrote -- with a checksum that
is computed over those zeros, so nothing downstream would ever notice. So every range write is
recorded while a step is written, the ranks' ranges travel to rank 0 with the rest of the write
phase's report, and rank 0 refuses to commit unless, for each such file, the ranges of all ranks
tile ``[0, size)`` with no hole and no byte written by two ranks (DCP validates its global plan
the same way).

Ranges of one rank may overlap each other (a single writer rewrites the header it created):
the rule is about ranks, which cannot see each other's writes.

Each range also carries the CRC-32C of its bytes, computed by the rank that wrote them, so
that rank 0 can :func:`fold` the ranges into the whole file's checksum without reading the file
back (see ``checksum.combine``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from orbit_pt._format import checksum as _checksum

Write = tuple[int, int, int | None]  # (offset, length, CRC-32C of the bytes or None)

_recording: contextvars.ContextVar[dict[str, list[Write]] | None] = contextvars.ContextVar(
    "orbit_pt_coverage", default=None
)

Intervals = list[list[int]]  # sorted, disjoint, non-adjacent [start, end) pairs (JSON-able)
Segments = list[list[Any]]  # sorted [start, end, crc or None] of one rank (JSON-able)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, list[Write]]]:
    """Collect ``path -> [(offset, length, crc), ...]`` of the range writes in this context."""
    table: dict[str, list[Write]] = {}
    token = _recording.set(table)
    try:
        yield table
    finally:
        _recording.reset(token)


def record(path: Path, offset: int, length: int, crc: int | None) -> None:
    """Note that ``length`` bytes were written at ``offset`` of ``path`` (when recording).

    ``crc`` is their CRC-32C, or None when the writer records the whole file's checksum itself.
    """
    table = _recording.get()
    if table is not None and length > 0:
        table.setdefault(str(Path(path).absolute()), []).append((offset, length, crc))


def segments(writes: Sequence[Write]) -> Segments:
    """One rank's writes as sorted ``[start, end, crc]`` segments, adjacent ones combined.

    Writes of this rank that overlap (a single writer rewriting the header it created) merge
    into one segment with no CRC (None): such a file's checksum comes from its writer's stream.
    """
    merged: Segments = []
    for offset, length, crc in sorted(writes, key=lambda w: (w[0], w[1])):
        end = offset + length
        last = merged[-1] if merged else None
        if last is not None and offset < last[1]:
            merged[-1] = [last[0], max(last[1], end), None]
        elif last is not None and offset == last[1] and last[2] is not None and crc is not None:
            merged[-1] = [last[0], end, _checksum.combine(last[2], crc, length)]
        else:
            merged.append([offset, end, crc])
    return merged


def fold(size: int, by_rank: Mapping[int, Segments]) -> str | None:
    """The whole file's checksum from every rank's segments, or None when they cannot give it.

    Call it after :func:`problems` found the segments tile ``[0, size)`` exactly.
    """
    crc = 0
    position = 0
    everything = (s for segs in by_rank.values() for s in segs)
    for start, end, part in sorted(everything, key=lambda s: (s[0], s[1])):
        if part is None or start != position:
            return None
        crc = _checksum.combine(crc, part, end - start) if position else part
        position = end
    return _checksum.format_crc(crc) if position == size else None


def intervals(ranges: Sequence[Sequence[int]]) -> Intervals:
    """Segments (or ``(offset, length)`` ranges) as merged ``[start, end)`` intervals."""
    merged: Intervals = []
    for start, end in sorted((r[0], r[1]) for r in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def problems(size: int, by_rank: Mapping[int, Intervals]) -> list[str]:
    """What is wrong with the ranks' intervals as a cover of ``[0, size)``; [] when exact."""
    found: list[str] = []
    marks = sorted((start, end, rank) for rank, ivs in by_rank.items() for start, end in ivs)
    position, last_rank = 0, None
    for start, end, rank in marks:
        if start > position:
            found.append(f"bytes {position}..{start} were written by no rank")
        elif start < position:
            found.append(
                f"bytes {start}..{min(end, position)} were written by rank {last_rank} and by "
                f"rank {rank}"
            )
        if end > position:
            position, last_rank = end, rank
    if position < size:
        found.append(f"bytes {position}..{size} were written by no rank")
    elif position > size:
        found.append(f"ranks wrote up to byte {position}, past the file's end at {size}")
    return found
