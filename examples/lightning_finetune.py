"""Fine-tune with Lightning, checkpointed by orbit_pt: resume exactly after a kill.

    python examples/lightning_finetune.py out --stop 5   # killed after step 5 (os._exit)
    python examples/lightning_finetune.py out            # resumes from step 4 and finishes
    torchrun --nproc_per_node 2 examples/lightning_finetune.py out2   # DDP, 2 ranks
    torchrun --nproc_per_node 2 examples/lightning_finetune.py out3 --fsdp   # FSDP2, gather-free

A tiny GPT-2 (dropout on) in a LightningModule, AdamW with a warm-up schedule, a shuffling
``StatefulDataLoader`` (its position is saved, so a resume goes on mid-epoch). ``ModelCheckpoint``
decides as usual (every 2 steps, the best ``--top-k`` by training loss, and ``last``); its
``.ckpt`` files in ``out/checkpoints`` are JSON pointers to the steps in ``out/orbit``. The
orbit_pt lines: the plugin, its callback, and ``ckpt_path="last"``.

``--fsdp`` (under torchrun) shards the model with ``fully_shard`` in ``configure_model`` and
trains with ``OrbitModelParallelStrategy``: each rank saves and restores only its own shards.
``--native`` runs the same training with Lightning's own checkpointing (for comparison).
``--record FILE`` writes each step's loss (``float.hex``), a digest of the final weights, the
checkpoint files kept and the best one (``.rank<N>`` under torchrun):
tests/test_integration_lightning.py compares runs with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import transformers
from pytorch_lightning.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from orbit_pt import CheckpointManagerOptions
from orbit_pt.integrations.lightning import OrbitCheckpointIO, OrbitModelParallelStrategy

SAMPLES, LENGTH, VOCAB = 12, 12, 50


class TinyGPT(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, warmup: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()  # saved as msgpack inside the step, never pickled
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)
        self.losses: list[str] = []
        self.batches: list[list[int]] = []

    def configure_model(self) -> None:
        # Under a model-parallel strategy only (device_mesh is None otherwise): FSDP2, each
        # block sharded on its own, then the whole model.
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()).hex())
        self.batches.append(batch[:, 0].tolist())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        warmup = self.hparams["warmup"]
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class KillAt(pl.Callback):
    """Ends the process after step ``stop`` as a kill would: no teardown, nothing flushed."""

    def __init__(self, stop: int, record: Any) -> None:
        self.stop, self.record = stop, record

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step == self.stop:
            self.record(module, trainer)
            os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps in all")
    parser.add_argument("--stop", type=int, default=0, help="kill the run after this step")
    parser.add_argument("--top-k", type=int, default=2, help="ModelCheckpoint(save_top_k=)")
    parser.add_argument("--native", action="store_true", help="Lightning's own checkpoints")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (under torchrun)")
    parser.add_argument("--async-save", action="store_true", help="orbit_pt's async saves")
    parser.add_argument("--record", default=None, help="write losses, weights and files here")
    args = parser.parse_args()

    out = Path(args.output_dir)
    pl.seed_everything(0, verbose=False)
    module = TinyGPT()
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1))
    distributed = "WORLD_SIZE" in os.environ  # under torchrun: DDP, or FSDP2 with --fsdp
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    sampler = None
    if distributed:
        # The sampler Lightning puts in under DDP cannot be saved: a resumed run sees other
        # batches (measured, with Lightning's own checkpoints too). torchdata's can.
        rank = int(os.environ["RANK"])
        sampler = StatefulDistributedSampler(list(tokens), ranks, rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(
        list(tokens), batch_size=2, shuffle=sampler is None, sampler=sampler
    )
    checkpoints = ModelCheckpoint(
        dirpath=out / "checkpoints", every_n_train_steps=2, save_top_k=args.top_k,
        monitor="train_loss", save_last=True,
    )  # fmt: skip
    callbacks: list[Any] = [checkpoints]
    plugins: list[Any] = []
    if not args.native:
        io = OrbitCheckpointIO(out / "orbit", CheckpointManagerOptions(async_save=args.async_save))
        plugins.append(io)
        callbacks.append(io.callback(model_attr="model"))

    def record(module: TinyGPT, trainer: Any) -> None:
        if args.record:
            _record(args.record, module, checkpoints)

    if args.stop:
        callbacks.append(KillAt(args.stop, record))
    strategy: Any = "ddp" if distributed else "auto"
    if args.fsdp:
        strategy = OrbitModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, strategy=strategy, use_distributed_sampler=False,
        max_steps=args.steps, plugins=plugins, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader, ckpt_path="last")  # from scratch when there is no last.ckpt
    if trainer.is_global_zero:
        print(f"trained to step {trainer.global_step}; best: {checkpoints.best_model_path}")
    record(module, trainer)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # Lightning leaves it up
    if args.fsdp:
        # Under FSDP2 on gloo a process that has finished (every checkpoint committed, the
        # group destroyed) can still abort in PyTorch's C++ teardown at interpreter exit:
        # SIGABRT, "terminate called without an active exception", in about 1 run in 20 here,
        # with Lightning's own ModelParallelStrategy checkpoints as with orbit_pt's. torchrun
        # would report the finished job as failed; leave without that teardown instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _record(path: str, module: TinyGPT, checkpoints: ModelCheckpoint) -> None:
    digest = hashlib.sha256()
    for name, value in sorted(module.model.state_dict().items()):
        if hasattr(value, "full_tensor"):  # FSDP2: a collective, in the same order on every rank
            value = value.full_tensor()
        digest.update(name.encode())
        digest.update(value.detach().contiguous().numpy().tobytes())
    folder = Path(checkpoints.dirpath or ".")
    path += f".rank{os.environ['RANK']}" if "RANK" in os.environ else ""
    Path(path).write_text(
        json.dumps(
            {
                "losses": module.losses,
                "batches": module.batches,
                "weights": digest.hexdigest(),
                "files": sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else [],
                "best": Path(checkpoints.best_model_path).name,
            }
        )
    )


if __name__ == "__main__":
    main()
