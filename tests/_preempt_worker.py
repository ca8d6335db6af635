"""A 2-rank training loop that saves on preemption (SIGTERM) and resumes; driven by test_preemption.

    python tests/_preempt_worker.py ROOT OUT TOTAL_STEPS

Each rank writes OUT/rank<r>.pid when it starts, OUT/progress<r> with its last step, and
OUT/result<r>.json with the step it stopped at and the step it resumed from.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orbit_pt import CheckpointManager, CheckpointManagerOptions, RecipeState

sys.path.insert(0, str(Path(__file__).parent))
from _distributed import free_port


def rank_main(rank: int, world_size: int, port: int, root: str, out: str, total: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out_dir = Path(out)
    (out_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    weights = torch.zeros(8)
    recipe = RecipeState(step=-1)
    options = CheckpointManagerOptions(save_interval_steps=1000, async_save=True)
    with CheckpointManager(root, options=options) as mgr:
        resumed = mgr.latest_step()
        if resumed is not None:
            mgr.restore(resumed, {"w": {"weights": weights}, "recipe": recipe})
        step = recipe.step
        for step in range(recipe.step + 1, total):
            weights += 1.0  # "training"
            recipe.step = step
            (out_dir / f"progress{rank}").write_text(str(step))
            if mgr.should_save(step):
                mgr.save(step, {"w": {"weights": weights}, "recipe": recipe})
            if mgr.reached_preemption(step):
                break
        mgr.wait_until_finished()
    result = {"stopped_at": step, "resumed_from": resumed, "weights": weights[0].item()}
    (out_dir / f"result{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # tear down together (see tests/_distributed.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    root, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(  # type: ignore[attr-defined]
        rank_main, args=(2, free_port(), root, out, total), nprocs=2, join=True
    )
