"""PreemptionWatcher: a flag-only handler that closes cleanly in any order, from any thread.

Signals are raised on the main thread (where Python runs handlers). The "original" disposition is
a recording Python handler installed by the fixture, so a signal that falls through every watcher
is counted instead of killing pytest; scenarios whose original is SIG_DFL run in a subprocess.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from orbit_pt._control.preemption import PreemptionWatcher

SIG = signal.SIGUSR1
TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[1]


class _Original:
    """The handler that was installed before any watcher; records each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append(signum)


@pytest.fixture
def original() -> Iterator[_Original]:
    recorder = _Original()
    before = signal.signal(SIG, recorder)
    try:
        yield recorder
    finally:
        signal.signal(SIG, before)


@pytest.fixture(autouse=True)
def _never_kill_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail, rather than die, if a buggy watcher sends us a signal with SIG_DFL installed."""
    real_kill = os.kill

    def guarded(pid: int, signum: int) -> None:
        if pid == os.getpid() and signal.getsignal(signum) in (signal.SIG_DFL, None):
            raise AssertionError(f"a watcher re-delivered signal {signum} to SIG_DFL")
        real_kill(pid, signum)

    monkeypatch.setattr(os, "kill", guarded)


def _raise(signum: signal.Signals = SIG) -> None:
    handler = signal.getsignal(signum)
    assert handler not in (signal.SIG_DFL, None), "SIG_DFL installed: the signal would kill us"
    signal.raise_signal(signum)


def _close_in_thread(watcher: PreemptionWatcher) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            watcher.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "close() hung on a non-main thread"
    assert errors == []


def _digits(order: tuple[int, ...]) -> str:
    return "".join(map(str, order))


def _close(watcher: PreemptionWatcher, closer: str, index: int) -> None:
    if closer == "thread" or (closer == "mixed" and index % 2):
        _close_in_thread(watcher)
    else:
        watcher.close()


def test_signal_sets_the_flag_logs_and_chains(
    original: _Original, caplog: pytest.LogCaptureFixture
) -> None:
    watcher = PreemptionWatcher([SIG])
    try:
        before = watcher.requested
        with caplog.at_level(logging.WARNING, logger="orbit_pt"):
            _raise()
        assert (before, watcher.requested) == (False, True)
        assert original.calls == [SIG]  # the handler that was there before still runs
        assert any("SIGUSR1" in r.getMessage() for r in caplog.records)
    finally:
        watcher.close()
    assert signal.getsignal(SIG) is original


def test_a_repeated_signal_is_the_same_preemption(original: _Original) -> None:
    """Issue 35, 6: under torchrun a worker gets the scheduler's SIGTERM and the agent's
    forwarded copy; the second must not fall back to the default (which kills the process
    before its preemption save). The previous handler still sees every signal."""
    watcher = PreemptionWatcher([SIG])
    try:
        for _ in range(3):
            _raise()
        assert watcher.requested
        assert original.calls == [SIG, SIG, SIG]
        assert signal.getsignal(SIG) == watcher._handle  # still ours: nothing fell through
    finally:
        watcher.close()
    assert signal.getsignal(SIG) is original


def test_a_second_sigint_restores_the_previous_handler_and_redelivers() -> None:
    """Ctrl-C twice at a terminal stops at once: the previous SIGINT handler gets it."""
    recorder = _Original()
    before = signal.signal(signal.SIGINT, recorder)
    try:
        watcher = PreemptionWatcher([signal.SIGINT])
        try:
            _raise(signal.SIGINT)
            assert recorder.calls == [signal.SIGINT]  # chained, as for any first signal
            _raise(signal.SIGINT)
            assert recorder.calls == [signal.SIGINT, signal.SIGINT]
            assert signal.getsignal(signal.SIGINT) is recorder
        finally:
            watcher.close()
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("closer", ["main", "thread", "mixed"])
@pytest.mark.parametrize(
    "order",
    [*itertools.permutations(range(2)), *itertools.permutations(range(3))],
    ids=lambda order: f"close{_digits(order)}",
)
def test_any_closing_order_hands_the_next_signal_to_the_original(
    original: _Original, order: tuple[int, ...], closer: str
) -> None:
    """Defect 5: two managers closed in opening order swallowed the next SIGTERM.

    Defect 4 too, where closes run on another thread: close() there raised ValueError.
    """
    watchers = [PreemptionWatcher([SIG]) for _ in order]
    try:
        for position, index in enumerate(order):
            _close(watchers[index], closer, position)
        _raise()
        assert original.calls == [SIG]
        assert not any(w.requested for w in watchers)
        if closer == "main":
            assert signal.getsignal(SIG) is original  # the chain is fully unwound
    finally:
        for w in watchers:
            w.close()


_CUTS = [
    (order, cut)
    for n in (2, 3)
    for order in itertools.permutations(range(n))
    for cut in range(1, n)
]


@pytest.mark.parametrize("closer", ["main", "thread"])
@pytest.mark.parametrize(
    ("order", "cut"),
    _CUTS,
    ids=[f"close{_digits(o[:c])}-signal-close{_digits(o[c:])}" for o, c in _CUTS],
)
def test_signal_between_closes_reaches_only_open_watchers_and_the_original_once(
    original: _Original, order: tuple[int, ...], cut: int, closer: str
) -> None:
    """Defect 5: a closed watcher in the middle of the chain must neither swallow nor count."""
    watchers = [PreemptionWatcher([SIG]) for _ in order]
    closed = [watchers[i] for i in order[:cut]]
    still_open = [watchers[i] for i in order[cut:]]
    try:
        for position, w in enumerate(closed):
            _close(w, closer, position)
        _raise()
        assert original.calls == [SIG]
        assert not any(w.requested for w in closed)
        assert all(w.requested for w in still_open)
        for position, w in enumerate(still_open):
            _close(w, closer, position)
        _raise()
        assert original.calls == [SIG, SIG]
        assert not any(w.requested for w in closed)
    finally:
        for w in watchers:
            w.close()


def test_close_from_another_thread_never_raises_and_stops_the_flag(original: _Original) -> None:
    """Defect 4: close() from a non-main thread raised ValueError from signal.signal."""
    watcher = PreemptionWatcher([SIG])
    try:
        _close_in_thread(watcher)
        _raise()
        assert original.calls == [SIG]  # forwarded by the pass-through
        assert not watcher.requested
        watcher.close()  # idempotent; now on the main thread, it has nothing left to do
        _raise()
        assert original.calls == [SIG, SIG]
    finally:
        watcher.close()


def test_concurrent_closes_are_idempotent(original: _Original) -> None:
    watcher = PreemptionWatcher([SIG, signal.SIGUSR2])
    before_usr2 = watcher._previous[signal.SIGUSR2]
    try:
        threads = [
            threading.Thread(target=watcher.close, daemon=True, name=f"closer-{i}")
            for i in range(8)
        ]
        for t in threads:
            t.start()
        watcher.close()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        watcher.close()
        _raise()
        assert original.calls == [SIG]
        assert not watcher.requested
    finally:
        watcher.close()
        signal.signal(signal.SIGUSR2, before_usr2)


def test_foreign_handler_chaining_to_a_closed_watcher_reaches_the_original(
    original: _Original,
) -> None:
    watcher = PreemptionWatcher([SIG])
    seen: list[int] = []
    below = signal.getsignal(SIG)

    def foreign(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        if callable(below):
            below(signum, frame)

    signal.signal(SIG, foreign)
    try:
        watcher.close()  # main thread, but not on top: stays as a pass-through
        assert signal.getsignal(SIG) is foreign
        _raise()
        assert seen == [SIG]
        assert original.calls == [SIG]
        assert not watcher.requested
    finally:
        watcher.close()


def test_watcher_created_off_the_main_thread_watches_nothing(original: _Original) -> None:
    made: list[PreemptionWatcher] = []
    thread = threading.Thread(target=lambda: made.append(PreemptionWatcher([SIG])), daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert made[0].signals == ()
    assert signal.getsignal(SIG) is original
    made[0].close()


def test_invalid_signal_undoes_the_handlers_already_installed(original: _Original) -> None:
    with pytest.raises((OSError, ValueError, RuntimeError)):
        PreemptionWatcher([SIG, signal.SIGKILL])
    assert signal.getsignal(SIG) is original


def _run_script(body: str) -> subprocess.CompletedProcess[str]:
    script = (
        "import os, signal, threading\nfrom orbit_pt._control.preemption import PreemptionWatcher\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )


def _in_thread_src(call: str) -> str:
    return f"t = threading.Thread(target={call}); t.start(); t.join()\n"


def test_pass_through_over_sig_dfl_lets_the_default_action_happen() -> None:
    """Defect 4: after close() from another thread, SIGUSR1's default action (exit) happens."""
    result = _run_script(
        "signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n"
        "w = PreemptionWatcher([signal.SIGUSR1])\n"
        + _in_thread_src("w.close")
        + "signal.raise_signal(signal.SIGUSR1)\n"
        "print('survived', w.requested, flush=True)\n"
    )
    assert result.returncode == -signal.SIGUSR1, result.stdout + result.stderr


def test_pass_through_over_sig_ign_ignores() -> None:
    result = _run_script(
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
        "w = PreemptionWatcher([signal.SIGUSR1])\n"
        + _in_thread_src("w.close")
        + "signal.raise_signal(signal.SIGUSR1)\n"
        "print('survived', w.requested, flush=True)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "survived False"


def test_open_watcher_above_a_closed_one_still_absorbs_the_first_signal() -> None:
    """Defect 5: a closed watcher below must not turn the first signal into the default exit."""
    result = _run_script(
        "signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n"
        "a = PreemptionWatcher([signal.SIGUSR1])\n"
        "b = PreemptionWatcher([signal.SIGUSR1])\n"
        "a.close()\n"
        "signal.raise_signal(signal.SIGUSR1)\n"
        "print('first', a.requested, b.requested, flush=True)\n"
        "signal.raise_signal(signal.SIGUSR1)\n"  # a repeat: the same preemption (issue 35, 6)
        "print('survived the second', flush=True)\n"
        "b.close()\n"
        "signal.raise_signal(signal.SIGUSR1)\n"  # both closed: the default action again
        "print('survived the third', flush=True)\n"
    )
    expected = ["first", "False", "True", "survived", "the", "second"]
    assert result.stdout.split() == expected, result.stderr
    assert result.returncode == -signal.SIGUSR1, result.stdout + result.stderr


def test_closed_in_opening_order_the_next_signal_exits_by_default() -> None:
    """Defect 5: A then B closed in opening order; the next SIGUSR1 must reach SIG_DFL (exit)."""
    result = _run_script(
        "signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n"
        "a = PreemptionWatcher([signal.SIGUSR1])\n"
        "b = PreemptionWatcher([signal.SIGUSR1])\n"
        "a.close(); b.close()\n"
        "assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL\n"
        "signal.raise_signal(signal.SIGUSR1)\n"
        "print('survived', a.requested, b.requested, flush=True)\n"
    )
    assert result.returncode == -signal.SIGUSR1, result.stdout + result.stderr
