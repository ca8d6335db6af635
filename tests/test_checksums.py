"""Checksums: recorded for every file at commit, and checked by restore(verify=True)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions, CorruptCheckpointError
from orbit_pt._format import checksum as _checksum


def _save(root: Path) -> CheckpointManager:
    mgr = CheckpointManager(root)
    model = torch.nn.Linear(32, 16)
    mgr.save(3, {"model": model, "extra": {"w": torch.arange(1000.0), "note": "x"}})
    return mgr


def test_every_file_has_the_checksum_of_its_bytes(tmp_path: Path) -> None:
    with _save(tmp_path) as mgr:
        meta = mgr.metadata(3)
        assert meta.files
        for rel, info in meta.files.items():
            assert info.checksum is not None, rel
            assert info.checksum == _checksum.of_file(mgr.step_dir(3) / rel)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_byte_anywhere_is_found_by_verify(tmp_path: Path, where: str) -> None:
    with _save(tmp_path) as mgr:
        for rel in mgr.metadata(3).files:
            path = mgr.step_dir(3) / rel
            data = bytearray(path.read_bytes())
            original = bytes(data)
            index = {"start": 0, "middle": len(data) // 2, "end": len(data) - 1}[where]
            data[index] ^= 0x01
            path.write_bytes(bytes(data))
            with pytest.raises(CorruptCheckpointError, match="step 3 is damaged") as info:
                mgr.restore(3, verify=True)
            assert str(path) in str(info.value)
            path.write_bytes(original)
        mgr.restore(3, verify=True)  # intact again


def test_verify_on_restore_option_and_subset(tmp_path: Path) -> None:
    _save(tmp_path).close()
    options = CheckpointManagerOptions(verify_on_restore=True)
    with CheckpointManager(tmp_path, options=options) as mgr:
        tensors = mgr.step_dir(3) / "extra" / "tensors.safetensors"
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError, match=r"tensors\.safetensors"):
            mgr.restore(3)
        # Only the items being restored are read in full.
        assert set(mgr.restore(3, ["model"])) == {"model"}
        # Explicitly turned off, the size check alone passes and the flipped byte is loaded.
        assert mgr.restore(3, ["extra"], verify=False)["extra"]["note"] == "x"


def test_truncated_or_deleted_file_is_found_even_without_verify(tmp_path: Path) -> None:
    with _save(tmp_path) as mgr:
        weights = mgr.step_dir(3) / "model" / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[:-4])
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            mgr.restore(3)
        weights.unlink()
        with pytest.raises(CorruptCheckpointError, match="missing"):
            mgr.restore(3)


def test_a_changed_metadata_value_makes_the_step_untrusted(tmp_path: Path) -> None:
    import json

    _save(tmp_path).close()
    meta_path = tmp_path / "step_00000003" / "_CHECKPOINT_METADATA"
    doc = json.loads(meta_path.read_text())
    assert doc["checksum"].startswith("xxh3-64:")
    doc["time"] += 1.0  # e.g. a hand edit, or a bit flip that still parses
    meta_path.write_text(json.dumps(doc))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == []


# ------------------------------------------------------------ files written in ranges (FSDP)


def test_crc32c_ranges_combine_into_the_whole_files_crc() -> None:
    """combine() is exact for any split, including empty and very long second parts."""
    import random

    import crc32c

    rng = random.Random(7)
    for _ in range(300):
        a = rng.randbytes(rng.randint(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, 7, 4096, rng.randint(0, 70_000)]))
        combined = _checksum.combine(_checksum.crc_of(a), _checksum.crc_of(b), len(b))
        assert combined == crc32c.crc32c(a + b)
    # A length past 2**32 exercises the high powers of x (no bytes needed: compare two splits).
    big = 5 << 32
    x = _checksum.combine(_checksum.combine(1, 2, big), 3, 10)
    y = _checksum.combine(1, _checksum.combine(2, 3, 10), big + 10)
    assert x == y


def test_segments_of_several_ranks_fold_into_the_files_checksum() -> None:
    """Interleaved ranges of three 'ranks', each summarized by its rank (bytes, position sums,
    the CRC of its bytes with zeros elsewhere), give the checksum verify computes."""
    import random

    from orbit_pt._format import coverage

    rng = random.Random(3)
    data = rng.randbytes(50_000)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    bounds = [0, *cuts, len(data)]
    writes: dict[int, list[coverage.Write]] = {0: [], 1: [], 2: []}
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        crc = _checksum.crc_of(data[start:end])
        writes[i % 3 if i % 5 else 0].append((start, end - start, crc))
    size = len(data)
    by_rank = {rank: coverage.summary(size, coverage.segments(w)) for rank, w in writes.items()}
    assert coverage.summary_problems(size, by_rank) == []
    assert coverage.fold_summaries(size, by_rank) == _checksum.format_crc(_checksum.crc_of(data))
    # Appending zeros to a CRC is what a rank does between its ranges.
    assert _checksum.extend_with_zeros(_checksum.crc_of(data), 77) == _checksum.crc_of(
        data + bytes(77)
    )
    # A rank whose writes overlap cannot vouch for its bytes: no checksum from the ranges.
    overlapping = {0: coverage.summary(size, coverage.segments([(0, size, None), (0, 10, 5)]))}
    assert coverage.summary_problems(size, overlapping) == []
    assert coverage.fold_summaries(size, overlapping) is None


def test_a_piecewise_file_is_checksummed_without_reading_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit takes a range-written file's checksum from its ranges' CRCs (of_file is not
    called for it), and verify, which reads the file, agrees."""
    from orbit_pt._format import coverage
    from orbit_pt._format.direct_io import RangeWriter
    from orbit_pt.handlers import HandlerContext

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes()

    class Ranges:
        """Writes its file as an FSDP rank would: create it, then ranges out of order."""

        name = "ranges"

        def save(self, directory: Path, item: object, context: HandlerContext) -> dict:
            path = directory / "blob.bin"
            with open(path, "xb") as f:
                f.truncate(len(data))
            cut = 1_000_003
            writer = RangeWriter(path)
            try:
                for start, end in [(cut, len(data)), (0, cut)]:
                    crc = _checksum.RangeChecksum()
                    writer.write(start, [memoryview(data)[start:end]], crc)
                    coverage.record(path, start, end - start, crc.crc)
            finally:
                writer.close()
            return {}

        def restore(self, directory: Path, target: object, context: HandlerContext) -> object:
            return (directory / "blob.bin").read_bytes()

    read_back: list[str] = []
    original = _checksum.of_file

    def spy(path: Path, algorithm: str = _checksum.ALGORITHM) -> str:
        read_back.append(Path(path).name)
        return original(path, algorithm)

    monkeypatch.setattr(_checksum, "of_file", spy)
    with CheckpointManager(tmp_path, handlers={"blob": Ranges()}) as mgr:
        mgr.save(1, {"blob": b"unused"})
        recorded = mgr.metadata(1).files["blob/blob.bin"].checksum
        assert "blob.bin" not in read_back
        assert recorded == _checksum.format_crc(_checksum.crc_of(data))
        assert mgr.restore(1, {"blob": None}, verify=True)["blob"] == data
    assert "blob.bin" in read_back  # verify read it, and its checksum matched


def test_boxes_written_in_runs_fold_into_the_files_checksum() -> None:
    """Two 'ranks' writing the column halves of one tensor run by run (each run's CRC folded
    over its box's span with zeros between), and rank 0 its header as one range: the ranks'
    summaries give the file's CRC and a cover with no hole; a range over a box is refused."""
    import random

    from orbit_pt._format import coverage

    rng = random.Random(5)
    header, rows, half = 40, 6, 1500  # a 6 x 3000-byte tensor after a 40-byte header
    data = rng.randbytes(header + rows * 2 * half)
    size = len(data)
    writes: dict[int, list[coverage.Write]] = {0: [(0, header, _checksum.crc_of(data[:header]))]}
    writes[1] = []
    for rank in (0, 1):
        starts = [header + r * 2 * half + rank * half for r in range(rows)]
        crc = _checksum.RangeChecksum()
        for k, at in enumerate(starts):
            if k:
                crc.skip(at - starts[k - 1] - half)
            crc.update(data[at : at + half])
        with coverage.recording() as table:
            coverage.record_runs(Path("f"), starts, half, crc.crc)
        writes[rank] += list(next(iter(table.values())))
    by_rank = {rank: coverage.summary(size, coverage.segments(w)) for rank, w in writes.items()}
    assert coverage.summary_problems(size, by_rank) == []
    assert coverage.fold_summaries(size, by_rank) == _checksum.format_crc(_checksum.crc_of(data))
    # A rank that also claims a byte of the other's box is caught by the position sums.
    doubled = {**by_rank, 1: coverage.summary(size, coverage.segments([*writes[1], (0, 1, 0)]))}
    assert coverage.summary_problems(size, doubled) != []
    with pytest.raises(ValueError, match="overlaps a box this rank wrote in runs"):
        coverage.segments([*writes[0], (header + 10, 5, 0)])
    # Skipping a long gap uses the arithmetic, a short one the instruction: the same CRC.
    for gap in (3, 1 << 21):
        skipped = _checksum.RangeChecksum()
        skipped.update(b"abc")
        skipped.skip(gap)
        assert skipped.crc == _checksum.crc_of(b"abc" + bytes(gap))
