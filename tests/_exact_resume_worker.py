"""A small training run for tests/test_exact_resume.py, run in its own process.

It trains an MLP with dropout, an optimizer, an LR scheduler, noise drawn from the python,
numpy and torch global generators, and a shuffling ``StatefulDataLoader``; it can save a
checkpoint after one step (and stop there), or resume from the latest checkpoint. It writes the
loss of every step it ran (as ``float.hex``) and the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import CheckpointManager, RecipeState, RNGState

DATASET_SIZE = 11  # odd, so that batches do not divide epochs evenly


def build_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raise SystemExit(f"unknown optimizer {kind!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="checkpoint root folder")
    parser.add_argument("--out", type=Path, required=True, help="folder for losses and params")
    parser.add_argument("--total", type=int, required=True, help="number of training steps")
    parser.add_argument("--batch", type=int, required=True, help="batch size")
    parser.add_argument("--opt", default="adamw", help="adamw, adam or sgd")
    parser.add_argument("--save-at", type=int, default=-1, help="save after this step")
    parser.add_argument("--stop", action="store_true", help="exit right after the save")
    parser.add_argument("--resume", action="store_true", help="resume from the latest step")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the same kernels in every process, so results are bitwise equal
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    data_gen = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(DATASET_SIZE, 4, generator=data_gen),
        torch.randn(DATASET_SIZE, 2, generator=data_gen),
    )
    loader = StatefulDataLoader(dataset, batch_size=args.batch, shuffle=True)
    optimizer = build_optimizer(args.opt, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    recipe = RecipeState(step=-1, epoch=0, rng=RNGState(), dataloader=loader)
    items = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "recipe": recipe}
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)

    losses: dict[int, str] = {}
    with CheckpointManager(args.root) as mgr:
        if args.resume:
            mgr.restore(None, items)
        batches = iter(loader)
        for step in range(recipe.step + 1, args.total):
            try:
                x, y = next(batches)
            except StopIteration:
                recipe.epoch += 1
                batches = iter(loader)
                x, y = next(batches)
            noise = torch.randn_like(x) * 0.1 + float(np.random.rand()) + random.random()
            loss = nn.functional.mse_loss(model(x + noise), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses[step] = float(loss.item()).hex()
            recipe.step = step
            if step == args.save_at:
                mgr.save(step, items, force=True)
                if args.stop:
                    break

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(losses))
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, args.out / "params.safetensors"
    )


if __name__ == "__main__":
    main()
