"""Fine-tune with the Hugging Face Trainer, checkpointed by orbit_pt: resume exactly after a stop.

    python examples/hf_trainer_finetune.py out --stop 5   # stops after step 5, as if killed
    python examples/hf_trainer_finetune.py out            # resumes from step 4 and finishes
    torchrun --nproc_per_node 2 examples/hf_trainer_finetune.py out2   # DDP, 2 ranks

A tiny GPT-2 (dropout on) trained by a ``Trainer`` subclass that already exists in the user's
code (here it records each step's loss; TRL's ``SFTTrainer`` is the common case), with
``OrbitTrainerMixin`` put in front of it. That, and ``resume_from_checkpoint=True`` when the
manager holds a step, are the orbit_pt lines. Checkpoints go to ``out/orbit`` (``save_steps=2``)
instead of ``out/checkpoint-N``: safetensors, JSON and msgpack, no pickle. ``--record FILE``
writes each step's loss (``float.hex``) and a digest of the final weights (``.rank<N>`` under
torchrun): tests/test_integration_hf.py compares a stopped-and-resumed run with one that did
not stop.
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

from orbit_pt.integrations.hf import OrbitTrainerMixin

SAMPLES, LENGTH, VOCAB = 12, 12, 50


class RecordingTrainer(transformers.Trainer):
    """The user's own Trainer subclass: it keeps each step's loss."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[str] = []

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss.item()).hex())
        return loss


class Trainer(OrbitTrainerMixin, RecordingTrainer):
    """Checkpoints by orbit_pt: the mixin goes first."""


class StopAt(transformers.TrainerCallback):
    """Ends training after step ``stop``, as a kill would (no save there)."""

    def __init__(self, stop: int) -> None:
        self.stop = stop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.stop:
            control.should_training_stop = True
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps in all")
    parser.add_argument("--stop", type=int, default=0, help="stop after this step, as if killed")
    parser.add_argument("--total-limit", type=int, default=None, help="save_total_limit")
    parser.add_argument("--record", default=None, help="write losses and weights here")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    training = transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        warmup_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=args.total_limit,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    callbacks = [StopAt(args.stop)] if args.stop else []
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    resume = trainer.checkpoint_manager.latest_step() is not None
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        print(f"trained to step {trainer.state.global_step}; steps saved: "
              f"{trainer.checkpoint_manager.all_steps()}")  # fmt: skip
    # Closing the manager ends its threads and its own gloo group; a process that exits with
    # them still running may abort (SIGABRT from a gloo thread, seen under torchrun).
    trainer.checkpoint_manager.close()
    if args.record:
        assert trainer.model is not None
        _record(args.record, trainer.losses, trainer.model)
    if torch.distributed.is_initialized():
        # The Trainer leaves the process group up; destroyed by the interpreter's exit, gloo's
        # threads may still hold tensors and abort the process.
        torch.distributed.destroy_process_group()


def _record(path: str, losses: list[str], model: torch.nn.Module) -> None:
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    path += f".rank{os.environ['RANK']}" if "RANK" in os.environ else ""
    Path(path).write_text(json.dumps({"losses": losses, "weights": digest.hexdigest()}))


if __name__ == "__main__":
    main()
