"""Which bytes of each file every rank wrote, and the check that together they cover it once.

A file written piecewise (rank 0 creates it with its header and a hole for the data, then each
rank ``pwrite``\\ s its rows) reads back as zeros wherever no rank wrote -- with a checksum that
is computed over those zeros, so nothing downstream would ever notice. So every range write is
recorded while a step is written, travels to rank 0 (summarized, below) with the rest of the
write phase's report, and rank 0 refuses to commit unless, for each such file, the ranges of all
ranks tile ``[0, size)`` with no hole and no byte written by two ranks (DCP validates its global
plan the same way).

Ranges of one rank may overlap each other (a single writer rewrites the header it created):
the rule is about ranks, which cannot see each other's writes.

Each range also carries the CRC-32C of its bytes, computed by the rank that wrote them. A rank
sends rank 0 not its ranges but their :func:`summary` per file (a few numbers), from which rank 0
checks the cover and gets the whole file's checksum without reading the file back.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from orbit_pt._format import checksum as _checksum

Write = tuple[int, int, int | None] | tuple[int, int, int, int, int, int]
"""``(offset, length, CRC-32C of the bytes or None)`` for a range; a box written run by run
(:func:`record_runs`) adds ``written, sum p, sum p^2``: its CRC then covers ``length`` bytes
with zeros between the runs, and only ``written`` of them are this rank's."""

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


def record_runs(path: Path, starts: Sequence[int], run: int, crc: int) -> None:
    """Note that ``run`` bytes were written at each of ``starts`` (ascending) of ``path``.

    ``crc`` is the CRC-32C of the bytes from the first start to the last run's end, with zeros
    between the runs (what :func:`summary` folds, as for any range).
    """
    table = _recording.get()
    if table is None or not starts or run <= 0:
        return
    first = second = 0
    for start in starts:
        s1, s2 = _position_sums(start, start + run)
        first, second = (first + s1) % _PRIME, (second + s2) % _PRIME
    span = starts[-1] + run - starts[0]
    record = (starts[0], span, crc, run * len(starts), first, second)
    table.setdefault(str(Path(path).absolute()), []).append(record)


def segments(writes: Sequence[Write]) -> Segments:
    """One rank's writes as sorted ``[start, end, crc]`` segments, adjacent ones combined.

    Writes of this rank that overlap (a single writer rewriting the header it created) merge
    into one segment with no CRC (None): such a file's checksum comes from its writer's stream.
    A box written in runs stays a segment of its own, ``[start, end, crc, written, sum p, sum
    p^2]``; nothing of this rank may overlap it.
    """
    merged: Segments = []
    for write in sorted(writes, key=lambda w: (w[0], w[1])):
        offset, length, crc = write[:3]
        end = offset + length
        last = merged[-1] if merged else None
        if len(write) > 3 or (last is not None and len(last) > 3):
            if last is not None and offset < last[1]:
                raise ValueError(
                    f"a write at bytes [{offset}, {end}) overlaps a box this rank wrote in runs "
                    f"ending at {last[1]}"
                )
            merged.append([offset, end, *write[2:]])
            continue
        if last is not None and offset < last[1]:
            merged[-1] = [last[0], max(last[1], end), None]
        elif last is not None and offset == last[1] and last[2] is not None and crc is not None:
            merged[-1] = [last[0], end, _checksum.combine(last[2], crc, length)]
        else:
            merged.append([offset, end, crc])
    return merged


# --- one rank's writes to a file, in a few numbers (what a rank sends rank 0 for each file)
#
# Sending every range costs ranks x tensors on rank 0 (2,169 ranges per rank for a 70B model:
# 66 MB at 1,024 ranks). So each rank sends, per file, the number of bytes it wrote, two sums
# of their positions (sum of p and of p squared, modulo a 61-bit prime), and the CRC-32C of
# the file as it would be with zeros wherever this rank did not write. Rank 0 then checks that
# the counts add up to the file's size and the sums to those of every position 0..size-1 --
# ranges that leave a hole or write a byte twice change them (a hole and an overlap of the same
# length would have to match both sums exactly) -- and, CRCs being affine, gets the file's CRC
# as the XOR of the ranks' CRCs (plus that of size zero bytes, for an even number of ranks).

_PRIME = (1 << 61) - 1


def _position_sums(start: int, end: int) -> tuple[int, int]:
    """(sum of p, sum of p squared) for p in [start, end), modulo the prime."""

    def upto(n: int) -> tuple[int, int]:  # over 0..n-1
        return n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6

    (a1, a2), (b1, b2) = upto(start), upto(end)
    return (b1 - a1) % _PRIME, (b2 - a2) % _PRIME


def summary(size: int, segments: Segments) -> list[Any]:
    """One rank's writes to a file of ``size`` bytes: ``[bytes, sum p, sum p^2, crc or None]``.

    The CRC is None when one of the segments has none (a writer that checksums the whole file
    itself, see :func:`segments`).
    """
    written = first = second = 0
    for segment in segments:
        start, end = segment[0], segment[1]
        if len(segment) > 3:  # a box written in runs: its own numbers
            count, s1, s2 = segment[3:]
        else:
            count, (s1, s2) = end - start, _position_sums(start, end)
        written, first, second = (
            written + count,
            (first + s1) % _PRIME,
            (second + s2) % _PRIME,
        )
    crc: int | None = 0
    position = 0
    for start, end, part, *_ in segments:
        if part is None or crc is None or start < position:
            crc = None
            break
        crc = _checksum.combine(
            _checksum.extend_with_zeros(crc, start - position), part, end - start
        )
        position = end
    if crc is not None:  # past the end: no CRC (summary_problems names the overrun)
        crc = _checksum.extend_with_zeros(crc, size - position) if position <= size else None
    return [written, first, second, crc]


def summary_problems(size: int, by_rank: Mapping[int, Sequence[Any]]) -> list[str]:
    """What is wrong with the ranks' :func:`summary` of a file as a cover of ``[0, size)``."""
    written = sum(int(s[0]) for s in by_rank.values())
    each = ", ".join(f"rank {rank}: {int(s[0])}" for rank, s in sorted(by_rank.items()))
    if written < size:
        return [
            f"some bytes were written by no rank ({written} bytes written in all, {each}; "
            f"the file has {size})"
        ]
    if written > size:
        return [
            f"some bytes were written by more than one rank ({written} bytes written in "
            f"all, {each}; the file has {size})"
        ]
    first = sum(int(s[1]) for s in by_rank.values()) % _PRIME
    second = sum(int(s[2]) for s in by_rank.values()) % _PRIME
    if (first, second) != _position_sums(0, size):
        return [f"some bytes were written by more than one rank and others by no rank ({each})"]
    return []


def fold_summaries(size: int, by_rank: Mapping[int, Sequence[Any]]) -> str | None:
    """The file's checksum from the ranks' :func:`summary` (after :func:`summary_problems`)."""
    crcs = [s[3] for s in by_rank.values()]
    if not crcs or any(c is None for c in crcs):
        return None
    crc = 0
    for part in crcs:
        crc ^= int(part)
    if len(crcs) % 2 == 0:  # crc(a ^ b) = crc(a) ^ crc(b) ^ crc(zeros) for equal lengths
        crc ^= _checksum.extend_with_zeros(0, size)
    return _checksum.format_crc(crc)


def intervals(ranges: Sequence[Sequence[int]]) -> Intervals:
    """Segments (or ``(offset, length)`` ranges) as merged ``[start, end)`` intervals."""
    merged: Intervals = []
    for start, end in sorted((r[0], r[1]) for r in ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
