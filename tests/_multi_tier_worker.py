"""A 2-rank FSDP2 loop saving often to a local tier (2 simulated nodes) and rarely to the root;
driven by test_multi_tier's SIGKILL test, which kills every rank mid-run.

    python tests/_multi_tier_worker.py BASE

Rank r's local root is BASE/node<r>; the persistent root is BASE/persistent. Each rank writes
BASE/progress<r> with the last step it finished (saves included) and runs until it is killed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from orbit_pt import CheckpointManager, CheckpointManagerOptions, LocalTierOptions

sys.path.insert(0, str(Path(__file__).parent))
from _distributed import free_port
from _multi_tier_model import build, train_step


def options(base: Path, rank: int) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(
        save_interval_steps=7,
        keep_last_n=2,
        async_save=True,
        agreement_timeout=60,
        local=LocalTierOptions(
            root=base / f"node{rank}", save_interval_steps=2, keep_last_n=2, replicas=1
        ),
    )


def rank_main(rank: int, world_size: int, port: int, base: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    base_path = Path(base)
    model, opt = build(shard=True)
    with CheckpointManager(base_path / "persistent", options=options(base_path, rank)) as mgr:
        step = 0
        while True:  # until killed
            step += 1
            train_step(model, opt, step)
            if mgr.should_save(step):
                mgr.save(step, {"model": model, "optimizer": opt})
            (base_path / f"progress{rank}").write_text(str(step))


if __name__ == "__main__":
    mp.spawn(rank_main, args=(2, free_port(), sys.argv[1]), nprocs=2, join=True)  # type: ignore[attr-defined]
