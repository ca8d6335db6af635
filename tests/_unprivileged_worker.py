"""A child process for tests/test_fault_injection.py: permission denied, for real.

Run as ``python tests/_unprivileged_worker.py FOLDER``. Started as root, it prepares what only
root can (a folder of another user inside the root), warms up every lazy import (the venv's
standard library may sit where an unprivileged user cannot read it), then drops to
``nobody`` (uid/gid 65534) for good. Started as anyone else, it runs the same cases as itself:
for a user without privileges, ``chmod`` is enough to be refused.

Each case prints one JSON line ``{"case": ..., "ok": ..., "detail": ...}``; the parent
asserts that every case is ok and counts them in its tally. After every injected refusal the
same invariants hold as in the rest of the suite: the writer lists what a fresh reader lists,
the next save succeeds, and every listed step restores bitwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import orbit_pt.cli
import orbit_pt.verify
from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
)

NOBODY = 65534
READ_ONLY = CheckpointManagerOptions(read_only=True)


def state(step: int, tag: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 7919 + len(tag))
    return {"w": torch.randn(32, generator=g), "ids": torch.arange(step, step + 8), "tag": tag}


def same(got: dict[str, Any], step: int, tag: str) -> bool:
    want = state(step, tag)
    return got["tag"] == tag and all(
        torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in ("w", "ids")
    )


def invariants(root: Path, mgr: CheckpointManager, tags: dict[int, str], next_step: int) -> str:
    """What must hold after any failure; returns a problem, or "" when all is well."""
    with CheckpointManager(root, options=READ_ONLY) as reader:
        disk = reader.all_steps()
        if mgr.all_steps() != disk:
            return f"the writer lists {mgr.all_steps()}, a fresh reader {disk}"
        for step in disk:
            if not same(reader.restore(step)["s"], step, tags[step]):
                return f"step {step} does not restore bitwise"
    mgr.save(next_step, {"s": state(next_step, "next")}, force=True)
    tags[next_step] = "next"
    with CheckpointManager(root, options=READ_ONLY) as reader:
        if mgr.all_steps() != reader.all_steps() or next_step not in reader.all_steps():
            return f"after the next save the writer lists {mgr.all_steps()}, a reader {disk}"
        if not same(reader.restore(next_step)["s"], next_step, "next"):
            return f"the next step {next_step} does not restore bitwise"
    return ""


def fresh(root: Path, steps: list[int], tags: dict[int, str]) -> None:
    with CheckpointManager(root) as mgr:
        for step in steps:
            mgr.save(step, {"s": state(step, "a")}, force=True)
            tags[step] = "a"


def cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = orbit_pt.cli.main(list(args))
    return code, out.getvalue()


# ---------------------------------------------------------------------------------- the cases


def case_foreign_step_folder(base: Path) -> str:
    """Another user's step_00000099 (mode 0700) and leftover: skipped, never fatal."""
    root = base / "foreign"
    tags: dict[int, str] = {}
    with CheckpointManager(root, options=READ_ONLY) as reader:
        if reader.all_steps() != [0, 1]:
            return f"a reader lists {reader.all_steps()}, not [0, 1]"
    code, text = cli("ls", str(root))
    if code != 0 or "step_00000099" not in text:
        return f"orbit-pt ls exited {code}: {text[-500:]}"
    code, text = cli("verify", str(root), "1")
    if code != 0:
        return f"orbit-pt verify of step 1 exited {code}: {text[-500:]}"
    code, text = cli("verify", "--all", str(root))
    if code not in (0, 1) or "step 1: OK" not in text:
        return f"orbit-pt verify --all exited {code} (only 0 or 1 are verdicts): {text[-500:]}"
    tags.update({0: "a", 1: "a"})
    mgr = CheckpointManager(root)  # the leftover it cannot remove is logged, not fatal
    try:
        return invariants(root, mgr, tags, 2)
    finally:
        mgr.close()


def case_unwritable_root(base: Path) -> str:
    """A save into a root that refuses new folders: a CheckpointSaveError, nothing changed."""
    root = base / "unwritable-root"
    tags: dict[int, str] = {}
    fresh(root, [0, 1], tags)
    mgr = CheckpointManager(root)
    try:
        root.chmod(0o555)
        try:
            mgr.save(2, {"s": state(2, "b")}, force=True)
            return "a save into a read-only root succeeded"
        except CheckpointSaveError as exc:
            if "nothing of step 2 was committed" not in str(exc):
                return f"the error does not say that nothing was committed: {exc}"
        finally:
            root.chmod(0o755)
        return invariants(root, mgr, tags, 3)
    finally:
        mgr.close()


def case_unwritable_superseded(base: Path) -> str:
    """A rollback that may not move steps into superseded/: the error names what is committed."""
    root = base / "unwritable-superseded"
    tags: dict[int, str] = {}
    fresh(root, [0, 1, 2, 3], tags)
    (root / "superseded").mkdir()
    mgr = CheckpointManager(root)
    try:
        (root / "superseded").chmod(0o555)
        try:
            mgr.save(1, {"s": state(1, "b")}, force=True)
            return "a rollback into a read-only superseded/ succeeded"
        except CheckpointSaveError as exc:
            if f"the committed steps are now {mgr.all_steps()}" not in str(exc):
                return f"the error does not name the committed steps {mgr.all_steps()}: {exc}"
        finally:
            (root / "superseded").chmod(0o755)
        problem = invariants(root, mgr, tags, 4)
        if problem:
            return problem
        mgr.save(1, {"s": state(1, "b")}, force=True)  # the rollback, retried
        tags[1] = "b"
        return invariants(root, mgr, tags, 2)
    finally:
        mgr.close()


def case_undeletable_step(base: Path) -> str:
    """Retention that cannot remove a step's files: the step is gone, retention goes on."""
    root = base / "undeletable"
    tags: dict[int, str] = {}
    fresh(root, [0, 1], tags)
    (root / "step_00000000" / "s").chmod(0o555)
    mgr = CheckpointManager(root, options=CheckpointManagerOptions(keep_last_n=2))
    try:
        mgr.save(2, {"s": state(2, "b")}, force=True)
        tags[2] = "b"
        if mgr.all_steps() != [1, 2]:
            return f"retention left {mgr.all_steps()}, not [1, 2]"
        problem = invariants(root, mgr, tags, 3)
        if problem:
            return problem
        if len(mgr.all_steps()) != 2:
            return f"retention stopped working: {mgr.all_steps()}"
    finally:
        mgr.close()
    # The half-deleted folder cannot be removed at open either: logged, and the root opens.
    with CheckpointManager(root) as again:
        if again.all_steps() != [2, 3]:
            return f"reopened, the writer lists {again.all_steps()}"
    (root / "step_00000000.orbit-deleting" / "s").chmod(0o755)
    with CheckpointManager(root):
        pass
    if (root / "step_00000000.orbit-deleting").exists():
        return "the leftover was not removed once it could be"
    return ""


def case_failed_open_releases_the_lock(base: Path) -> str:
    """An open that fails after taking the lock releases it at once (no gc needed)."""
    root = base / "unlistable"
    tags: dict[int, str] = {}
    fresh(root, [0], tags)
    root.chmod(0o333)  # may enter and create, may not list
    kept: list[BaseException] = []
    try:
        CheckpointManager(root)
        return "a writer opened a root it cannot list"
    except Exception as exc:
        kept.append(exc)  # its traceback stays alive, as in a REPL or a logger's record
        if not isinstance(exc, (CheckpointError, PermissionError)):
            return f"opening raised {type(exc).__name__}: {exc}"
    finally:
        root.chmod(0o755)
    mgr = CheckpointManager(root)  # a CheckpointLockedError here is the bug
    try:
        return invariants(root, mgr, tags, 1)
    finally:
        mgr.close()
        kept.clear()


CASES: dict[str, Callable[[Path], str]] = {
    "another user's step folder": case_foreign_step_folder,
    "read-only root": case_unwritable_root,
    "read-only superseded/": case_unwritable_superseded,
    "undeletable step files": case_undeletable_step,
    "unlistable root at open": case_failed_open_releases_the_lock,
}


# ------------------------------------------------------------------------------------ running


def prepare_foreign(base: Path, privileged: bool) -> None:
    """The root of the first case: steps 0 and 1, another user's step 99 and leftover."""
    root = base / "foreign"
    fresh(root, [0, 1], {})
    scratch = base / "scratch"
    fresh(scratch, [99], {})
    os.replace(scratch / "step_00000099", root / "step_00000099")
    (root / "step_00000050.orbit-tmp" / "s").mkdir(parents=True)
    shutil.rmtree(scratch)
    if privileged:
        for path in [root, *root.rglob("*")]:
            if "step_00000099" not in path.parts and ".orbit-tmp" not in str(path):
                os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        (root / "step_00000050.orbit-tmp").chmod(0o700)
    else:  # the nearest a user can come to another user's folder: one it may not enter
        (root / "step_00000050.orbit-tmp" / "s").chmod(0o555)
    (root / "step_00000099").chmod(0o700 if privileged else 0o000)


def warm_up(base: Path) -> None:
    """Import everything a save, restore, ls and verify import lazily, as root."""
    scratch = base / "warm-up"
    fresh(scratch, [0, 1], {})
    with CheckpointManager(scratch, options=CheckpointManagerOptions(keep_last_n=1)) as mgr:
        mgr.restore(1)
        mgr.save(0, {"s": state(0, "b")}, force=True)
    for args in (["ls", str(scratch)], ["verify", "--all", str(scratch)], ["info", str(scratch)]):
        cli(*args)
    shutil.rmtree(scratch)
    traceback.format_exception(ValueError("warm"))


@contextlib.contextmanager
def reported(name: str) -> Iterator[None]:
    try:
        yield
    except Exception:
        print(json.dumps({"case": name, "ok": False, "detail": traceback.format_exc()}))


def main() -> None:
    base = Path(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    privileged = os.geteuid() == 0
    warm_up(base)
    prepare_foreign(base, privileged)
    if privileged:
        os.chown(base, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    for name, case in CASES.items():
        with reported(name):
            problem = case(base)
            print(json.dumps({"case": name, "ok": not problem, "detail": problem}), flush=True)


if __name__ == "__main__":
    main()
