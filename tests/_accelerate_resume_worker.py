"""A training run through Accelerate for tests/test_accelerate_resume.py, run in its own process.

The model (dropout on), optimizer and a shuffling ``StatefulDataLoader`` go through
``accelerator.prepare`` with ``use_stateful_dataloader=True``, so the loader the recipe holds is
Accelerate's wrapper, which answers ``state_dict()`` from a copy it caches. A step is saved every
2 steps; ``first`` stops after ``--stop`` steps, ``resume`` restores the latest step and goes on.
It writes every step's loss (``float.hex``) and the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import CheckpointManager, RecipeState, RNGState

BATCHES_PER_EPOCH = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("mode", choices=("first", "resume"))
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(dataloader_config=config, cpu=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES_PER_EPOCH, 8), torch.randn(24, 1))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    recipe = RecipeState(step=0, epoch=0, rng=RNGState(), dataloader=loader)
    losses: list[str] = []
    stop = args.stop or args.steps
    with CheckpointManager(args.root) as mgr:
        if args.mode == "resume":
            items = {"model": model, "optimizer": optimizer, "recipe": recipe}
            mgr.restore(mgr.latest_step(), items)
        step, epoch = recipe.step, recipe.epoch
        while step < stop:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                losses.append(float(loss.item()).hex())
                if step % 2 == 0:
                    recipe.step, recipe.epoch = step, epoch
                    mgr.save(step, {"model": model, "optimizer": optimizer, "recipe": recipe})
                if step == stop:
                    break
            else:
                epoch += 1
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    Path(args.out).write_text(json.dumps({"losses": losses, "weights": weights}))


if __name__ == "__main__":
    main()
