"""Checksums: recorded for every file at commit, and checked by restore(verify=True)."""

from __future__ import annotations

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
