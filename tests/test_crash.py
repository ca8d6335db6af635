"""Crash safety: a saver process dies at any instant, and the root still holds only whole steps.

The saver (tests/_crash_worker.py) saves steps in a loop and is killed with SIGKILL at random
moments -- mostly in the middle of writing a step of a few MiB -- or ends itself with
``os._exit`` right before or right after a chosen ``os.replace`` (the commit, a move into
``superseded/``, a retention rename) or ``os.unlink`` (retention removing files). After every
death a new manager must list only steps that were fully saved, each restoring exactly the state
that was saved for it, and a new writer must leave no ``*.orbit-tmp`` behind.

For the exact-point deaths the expected steps are computed from the saver's own trace of its
renames: a step appears exactly at the rename that commits it and disappears exactly at the one
that moves it away, so a death before or after any rename leaves a known set of steps.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _crash_worker import EXIT_CODE, make_state

from orbit_pt import CheckpointManager, CheckpointManagerOptions
from orbit_pt._storage.layout import parse_step_name
from orbit_pt.metadata import StepMetadata

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash worker forks savers")

WORKER = Path(__file__).with_name("_crash_worker.py")
REPO = WORKER.parents[1]
TIMEOUT = 120.0  # seconds for any one event; a hang fails the test instead of blocking CI


# ---------------------------------------------------------------------------- the fork server


class CrashServer:
    """The parent's side of tests/_crash_worker.py: starts savers and reads their events."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            bufsize=0,
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buffer = b""
        assert self.event()["event"] == "ready"

    def event(self) -> dict[str, Any]:
        event = self.next_event()
        assert event is not None
        return event

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next event; None if ``timeout`` seconds pass without one (default: fail)."""
        deadline = time.monotonic() + (TIMEOUT if timeout is None else timeout)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._fd], [], [], remaining)[0]:
                if timeout is not None:
                    return None
                raise TimeoutError(f"the crash worker said nothing for {TIMEOUT}s")
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise EOFError(f"the crash worker exited with {self.proc.wait()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        assert event["event"] != "error", event["message"]
        return event

    def start(self, **job: Any) -> int:
        """Fork a saver for ``job``; returns its pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        event = self.event()
        assert event["event"] == "pid", event
        return int(event["pid"])

    def events_until_exit(self, pid: int, *, kill_after: float | None = None) -> Iterator[dict]:
        """The saver's events up to its exit; SIGKILL it once ``kill_after`` seconds passed."""
        deadline = None if kill_after is None else time.monotonic() + kill_after
        while True:
            event: dict[str, Any] | None
            if deadline is None:
                event = self.event()
            else:
                remaining = deadline - time.monotonic()
                event = self.next_event(timeout=max(remaining, 0.0)) if remaining > 0 else None
                if event is None:
                    os.kill(pid, signal.SIGKILL)
                    deadline = None
                    continue
            yield event
            if event["event"] == "exit":
                return

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrashServer]:
    crash_server = CrashServer(tmp_path_factory.mktemp("crash-server-cwd"))
    yield crash_server
    crash_server.close()


@dataclass
class Run:
    """What the parent saw of one saver: the steps it started and finished, and its renames."""

    started: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    renames: list[tuple[str, str]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def run_saver(
    server: CrashServer, *, kill_when: tuple[int, float] | None = None, **job: Any
) -> Run:
    """Run one saver to its end; with ``kill_when=(step, delay)``, SIGKILL it ``delay`` seconds
    after it starts saving ``step`` (or, if it finishes first, once it is done)."""
    pid = server.start(pause_at_end=kill_when is not None, **job)
    run = Run()
    for event in server.events_until_exit(pid):
        _record(run, event)
        if kill_when is None:
            continue
        if event == {"event": "saving", "step": kill_when[0]}:
            kill_after = kill_when[1]
            break
        if event["event"] == "done":
            kill_after = 0.0
            break
    else:
        return run  # it ended by itself
    # The kill is timed from the moment the saver reported the chosen step.
    for event in server.events_until_exit(pid, kill_after=kill_after):
        _record(run, event)
    return run


def _record(run: Run, event: dict[str, Any]) -> None:
    run.events.append(event)
    kind = event["event"]
    if kind == "saving":
        run.started.append(event["step"])
    elif kind == "saved":
        run.saved.append(event["step"])
    elif kind == "replace":
        run.renames.append((event["args"][0], event["args"][1]))
    elif kind == "exit":
        run.exit_code = event["code"]


# ------------------------------------------------------------------------------- invariants


def assert_exact(restored: dict[str, Any], step: int, tags: set[str]) -> str:
    """``restored`` is exactly what a saver with one of ``tags`` saved as ``step``; its tag."""
    tag = restored["tag"]
    assert tag in tags, f"step {step} holds tag {tag!r}, never saved as that step"
    want = make_state(step, tag)
    assert restored.keys() == want.keys()
    for got_t, want_t in zip(restored["big"], want["big"], strict=True):
        assert torch.equal(got_t, want_t), f"step {step}: a big tensor differs"
    for key in ("bf16", "ids"):
        assert restored[key].dtype == want[key].dtype
        assert torch.equal(restored[key], want[key]), f"step {step}: {key} differs"
    for key in ("step", "tag", "blob", "pair"):
        assert restored[key] == want[key]
        assert type(restored[key]) is type(want[key])
    assert [repr(x) for x in restored["history"]] == [repr(x) for x in want["history"]]
    return str(tag)


Verified = dict[int, tuple[StepMetadata, str]]


def check_root(
    root: Path, tags_of: dict[int, set[str]], verified: Verified | None = None
) -> dict[int, str]:
    """The invariants after a crash; returns each listed step's tag.

    ``tags_of[step]`` holds the tags of every saver that started saving ``step``. ``verified``
    remembers steps already restored and compared by an earlier check: a step committed by the
    same commit (equal metadata) is not read again, which keeps long sweeps linear.
    """
    verified = {} if verified is None else verified
    found: dict[int, str] = {}
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as reader:
        listed = reader.all_steps()
        for step in listed:
            assert step in tags_of, f"step {step} is listed but was never saved"
            meta = reader.metadata(step)
            if step in verified and verified[step][0] == meta:
                found[step] = verified[step][1]
                continue
            found[step] = assert_exact(reader.restore(step)["state"], step, tags_of[step])
            verified[step] = (meta, found[step])
        # Steps are saved consecutively and leave oldest first (retention) or newest first (a
        # rollback): a crash never opens a gap.
        if listed:
            assert listed == list(range(listed[0], listed[-1] + 1)), listed
        latest = reader.latest_step()
        assert latest == (listed[-1] if listed else None)
        if latest is not None:
            assert_exact(reader.restore()["state"], latest, tags_of[latest])
    with CheckpointManager(root) as writer:
        assert writer.all_steps() == listed
        names = [p.name for p in root.iterdir()]
        assert not [n for n in names if n.endswith((".orbit-tmp", ".orbit-deleting"))], names
    return found


# ------------------------------------------------------------------------------ random kills


SCENARIOS = ["append", "retention", "rollback"]


def random_kills(server: CrashServer, root: Path, scenario: str, kills: int, seed: int) -> None:
    """Kill savers at random moments, ``kills`` times, checking the invariants after each."""
    rng = random.Random(seed)
    tags_of: dict[int, set[str]] = {}
    keep_last_n = 2 if scenario == "retention" else None
    read_only = CheckpointManagerOptions(read_only=True)
    verified: Verified = {}
    for kill in range(kills):
        with CheckpointManager(root, options=read_only) as reader:
            latest = reader.latest_step()
        first = 0 if latest is None else latest + 1
        if scenario == "rollback" and latest is not None:
            first = max(0, latest - rng.randrange(3))
        steps = list(range(first, first + 6))
        tag = f"kill {kill}"
        # Mostly in the middle of a save (a step takes ~10 ms), sometimes between two saves.
        delay = rng.choice([0.0, rng.uniform(0, 0.004), rng.uniform(0, 0.03)])
        run = run_saver(
            server,
            root=str(root),
            steps=steps,
            tag=tag,
            keep_last_n=keep_last_n,
            kill_when=(rng.choice(steps), delay),
        )
        assert run.exit_code == -signal.SIGKILL, run.events[-5:]
        for step in run.started:
            tags_of.setdefault(step, set()).add(tag)
        found = check_root(root, tags_of, verified)
        listed = sorted(found)
        if run.saved:
            assert listed
            assert listed[-1] >= run.saved[-1]
        # Every step this saver finished is there (unless retention let it go), with its state.
        for step in run.saved:
            if keep_last_n is None or step > listed[-1] - keep_last_n:
                assert found.get(step) == tag, (step, found)
        if scenario == "retention":
            assert len(listed) <= 2 + 1  # + 1: killed between a commit and its retention
        else:
            assert listed == list(range(len(listed)))  # nothing lost, no gaps


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sigkill_at_random_moments(server: CrashServer, tmp_path: Path, scenario: str) -> None:
    random_kills(server, tmp_path / "root", scenario, kills=10, seed=SCENARIOS.index(scenario))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sigkill_at_random_moments_sweep(
    server: CrashServer, tmp_path: Path, scenario: str, seed: int
) -> None:
    random_kills(server, tmp_path / "root", scenario, kills=40, seed=1000 + seed)


# ------------------------------------------------------------------------ exact-point deaths


@dataclass(frozen=True)
class Job:
    steps: list[int]
    tag: str
    keep_last_n: int | None = None


# The last job of each plan is the one that dies; the jobs before it set the scene.
PLANS: dict[str, list[Job]] = {
    "commit": [Job([0, 1], "a"), Job([2, 3], "b")],
    "overwrite": [Job([0, 1, 2], "a"), Job([2], "b")],
    "rollback": [Job([0, 1, 2, 3, 4], "a"), Job([2, 3], "b")],
    "retention": [Job([0, 1], "a", keep_last_n=2), Job([2, 3], "b", keep_last_n=2)],
    "rollback+retention": [
        Job([0, 1, 2, 3, 4], "a", keep_last_n=2),
        Job([4, 5], "b", keep_last_n=2),
    ],
}


def replay(renames: list[tuple[str, str]], tag: str, steps: dict[int, str]) -> dict[int, str]:
    """The committed steps after ``renames`` (of a saver with ``tag``), starting from ``steps``."""
    steps = dict(steps)
    for src, dst in renames:
        gone, new = parse_step_name(Path(src).name), parse_step_name(Path(dst).name)
        if gone is not None:
            del steps[gone]
        if new is not None:
            steps[new] = tag
    return steps


def prepare(
    server: CrashServer, root: Path, plan: list[Job]
) -> tuple[dict[int, str], dict[int, set[str]]]:
    """Run every job of ``plan`` but the last; the committed steps then, and every step's tags."""
    steps: dict[int, str] = {}
    tags_of: dict[int, set[str]] = {}
    for job in plan:
        for step in job.steps:
            tags_of.setdefault(step, set()).add(job.tag)
    for job in plan[:-1]:
        run = run_saver(
            server, root=str(root), steps=job.steps, tag=job.tag, keep_last_n=job.keep_last_n
        )
        assert run.exit_code == 0
        steps = replay(run.renames, job.tag, steps)
    return steps, tags_of


def trace(server: CrashServer, root: Path, plan: list[Job]) -> list[dict[str, Any]]:
    """Every replace/unlink call the last job of ``plan`` makes when nothing goes wrong."""
    prepare(server, root, plan)
    last = plan[-1]
    run = run_saver(
        server, root=str(root), steps=last.steps, tag=last.tag, keep_last_n=last.keep_last_n
    )
    assert run.exit_code == 0
    return [e for e in run.events if e["event"] in ("replace", "unlink")]


def die_at(
    server: CrashServer, root: Path, plan: list[Job], call: str, n: int, when: str
) -> dict[int, str]:
    """Run ``plan``, its last job dying around its ``n``-th ``call``; check the root after.

    Returns the steps left, with the tag of the saver that wrote each.
    """
    before, tags_of = prepare(server, root, plan)
    last = plan[-1]
    run = run_saver(
        server,
        root=str(root),
        steps=last.steps,
        tag=last.tag,
        keep_last_n=last.keep_last_n,
        exit_at=[call, n, when],
    )
    assert run.exit_code == EXIT_CODE, run.events[-5:]
    assert run.events[-2] == {"event": "exiting", "call": call, "n": n, "when": when}
    found = check_root(root, tags_of)
    assert found == replay(run.renames, last.tag, before)
    # Whatever was moved aside is whole: its metadata names its step and its files are all there.
    superseded = root / "superseded"
    for folder in sorted(superseded.iterdir()) if superseded.exists() else []:
        meta = json.loads((folder / "_CHECKPOINT_METADATA").read_bytes())
        assert folder.name.startswith(f"step_{meta['step']:08d}.")
        for rel, info in meta["files"].items():
            assert (folder / rel).stat().st_size == info["size"]
    return found


def points(events: list[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    """(call, n, what it does, a name) for every rename/unlink of a trace."""
    out = []
    for event in events:
        if event["event"] == "replace":
            src, dst = (Path(a) for a in event["args"])
            if src.name.endswith(".orbit-tmp"):
                what = f"commit-{dst.name}"
            elif dst.parent.name == "superseded":
                what = f"supersede-{src.name}"
            else:
                what = f"retire-{src.name}"
            out.append(("replace", event["n"], what))
        else:
            out.append(("unlink", event["n"], "delete-file"))
    return [(call, n, what, f"{call}{n}-{what}") for call, n, what in out]


# The deaths every default run checks, and the steps (number + tag of the saver) left after each.
# Beyond matching the replay of the renames, these pin the order of the protocol: what is moved
# aside first, and that retention runs only after the new step is committed.
DEFAULT_DEATHS = [
    ("commit", "replace", 1, "before", "0a 1a"),  # right before the rename that commits step 2
    ("commit", "replace", 1, "after", "0a 1a 2b"),  # right after it, before the root's fsync
    ("commit", "replace", 2, "before", "0a 1a 2b"),
    ("overwrite", "replace", 1, "after", "0a 1a"),  # old 2 moved aside, new 2 not yet renamed
    ("overwrite", "replace", 2, "before", "0a 1a"),
    ("overwrite", "replace", 2, "after", "0a 1a 2b"),
    ("rollback", "replace", 1, "after", "0a 1a 2a 3a"),  # superseding 4, 3, 2: newest first
    ("rollback", "replace", 2, "after", "0a 1a 2a"),
    ("rollback", "replace", 3, "after", "0a 1a"),
    ("rollback", "replace", 4, "after", "0a 1a 2b"),
    ("retention", "replace", 1, "after", "0a 1a 2b"),  # committed; retention has not run yet
    ("retention", "replace", 2, "before", "0a 1a 2b"),  # right before step 0 is renamed away
    ("retention", "replace", 2, "after", "1a 2b"),  # renamed away; no file removed yet
    ("retention", "unlink", 1, "after", "1a 2b"),  # in the middle of removing step 0's files
    ("retention", "unlink", 3, "before", "1a 2b"),
    ("rollback+retention", "replace", 1, "after", "3a"),  # old 4 moved aside
    ("rollback+retention", "replace", 3, "after", "3a 4b 5b"),  # 5 committed, 3 not yet retired
    ("rollback+retention", "replace", 4, "after", "4b 5b"),
]


@pytest.mark.parametrize(
    ("plan", "call", "n", "when", "left"),
    DEFAULT_DEATHS,
    ids=[f"{p}-{c}{n}-{w}" for p, c, n, w, _ in DEFAULT_DEATHS],
)
def test_death_at_an_exact_call(
    server: CrashServer, tmp_path: Path, plan: str, call: str, n: int, when: str, left: str
) -> None:
    found = die_at(server, tmp_path / "root", PLANS[plan], call, n, when)
    assert found == {int(s[:-1]): s[-1] for s in left.split()}


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_death_at_every_call(server: CrashServer, tmp_path: Path, plan: str) -> None:
    calls = points(trace(server, tmp_path / "trace", PLANS[plan]))
    for i, (call, n, _what, name) in enumerate(calls):
        for when in ("before", "after"):
            die_at(server, tmp_path / f"{i}-{name}-{when}", PLANS[plan], call, n, when)
