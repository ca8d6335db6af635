"""Fault injection: after any failure, the manager's view is the disk, and the run goes on.

Every case injects one fault into one operation of a writing manager -- a save, an overwrite, a
rollback, a save whose retention deletes, a delete, an async save, or the open itself -- and
then checks the same invariants:

1. what the operation raised (if anything) is an orbit_pt error, and it tells the truth: a
   :class:`StepNotDurableError` means the step is committed, any other
   :class:`CheckpointSaveError` means the new step is not, and the committed steps it names are
   the ones on disk;
2. the writer's ``all_steps()`` equals a fresh read-only reader's;
3. every listed step restores bitwise (tensors compared as bytes);
4. the next save succeeds, is listed by both, restores bitwise, and retention works again;
5. after ``close()`` a new writer opens at once (the lock was released), removes whatever
   leftovers the failure made, and lists the same steps.

The fault classes (docs/reliability.md has the table and the tally):

- the k-th call of an ``os`` function (or ``open``) fails with an ``OSError``, for every k the
  operation makes: counted in a dry run first, then failed one k at a time;
- disk full on a real tmpfs, at every count of free pages from none to enough (root only:
  mounting needs it);
- permission denied as an unprivileged user (tests/_unprivileged_worker.py: as root it drops
  to ``nobody``; as anyone else it is refused by ``chmod`` alone);
- SIGKILL at the k-th ``fsync``/``mkdir``/``os.open``/``rmdir`` call of a save, a rollback and
  a retention pass (the fork server of tests/test_crash.py, which covers every rename and
  unlink and random moments).

The module prints a tally (tried / survived / failed, per fault class) when it ends.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _tally import Tally, printing_fixture
from test_crash import PLANS, CrashServer, check_root, prepare, replay, run_saver

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    StepNotDurableError,
)

READ_ONLY = CheckpointManagerOptions(read_only=True)
WORKER = Path(__file__).with_name("_unprivileged_worker.py")
REPO = WORKER.parents[1]


# ------------------------------------------------------------------------------------ the tally


TALLY = Tally()
_print_the_tally = printing_fixture(TALLY, "fault injection tally (tests/test_fault_injection.py)")


# ----------------------------------------------------------------------------------- the state


def items(step: int, tag: str) -> dict[str, Any]:
    """What a run saves as ``step`` on timeline ``tag``: a model and a dict of mixed state."""
    g = torch.Generator().manual_seed(step * 1_000_003 + sum(map(ord, tag)))
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 8, generator=g))
        model.bias.copy_(torch.randn(4, generator=g))
    state = {
        "w": torch.randn(4096, generator=g),  # 16 KiB: a few pages of a tmpfs
        "bf16": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**62), 2**62, (32,), generator=g),
        "step": step,
        "tag": tag,
        "history": [step / 3, -0.0, float("inf")],
    }
    return {"model": model, "state": state}


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).numpy())


def assert_bitwise(restored: dict[str, Any], step: int, tags: set[str]) -> None:
    """``restored`` (a reader's restore of ``step``) is exactly what one of ``tags`` saved."""
    tag = restored["state"]["tag"]
    assert tag in tags, f"step {step} holds timeline {tag!r}, never saved as that step"
    want = items(step, tag)
    model = want["model"].state_dict()
    assert restored["model"].keys() == model.keys()
    for name, tensor in model.items():
        got = restored["model"][name]
        assert (got.dtype, bits(got)) == (tensor.dtype, bits(tensor)), f"{step}: model.{name}"
    for key, value in want["state"].items():
        got = restored["state"][key]
        if isinstance(value, torch.Tensor):
            assert (got.dtype, bits(got)) == (value.dtype, bits(value)), f"{step}: {key}"
        else:
            assert (type(got), repr(got)) == (type(value), repr(value)), f"{step}: {key}"


# ------------------------------------------------------------------------------- the workloads


NEXT = 10  # the step of the save after the failure


@dataclass(frozen=True)
class Workload:
    """One operation of a writing manager, on a root that holds ``setup`` (timeline "a")."""

    name: str
    setup: tuple[int, ...]
    action: str  # "save" (timeline "b"), "delete" or "open"
    step: int = -1
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def manager_options(self) -> CheckpointManagerOptions:
        return CheckpointManagerOptions(**dict(self.options))

    def tags(self, step: int) -> set[str]:
        """The timelines ``step`` may hold after this workload (before the next save)."""
        out = {"a"} if step in self.setup else set()
        if self.action == "save" and step == self.step:
            out.add("b")
        return out


WORKLOADS = [
    Workload("save", (0, 1), "save", 2),
    Workload("overwrite", (0, 1, 2), "save", 2),
    Workload("rollback", (0, 1, 2, 3), "save", 1),
    Workload("retention", (0, 1, 2, 3), "save", 4, (("keep_last_n", 2),)),
    Workload("delete", (0, 1, 2), "delete", 1),
    Workload("async save", (0, 1), "save", 2, (("async_save", True),)),
    Workload("open", (0, 1), "open"),
]


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each workload's starting root, built once and copied for every case."""
    out = {}
    for workload in WORKLOADS:
        root = tmp_path_factory.mktemp("template") / "root"
        with CheckpointManager(root) as mgr:
            for step in workload.setup:
                mgr.save(step, items(step, "a"), force=True)
        if workload.action == "open":  # leftovers for the open to clean
            (root / "step_00000007.orbit-tmp" / "model").mkdir(parents=True)
            (root / "step_00000007.orbit-tmp" / "model" / "part").write_bytes(b"x" * 100)
            (root / "step_00000008.orbit-deleting").mkdir()
        out[workload.name] = root
    return out


def perform(workload: Workload, root: Path, mgr: CheckpointManager | None) -> CheckpointManager:
    """Run the workload's operation; returns the manager (the one it opened, for "open")."""
    if workload.action == "open":
        return CheckpointManager(root, options=workload.manager_options)
    assert mgr is not None
    if workload.action == "delete":
        mgr.delete(workload.step)
    else:
        mgr.save(workload.step, items(workload.step, "b"), force=True)
        mgr.wait_until_finished()
    return mgr


def check_after(
    root: Path, mgr: CheckpointManager, workload: Workload, error: BaseException | None
) -> None:
    """The invariants of the module docstring, after ``workload`` raised ``error`` (or not)."""
    if error is not None:
        assert isinstance(error, CheckpointError), f"not an orbit_pt error: {error!r}"
    with CheckpointManager(root, options=READ_ONLY) as reader:
        disk = reader.all_steps()
        assert mgr.all_steps() == disk, f"the writer lists {mgr.all_steps()}, the disk {disk}"
        if isinstance(error, CheckpointSaveError) and error.committed is not None:
            assert error.committed == disk, f"the error says {error.committed}: {error}"
        restored = {step: reader.restore(step) for step in disk}
    for step, state in restored.items():
        assert_bitwise(state, step, workload.tags(step))
    new = workload.step if workload.action == "save" else None
    if new is not None:
        tag = restored[new]["state"]["tag"] if new in restored else None
        if error is None or isinstance(error, StepNotDurableError):
            assert tag == "b", f"save({new}) {'returned' if error is None else error}; disk: {tag}"
        else:
            assert tag != "b", f"the error says step {new} is not committed, but it is: {error}"
    if workload.action == "delete" and error is None:
        assert workload.step not in disk
    # The next save, on the same manager.
    mgr.save(NEXT, items(NEXT, "c"), force=True)
    mgr.wait_until_finished()
    with CheckpointManager(root, options=READ_ONLY) as reader:
        disk = reader.all_steps()
        assert mgr.all_steps() == disk, f"after the next save: {mgr.all_steps()} vs {disk}"
        assert disk[-1] == NEXT
        assert_bitwise(reader.restore(NEXT), NEXT, {"c"})
    keep = dict(workload.options).get("keep_last_n")
    if keep is not None:
        assert len(disk) <= keep, f"retention stopped: {disk}"


def check_reopen(root: Path, workload: Workload) -> None:
    """A new writer opens at once, cleans every leftover, and lists the same steps."""
    with CheckpointManager(root, options=READ_ONLY) as reader:
        disk = reader.all_steps()
    with CheckpointManager(root, options=workload.manager_options) as writer:
        assert writer.all_steps() == disk
    leftovers = [p.name for p in root.iterdir() if p.name.endswith((".orbit-tmp", "-deleting"))]
    assert not leftovers, leftovers


# ------------------------------------------------------------- the findings of issue 17, by name


def test_a_failed_fsync_after_the_rename_leaves_the_step_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename is the commit: after it, the step is there, and the error says so."""
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(1, items(1, "a"), force=True)
    real = os.fsync
    root_id = (root.stat().st_dev, root.stat().st_ino)

    def fsync(fd: int) -> None:
        if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == root_id:  # only the root's fsync
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StepNotDurableError, match="step 2 is committed") as info:
        mgr.save(2, items(2, "b"), force=True)
    assert isinstance(info.value, CheckpointSaveError)
    assert info.value.committed == [1, 2] == mgr.all_steps()
    assert "making it durable failed: OSError: [Errno 5]" in str(info.value)
    monkeypatch.setattr(os, "fsync", real)
    mgr.save(2, items(2, "b"), force=True)  # a retry: no false StepAlreadyExistsError
    assert mgr.all_steps() == [1, 2]
    with CheckpointManager(root, options=READ_ONLY) as reader:
        assert reader.all_steps() == [1, 2]
        assert_bitwise(reader.restore(2), 2, {"b"})
    mgr.close()


def test_a_step_not_durable_survives_the_async_hop_and_pickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from orbit_pt._storage import fs as _fs

    root = tmp_path / "root"
    real = _fs.fsync_path

    def fsync_path(path: Path) -> None:
        if Path(path) == root:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(path)

    with CheckpointManager(root, options=CheckpointManagerOptions(async_save=True)) as mgr:
        monkeypatch.setattr(_fs, "fsync_path", fsync_path)
        mgr.save(0, items(0, "a"), force=True)
        with pytest.raises(StepNotDurableError, match="step 0 is committed") as info:
            mgr.wait_until_finished()
        monkeypatch.setattr(_fs, "fsync_path", real)
        assert mgr.all_steps() == [0]
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is StepNotDurableError
    assert str(again) == str(info.value)
    assert (again.step, again.committed) == (0, [0])


def test_a_failed_rollback_leaves_no_ghost_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 1-3, save(2) fails at the second move into superseded/: the view is [1, 2]."""
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, items(step, "a"), force=True)
    real = os.replace
    moves = []

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).parent.name == "superseded":
            moves.append(src)
            if len(moves) == 2:
                raise OSError(errno.EIO, "Input/output error (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointSaveError) as info:
        mgr.save(2, items(2, "b"), force=True)
    monkeypatch.setattr(os, "replace", real)
    text = str(info.value)
    assert "nothing of the new step 2 was committed" in text
    assert "step(s) [3] it replaces had already been moved into superseded/" in text
    assert text.endswith("the committed steps are now [1, 2]")
    assert (info.value.superseded, info.value.committed) == ([3], [1, 2])
    assert mgr.all_steps() == [1, 2]
    assert mgr.latest_step() == 2
    assert_bitwise(mgr.restore(None), 2, {"a"})  # the old step 2, whole
    mgr.save(2, items(2, "b"), force=True)  # the retry goes through
    assert mgr.all_steps() == [1, 2]
    mgr.close()


def test_retention_drops_a_vanished_step_and_goes_on(tmp_path: Path) -> None:
    """A step removed behind the writer's back does not stop retention for the run."""
    root = tmp_path / "root"
    mgr = CheckpointManager(root, options=CheckpointManagerOptions(keep_last_n=2))
    mgr.save(0, items(0, "a"), force=True)
    mgr.save(1, items(1, "a"), force=True)
    shutil.rmtree(root / "step_00000000")
    for step in range(2, 6):
        mgr.save(step, items(step, "a"), force=True)
        assert mgr.all_steps() == [step - 1, step]
    mgr.close()


def test_an_unreadable_step_folder_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated here (root may read anything); test_permission_denied_... does it for real."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        for step in (0, 1, 99):
            mgr.save(step, items(step, "a"), force=True)
    foreign = root / "step_00000099"
    real = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(os.fsdecode(path)).parent == foreign:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with CheckpointManager(root, options=READ_ONLY) as reader:
        assert reader.all_steps() == [0, 1]
        assert reader.all_steps() == [0, 1]  # a reader scans again: logged once
    warnings = [r for r in caplog.records if "step_00000099" in r.getMessage()]
    assert len(warnings) == 1
    assert "may not look inside it" in warnings[0].getMessage()
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [0, 1]
        mgr.save(2, items(2, "b"), force=True)
        assert mgr.all_steps() == [0, 1, 2]


def test_an_io_error_reading_a_step_fails_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO is not "another user's folder": skipping the step would make the view wrong."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(0, items(0, "a"), force=True)
    real = os.open

    def open_(path: Any, *args: Any, **kwargs: Any) -> int:
        if os.fsdecode(path).endswith("_CHECKPOINT_METADATA"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(CheckpointError, match="cannot be listed without it"):
        CheckpointManager(root)
    monkeypatch.setattr(os, "open", real)
    with CheckpointManager(root) as mgr:  # and the failed open released the lock
        assert mgr.all_steps() == [0]


def test_a_failed_open_releases_the_lock_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No garbage collection needed: the error (and its traceback) is still alive here."""
    import gc

    from orbit_pt._storage import root as _root

    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(0, items(0, "a"), force=True)
    real = _root.scan_root

    def scan_root(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error (injected)")

    gc.disable()
    try:
        monkeypatch.setattr(_root, "scan_root", scan_root)
        with pytest.raises(OSError, match="injected") as info:
            CheckpointManager(root)
        monkeypatch.setattr(_root, "scan_root", real)
        with CheckpointManager(root) as mgr:  # not CheckpointLockedError
            assert mgr.all_steps() == [0]
        assert info.value is not None
    finally:
        gc.enable()


def test_a_superseded_link_and_a_lock_link_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(0, items(0, "a"), force=True)
    (root / "superseded").symlink_to(outside)
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointSaveError, match="not a folder"):
            mgr.save(0, items(0, "b"), force=True)
        assert mgr.all_steps() == [0]
    assert not list(outside.iterdir())
    (root / "superseded").unlink()
    (root / ".orbit.lock").unlink()
    (root / ".orbit.lock").symlink_to(outside / "lock")
    with pytest.raises(CheckpointError, match="symbolic link"):
        CheckpointManager(root)
    assert not (outside / "lock").exists()


# ------------------------------------------------------------------- two ranks: one view


def _faults_on_rank_0(rank: int, world_size: int, root: str) -> None:
    from _distributed import gather

    def state(step: int) -> dict[str, Any]:
        return {"x": {"w": torch.arange(8.0) * step + rank, "step": step}}

    from orbit_pt._storage import fs as _fs

    real_replace, real_fsync_path = os.replace, _fs.fsync_path
    with CheckpointManager(root, options=CheckpointManagerOptions(keep_last_n=3)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), force=True)
        # A rollback that fails at its second move on rank 0.
        moves: list[str] = []

        def replace(src: Any, dst: Any) -> None:
            if Path(dst).parent.name == "superseded":
                moves.append(str(src))
                if len(moves) == 2:
                    raise OSError(errno.EIO, "Input/output error (injected)")
            real_replace(src, dst)

        if rank == 0:
            os.replace = replace  # type: ignore[assignment]
        try:
            with pytest.raises(CheckpointSaveError) as failed:
                mgr.save(2, state(2), force=True)
        finally:
            os.replace = real_replace
        assert (failed.value.superseded, failed.value.committed) == ([3], [1, 2])
        assert gather(mgr.all_steps()) == [[1, 2]] * world_size

        # The root's fsync after the commit fails on rank 0: committed everywhere.
        def fsync_path(path: Path) -> None:
            if Path(path) == Path(root):
                raise OSError(errno.EIO, "Input/output error (injected)")
            real_fsync_path(path)

        if rank == 0:
            _fs.fsync_path = fsync_path
        try:
            with pytest.raises(StepNotDurableError) as not_durable:
                mgr.save(4, state(4), force=True)
        finally:
            _fs.fsync_path = real_fsync_path
        assert not_durable.value.committed == [1, 2, 4]
        assert gather(mgr.all_steps()) == [[1, 2, 4]] * world_size
        # Retention after the next save: a step vanished behind the writer's back.
        if rank == 0:
            shutil.rmtree(Path(root) / "step_00000001")
        gather(None)
        mgr.save(5, state(5), force=True)
        mgr.save(6, state(6), force=True)
        assert gather(mgr.all_steps()) == [[4, 5, 6]] * world_size
        with CheckpointManager(root, options=READ_ONLY) as reader:
            assert reader.all_steps() == [4, 5, 6]
        restored = mgr.restore(6)["x"]
        assert torch.equal(restored["w"], state(6)["x"]["w"])
        # A listing that fails on rank 0 fails on every rank: no rank waits for it forever.
        real_scandir = os.scandir

        def scandir(path: Any = ".") -> Any:
            if Path(os.fsdecode(path)) == Path(root):
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real_scandir(path)

        if rank == 0:
            os.scandir = scandir
        try:
            with pytest.raises(CheckpointError, match="list"):
                mgr.reload()
        finally:
            os.scandir = real_scandir
        mgr.reload()
        assert gather(mgr.all_steps()) == [[4, 5, 6]] * world_size


@pytest.mark.distributed
def test_every_rank_takes_the_view_from_the_disk(tmp_path: Path) -> None:
    from _distributed import run_ranks

    run_ranks(2, _faults_on_rank_0, str(tmp_path / "root"))


# -------------------------------------------------------------------- the k-th call fails


@dataclass(frozen=True)
class Call:
    """A function whose k-th call fails, and how: ``targets`` are (module, attribute)."""

    name: str
    targets: tuple[tuple[Any, str], ...]
    errno: int


CALLS = [
    Call("os.fsync", ((os, "fsync"),), errno.EIO),
    Call("os.replace", ((os, "replace"),), errno.EIO),
    Call("os.rename", ((os, "rename"),), errno.EIO),
    # open() and io.open are one function; Path.open goes through io.open.
    Call("open", ((builtins, "open"), (io, "open")), errno.ENOSPC),
    Call("os.open", ((os, "open"),), errno.ENOSPC),
    Call("os.mkdir", ((os, "mkdir"),), errno.ENOSPC),
    Call("os.write", ((os, "write"),), errno.ENOSPC),
    Call("os.pwrite", ((os, "pwrite"),), errno.ENOSPC),
    Call("os.unlink", ((os, "unlink"),), errno.EIO),
    Call("os.rmdir", ((os, "rmdir"),), errno.EIO),
    Call("os.scandir", ((os, "scandir"),), errno.EIO),
]


@dataclass
class Injector:
    """Counts the calls of every function of :data:`CALLS`; fails the k-th call of one."""

    fail: tuple[str, int] | None
    counts: Counter[str] = field(default_factory=Counter)
    fired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, call: Call, real: Callable[..., Any]) -> Callable[..., Any]:
        def injected(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.counts[call.name] += 1
                hit = self.fail == (call.name, self.counts[call.name])
                self.fired = self.fired or hit
            if hit:
                raise OSError(call.errno, f"{os.strerror(call.errno)} (injected: {call.name})")
            return real(*args, **kwargs)

        return injected


@contextlib.contextmanager
def injecting(fail: tuple[str, int] | None = None) -> Iterator[Injector]:
    """Watch (and with ``fail``, break) the calls of :data:`CALLS` inside the block, in every
    thread -- the module attributes are replaced, so orbit_pt, shutil and pathlib all see it."""
    injector = Injector(fail)
    saved: list[tuple[Any, str, Any]] = []
    try:
        for call in CALLS:
            wrapper = injector.wrap(call, getattr(*call.targets[0]))
            for module, attribute in call.targets:
                saved.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, wrapper)
        yield injector
    finally:
        for module, attribute, real in reversed(saved):
            setattr(module, attribute, real)


def run_case(
    template: Path, root: Path, workload: Workload, fail: tuple[str, int] | None
) -> Injector:
    """One case: copy the template, run the workload with the fault, check every invariant."""
    shutil.copytree(template, root, symlinks=True)
    mgr = None if workload.action == "open" else perform_open(root, workload)
    error: Exception | None = None
    with injecting(fail) as injector:
        try:
            mgr = perform(workload, root, mgr)
        except Exception as exc:
            error = exc
        if mgr is not None:
            # Retention removes deleted steps' files on a thread of its own: its calls belong
            # to the workload (and are counted and failed like the others).
            mgr._store.wait_for_removals()
    if mgr is None:
        # The open failed; ``error`` (and its traceback) is still alive here, and the lock it
        # took must be free already: a CheckpointLockedError now is the bug.
        mgr = perform_open(root, workload)
    try:
        check_after(root, mgr, workload, error)
    finally:
        mgr.close()
    check_reopen(root, workload)
    return injector


def perform_open(root: Path, workload: Workload) -> CheckpointManager:
    return CheckpointManager(root, options=workload.manager_options)


def sweep(
    templates: dict[str, Path], tmp_path: Path, workload: Workload, calls: list[Call]
) -> None:
    """Fail each k-th call of each of ``calls`` during ``workload``, for every k."""
    template = templates[workload.name]
    counts = run_case(template, tmp_path / "dry-run", workload, None).counts
    failures = []
    for call in calls:
        for k in range(1, counts[call.name] + 1):
            name = f"{call.name}-{k}"
            try:
                injector = run_case(template, tmp_path / name, workload, (call.name, k))
                assert injector.fired, f"the {k}-th {call.name} call never came"
                ok = True
            except AssertionError as exc:
                failures.append(f"{workload.name}, {k}-th {call.name} call fails: {exc}")
                ok = False
            TALLY.add(f"k-th call fails: {call.name}", ok=ok)
            shutil.rmtree(tmp_path / name, ignore_errors=True)
    assert not failures, "\n".join(failures)


# Every function on every workload; the functions orbit_pt calls most are in the default run,
# the rest (and the async save, whose calls are the sync save's) only with -m slow.
DEFAULT_CALLS = [c for c in CALLS if c.name not in ("os.unlink", "os.scandir")]
SLOW_CALLS = [c for c in CALLS if c not in DEFAULT_CALLS]


@pytest.mark.parametrize(
    "workload", [w for w in WORKLOADS if w.name != "async save"], ids=lambda w: w.name
)
def test_kth_call_fails(templates: dict[str, Path], tmp_path: Path, workload: Workload) -> None:
    sweep(templates, tmp_path, workload, DEFAULT_CALLS)


@pytest.mark.slow
@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_kth_call_fails_more(
    templates: dict[str, Path], tmp_path: Path, workload: Workload
) -> None:
    calls = CALLS if workload.name == "async save" else SLOW_CALLS
    sweep(templates, tmp_path, workload, calls)


def test_the_dry_runs_make_the_calls_the_docs_count(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    """Every workload reaches the commit protocol's calls; os.write/os.rename are not used."""
    for workload in WORKLOADS:
        counts = run_case(templates[workload.name], tmp_path / workload.name, workload, None)
        if workload.action == "save":
            assert counts.counts["os.fsync"] >= 5
            assert counts.counts["os.replace"] >= 1
            assert counts.counts["os.pwrite"] >= 1
        assert counts.counts["os.write"] == 0
        assert counts.counts["os.rename"] == 0


# ------------------------------------------------------------------- disk full on a real tmpfs


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 16 MiB tmpfs of its own; skipped unless this process may mount one."""
    if os.geteuid() != 0:
        pytest.skip("disk full is tested on a tmpfs, and mounting one needs root")
    mount = tmp_path_factory.mktemp("tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


def fill(mount: Path, free_pages: int) -> Path:
    """Fill ``mount`` until exactly ``free_pages`` pages are free; returns the filler file."""
    filler = mount / "filler"
    stats = os.statvfs(mount)
    size = (stats.f_bavail - free_pages) * stats.f_frsize
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    assert os.statvfs(mount).f_bavail == free_pages
    return filler


def disk_full_case(template: Path, mount: Path, workload: Workload, free_pages: int) -> bool:
    """One case; returns whether the workload ran without any error (then there was room)."""
    root = mount / "root"
    shutil.copytree(template, root, symlinks=True)
    mgr = perform_open(root, workload) if workload.action != "open" else None
    filler = fill(mount, free_pages)
    error: Exception | None = None
    try:
        mgr = perform(workload, root, mgr)
    except Exception as exc:
        error = exc
    finally:
        filler.unlink()
    if mgr is None:
        mgr = perform_open(root, workload)
    try:
        check_after(root, mgr, workload, error)
    finally:
        mgr.close()
    check_reopen(root, workload)
    shutil.rmtree(root)
    return error is None


DISK_FULL = [w for w in WORKLOADS if w.name in ("save", "rollback", "retention", "async save")]


@pytest.mark.parametrize("workload", DISK_FULL, ids=lambda w: w.name)
def test_disk_full_at_every_free_page_count(
    templates: dict[str, Path], tmpfs: Path, workload: Workload
) -> None:
    failures = []
    for free_pages in range(200):
        try:
            fits = disk_full_case(templates[workload.name], tmpfs, workload, free_pages)
            ok = True
        except AssertionError as exc:
            failures.append(f"{workload.name} with {free_pages} free page(s): {exc}")
            fits, ok = False, False
            shutil.rmtree(tmpfs / "root", ignore_errors=True)
        TALLY.add("disk full (tmpfs)", ok=ok)
        if fits:
            break
    else:
        failures.append(f"{workload.name} never fitted in 200 free pages")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------- permission denied, for real


def test_permission_denied_as_an_unprivileged_user() -> None:
    """tests/_unprivileged_worker.py: as root it drops to nobody (uid 65534) first."""
    if os.geteuid() == 0 and not hasattr(os, "setuid"):
        pytest.skip("cannot drop privileges on this platform")
    # Not under tmp_path: nobody must be able to reach the folder, and pytest's base
    # temporary folder is private to root.
    with tempfile.TemporaryDirectory(prefix="orbit-pt-unprivileged-") as folder:
        Path(folder).chmod(0o755)
        done = subprocess.run(
            [sys.executable, str(WORKER), folder],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=folder,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
        # The worker leaves folders that nobody owns, some read-only: let root clean them.
        for path in Path(folder).rglob("*"):
            if path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 5, done.stdout + done.stderr[-3000:]
    for result in results:
        TALLY.add("permission denied (unprivileged)", ok=result["ok"])
    bad = [f"{r['case']}: {r['detail']}" for r in results if not r["ok"]]
    assert not bad, "\n".join(bad) + "\n" + done.stderr[-3000:]


# --------------------------------------------------------------------------- SIGKILL at a call


KILL_CALLS = ["fsync", "mkdir", "open", "rmdir"]  # test_crash.py covers replace and unlink


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrashServer]:
    if not hasattr(os, "fork"):
        pytest.skip("the crash worker forks savers")
    crash_server = CrashServer(tmp_path_factory.mktemp("kill-server-cwd"))
    yield crash_server
    crash_server.close()


def kill_trace(server: CrashServer, root: Path, plan: str) -> Counter[str]:
    """How many calls of each of :data:`KILL_CALLS` the last job of ``plan`` makes."""
    prepare(server, root, PLANS[plan])
    last = PLANS[plan][-1]
    run = run_saver(
        server,
        root=str(root),
        steps=last.steps,
        tag=last.tag,
        keep_last_n=last.keep_last_n,
        trap=["replace", "unlink", *KILL_CALLS],
    )
    assert run.exit_code == 0
    return Counter(e["event"] for e in run.events if e["event"] in KILL_CALLS)


def kill_at(server: CrashServer, root: Path, plan: str, call: str, n: int) -> None:
    """The last job of ``plan`` SIGKILLs itself right before its ``n``-th ``call``."""
    before, tags_of = prepare(server, root, PLANS[plan])
    last = PLANS[plan][-1]
    run = run_saver(
        server,
        root=str(root),
        steps=last.steps,
        tag=last.tag,
        keep_last_n=last.keep_last_n,
        trap=["replace", "unlink", *KILL_CALLS],
        exit_at=[call, n, "before", "kill"],
    )
    assert run.exit_code == -9, run.events[-3:]
    found = check_root(root, tags_of)  # every listed step restores exactly; no leftovers
    assert found == replay(run.renames, last.tag, before)


def kill_sweep(server: CrashServer, tmp_path: Path, plan: str, calls: list[str]) -> None:
    counts = kill_trace(server, tmp_path / "trace", plan)
    failures = []
    for call in calls:
        for n in range(1, counts[call] + 1):
            try:
                kill_at(server, tmp_path / f"{call}-{n}", plan, call, n)
                ok = True
            except AssertionError as exc:
                failures.append(f"{plan}: SIGKILL before {call} call {n}: {exc}")
                ok = False
            TALLY.add(f"SIGKILL at a call: {call}", ok=ok)
    assert not failures, "\n".join(failures)


def test_sigkill_at_every_fsync_and_mkdir(server: CrashServer, tmp_path: Path) -> None:
    # rollback+retention: a rollback's moves, the commit and retention's deletions in one job.
    kill_sweep(server, tmp_path, "rollback+retention", ["fsync", "mkdir"])


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_sigkill_at_every_call(server: CrashServer, tmp_path: Path, plan: str) -> None:
    kill_sweep(server, tmp_path, plan, KILL_CALLS)
