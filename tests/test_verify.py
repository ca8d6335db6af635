"""orbit_pt.verify: every kind of damage to a committed step is found, and named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from orbit_pt import CheckpointManager, CorruptCheckpointError, StepNotFoundError
from orbit_pt.errors import CheckpointValueError
from orbit_pt.metadata import _self_checksum
from orbit_pt.verify import verify_step


def _save(root: Path, step: int = 7) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    items = {"model": model, "optimizer": optimizer, "extra": {"n": 3, "t": torch.arange(5)}}
    with CheckpointManager(root) as mgr:
        mgr.save(step, items, metrics={"loss": 0.5}, force=True)
        return mgr.step_dir(step)


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    return _save(tmp_path / "ckpt")


def _meta(step_dir: Path) -> dict:
    return json.loads((step_dir / "_CHECKPOINT_METADATA").read_bytes())  # type: ignore[no-any-return]


def _write_meta(step_dir: Path, doc: dict, *, resign: bool = True) -> None:
    """Write edited metadata; re-signed (its own checksum recomputed) unless ``resign=False``.

    Re-signing models a consistent forgery, so that the checks on the files themselves are
    what the test exercises; an unsigned edit is caught by the metadata's own checksum.
    """
    if resign:
        doc = {k: v for k, v in doc.items() if k != "checksum"}
        doc["checksum"] = _self_checksum(doc)
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(doc, indent=1, sort_keys=True))


def _kinds(step_dir: Path) -> dict[str, str]:
    report = verify_step(step_dir)
    return {p.path: p.kind for p in report.problems}


def test_a_fresh_step_is_whole_and_every_file_has_a_checksum(step_dir: Path) -> None:
    report = verify_step(step_dir.parent, 7)
    assert report.ok, report.summary()
    listed = _meta(step_dir)["files"]
    # The write path records a checksum for every file; verify recomputed every one.
    assert sorted(report.checksummed) == sorted(listed)
    assert report.unchecksummed == ()
    assert report.bytes_read == sum(f["size"] for f in listed.values())
    report.raise_for_problems()  # no-op
    assert "OK" in report.summary()
    assert report.to_json()["ok"] is True


def test_the_step_folder_or_the_root_and_step_give_the_same_report(step_dir: Path) -> None:
    assert verify_step(step_dir) == verify_step(step_dir.parent, 7)


@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_a_flipped_byte_in_any_file_is_a_checksum_problem(step_dir: Path, where: float) -> None:
    for rel in _meta(step_dir)["files"]:
        path = step_dir / rel
        data = bytearray(path.read_bytes())
        offset = min(int(len(data) * where), len(data) - 1)
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        problems = verify_step(step_dir).problems
        assert rel in {p.path for p in problems}, (rel, offset)
        assert "checksum" in {p.kind for p in problems if p.path == rel}
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
    assert verify_step(step_dir).ok


def test_a_flip_in_the_middle_of_tensor_data_is_found_even_though_the_header_is_fine(
    step_dir: Path,
) -> None:
    path = step_dir / "model" / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    middle = 8 + header_len + (len(data) - 8 - header_len) // 2
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify_step(step_dir)
    assert [(p.path, p.kind) for p in report.problems] == [("model/model.safetensors", "checksum")]
    with pytest.raises(CorruptCheckpointError, match=r"model/model\.safetensors.*checksum"):
        report.raise_for_problems()


def test_truncated_missing_and_unlisted_files(step_dir: Path) -> None:
    tensors = step_dir / "optimizer" / "optimizer.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-3])
    (step_dir / "extra" / "state.msgpack").unlink()
    (step_dir / "model" / "stray.bin").write_bytes(b"x")
    assert _kinds(step_dir) == {
        "optimizer/optimizer.safetensors": "size",
        "extra/state.msgpack": "missing",
        "model/stray.bin": "unlisted",
    }


def test_a_deleted_item_folder_lists_each_of_its_files(step_dir: Path) -> None:
    for path in (step_dir / "model").iterdir():
        path.unlink()
    (step_dir / "model").rmdir()
    kinds = _kinds(step_dir)
    assert kinds == {"model/model.safetensors": "missing"}


def test_metadata_problems(step_dir: Path) -> None:
    meta = step_dir / "_CHECKPOINT_METADATA"
    original = meta.read_bytes()
    meta.write_bytes(original[: len(original) // 2])
    assert _kinds(step_dir) == {"_CHECKPOINT_METADATA": "metadata"}
    meta.unlink()
    report = verify_step(step_dir)
    assert [p.kind for p in report.problems] == ["metadata"]
    assert "never committed" in report.problems[0].detail
    meta.write_bytes(original)
    renamed = step_dir.with_name("step_00000008")
    step_dir.rename(renamed)
    assert _kinds(renamed) == {"_CHECKPOINT_METADATA": "metadata"}


def test_a_flip_in_a_recorded_size_or_checksum_of_the_metadata_is_found(step_dir: Path) -> None:
    doc = _meta(step_dir)
    doc["files"]["model/model.safetensors"]["size"] += 1
    first, second = "extra/state.msgpack", "extra/tensors.safetensors"
    checksum = doc["files"][first]["checksum"]
    doc["files"][first]["checksum"] = checksum[:-1] + ("0" if checksum[-1] != "0" else "1")
    _write_meta(step_dir, doc)
    assert _kinds(step_dir) == {"model/model.safetensors": "size", first: "checksum"}
    assert second not in _kinds(step_dir)


def test_files_without_a_checksum_are_checked_structurally_and_reported(step_dir: Path) -> None:
    doc = _meta(step_dir)
    for info in doc["files"].values():
        info["checksum"] = None
    _write_meta(step_dir, doc)
    report = verify_step(step_dir)
    assert report.ok
    assert sorted(report.unchecksummed) == sorted(doc["files"])
    assert "no checksum" in report.summary()
    strict = verify_step(step_dir, require_checksums=True)
    assert {p.kind for p in strict.problems} == {"no-checksum"}
    # Structure is still checked: a malformed header is found without any checksum.
    path = step_dir / "model" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[9] = ord("!")  # inside the JSON header
    path.write_bytes(bytes(data))
    assert _kinds(step_dir) == {"model/model.safetensors": "unreadable"}


def test_an_unknown_checksum_algorithm_is_a_problem(step_dir: Path) -> None:
    doc = _meta(step_dir)
    doc["files"]["extra/state.msgpack"]["checksum"] = "sha999:00"
    _write_meta(step_dir, doc)
    assert _kinds(step_dir) == {"extra/state.msgpack": "checksum"}


def test_paths_outside_the_step_are_never_read(step_dir: Path) -> None:
    (step_dir.parent / "secret").write_bytes(b"s")
    doc = _meta(step_dir)
    doc["files"]["../secret"] = {"size": 1, "checksum": None}
    _write_meta(step_dir, doc)
    # Even correctly re-signed, metadata naming a path outside the step is refused whole.
    kinds = _kinds(step_dir)
    assert kinds == {"_CHECKPOINT_METADATA": "metadata"}


def test_garbage_msgpack_is_unreadable(step_dir: Path) -> None:
    doc = _meta(step_dir)
    path = step_dir / "extra" / "state.msgpack"
    path.write_bytes(b"\xc1" * path.stat().st_size)  # 0xc1 is never valid msgpack
    doc["files"]["extra/state.msgpack"]["checksum"] = None
    _write_meta(step_dir, doc)
    assert _kinds(step_dir) == {"extra/state.msgpack": "unreadable"}


def test_a_symlink_in_place_of_a_file_is_not_followed(step_dir: Path) -> None:
    target = step_dir / "model" / "model.safetensors"
    moved = step_dir.parent / "elsewhere.safetensors"
    target.rename(moved)
    target.symlink_to(moved)
    assert _kinds(step_dir) == {"model/model.safetensors": "not-a-file"}


def test_progress_is_called_with_every_byte(step_dir: Path) -> None:
    seen: list[int] = []
    report = verify_step(step_dir, progress=seen.append)
    assert sum(seen) == report.bytes_read > 0


def test_missing_steps_and_bad_arguments(tmp_path: Path, step_dir: Path) -> None:
    with pytest.raises(StepNotFoundError, match="step 8"):
        verify_step(step_dir.parent, 8)
    with pytest.raises(CheckpointValueError, match="not a step folder"):
        verify_step(tmp_path)
    with pytest.raises(CheckpointValueError, match="step must be"):
        verify_step(step_dir.parent, -1)
