"""The upload plan of a file several ranks wrote: every byte in exactly one part, parts S3
accepts, and only short runs changing hands."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_pt._storage.parts import MIN_PART_SIZE, Part, plan_parts, runs_of

MiB = 2**20


def _check(size: int, runs: list[tuple[int, int, int]], parts: list[Part], min_part: int) -> None:
    owner = {}
    for start, end, rank in runs:
        owner[(start, end)] = rank
    position = 0
    for i, part in enumerate(parts, 1):
        assert part.number == i
        assert part.start == position
        assert part.end > part.start
        assert part.pieces[0][0] == part.start
        assert part.pieces[-1][1] == part.end
        for (s, e, r), nxt in zip(part.pieces, [*part.pieces[1:], None], strict=True):
            assert s < e
            assert any(a <= s and e <= b and rank == r for (a, b), rank in owner.items())
            if nxt is not None:
                assert nxt[0] == e
        if i < len(parts):
            assert part.end - part.start >= min_part, part
        if part.mixed:
            assert part.end - part.start < 2 * min_part, part
            held = sum(e - s for s, e, r in part.pieces if r == part.uploader)
            assert all(
                held >= sum(e - s for s, e, r in part.pieces if r == rank)
                for rank in {r for _, _, r in part.pieces}
            )
        position = part.end
    assert position == size


def test_large_runs_become_direct_parts_and_short_ones_are_coalesced() -> None:
    header = (0, 1000, 0)
    runs = [header, (1000, 40 * MiB, 0), (40 * MiB, 80 * MiB, 1)]
    runs += [(80 * MiB + i * 4096, 80 * MiB + (i + 1) * 4096, i % 2) for i in range(3000)]
    size = runs[-1][1]
    merged = runs_of({r: [x[:2] for x in runs if x[2] == r] for r in (0, 1)})
    parts = plan_parts(size, merged)
    _check(size, merged, parts, MIN_PART_SIZE)
    direct = [p for p in parts if not p.mixed]
    assert [p.uploader for p in direct[:2]] == [0, 1]
    moved = sum(e - s for p in parts for s, e, r in p.pieces if r != p.uploader)
    assert moved <= 3000 * 4096  # only the short runs change hands


def test_a_file_smaller_than_one_part_is_one_part_sent_by_its_main_writer() -> None:
    runs = [(0, 100, 0), (100, 900, 1), (900, 1000, 0)]
    parts = plan_parts(1000, runs)
    assert len(parts) == 1
    assert parts[0].uploader == 1
    assert parts[0].mixed


def test_the_plan_survives_json() -> None:
    runs = [(0, 10, 0), (10, 12 * MiB, 1)]
    parts = plan_parts(12 * MiB, runs)
    assert [Part.from_json(p.to_json()) for p in parts] == parts


def test_gaps_are_refused() -> None:
    with pytest.raises(Exception, match="do not tile"):
        plan_parts(100, [(0, 10, 0), (20, 100, 1)])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_between_ranks_gives_valid_parts(data: st.DataObject) -> None:
    min_part = data.draw(st.sampled_from([8, 64, 1000]))
    ranks = data.draw(st.integers(1, 5))
    lengths = data.draw(st.lists(st.integers(1, 5 * min_part), min_size=1, max_size=60))
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    runs, position = [], 0
    for length in lengths:
        runs.append((position, position + length, rng.randrange(ranks)))
        position += length
    merged = runs_of({r: [x[:2] for x in runs if x[2] == r] for r in range(ranks)})
    parts = plan_parts(position, merged, min_part=min_part, part_size=3 * min_part)
    _check(position, merged, parts, min_part)
