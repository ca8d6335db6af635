"""One view of the root: every reader agrees on which entries are committed steps.

The manager, ``orbit-pt ls``/``verify``/``export`` and ``verify_step`` all ask
``orbit_pt._storage.root``; a root holding every kind of entry must look the same to each. Then
``CheckpointManager.apply_retention`` and the retention record that ``orbit-pt ls`` reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import (
    CheckpointManager,
    CheckpointManagerOptions,
    ReadOnlyError,
    StepAlreadyExistsError,
)
from orbit_pt._storage import root as _root
from orbit_pt._storage.store import StepStore
from orbit_pt.cli import main
from orbit_pt.policies import CheckpointInfo, KeepBestN, KeepLastN, KeepSteps
from orbit_pt.retention import RetentionDecision, decide, read_record
from orbit_pt.verify import verify_step

READ_ONLY = CheckpointManagerOptions(read_only=True)
RECORD = ".orbit-retention.json"


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 60.0
        return self.now


def _items(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": torch.nn.Linear(4, 2), "extra": {"step": step}}


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, Any]:
    code = main([str(a) for a in (*argv, "--json")])
    out = capsys.readouterr().out
    return code, json.loads(out)


# ---------------------------------------------------------------------- every kind of entry

COMMITTED = [1, 2, 3]
# Step-named entries that are not steps, by step: what each one is.
NOT_STEPS = {
    10: "no-metadata",
    11: "bad-metadata",
    12: "other-step",
    13: "link",
    14: "not-a-folder",
}


@pytest.fixture
def zoo(tmp_path: Path) -> Path:
    """A root with committed steps 1, 2, 3 and one of every other kind of entry."""
    root = tmp_path / "zoo"
    with CheckpointManager(root, clock=_Clock()) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _items(step), force=True)
        mgr.save(3, _items(3), force=True)  # a rollback: old 3 and 4 move to superseded/
    (root / "step_00000004.orbit-tmp" / "model").mkdir(parents=True)
    (root / "step_00000005.orbit-deleting").mkdir()
    (root / "step_00000010" / "model").mkdir(parents=True)
    shutil.copytree(root / "step_00000002", root / "step_00000011")
    (root / "step_00000011" / "_CHECKPOINT_METADATA").write_text('{"format": "orbit_pt"}')
    shutil.copytree(root / "step_00000002", root / "step_00000012")
    (root / "step_00000013").symlink_to(root / "step_00000002", target_is_directory=True)
    (root / "step_00000014").write_bytes(b"a file with a step name")
    (root / "notes.txt").write_text("mine")
    (root / "step_7").mkdir()  # not the canonical name of step 7
    (root / "eval" / "step_00000001").mkdir(parents=True)
    return root


def test_the_root_api_classifies_every_entry(zoo: Path) -> None:
    by_name = {e.name: e for e in _root.scan_root(zoo)}
    assert [e.step for e in by_name.values() if e.committed] == COMMITTED
    assert by_name["step_00000004.orbit-tmp"].kind == "temporary"
    assert by_name["step_00000005.orbit-deleting"].kind == "deleting"
    superseded = sorted(e.step or 0 for e in by_name.values() if e.kind == "superseded")
    assert superseded == [3, 4]
    for step, defect in NOT_STEPS.items():
        entry = by_name[f"step_{step:08d}"]
        assert (entry.kind, entry.step, entry.defect) == ("foreign", step, defect)
        assert entry.reason
    for name in ("notes.txt", "step_7", "eval"):
        assert (by_name[name].kind, by_name[name].step) == ("foreign", None)
    assert ".orbit.lock" not in by_name  # the root's own file is no entry
    assert _root.committed_steps(zoo) == COMMITTED
    assert _root.step_entry(zoo, 99) is None
    assert "symbolic link" in by_name["step_00000013"].reason


def test_every_reader_agrees_on_which_steps_exist(
    zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointManager(zoo, options=READ_ONLY) as reader:
        assert reader.all_steps() == COMMITTED

    code, doc = _run(capsys, "ls", zoo)
    assert code == 0
    assert [e["step"] for e in doc["entries"] if e["status"] == "committed"] == COMMITTED
    invalid = {e["step"]: e["note"] for e in doc["entries"] if e["status"] == "invalid"}
    assert sorted(invalid) == sorted(NOT_STEPS)
    assert "symbolic link" in invalid[13]
    assert doc["latest"] == COMMITTED[-1]

    code, doc = _run(capsys, "verify", zoo, "--all")
    assert code == 1  # the step-named entries that are not steps are problems
    whole = [s["step"] for s in doc["steps"] if s["ok"]]
    assert whole == COMMITTED
    broken = {s["step"]: s["problems"] for s in doc["steps"] if not s["ok"]}
    assert sorted(broken) == sorted(NOT_STEPS)
    assert all([p["kind"] for p in problems] == ["metadata"] for problems in broken.values())
    assert "symbolic link" in broken[13][0]["detail"]

    exported = []
    for step in [*COMMITTED, 4, 5, *NOT_STEPS, 99]:
        code = main(["export", str(zoo), str(step), str(tmp_path / f"out-{step}")])
        capsys.readouterr()
        if code == 0:
            exported.append(step)
        else:
            # Nothing at all under the step's name: not found; something that is not a step: 1.
            assert code == (1 if step in NOT_STEPS else 3), step
            assert not (tmp_path / f"out-{step}").exists()
    assert exported == COMMITTED


def test_verify_step_never_follows_a_linked_step_folder(zoo: Path) -> None:
    report = verify_step(zoo, 13)
    assert [(p.path, p.kind) for p in report.problems] == [("_CHECKPOINT_METADATA", "metadata")]
    assert "symbolic link" in report.problems[0].detail
    assert report.bytes_read == 0  # the linked step's files were never read
    assert verify_step(zoo / "step_00000013") == report
    assert verify_step(zoo, 2).ok


def test_a_writer_cleans_leftovers_and_touches_nothing_foreign(zoo: Path) -> None:
    (zoo / "step_00000006.orbit-tmp").symlink_to(zoo / "eval", target_is_directory=True)
    with CheckpointManager(zoo) as mgr:
        assert mgr.all_steps() == COMMITTED
        # A link is in the way of its step: saving over it is refused, not silently replaced.
        with pytest.raises(StepAlreadyExistsError, match="symbolic link"):
            mgr.save(13, _items(13), force=True)
    assert not (zoo / "step_00000004.orbit-tmp").exists()
    assert not (zoo / "step_00000005.orbit-deleting").exists()
    # A link named like a leftover is foreign: neither it nor what it points to is removed.
    assert (zoo / "step_00000006.orbit-tmp").is_symlink()
    assert (zoo / "eval" / "step_00000001").is_dir()
    assert (zoo / "step_00000013").is_symlink()
    assert (zoo / "step_00000002" / "_CHECKPOINT_METADATA").is_file()


def test_restore_refuses_a_linked_file(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"extra": {"v": 1}}, force=True)
        target = mgr.step_dir(1) / "extra" / "state.msgpack"
        moved = tmp_path / "elsewhere.msgpack"
        target.rename(moved)
        target.symlink_to(moved)
        with pytest.raises(Exception, match="is a symbolic link") as info:
            mgr.restore(1)
        assert "step 1 is damaged" in str(info.value)


def test_verify_reports_progress_through_the_shared_checksum(zoo: Path) -> None:
    seen: list[int] = []
    report = verify_step(zoo, 3, progress=seen.append)
    assert report.ok
    assert sum(seen) == report.bytes_read > 0


# ------------------------------------------------------------------------------ retention

LOSSES = {0: 5.0, 1: 1.0, 2: None, 3: 2.0, 4: 4.0}  # step 2 is saved without the metric


def _saved(root: Path, options: CheckpointManagerOptions | None = None) -> None:
    with CheckpointManager(root, options=options, clock=_Clock()) as mgr:
        for step, loss in LOSSES.items():
            metrics = {} if loss is None else {"loss": loss}
            mgr.save(step, {"x": {"step": step}}, metrics=metrics, force=True)


def _rows(decisions: list[RetentionDecision]) -> dict[int, tuple[bool, tuple[str, ...]]]:
    return {d.step: (d.kept, d.kept_by) for d in decisions}


def test_decide_names_the_rules_that_keep_each_step() -> None:
    infos = [
        CheckpointInfo(s, 60.0 * s, {} if loss is None else {"loss": loss})
        for s, loss in LOSSES.items()
    ]
    policy = KeepBestN(1, "loss")
    assert _rows(decide(infos, policy)) == {
        0: (False, ()),
        1: (True, ("keep-best-n=1(loss,min)",)),
        2: (True, ("keep-best-n=1(loss,min):unranked",)),
        3: (False, ()),
        4: (True, ("latest",)),
    }
    # No policy: every step is kept; only the latest names a reason.
    assert _rows(decide(infos, None)) == {s: (True, ("latest",) if s == 4 else ()) for s in LOSSES}
    assert decide([], policy) == []
    # A policy naming a step that is not committed keeps nothing more.
    assert _rows(decide(infos[:2], KeepSteps([1, 7]))) == {
        0: (False, ()),
        1: (True, ("keep-steps=1,7", "latest")),
    }


def test_apply_retention_returns_its_decisions_and_deletes(tmp_path: Path) -> None:
    _saved(tmp_path)  # no retention: all five kept
    options = CheckpointManagerOptions(keep_last_n=2, keep_best_n=1, best_metric="loss")
    expected = {
        0: (False, ()),
        1: (True, ("keep-best-n=1(loss,min)",)),
        2: (True, ("keep-best-n=1(loss,min):unranked",)),
        3: (True, ("keep-last-n=2",)),
        4: (True, ("keep-last-n=2", "latest")),
    }
    with CheckpointManager(tmp_path, options=options) as mgr:
        assert _rows(mgr.apply_retention(dry_run=True)) == expected
        assert mgr.all_steps() == [0, 1, 2, 3, 4]  # a dry run deletes nothing
        assert _rows(mgr.apply_retention()) == expected
        assert mgr.all_steps() == [1, 2, 3, 4]
        assert _rows(mgr.apply_retention()) == {s: expected[s] for s in (1, 2, 3, 4)}
    with CheckpointManager(tmp_path, options=READ_ONLY) as reader:
        assert reader.all_steps() == [1, 2, 3, 4]
        rows = _rows(reader.apply_retention(dry_run=True))
        assert rows == {s: (True, ("latest",) if s == 4 else ()) for s in (1, 2, 3, 4)}
        with pytest.raises(ReadOnlyError, match="dry_run=True"):
            reader.apply_retention()


def test_a_save_applies_the_same_retention(tmp_path: Path) -> None:
    options = CheckpointManagerOptions(keep_last_n=2, keep_best_n=1, best_metric="loss")
    _saved(tmp_path, options)
    with CheckpointManager(tmp_path, options=READ_ONLY) as reader:
        assert reader.all_steps() == [1, 2, 3, 4]


def test_prune_deletes_in_one_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path)
    calls: list[list[int]] = []
    real_delete = StepStore.delete

    def spy(self: StepStore, steps: list[int], **kwargs: Any) -> None:
        calls.append(list(steps))
        real_delete(self, steps, **kwargs)

    monkeypatch.setattr(StepStore, "delete", spy)
    code, doc = _run(capsys, "prune", tmp_path, "--keep-last-n", "1")
    assert code == 0
    assert doc["deleted"] == [0, 1, 2, 3]
    assert calls == [[0, 1, 2, 3]]


# ------------------------------------------------------------------------ the record


def test_the_root_records_the_retention_its_writer_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(tmp_path)
    assert not (tmp_path / RECORD).exists()  # no retention ever configured: no record
    code, doc = _run(capsys, "ls", tmp_path)
    assert doc["retention"] == "none"
    assert doc["rules"] == []

    options = CheckpointManagerOptions(keep_last_n=2, keep_best_n=1, best_metric="loss")
    with CheckpointManager(tmp_path, options=options, clock=_Clock()) as mgr:
        mgr.save(5, {"x": {"step": 5}}, metrics={"loss": 3.0}, force=True)
        first = (tmp_path / RECORD).stat()
        mgr.save(6, {"x": {"step": 6}}, metrics={"loss": 0.5}, force=True)
        assert (tmp_path / RECORD).stat().st_ino == first.st_ino  # unchanged: not rewritten
    recorded = read_record(tmp_path)
    assert recorded is not None
    assert recorded.options["keep_last_n"] == 2
    assert recorded.rules == ("keep-last-n=2", "keep-best-n=1(loss,min)")
    assert json.loads((tmp_path / RECORD).read_text())["custom"] == []

    # ls without flags shows what the recorded rules keep (the job's code is not needed) ...
    code, doc = _run(capsys, "ls", tmp_path)
    assert code == 0
    assert doc["retention"] == "recorded"
    assert doc["rules"] == ["keep-last-n=2", "keep-best-n=1(loss,min)"]
    kept = {e["step"]: e["kept_by"] for e in doc["entries"] if e["status"] == "committed"}
    assert kept == {
        2: ["keep-best-n=1(loss,min):unranked"],
        5: ["keep-last-n=2"],
        6: ["keep-last-n=2", "keep-best-n=1(loss,min)", "latest"],
    }
    # ... and the flags win over the record.
    code, doc = _run(capsys, "ls", tmp_path, "--keep-last-n", "1")
    assert doc["retention"] == "flags"
    pruned = [e["step"] for e in doc["entries"] if e["pruned"]]
    assert pruned == [2, 5]

    # A later writer without retention updates the record: ls then shows no rule.
    with CheckpointManager(tmp_path, clock=_Clock()) as mgr:
        mgr.save(7, {"x": {"step": 7}}, force=True)
    code, doc = _run(capsys, "ls", tmp_path)
    assert doc["retention"] == "recorded"
    assert doc["rules"] == []
    assert not any(e["pruned"] for e in doc["entries"])


def test_a_custom_policy_is_recorded_by_its_repr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = CheckpointManagerOptions(keep_every_k_steps=2, retention=[KeepLastN(1)])
    _saved(tmp_path, options)
    doc = json.loads((tmp_path / RECORD).read_text())
    assert doc["custom"] == [{"repr": "KeepLastN(n=1)", "reconstructible": False}]
    code, ls = _run(capsys, "ls", tmp_path)
    assert code == 0
    assert ls["rules"] == ["keep-every-k-steps=2", "keep-last-n=1"]
    kept = {e["step"]: e["kept_by"] for e in ls["entries"] if e["status"] == "committed"}
    # Only the rule that can be rebuilt is shown, and no step is claimed to be deleted.
    assert kept == {
        0: ["keep-every-k-steps=2"],
        2: ["keep-every-k-steps=2"],
        4: ["keep-every-k-steps=2", "latest"],
    }
    assert not any(e["pruned"] for e in ls["entries"])
    main(["ls", str(tmp_path)])
    assert "cannot evaluate" in capsys.readouterr().out


def test_an_unreadable_record_is_reported_not_fatal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(tmp_path)
    (tmp_path / RECORD).write_text("{not json")
    code, doc = _run(capsys, "ls", tmp_path)
    assert code == 0
    assert doc["retention"] == "none"
    main(["ls", str(tmp_path)])
    assert "unreadable" in capsys.readouterr().out
