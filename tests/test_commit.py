"""The root folder: discovery of committed steps, the lock, rollback, and the manager's basics.

A folder is a step only when it has a canonical step name and readable metadata of that step;
everything else in the root is someone else's and is left alone, byte for byte.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointManagerOptions,
    ReadOnlyError,
    StepAlreadyExistsError,
    StepNotFoundError,
)
from orbit_pt.metadata import StepMetadata, _self_checksum

REPO = Path(__file__).resolve().parents[1]
READ_ONLY = CheckpointManagerOptions(read_only=True)


def state(step: int, tag: str = "") -> dict[str, Any]:
    """What step ``step`` of a run holds (``tag`` tells timelines apart after a rollback)."""
    return {"w": torch.full((3,), float(step)), "step": step, "tag": tag}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder (None) under ``root``, by relative path."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root))] = None
        for name in filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def save_steps(mgr: CheckpointManager, steps: list[int], tag: str = "") -> None:
    for step in steps:
        assert mgr.save(step, {"s": state(step, tag)}, metrics={"loss": 1.0 / (step + 1)})


def restored_state(mgr: CheckpointManager, step: int | None = None) -> dict[str, Any]:
    return mgr.restore(step)["s"]  # type: ignore[no-any-return]


def assert_state(got: dict[str, Any], step: int, tag: str = "") -> None:
    want = state(step, tag)
    assert got.keys() == want.keys()
    assert torch.equal(got["w"], want["w"])
    assert (got["step"], got["tag"]) == (step, tag)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


# -------------------------------------------------------------------------------- discovery


def test_empty_root(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == []
        assert mgr.latest_step() is None
        assert mgr.best_step() is None
        assert mgr.directory == root
    assert root.is_dir()


def test_steps_are_sorted_numerically_past_eight_digits(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [0, 7, 99_999_999, 123_456_789_012])
        assert mgr.all_steps() == [0, 7, 99_999_999, 123_456_789_012]
        assert mgr.step_dir(123_456_789_012).name == "step_123456789012"
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [0, 7, 99_999_999, 123_456_789_012]
        assert_state(restored_state(mgr, 123_456_789_012), 123_456_789_012)


def _copy_step(root: Path, step: int, name: str) -> Path:
    destination = root / name
    shutil.copytree(root / f"step_{step:08d}", destination)
    return destination


GARBAGE_METADATA: list[bytes] = [
    b"",
    b"\xff\xfe\x00garbage",
    b"{",
    b"[]",
    b"{}",
    b'{"format": "orbit_pt"}',
    b'{"format": "other", "format_version": 1, "step": 5, "time": 0, "items": {}}',
    b'{"format": "orbit_pt", "format_version": 99, "step": 5, "time": 0, "items": {}}',
    b'{"format": "orbit_pt", "format_version": 1, "step": "5", "time": 0, "items": {}}',
    b'{"format": "orbit_pt", "format_version": 1, "step": 5, "time": null, "items": {}}',
    b'{"format": "orbit_pt", "format_version": 1, "step": 5, "time": 0, "items": []}',
    b'{"format": "orbit_pt", "format_version": 1, "step": 5, "time": 0, "items": {"a": 1}}',
    b'{"format": "orbit_pt", "format_version": 1, "step": 5, "time": 0, "items": {}, '
    b'"files": {"a": {"size": "big"}}}',
    b"[" * 100_000,
]
# Checksummed, so that they get past the metadata's checksum of itself, but wrong inside.
SIGNED_GARBAGE: list[Callable[[dict[str, Any]], dict[str, Any]]] = [
    lambda doc: {**doc, "format": "other"},
    lambda doc: {**doc, "format_version": 99},
    lambda doc: {**doc, "step": str(doc["step"])},
    lambda doc: {**doc, "step": float(doc["step"])},
    lambda doc: {**doc, "time": None},
    lambda doc: {**doc, "items": []},
    lambda doc: {**doc, "items": {"a": 1}},
    lambda doc: {**doc, "files": {"a": {"size": "big"}}},
    lambda doc: {**doc, "metrics": {"loss": "low"}},
    lambda doc: {key: value for key, value in doc.items() if key != "items"},
]


def signed_garbage(step: int) -> list[bytes]:
    base = {"format": "orbit_pt", "format_version": 1, "step": step, "time": 0.0, "items": {}}
    # The unmodified base is accepted: so each variant is refused for its own flaw alone.
    assert StepMetadata.from_json(sign(base), path=Path("x")).step == step
    return [sign(variant(base)) for variant in SIGNED_GARBAGE]


def sign(doc: dict[str, Any]) -> bytes:
    return json.dumps({**doc, "checksum": _self_checksum(doc)}).encode()


def test_only_committed_steps_are_listed(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2])
    # A step folder without metadata (a step being written by hand, or a crashed copy).
    (root / "step_00000003" / "s").mkdir(parents=True)
    (root / "step_00000003" / "s" / "state.msgpack").write_bytes(b"\x80")
    # Unreadable metadata, in every way we can think of.
    unsigned, count = len(GARBAGE_METADATA), len(GARBAGE_METADATA) + len(SIGNED_GARBAGE)
    for i in range(count):
        step = 100 + i
        data = GARBAGE_METADATA[i] if i < unsigned else signed_garbage(step)[i - unsigned]
        (root / f"step_{step:08d}").mkdir()
        (root / f"step_{step:08d}" / "_CHECKPOINT_METADATA").write_bytes(data)
    # Metadata that is a folder, not a file.
    (root / "step_00000004" / "_CHECKPOINT_METADATA").mkdir(parents=True)
    # Metadata of another step: the folder was renamed by hand.
    _copy_step(root, 2, "step_00000005")
    # Non-canonical names of committed steps.
    for name in ("step_000000001", "step_1", "step_00000001.bak", "Step_00000001", "step_-0000001"):
        _copy_step(root, 1, name)
    # A file with a step name.
    (root / "step_00000006").write_bytes(b"not a folder")
    # A symlink to a committed step is not a step either.
    (root / "step_00000007").symlink_to(root / "step_00000001", target_is_directory=True)
    foreign = tree(root)

    with caplog.at_level(logging.WARNING, logger="orbit_pt"):
        for options in (READ_ONLY, None):
            with CheckpointManager(root, options=options) as mgr:
                assert mgr.all_steps() == [1, 2]
                assert mgr.latest_step() == 2
                with pytest.raises(StepNotFoundError):
                    mgr.restore(5)
    assert tree(root) == foreign
    # Each unreadable metadata file is logged with its folder, so a user can find it.
    logged = caplog.text
    for i in range(count):
        assert f"step_{100 + i:08d}" in logged
    assert "step_00000005" in logged


def test_foreign_files_are_left_alone_byte_for_byte(root: Path) -> None:
    root.mkdir()
    (root / "notes.txt").write_text("do not touch")
    (root / "events").mkdir()
    (root / "events" / "events.out.tfevents").write_bytes(os.urandom(1000))
    (root / "wandb.orbit-tmp").mkdir()  # our suffix, but not a step name
    (root / "wandb.orbit-tmp" / "x").write_bytes(b"x")
    (root / "step_x.orbit-deleting").mkdir()
    (root / "step_00000001.orbit-tmp.keep").write_bytes(b"y")
    (root / "step_00000099.orbit-tmp").write_bytes(b"a file, not a folder")
    (root / "superseded").mkdir()
    (root / "superseded" / "mine.txt").write_bytes(b"z")
    foreign = tree(root)

    options = CheckpointManagerOptions(keep_last_n=1)
    with CheckpointManager(root, options=options) as mgr:
        save_steps(mgr, [1, 2, 3])
        save_steps(mgr, [2], tag="rollback")  # supersedes step 3
        mgr.delete(2)
        save_steps(mgr, [4])
    after = tree(root)
    for path, content in foreign.items():
        assert after[path] == content, path


def test_leftovers_are_removed_by_a_writer_only(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2])
    tmp = _copy_step(root, 2, "step_00000003.orbit-tmp")
    deleting = _copy_step(root, 1, "step_00000001.orbit-deleting")
    half = root / "step_00000004.orbit-tmp"
    half.mkdir()
    (half / "partial").write_bytes(b"p" * 10)

    with CheckpointManager(root, options=READ_ONLY) as reader:
        assert reader.all_steps() == [1, 2]
        assert tmp.exists()
        assert deleting.exists()
        assert half.exists()
    with CheckpointManager(root) as writer:
        assert writer.all_steps() == [1, 2]
        assert sorted(p.name for p in root.iterdir()) == [
            ".orbit.lock",
            "step_00000001",
            "step_00000002",
        ]
        assert_state(restored_state(writer, 1), 1)


# -------------------------------------------------------------------------------------- lock


def test_second_writer_is_refused_and_close_releases_the_lock(root: Path) -> None:
    first = CheckpointManager(root)
    with pytest.raises(CheckpointLockedError, match=r"read_only=True") as info:
        CheckpointManager(root)
    assert isinstance(info.value, PermissionError)
    assert str(root) in str(info.value)
    first.close()
    first.close()  # twice is fine
    with CheckpointManager(root) as second:
        save_steps(second, [1])
    with CheckpointManager(root) as third:
        assert third.all_steps() == [1]


def test_context_manager_releases_the_lock_on_error(root: Path) -> None:
    def fail_inside(mgr: CheckpointManager) -> None:
        with mgr:
            save_steps(mgr, [1])
            raise RuntimeError("boom")

    mgr = CheckpointManager(root)
    with pytest.raises(RuntimeError, match="boom"):
        fail_inside(mgr)
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(2, {"s": state(2)})
    with CheckpointManager(root) as again:
        assert again.all_steps() == [1]


def test_read_only_manager_reads_beside_a_writer(root: Path) -> None:
    missing = root / "not-yet"
    with CheckpointManager(missing, options=READ_ONLY) as early:
        assert early.all_steps() == []
    assert not missing.exists()  # a reader creates nothing

    with CheckpointManager(root) as writer:
        reader = CheckpointManager(root, options=READ_ONLY)
        assert reader.all_steps() == []
        save_steps(writer, [1, 2])
        assert reader.all_steps() == [1, 2]  # no reload needed
        assert reader.latest_step() == 2
        assert_state(restored_state(reader), 2)
        writer.delete(1)
        assert reader.all_steps() == [2]
        reader.reload()
        assert reader.all_steps() == [2]
        with pytest.raises(ReadOnlyError, match="read-only"):
            reader.save(3, {"s": state(3)}, force=True)
        with pytest.raises(ReadOnlyError):
            reader.delete(2)
        assert isinstance(ReadOnlyError("x"), PermissionError)
        assert writer.all_steps() == [2]
        reader.close()


def test_read_only_manager_sees_a_step_replaced_by_a_rollback(root: Path) -> None:
    with CheckpointManager(root) as writer, CheckpointManager(root, options=READ_ONLY) as reader:
        save_steps(writer, [1, 2])
        assert reader.metadata(2).metrics == {"loss": 1.0 / 3}
        assert_state(restored_state(reader, 2), 2)
        writer.save(2, {"s": state(2, "second timeline")}, metrics={"loss": 0.5})
        assert reader.metadata(2).metrics == {"loss": 0.5}
        assert_state(restored_state(reader, 2), 2, "second timeline")


_HOLD_LOCK = """
import sys
from orbit_pt import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the parent closes our stdin (or kills us)
mgr.close()
"""


@pytest.mark.parametrize("how", ["close", "sigkill"])
def test_lock_holds_across_processes(root: Path, tmp_path: Path, how: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLD_LOCK), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline() == "locked\n"
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(root)
        with CheckpointManager(root, options=READ_ONLY) as reader:
            assert reader.all_steps() == []
        if how == "close":
            child.stdin.close()
            assert child.wait(timeout=60) == 0
        else:
            child.send_signal(signal.SIGKILL)  # the kernel drops the lock of a dead process
            assert child.wait(timeout=60) == -signal.SIGKILL
        with CheckpointManager(root) as writer:
            save_steps(writer, [1])
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------- rollback/overwrite


class FrozenDatetime(dt.datetime):
    """``datetime.now()`` that never moves, as on a platform with a coarse clock."""

    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> FrozenDatetime:
        return cls(2026, 1, 1, tzinfo=tz)


def test_rollback_moves_newer_steps_to_superseded(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2, 3, 4, 5])
        before = {s: tree(mgr.step_dir(s)) for s in (3, 4, 5)}
        with caplog.at_level(logging.WARNING, logger="orbit_pt"):
            save_steps(mgr, [3], tag="resumed")
        assert mgr.all_steps() == [1, 2, 3]
        assert mgr.latest_step() == 3
        assert_state(restored_state(mgr), 3, "resumed")
        assert_state(restored_state(mgr, 2), 2)
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert "[5, 4, 3]" in warning.getMessage()
    assert str(root) in warning.getMessage()
    assert "superseded" in warning.getMessage()
    moved = sorted((root / "superseded").iterdir())
    assert [p.name.split(".")[0] for p in moved] == [
        "step_00000003",
        "step_00000004",
        "step_00000005",
    ]
    for folder in moved:
        step = int(folder.name.split(".")[0].removeprefix("step_"))
        assert tree(folder) == before[step]  # intact, byte for byte
        assert json.loads((folder / "_CHECKPOINT_METADATA").read_bytes())["step"] == step
    # A new manager agrees: the abandoned timeline is gone for good.
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        assert_state(restored_state(mgr), 3, "resumed")


def test_overwriting_the_latest_step(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2])
        with caplog.at_level(logging.WARNING, logger="orbit_pt"):
            save_steps(mgr, [2], tag="again")
        assert mgr.all_steps() == [1, 2]
        assert_state(restored_state(mgr), 2, "again")
    assert "replaces committed step(s) [2]" in caplog.text
    assert len(list((root / "superseded").iterdir())) == 1


def test_rollback_to_before_every_step(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [5, 6])
        save_steps(mgr, [0], tag="restart")
        assert mgr.all_steps() == [0]
        assert_state(restored_state(mgr), 0, "restart")
    assert len(list((root / "superseded").iterdir())) == 2


def test_repeated_rollbacks_never_collide(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import orbit_pt._storage.store

    monkeypatch.setattr(orbit_pt._storage.store, "datetime", FrozenDatetime)
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2, 3])
        for round_ in range(4):
            save_steps(mgr, [2, 3], tag=f"round {round_}")
            assert mgr.all_steps() == [1, 2, 3]
            assert_state(restored_state(mgr), 3, f"round {round_}")
        assert not list(root.glob("*.orbit-tmp"))
    moved = list((root / "superseded").iterdir())
    # Each round's save of step 2 moves steps 2 and 3 of the timeline before it.
    assert len(moved) == len({p.name for p in moved}) == 8
    steps = sorted(json.loads((p / "_CHECKPOINT_METADATA").read_bytes())["step"] for p in moved)
    assert steps == [2] * 4 + [3] * 4


def test_saving_over_an_uncommitted_step_folder_is_refused(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2])
        stray = root / "step_00000003"
        (stray / "model").mkdir(parents=True)
        (stray / "model" / "weights.bin").write_bytes(b"precious")
        before = tree(root)
        with pytest.raises(StepAlreadyExistsError, match=r"step_00000003.*move it out") as info:
            mgr.save(3, {"s": state(3)})
        assert isinstance(info.value, FileExistsError)
        assert tree(root) == before
        assert mgr.all_steps() == [1, 2]
        # Rolling back over it is refused too, before anything is moved.
        with pytest.raises(StepAlreadyExistsError):
            mgr.save(3, {"s": state(3)})
        assert_state(restored_state(mgr), 2)


# ---------------------------------------------------------------- delete, reload, step_dir, ...


def test_delete(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2, 3])
        mgr.delete(2)
        assert mgr.all_steps() == [1, 3]
        assert not (root / "step_00000002").exists()
        mgr.delete(3)  # even the latest, when asked explicitly
        assert mgr.latest_step() == 1
        with pytest.raises(StepNotFoundError, match=r"step 3 .*committed steps: 1"):
            mgr.delete(3)
        assert sorted(p.name for p in root.iterdir()) == [".orbit.lock", "step_00000001"]
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1]


def test_reload_sees_changes_made_behind_the_managers_back(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [1, 2])
        shutil.rmtree(root / "step_00000002")
        mgr.reload()
        assert mgr.all_steps() == [1]
        _copy_step(root, 1, "step_00000009.orbit-tmp")
        mgr.reload()
        assert mgr.all_steps() == [1]


def test_step_dir(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        save_steps(mgr, [7])
        assert mgr.step_dir(7) == root / "step_00000007"
        assert (mgr.step_dir(7) / "s" / "tensors.safetensors").is_file()
        with pytest.raises(StepNotFoundError, match="committed steps: 7"):
            mgr.step_dir(8)


def test_metadata(root: Path) -> None:
    now = iter([1000.5, 2000.25])
    with CheckpointManager(root, clock=lambda: next(now)) as mgr:
        mgr.save(3, {"a": {"x": torch.ones(2)}, "b": [1, 2]}, metrics={"loss": 0.25, "acc": 1})
        mgr.save(4, {"a": {"x": torch.ones(2)}})
        meta = mgr.metadata(3)
        assert meta.step == 3
        assert meta.time == 1000.5
        assert meta.world_size == 1
        assert meta.metrics == {"loss": 0.25, "acc": 1.0}
        assert {name: item.handler for name, item in meta.items.items()} == {
            "a": "state",
            "b": "state",
        }
        step_dir = mgr.step_dir(3)
        on_disk = {
            str(p.relative_to(step_dir)): p.stat().st_size
            for p in step_dir.rglob("*")
            if p.is_file() and p.name != "_CHECKPOINT_METADATA"
        }
        assert {path: f.size for path, f in meta.files.items()} == on_disk
        assert "a/tensors.safetensors" in on_disk
        assert mgr.metadata().step == 4  # the latest
        assert mgr.metadata(4).metrics == {}
    with CheckpointManager(root) as mgr:
        assert mgr.metadata(3) == meta  # read back from disk


def test_restore_variants(root: Path) -> None:
    items: dict[str, Any] = {"a": {"x": torch.arange(3)}, "b": {"y": 2}, "c": [torch.ones(1)]}
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": {"x": torch.zeros(3)}, "b": {"y": 1}, "c": [torch.zeros(1)]})
        mgr.save(2, items)
        latest = mgr.restore()
        assert latest.keys() == {"a", "b", "c"}
        assert torch.equal(latest["a"]["x"], items["a"]["x"])
        assert mgr.restore(None, ["b"]) == {"b": {"y": 2}}
        assert mgr.restore(2, ("b", "a")).keys() == {"a", "b"}
        assert mgr.restore(1, {"b": None}) == {"b": {"y": 1}}
        target = {"x": torch.full((3,), -1)}
        out = mgr.restore(2, {"a": target, "b": None})
        assert out["a"] is target
        assert torch.equal(target["x"], items["a"]["x"])
        assert out["b"] == {"y": 2}


def test_save_respects_should_save(root: Path) -> None:
    options = CheckpointManagerOptions(save_interval_steps=10)
    with CheckpointManager(root, options=options) as mgr:
        assert mgr.save(5, {"s": state(5)}) is False
        assert mgr.save(10, {"s": state(10)}) is True
        assert mgr.save(5, {"s": state(5)}, force=True) is True  # a rollback, forced
        assert mgr.all_steps() == [5]
        assert "steps=[5]" in repr(mgr)
