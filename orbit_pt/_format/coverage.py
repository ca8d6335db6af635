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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

_recording: contextvars.ContextVar[dict[str, list[tuple[int, int]]] | None] = (
    contextvars.ContextVar("orbit_pt_coverage", default=None)
)

Intervals = list[list[int]]  # sorted, disjoint, non-adjacent [start, end) pairs (JSON-able)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, list[tuple[int, int]]]]:
    """Collect ``path -> [(offset, length), ...]`` of the range writes made in this context."""
    table: dict[str, list[tuple[int, int]]] = {}
    token = _recording.set(table)
    try:
        yield table
    finally:
        _recording.reset(token)


def record(path: Path, offset: int, length: int) -> None:
    """Note that ``length`` bytes were written at ``offset`` of ``path`` (when recording)."""
    table = _recording.get()
    if table is not None and length > 0:
        table.setdefault(str(Path(path).absolute()), []).append((offset, length))


def intervals(ranges: Sequence[tuple[int, int]]) -> Intervals:
    """One rank's ranges as merged ``[start, end)`` intervals (small enough to send to rank 0)."""
    merged: Intervals = []
    for offset, length in sorted(ranges):
        end = offset + length
        if merged and offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([offset, end])
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
