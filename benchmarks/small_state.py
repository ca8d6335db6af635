"""Small states: a save's fixed costs against safetensors' ``save_file`` + fsync, in one run.

    python benchmarks/small_state.py [--size-gb 0.1] [--rounds 11]

Saves the same ~0.1 GB state (``bench.build_state``: a transformer-like model and its AdamW
state) in turn, each round: ``safetensors.torch.save_file`` + fsync (the peer), orbit_pt
without retention, orbit_pt with ``keep_last_n=1`` (every save deletes the previous step, its
files removed on a thread of their own), and the same with the deletion on the save's path
(as before 0.2), and with whole 16 MiB fills of the O_DIRECT bounce buffers (as before the
fills followed the range's size), for comparison. Medians and ratios to the peer; machines are
noisy, so only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bench
import safetensors.torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions
from orbit_pt._format import direct_io
from orbit_pt._storage import store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    model, optimizer = bench.build_state(args.size_gb)
    tensors = {k: v.contiguous() for k, v in bench.state_tensors(model, optimizer).items()}
    items = {"model": model, "optimizer": optimizer}
    background = store.StepStore._delete_one

    def on_the_save_path(self: store.StepStore, step: int, *, background: bool) -> None:
        return original(self, step, background=False)

    original: Callable[..., None] = background
    base = Path(tempfile.mkdtemp(prefix="orbit-small-"))
    plain = CheckpointManagerOptions(preemption_signals=())
    keep = CheckpointManagerOptions(preemption_signals=(), keep_last_n=1)
    managers = {
        "orbit_pt, no retention": CheckpointManager(base / "plain", options=plain),
        "orbit_pt, keep_last_n=1": CheckpointManager(base / "keep", options=keep),
        "keep_last_n=1, deletion on the save path": CheckpointManager(base / "sync", options=keep),
        "keep_last_n=1, 16 MiB fills": CheckpointManager(base / "fills", options=keep),
    }
    adaptive_fill = direct_io._MIN_FILL
    times: dict[str, list[float]] = {"save_file + fsync": []}
    try:
        for step in range(args.rounds):
            peer = base / "peer.safetensors"
            started = time.perf_counter()
            safetensors.torch.save_file(tensors, str(peer))
            bench.fsync_tree(peer)
            times["save_file + fsync"].append(time.perf_counter() - started)
            peer.unlink()
            for name, mgr in managers.items():
                store.StepStore._delete_one = on_the_save_path if "path" in name else background  # type: ignore[method-assign]
                direct_io._MIN_FILL = direct_io._BUFFER_BYTES if "fills" in name else adaptive_fill
                started = time.perf_counter()
                mgr.save(step, items)
                times.setdefault(name, []).append(time.perf_counter() - started)
    finally:
        store.StepStore._delete_one = background  # type: ignore[method-assign]
        direct_io._MIN_FILL = adaptive_fill
        for mgr in managers.values():
            mgr.close()
        shutil.rmtree(base, ignore_errors=True)
    size = bench.nbytes(tensors) / 1e9
    reference = statistics.median(times["save_file + fsync"])
    print(f"state {size:.3f} GB, {len(tensors)} tensors, {args.rounds} rounds, medians")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<42} {median:.3f} s  x{median / reference:.2f}")


if __name__ == "__main__":
    main()
