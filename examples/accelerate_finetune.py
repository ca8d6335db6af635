"""Fine-tune with Hugging Face Accelerate, checkpointed by orbit_pt: resume exactly after a stop.

    python examples/accelerate_finetune.py ckpt --steps 20 --stop 7   # stops after 7 batches
    python examples/accelerate_finetune.py ckpt --steps 20             # resumes at step 6
    torchrun --nproc_per_node 2 examples/accelerate_finetune.py ckpt2 --steps 20   # DDP

A tiny GPT-2 (dropout on), AdamW, a warm-up scheduler, a shuffling ``StatefulDataLoader``, two
micro-batches per optimizer step and an object given to ``register_for_checkpointing``, all
prepared by an ``Accelerator``. The orbit_pt lines: a ``CheckpointManager`` with options from
the project configuration, ``load_state`` once, ``save_state`` after every batch (the manager
saves every 2nd). ``use_stateful_dataloader=True`` saves the loader's position; see ``main`` for
the sampler that makes the shuffle resume exactly, alone and across ranks.
``--record FILE`` writes each batch's loss (``float.hex``), its first tokens and a digest of the
final weights (``.rank<N>`` appended under torchrun): tests/test_integration_accelerate.py
compares a stopped-and-resumed run with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import CheckpointManager
from orbit_pt.integrations import accelerate as orbit

SAMPLES, LENGTH, VOCAB = 24, 12, 50


class Seen:
    """A user's own counter, registered for checkpointing."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = int(state["batches"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", help="the checkpoint folder (or an s3:// URL)")
    parser.add_argument("--steps", type=int, default=20, help="batches to train in all")
    parser.add_argument("--stop", type=int, default=0, help="stop after this batch, as if killed")
    parser.add_argument("--total-limit", type=int, default=None, help="checkpoints kept")
    parser.add_argument("--record", default=None, help="write losses, batches, weights here")
    parser.add_argument(
        "--other-world-size",
        action="store_true",
        help="resume a step saved on another number of ranks (fresh RNG, data started over)",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    # The shuffle resumes exactly when its order can be drawn again. Alone, torchdata's own
    # sampler (shuffle=True) saves its generator. Across ranks Accelerate shards the batches,
    # which torchdata cannot save, so the order must follow the epoch number: a torch
    # RandomSampler, which use_seedable_sampler replaces by a sampler seeded by the epoch.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=distributed
        ),
        project_config=ProjectConfiguration(total_limit=args.total_limit),
    )
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1))
    if distributed:
        sampler = torch.utils.data.RandomSampler(tokens)
        loader = StatefulDataLoader(tokens, batch_size=2, sampler=sampler)
    else:
        loader = StatefulDataLoader(tokens, batch_size=2, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)

    options = orbit.options_from_project_config(accelerator, save_interval_steps=2)
    losses: list[str] = []
    data: list[list[int]] = []  # each batch's first tokens: tells a data drift from an RNG one
    stop = args.stop or args.steps
    with CheckpointManager(args.root, options=options) as mgr:
        # The latest step; 0 on an empty root. On another number of ranks than saved it, the
        # per-rank parts must be left out (the resume is then not exact).
        per_rank = ("recipe.rng", "recipe.dataloader") if args.other_world_size else ()
        step = orbit.load_state(accelerator, mgr, exclude=per_rank) or 0
        accelerator.print(f"starting at step {step}")
        model.train()
        while step < stop:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                step += 1
                seen.batches += 1
                losses.append(float(loss.item()).hex())
                data.append(batch[:, 0].tolist())
                orbit.save_state(accelerator, mgr, step)
                if step == stop:
                    break
        mgr.wait_until_finished()
        accelerator.print(f"trained to step {step}; checkpoints: {mgr.all_steps()}")
    if args.record:
        _record(args.record, losses, data, accelerator.unwrap_model(model))
    # Destroys the process group while the interpreter is whole: left to its exit, gloo's
    # threads may still hold tensors and abort the process.
    accelerator.end_training()


def _record(path: str, losses: list[str], data: list[list[int]], model: torch.nn.Module) -> None:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    path += f".rank{os.environ['RANK']}" if "RANK" in os.environ else ""
    Path(path).write_text(
        json.dumps({"losses": losses, "data": data, "weights": digest.hexdigest()})
    )


if __name__ == "__main__":
    main()
