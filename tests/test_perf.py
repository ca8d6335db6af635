"""Quick performance regression checks on a small state: ratios within one run, never seconds.

The targets themselves (docs/performance.md) are measured by benchmarks/bench.py on 1-4 GB
states; these checks use a ~100 MB state and generous margins so that a noisy shared machine
does not fail them, while a regression of the kind that matters (an extra copy of the state, a
read-back of every file, a return to buffered writes, staging buffers that grow) still does.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import bench

pytestmark = pytest.mark.perf

SIZE_GB = 0.1


def _median(fn: Callable[[], object], *, before: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(3):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@pytest.fixture(scope="module")
def state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    model, optimizer = bench.build_state(SIZE_GB)
    return model, optimizer, bench.state_tensors(model, optimizer)


def test_sync_save_is_not_slower_than_safetensors(tmp_path: Path, state: tuple) -> None:
    import safetensors.torch

    model, optimizer, tensors = state
    items = {"model": model, "optimizer": optimizer}
    # With retention: every save deletes the previous step, whose files are removed off the
    # save's path (a thread of their own); the peer deletes nothing.
    options = CheckpointManagerOptions(preemption_signals=(), keep_last_n=1)
    steps = iter(range(100))
    peer_file = tmp_path / "peer.safetensors"

    def peer() -> None:
        safetensors.torch.save_file(tensors, str(peer_file))
        bench.fsync_tree(peer_file)

    with CheckpointManager(tmp_path / "ckpt", options=options) as mgr:
        ours = _median(lambda: mgr.save(next(steps), items, force=True))
    theirs = _median(peer, before=lambda: peer_file.unlink(missing_ok=True))
    # At 1 GB orbit_pt saves as fast as safetensors (both at the disk's limit, docs/
    # performance.md); at 0.1 GB with keep_last_n=1 it measured 1.07-1.15x on a quiet machine
    # (1.46-1.55x when the deletion ran on the save's path). A regression to buffered writes,
    # or to writing or hashing the state twice, makes it 2x or more.
    assert ours <= 2.0 * theirs, f"orbit_pt save {ours:.3f}s vs safetensors {theirs:.3f}s"


def test_async_save_blocks_for_little_more_than_a_copy(tmp_path: Path, state: tuple) -> None:
    model, optimizer, tensors = state
    copies = {k: torch.zeros_like(v) for k, v in tensors.items()}

    def copy() -> None:
        for k, v in tensors.items():
            copies[k].copy_(v)

    options = CheckpointManagerOptions(async_save=True, keep_last_n=1, preemption_signals=())
    steps = iter(range(100))
    blocked_times, copied_times = [], []
    with CheckpointManager(tmp_path, options=options) as mgr:
        items = {"model": model, "optimizer": optimizer}
        mgr.save(next(steps), items, force=True)  # first save allocates the staging buffers
        copy()  # and this one its buffers
        # Interleaved, so that a burst of load from other processes on this shared machine
        # (memory bandwidth) slows both sides alike instead of one.
        for _ in range(7):
            mgr.wait_until_finished()
            copied_times.append(_median(copy))
            started = time.perf_counter()
            mgr.save(next(steps), items, force=True)
            blocked_times.append(time.perf_counter() - started)
    blocked = statistics.median(blocked_times)
    copied = statistics.median(copied_times)
    # Target: <= 1.5x the copy. Here <= 4x, with the noise of a shared 2-core machine.
    assert blocked <= 4 * copied + 0.02, f"blocked {blocked:.3f}s vs copy {copied:.3f}s"


def test_restore_in_place_needs_no_second_copy_of_the_state(tmp_path: Path, state: tuple) -> None:
    model, optimizer, tensors = state
    total = bench.nbytes(tensors)
    items = {"model": model, "optimizer": optimizer}
    with CheckpointManager(
        tmp_path, options=CheckpointManagerOptions(preemption_signals=())
    ) as mgr:
        mgr.save(0, items, force=True)
        mgr.restore(0, items)  # warm up allocator caches
        with bench.PeakRSS() as rss:
            mgr.restore(0, items)
    # Target: <= 10% of the state. Allow 25% for sampling and allocator noise.
    assert rss.extra <= 0.25 * total, f"restore used {rss.extra / 1e6:.0f} MB extra"


def test_sync_save_needs_no_copy_of_the_state(tmp_path: Path, state: tuple) -> None:
    model, optimizer, tensors = state
    total = bench.nbytes(tensors)
    options = CheckpointManagerOptions(keep_last_n=1, preemption_signals=())
    with CheckpointManager(tmp_path, options=options) as mgr:
        mgr.save(0, {"model": model, "optimizer": optimizer}, force=True)
        with bench.PeakRSS() as rss:
            mgr.save(1, {"model": model, "optimizer": optimizer}, force=True)
    # The bounce buffers of the O_DIRECT writer (64 MiB, allocated once) are the only memory.
    assert rss.extra <= 0.25 * total + (64 << 20), f"save used {rss.extra / 1e6:.0f} MB extra"
