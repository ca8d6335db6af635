"""What ``CheckpointManager.should_save(step)`` costs per training step on several gloo ranks.

    python benchmarks/step_overhead.py [--ranks 2] [--steps 3000] [--work-us 1000]
        [--work sleep|spin] [--json OUT]

``should_save`` is called on every step of every rank, and under torch.distributed it asks
``reached_preemption``, which agrees on the preemption flag over orbit_pt's gloo group. Each
rank (fresh processes, ``torch.multiprocessing``) runs the same loop of ``--steps`` steps four
times, timing each call with ``perf_counter_ns``:

- ``bare``: the loop with nothing in it (the timer's own cost);
- ``interval``: the save policy alone (``should_save`` without the preemption check);
- ``should_save``: ``CheckpointManager.should_save(step)``, what a training loop pays;
- ``blocking any``: one blocking all-reduce of the flag (``Collective.any``), which is what
  ``should_save`` did before its check was pipelined (plus the ``interval`` case).

Between calls each rank does ``--work-us`` of "training": ``sleep`` leaves the CPU idle, as a
step that waits for its GPU does; ``spin`` keeps it busy, so that gloo's own threads (which run
the all-reduce) get a core only when the loop waits -- the worst case, and on a machine with
fewer cores than ranks x 2 threads the pipelined check then costs a round trip again.
``--work-us 0`` is a tight loop, where a check that waits for its peers always waits.
Figures are medians (and 90th percentiles) over the steps, per rank; the machine is shared, so
only the ratios within one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from orbit_pt import CheckpointManager, CheckpointManagerOptions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _work(us: float, kind: str) -> None:
    """A training step's worth of time: the CPU idle (``sleep``) or busy (``spin``)."""
    if us <= 0:
        return
    if kind == "sleep":
        time.sleep(us / 1e6)
        return
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def _time_calls(
    call: Callable[[int], object], steps: int, work_us: float, kind: str
) -> list[float]:
    """Microseconds of each call, after the ranks start together (a barrier)."""
    dist.barrier()
    out = []
    for step in range(steps):
        _work(work_us, kind)
        start = time.perf_counter_ns()
        call(step)
        out.append((time.perf_counter_ns() - start) / 1000)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered),
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))],
        "mean_us": statistics.fmean(ordered),
    }


def _rank(
    rank: int, world: int, port: int, root: str, steps: int, work: tuple[float, str], out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # An interval no step reaches: every call is a non-save step, the per-step case.
    options = CheckpointManagerOptions(save_interval_steps=10**9)
    results: dict[str, Any] = {}
    with CheckpointManager(root, options=options) as mgr:
        policy = options.save_policy_object()
        collective = mgr._dist  # the manager's own gloo group
        cases: dict[str, Callable[[int], object]] = {
            "bare": lambda step: None,
            "interval": lambda step: policy.should_save(step),
            "should_save": mgr.should_save,
            "blocking any": lambda step: collective.any(False),
        }
        for name, call in cases.items():
            _time_calls(call, min(200, steps), *work)  # warm-up
            results[name] = _summary(_time_calls(call, steps, *work))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes)")
    parser.add_argument("--steps", type=int, default=3000, help="timed calls per case and rank")
    parser.add_argument(
        "--work-us", type=float, default=1000.0, help="a training step between calls (us)"
    )
    parser.add_argument(
        "--work", choices=("sleep", "spin"), default="sleep", help="the CPU idle or busy meanwhile"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, out = Path(tmp, "ckpt"), Path(tmp, "out")
        out.mkdir()
        mp.spawn(  # type: ignore[attr-defined]
            _rank,
            args=(
                args.ranks,
                _free_port(),
                str(root),
                args.steps,
                (args.work_us, args.work),
                str(out),
            ),
            nprocs=args.ranks,
            join=True,
        )
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    print(
        f"{args.ranks} gloo ranks, {args.steps} calls per case, "
        f"{args.work_us:g} us of work ({args.work}) between calls"
    )
    print(f"{'case':<14}" + "".join(f"  rank {r} median / p90 (us)" for r in range(args.ranks)))
    for case in per_rank[0]:
        cells = "".join(
            f"  {r[case]['median_us']:>12.1f} / {r[case]['p90_us']:<10.1f}" for r in per_rank
        )
        print(f"{case:<14}{cells}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "ranks": per_rank}))


if __name__ == "__main__":
    main()
