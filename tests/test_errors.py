"""Every bad input gets a clear error: an ``orbit_pt`` class that is also the matching builtin,
with a message that names the step, path or item and says what to do.

A failed save commits nothing, leaves no temporary folder, and loses nothing committed before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import orbit_pt
from orbit_pt import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    ReadOnlyError,
    StateMismatchError,
    StepAlreadyExistsError,
    StepNotDurableError,
    StepNotFoundError,
)
from orbit_pt.handlers import HandlerContext
from orbit_pt.metadata import ItemMetadata

BUILTIN_OF: dict[type[CheckpointError], type[Exception]] = {
    CheckpointValueError: ValueError,
    CheckpointTypeError: TypeError,
    StepNotFoundError: FileNotFoundError,
    StepAlreadyExistsError: FileExistsError,
    CheckpointLockedError: PermissionError,
    ReadOnlyError: PermissionError,
    CorruptCheckpointError: ValueError,
    ItemNotFoundError: KeyError,
    StateMismatchError: ValueError,
    CheckpointSaveError: RuntimeError,
    StepNotDurableError: RuntimeError,  # a CheckpointSaveError whose step *is* committed
}


def good_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.arange(3) * step, "n": step}


def assert_good(restored: Mapping[str, Any], step: int) -> None:
    want = good_state(step)
    assert torch.equal(restored["w"], want["w"])
    assert torch.equal(restored["b"], want["b"])
    assert restored["n"] == step


@pytest.fixture
def mgr(tmp_path: Path) -> Any:
    with CheckpointManager(tmp_path / "root") as manager:
        manager.save(1, {"s": good_state(1)}, metrics={"loss": 0.5})
        manager.save(2, {"s": good_state(2)}, metrics={"loss": 0.25})
        yield manager


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith((".orbit-tmp", "-deleting")))


# ------------------------------------------------------------------------------ the hierarchy


def test_every_public_error_is_covered_here() -> None:
    public = {getattr(orbit_pt, n) for n in orbit_pt.__all__ if n.endswith("Error")}
    assert public - {CheckpointError} == set(BUILTIN_OF)


@pytest.mark.parametrize("cls", list(BUILTIN_OF))
def test_errors_derive_from_the_root_and_the_matching_builtin(cls: type[CheckpointError]) -> None:
    assert issubclass(cls, CheckpointError)
    assert issubclass(cls, BUILTIN_OF[cls])
    assert issubclass(CheckpointError, Exception)


def sample_errors(tmp_path: Path) -> list[CheckpointError]:
    return [
        CheckpointError("plain"),
        CheckpointValueError("bad value"),
        CheckpointTypeError("bad type"),
        StepNotFoundError(7, tmp_path, [1, 2, 3]),
        StepNotFoundError(None, tmp_path, []),
        StepAlreadyExistsError(f"{tmp_path}/step_00000007 exists"),
        CheckpointLockedError("locked"),
        ReadOnlyError("read-only"),
        CorruptCheckpointError("corrupt"),
        ItemNotFoundError("no item 'model'"),
        StateMismatchError("mismatch"),
        CheckpointSaveError(7, tmp_path / "step_00000007.orbit-tmp", "OSError: disk full"),
        CheckpointSaveError(8, str(tmp_path)),
        CheckpointSaveError(9, tmp_path, "OSError: EIO", superseded=[10, 9], committed=[1, 2]),
        StepNotDurableError(9, tmp_path / "step_00000009", "OSError: EIO", committed=[9]),
    ]


def test_errors_survive_pickling(tmp_path: Path) -> None:
    for error in sample_errors(tmp_path):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert copy.args == error.args
        assert vars(copy) == vars(error)


def test_raised_errors_survive_pickling(mgr: CheckpointManager) -> None:
    raised: list[BaseException] = []
    for action in (
        lambda: mgr.restore(99),
        lambda: mgr.restore(1, ["nope"]),
        lambda: mgr.save(3, {"s": {"f": lambda: 0}}),
        lambda: mgr.save(-1, {"s": {}}),
        lambda: CheckpointManager(mgr.directory),
    ):
        with pytest.raises(CheckpointError) as info:
            action()
        raised.append(info.value)
    for error in raised:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)


def test_step_not_found_message(tmp_path: Path) -> None:
    error = StepNotFoundError(7, tmp_path, list(range(0, 2000, 100)))
    assert (error.step, error.root, error.available[:2]) == (7, str(tmp_path), [0, 100])
    message = str(error)
    assert "step 7" in message
    assert str(tmp_path) in message
    assert "0, 100, 200, 300, 400, ..., 1500, 1600, 1700, 1800, 1900" in message
    assert "None for the latest" in message


# ------------------------------------------------------------------------------------- steps


BAD_STEPS: list[tuple[object, type[CheckpointError], str]] = [
    (-1, CheckpointValueError, r"step must be >= 0, got -1"),
    (-(2**70), CheckpointValueError, r"got -1180591620717411303424"),
    (True, CheckpointTypeError, r"step must be an int, got True \(bool\); pass int\(step\)"),
    (1.0, CheckpointTypeError, r"got 1.0 \(float\); pass int\(step\)"),
    ("100", CheckpointTypeError, r"got '100' \(str\); pass int\(step\)"),
    (torch.tensor(3), CheckpointTypeError, r"\(Tensor\); pass int\(step\)"),
]
STEP_CALLS: dict[str, Callable[[CheckpointManager, Any], object]] = {
    "save": lambda m, s: m.save(s, {"s": good_state(3)}, force=True),
    "restore": lambda m, s: m.restore(s),
    "delete": lambda m, s: m.delete(s),
    "step_dir": lambda m, s: m.step_dir(s),
    "metadata": lambda m, s: m.metadata(s),
    "should_save": lambda m, s: m.should_save(s),
    "reached_preemption": lambda m, s: m.reached_preemption(s),
}


@pytest.mark.parametrize(("step", "cls", "message"), BAD_STEPS)
@pytest.mark.parametrize("call", list(STEP_CALLS))
def test_bad_steps_are_refused_everywhere(
    mgr: CheckpointManager, step: object, cls: type[CheckpointError], message: str, call: str
) -> None:
    with pytest.raises(cls, match=message) as info:
        STEP_CALLS[call](mgr, step)
    assert isinstance(info.value, BUILTIN_OF[cls])
    assert mgr.all_steps() == [1, 2]
    assert leftovers(mgr.directory) == []


@pytest.mark.parametrize("call", ["restore", "delete", "step_dir", "metadata"])
def test_unknown_step_lists_the_committed_ones(mgr: CheckpointManager, call: str) -> None:
    with pytest.raises(StepNotFoundError) as info:
        STEP_CALLS[call](mgr, 5)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert "step 5 is not a committed checkpoint" in message
    assert str(mgr.directory) in message
    assert "committed steps: 1, 2" in message
    assert info.value.available == [1, 2]


def test_restore_with_no_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        for action in (mgr.restore, mgr.metadata):
            with pytest.raises(StepNotFoundError, match="no committed checkpoint under") as info:
                action()
            assert str(tmp_path / "root") in str(info.value)
            assert "latest_step() is None" in str(info.value)


# ------------------------------------------------------------------------------------- items


BAD_NAMES = [
    "",
    ".",
    "..",
    "a/b",
    "../x",
    "a\\b",
    ".hidden",
    "_x",
    "_CHECKPOINT_METADATA",
    " x",
    "a\0",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_item_names_are_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointValueError, match="item name") as info:
            mgr.save(1, {name: {"x": 1}})
        assert repr(name) in str(info.value)
        assert "e.g. 'model'" in str(info.value) or "non-empty" in str(info.value)
        assert mgr.all_steps() == []
    assert sorted(p.name for p in root.iterdir()) == [".orbit.lock"]
    with pytest.raises(CheckpointValueError, match="item name"):
        CheckpointManager(root, handlers={name: orbit_pt.handlers.StateHandler()})


def test_non_string_item_name_is_refused(mgr: CheckpointManager) -> None:
    with pytest.raises(CheckpointValueError, match="item names must be non-empty strings, got 3"):
        mgr.save(3, {3: {"x": 1}})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("items", "cls", "message"),
    [
        ([("s", {})], CheckpointTypeError, r"items must be a mapping .* got list; e\.g\."),
        ("s", CheckpointTypeError, r"items must be a mapping .* got str"),
        (None, CheckpointTypeError, r"items must be a mapping .* got NoneType"),
        ({}, CheckpointValueError, r"items is empty; give at least one item"),
    ],
)
def test_items_must_be_a_non_empty_mapping(
    mgr: CheckpointManager, items: Any, cls: type[CheckpointError], message: str
) -> None:
    with pytest.raises(cls, match=message):
        mgr.save(3, items)
    assert mgr.all_steps() == [1, 2]


def test_missing_items_at_restore_name_what_the_step_holds(mgr: CheckpointManager) -> None:
    for items in (["model"], {"model": None, "s": None}, ("s", "optimizer")):
        with pytest.raises(ItemNotFoundError) as info:
            mgr.restore(2, items)
        message = str(info.value)
        assert isinstance(info.value, KeyError)
        assert "step 2" in message
        assert str(mgr.directory) in message
        assert "it holds ['s']" in message
        assert not message.startswith(("'", '"'))  # readable, not KeyError's quoting


def test_restore_items_of_the_wrong_type(mgr: CheckpointManager) -> None:
    with pytest.raises(CheckpointTypeError, match="sequence of item names, got str"):
        mgr.restore(2, "s")


def test_bad_handler_configuration(tmp_path: Path) -> None:
    with pytest.raises(CheckpointTypeError, match=r"handlers\['s'\] must implement the Handler"):
        CheckpointManager(tmp_path / "root", handlers={"s": object()})  # type: ignore[dict-item]
    with pytest.raises(CheckpointTypeError, match="options must be a CheckpointManagerOptions"):
        CheckpointManager(tmp_path / "root", options={"keep_last_n": 1})  # type: ignore[arg-type]


class OtherHandler:
    """A handler with a different name than the built-in state handler."""

    name = "other"

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        (directory / "blob").write_bytes(b"x")
        return {}

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        return (directory / "blob").read_bytes()


def test_restore_with_a_different_handler_than_the_one_that_saved(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"s": {"x": 1}})
    with (
        CheckpointManager(root, handlers={"s": OtherHandler()}) as mgr,
        pytest.raises(CheckpointValueError, match=r"saved by handler 'state'.*handlers\['s'\]"),
    ):
        mgr.restore(1)
    with CheckpointManager(root, handlers={"o": OtherHandler()}) as mgr:
        mgr.save(2, {"o": {"x": 1}})
    with (
        CheckpointManager(root) as mgr,
        pytest.raises(CheckpointValueError, match=r"item 'o' of step 2 .*'other'.*not built in"),
    ):
        mgr.restore(2)


def test_metadata_never_makes_orbit_pt_import_a_handler(mgr: CheckpointManager) -> None:
    # A well-formed, correctly checksummed metadata file that names a handler we do not have.
    meta = mgr.metadata(2)
    forged = dataclasses.replace(meta, items={"s": ItemMetadata(handler="os.system")})
    (mgr.step_dir(2) / "_CHECKPOINT_METADATA").write_bytes(forged.to_json())
    read_only = CheckpointManagerOptions(read_only=True)
    with (
        CheckpointManager(mgr.directory, options=read_only) as reader,
        pytest.raises(CheckpointValueError, match=r"'os\.system', which is not built in"),
    ):
        reader.restore(2)


# ----------------------------------------------------------------------------- corrupt steps


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 7)


def _garble(path: Path) -> None:
    size = path.stat().st_size
    path.write_bytes(b"\xc1" * size)  # 0xc1 is never valid msgpack, and no JSON header length


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"#!%@"  # the JSON header is no longer JSON
    path.write_bytes(bytes(data))


def _huge_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("file", "damage", "says"),
    [
        ("tensors.safetensors", _truncate, "bytes, the metadata recorded"),
        ("tensors.safetensors", Path.unlink, "is missing"),
        ("tensors.safetensors", _garble_header, "not a valid safetensors file"),
        ("tensors.safetensors", _huge_header, "not a valid safetensors file"),
        ("tensors.safetensors", _garble, "not a valid safetensors file"),
        ("state.msgpack", _truncate, "bytes, the metadata recorded"),
        ("state.msgpack", _garble, "not valid msgpack"),
        ("state.msgpack", Path.unlink, "is missing"),
    ],
)
def test_damaged_files_are_reported_with_their_path(
    mgr: CheckpointManager, file: str, damage: Callable[[Path], object], says: str
) -> None:
    path = mgr.step_dir(2) / "s" / file
    damage(path)
    for target in (None, {"s": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.int64)}}):
        with pytest.raises(CorruptCheckpointError, match=says) as info:
            mgr.restore(2, target)
        assert isinstance(info.value, ValueError)
        assert str(path) in str(info.value)
        assert "restore another step" in str(info.value)
    assert_good(mgr.restore(1)["s"], 1)  # the other step is fine


def test_damage_that_keeps_the_size_is_caught_by_the_readers(mgr: CheckpointManager) -> None:
    # Same size, so the size check passes; the safetensors header no longer fits the data.
    path = mgr.step_dir(2) / "s" / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header["w"]["shape"] = [4, 4]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_len
    data[8 : 8 + header_len] = text + b" " * (header_len - len(text))
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"entry 'w' has offsets"):
        mgr.restore(2)


def test_unreadable_metadata_hides_the_step(mgr: CheckpointManager) -> None:
    (mgr.step_dir(2) / "_CHECKPOINT_METADATA").write_bytes(b'{"format": "orbit_pt", "step"')
    with CheckpointManager(mgr.directory, options=CheckpointManagerOptions(read_only=True)) as r:
        assert r.all_steps() == [1]
        assert r.latest_step() == 1
        assert_good(r.restore()["s"], 1)
        with pytest.raises(StepNotFoundError, match="committed steps: 1"):
            r.restore(2)


# ----------------------------------------------------------------------------- failed saves


class Exploding:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class HalfWriter:
    """A handler that writes some files and then fails, like a full disk would."""

    name = "half"

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        (directory / "part-1").write_bytes(os.urandom(1000))
        raise OSError(28, "No space left on device")

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        raise AssertionError("never committed")


@pytest.mark.parametrize(
    ("items", "cause", "says"),
    [
        ({"s": good_state(3), "obj": Exploding()}, RuntimeError, "state_dict exploded"),
        ({"s": {"ok": 1, "f": lambda: 1}}, CheckpointTypeError, "the value at f is a"),
        ({"s": {"nested": [{1, 2}]}}, CheckpointTypeError, "the value at nested/0 is a"),
        ({"s": good_state(3), "half": {"x": 1}}, OSError, "No space left on device"),
    ],
)
@pytest.mark.parametrize("step", [3, 2, 1])  # a new step, an overwrite, a rollback
def test_failed_save_commits_nothing_and_loses_nothing(
    tmp_path: Path, items: dict[str, Any], cause: type[Exception], says: str, step: int
) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root, handlers={"half": HalfWriter()}) as mgr:
        mgr.save(1, {"s": good_state(1)})
        mgr.save(2, {"s": good_state(2)})
        before = {s: mgr.metadata(s) for s in (1, 2)}
        with pytest.raises(CheckpointSaveError, match=says) as info:
            mgr.save(step, items)
        error = info.value
        assert isinstance(error.__cause__, cause)
        assert error.step == step
        assert f"saving step {step}" in str(error)
        assert "nothing of step" in str(error)
        assert leftovers(root) == []
        assert not (root / "superseded").exists()
        assert mgr.all_steps() == [1, 2]
        for s in (1, 2):
            assert mgr.metadata(s) == before[s]
            assert_good(mgr.restore(s)["s"], s)
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert_good(mgr.restore()["s"], 2)


@pytest.mark.parametrize(
    ("metrics", "cls", "says"),
    [
        ({"loss": float("nan")}, CheckpointValueError, r"metric 'loss' at step 3 is nan"),
        ({"loss": "low"}, CheckpointTypeError, r"metric 'loss' at step 3 must be a number"),
        ({"": 1.0}, CheckpointValueError, r"metric names must be non-empty strings"),
        ([("loss", 1.0)], CheckpointTypeError, r"metrics for step 3 must be a mapping"),
    ],
)
def test_bad_metrics_are_refused_before_anything_is_written(
    mgr: CheckpointManager, metrics: Any, cls: type[CheckpointError], says: str
) -> None:
    with pytest.raises(cls, match=says):
        mgr.save(3, {"s": good_state(3)}, metrics=metrics)
    assert mgr.all_steps() == [1, 2]
    assert leftovers(mgr.directory) == []


def test_closed_manager_says_so(mgr: CheckpointManager) -> None:
    mgr.close()
    for action in (lambda: mgr.save(3, {"s": {}}), lambda: mgr.restore(1)):
        with pytest.raises(CheckpointError, match=r"is closed; open a new one") as info:
            action()
        assert str(mgr.directory) in str(info.value)
