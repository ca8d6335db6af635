"""A fine-tune through Accelerate and orbit_pt.integrations.accelerate, run in its own process.

Used by tests/test_integration_accelerate.py, alone or under torchrun (2 gloo ranks, DDP). A
tiny GPT-2 (dropout on), AdamW, a warm-up scheduler, a shuffling ``StatefulDataLoader``, two
micro-batches per optimizer step and an object given to ``register_for_checkpointing`` all go
through the Accelerator; ``save_state`` runs after every batch (the manager saves every 2nd),
``first`` stops after ``--stop`` batches, ``resume`` restores the latest step with
``load_state`` and goes on. Each rank writes every batch's loss (``float.hex``) and a digest of
the final weights to ``--out`` (``.rank<N>`` appended under torchrun).
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
    parser.add_argument("root")
    parser.add_argument("mode", choices=("first", "resume"))
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop", type=int, default=0)
    parser.add_argument("--total-limit", type=int, default=None)
    parser.add_argument("--seedable", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=args.seedable
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
    if args.seedable:  # a torch RandomSampler, which Accelerate replaces by a seedable one
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
        step = 0
        if args.mode == "resume":
            restored = orbit.load_state(accelerator, mgr)
            assert restored is not None
            step = restored
            assert seen.batches == step, (seen.batches, step)
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
    digest = hashlib.sha256()
    for name, value in sorted(accelerator.unwrap_model(model).state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    out = args.out
    if "RANK" in os.environ:
        out += f".rank{os.environ['RANK']}"
    Path(out).write_text(json.dumps({"losses": losses, "data": data, "weights": digest.hexdigest()}))


if __name__ == "__main__":
    main()
