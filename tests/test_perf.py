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

    def timed(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    # Paired and interleaved: a burst of load from a neighbour slows one pair, not one side.
    ratios, ours_times, theirs_times = [], [], []
    with CheckpointManager(tmp_path / "ckpt", options=options) as mgr:
        for _ in range(5):
            ours_times.append(timed(lambda: mgr.save(next(steps), items, force=True)))
            peer_file.unlink(missing_ok=True)
            theirs_times.append(timed(peer))
            ratios.append(ours_times[-1] / theirs_times[-1])
    ours, theirs = statistics.median(ours_times), statistics.median(theirs_times)
    # At 1 GB orbit_pt saves as fast as safetensors (both at the disk's limit, docs/
    # performance.md); at 0.1 GB with keep_last_n=1 it measured 1.07-1.15x on a quiet machine
    # (1.46-1.55x when the deletion ran on the save's path). A regression to buffered writes,
    # or to writing or hashing the state twice, makes it 2x or more.
    assert statistics.median(ratios) <= 2.0, (
        f"orbit_pt save {ours:.3f}s vs safetensors {theirs:.3f}s (medians; pair ratios "
        f"{[round(r, 2) for r in ratios]})"
    )


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


class _RowWriter:
    """A handler that writes one file in ranges, out of order, as an FSDP rank writes its rows
    (the piecewise path: the commit must take the file's checksum from the ranges' CRCs)."""

    name = "rows"

    def __init__(self, data: torch.Tensor, cuts: int = 8) -> None:
        self.data = data
        self.cuts = cuts

    def write(self, path: Path) -> None:
        from orbit_pt._format import checksum as _checksum
        from orbit_pt._format import coverage
        from orbit_pt._format.direct_io import RangeWriter
        from orbit_pt._format.safetensors import tensor_bytes

        view = tensor_bytes(self.data)
        with open(path, "xb") as f:
            f.truncate(len(view))
        step = len(view) // self.cuts
        ranges = [
            (i * step, len(view) if i == self.cuts - 1 else (i + 1) * step)
            for i in range(self.cuts)
        ]
        writer = RangeWriter(path)
        try:
            for start, end in reversed(ranges):
                crc = _checksum.RangeChecksum()
                writer.write(start, [view[start:end]], crc)
                coverage.record(path, start, end - start, crc.crc)
        finally:
            writer.close()

    def save(self, directory: Path, item: object, context: object) -> dict:
        self.write(directory / "rows.bin")
        return {}

    def restore(self, directory: Path, target: object, context: object) -> object:
        return None


def test_a_piecewise_save_costs_little_more_than_its_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orbit_pt._format import checksum as _checksum

    data = torch.randint(0, 256, (int(SIZE_GB * 1e9),), dtype=torch.uint8)
    handler = _RowWriter(data)
    read_back: list[str] = []
    real_of_file = _checksum.of_file

    def of_file(path: Path, *args: object, **kwargs: object) -> str:
        read_back.append(Path(path).name)
        return real_of_file(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_checksum, "of_file", of_file)
    steps = iter(range(100))
    plain = iter(range(100))
    options = CheckpointManagerOptions(preemption_signals=(), keep_last_n=1)
    saves, writes = [], []
    with CheckpointManager(tmp_path / "ckpt", options=options, handlers={"rows": handler}) as mgr:
        for _ in range(5):  # interleaved, so that the machine's drift hits both alike
            saves.append(_median(lambda: mgr.save(next(steps), {"rows": None}, force=True)))
            path = tmp_path / f"plain{next(plain)}.bin"

            def write(path: Path = path) -> None:
                path.unlink(missing_ok=True)
                handler.write(path)

            writes.append(_median(write))
    assert "rows.bin" not in read_back  # the checksum came from the ranges' CRCs
    ours, theirs = statistics.median(saves), statistics.median(writes)
    # Target: <= 1.1x the handler's own writes (docs/performance.md, "No read-back"). Here
    # <= 1.6x: a read-back of the file would add a read and a hash of every byte on top.
    assert ours <= 1.6 * theirs, f"save {ours:.3f}s vs the handler's writes {theirs:.3f}s"
