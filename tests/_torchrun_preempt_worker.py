"""One rank of a torchrun job that saves on preemption; driven by test_operations (issue 35, 6).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/_torchrun_preempt_worker.py ROOT OUT STEP_SECONDS

The README's loop: ``mgr.save(step, items)`` every step, which saves at its interval and, once a
preemption signal reached any rank, saves that step on every rank and exits with status 143.
Each rank writes OUT/pid<r> when it starts, OUT/step<r> with its last step, and
OUT/resumed<r> with the step it resumed from ("none" when it started afresh), and
OUT/exit<r> with its exit status. Each step sleeps STEP_SECONDS: signals that arrive a moment
apart both land before the next save.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from orbit_pt import CheckpointManager, CheckpointManagerOptions, RecipeState


def main(root: str, out: str, step_seconds: float) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out_dir = Path(out)
    weights = torch.zeros(8)
    recipe = RecipeState(step=-1)
    options = CheckpointManagerOptions(save_interval_steps=1000)
    with CheckpointManager(root, options=options) as mgr:
        resumed = mgr.latest_step()
        if resumed is not None:
            mgr.restore(resumed, {"w": {"weights": weights}, "recipe": recipe})
        (out_dir / f"resumed{rank}").write_text(str(resumed).lower())
        (out_dir / f"pid{rank}").write_text(str(os.getpid()))
        for step in range(recipe.step + 1, 100_000):
            weights += 1.0  # "training"
            recipe.step = step
            (out_dir / f"step{rank}").write_text(str(step))
            time.sleep(step_seconds)
            mgr.save(step, {"w": {"weights": weights}, "recipe": recipe})
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    except SystemExit as exc:  # PreemptionExit, with the manager's preemption_exit_code
        rank = os.environ["RANK"]
        (Path(sys.argv[2]) / f"exit{rank}").write_text(str(exc.code))
        raise
    (Path(sys.argv[2]) / f"exit{os.environ['RANK']}").write_text("0")
