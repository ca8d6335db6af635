"""orbit_pt quick start: train, get interrupted, resume, and prove nothing drifted.

    python examples/quickstart.py [--steps 60] [--interrupt-at 37] [--save-every 10]

The same small training job runs twice: once straight through, once interrupted at
``--interrupt-at`` and resumed by a fresh set of objects from the latest checkpoint. The model
has dropout, the optimizer is AdamW with an LR schedule, and batches come from a shuffling
sampler -- everything that makes a naive resume drift. With orbit_pt saving the model, the
optimizer and a RecipeState (step, epoch, RNG, data position, scheduler), the resumed run ends
with bitwise the same weights and the same losses as the uninterrupted one.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orbit_pt import CheckpointManager, CheckpointManagerOptions, RecipeState, RNGState


class ShuffledBatches:
    """An endless, reshuffled-every-epoch stream of batch indices that can be checkpointed."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        self.size, self.batch_size = size, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(size, generator=self.generator)
        self.position = 0
        self.epoch = 0

    def next_batch(self) -> torch.Tensor:
        if self.position + self.batch_size > self.size:
            self.order = torch.randperm(self.size, generator=self.generator)
            self.position, self.epoch = 0, self.epoch + 1
        batch = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "order": self.order,
            "position": self.position,
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.position, self.epoch = state["order"], state["position"], state["epoch"]


@dataclass
class RunResult:
    losses: dict[int, float]
    weights: dict[str, torch.Tensor]
    resumed_from: int | None


def train(args: argparse.Namespace, checkpoints: Path, *, stop_after: int | None) -> RunResult:
    """Train to ``args.steps`` (or stop after ``stop_after``), resuming from the latest step."""
    torch.manual_seed(0)  # the initial weights; a resume overwrites them from the checkpoint
    inputs = torch.randn(512, 16)
    targets = inputs @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    batches = ShuffledBatches(len(inputs), batch_size=32, seed=1)
    recipe = RecipeState(step=-1, rng=RNGState(), data=batches, scheduler=scheduler)
    items = {"model": model, "optimizer": optimizer, "recipe": recipe}

    options = CheckpointManagerOptions(
        save_interval_steps=args.save_every, keep_last_n=2, keep_every_k_steps=args.save_every * 3
    )
    losses: dict[int, float] = {}
    with CheckpointManager(checkpoints, options=options) as mgr:
        resumed_from = mgr.latest_step()
        if resumed_from is not None:
            mgr.restore(resumed_from, items)  # in place: weights, moments, RNG, data, LR
        for step in range(recipe.step + 1, args.steps):
            batch = batches.next_batch()
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses[step] = loss.item()
            recipe.step = step
            mgr.save(step, items, metrics={"loss": losses[step]})
            if step == stop_after:
                print(f"  ... interrupted after step {step}; committed: {mgr.all_steps()}")
                break
        print(f"  committed steps kept by retention: {mgr.all_steps()}")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return RunResult(losses, weights, resumed_from)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps in all")
    parser.add_argument("--interrupt-at", type=int, default=37, help="step to stop the 2nd run at")
    parser.add_argument("--save-every", type=int, default=10, help="save_interval_steps")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="orbit_pt-quickstart-"))

    print(f"1. an uninterrupted run of {args.steps} steps")
    reference = train(args, root / "uninterrupted", stop_after=None)

    print(f"2. the same run, interrupted after step {args.interrupt_at}")
    train(args, root / "interrupted", stop_after=args.interrupt_at)
    # A fresh process would start with other random state: make sure nothing leaks through.
    torch.manual_seed(12345)
    random.seed(12345)
    print("3. resumed from the latest checkpoint by fresh objects")
    resumed = train(args, root / "interrupted", stop_after=None)

    same_weights = all(torch.equal(reference.weights[k], v) for k, v in resumed.weights.items())
    after = dict(resumed.losses)
    same_losses = all(reference.losses[s] == loss for s, loss in after.items())
    print()
    print(f"resumed from step {resumed.resumed_from}; replayed steps {min(after)}..{max(after)}")
    print(f"final weights bitwise equal to the uninterrupted run: {same_weights}")
    print(f"losses after the resume equal to the uninterrupted run: {same_losses}")
    print(f"checkpoints are under {root}")
    if not (same_weights and same_losses):
        raise SystemExit("resume drifted from the uninterrupted run")


if __name__ == "__main__":
    main()
