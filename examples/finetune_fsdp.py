"""Full fine-tuning of a causal language model under FSDP2, checkpointed with orbit_pt.

    torchrun --nproc_per_node 2 examples/finetune_fsdp.py --out runs/finetune
    torchrun --nproc_per_node 8 examples/finetune_fsdp.py --device cuda \\
        --model /models/Llama-3.2-1B --data my_corpus.txt --out runs/llama1b --lr 2e-5

With no ``--model``/``--data`` it runs offline on a fresh machine: the base model is a small
Llama (examples/tiny_llama.py) whose weights are drawn from a fixed seed and written under
``--out`` on first use, the data is a few of Aesop's fables (examples/data/aesop.txt) and the
tokenizer is byte-level. With ``--model PATH`` (and transformers installed) any local Hugging
Face causal-LM folder is fine-tuned instead.

What orbit_pt does here:

- loads the base weights into the model built on the meta device and already sharded
  (``load_pretrained``): each rank reads only its own rows, no rank ever holds the whole model;
- saves the model (a Hugging Face folder: ``from_pretrained(step_dir / "model")`` loads it),
  the optimizer, and a RecipeState (step, epoch, RNG, data position, LR schedule) every
  ``--save-every`` steps, keeping ``--keep-last-n`` of them plus every ``--keep-every-k-steps``;
- resumes from the latest committed step when the job is started again, or from
  ``--load-step N`` (newer steps are moved to ``superseded/`` when step N's timeline saves);
- on SIGTERM (to any rank) every rank saves the same step and the job exits 0, to be requeued;
- a resumed run continues exactly: on the same world size its losses and final weights are
  bitwise those of a run that never stopped;
- at the end of training, writes the final model in bfloat16 as a Hugging Face folder to serve
  (``OUT/export/step_N/model``, path printed), each rank writing its own rows.

``--batch-size`` is the *global* batch (sequences per step over all ranks): the same job resumed
on another number of ranks sees the same data in the same order and takes the same steps, up to
floating-point rounding. Rank 0 prints one progress line per step and appends every step's loss
to ``OUT/losses.jsonl``. Without torchrun (``python examples/finetune_fsdp.py``) it runs as one
rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from tiny_llama import CONFIG_FILE, ByteTokenizer, TinyLlama, TinyLlamaConfig, write_base_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from orbit_pt import (
    CheckpointManager,
    CheckpointManagerOptions,
    RecipeState,
    RNGState,
    load_pretrained,
)
from orbit_pt.handlers import ModelHandler

EXAMPLES = Path(__file__).resolve().parent
DEFAULT_DATA = EXAMPLES / "data" / "aesop.txt"
BASE_MODEL_SEED = 0  # the embedded base model's weights are drawn from this seed
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        type=Path,
        default=None,
        help="a local Hugging Face causal-LM folder to fine-tune (needs transformers); by "
        "default a small Llama generated from a fixed seed under OUT/tiny-llama-base",
    )
    parser.add_argument(
        "--data",
        metavar="FILE",
        type=Path,
        default=None,
        help="a UTF-8 text file to fine-tune on; by default a few of Aesop's fables "
        "(examples/data/aesop.txt)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("runs/finetune"),
        help="output folder: checkpoints/ (orbit_pt's root), export/ (the final model in "
        "bfloat16, to serve), losses.jsonl (rank 0's log of every step) and the generated base "
        "model",
    )
    parser.add_argument("--steps", type=int, default=60, help="total training steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="global batch: sequences per step over all ranks (divisible by the world size)",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of AdamW")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="linear LR warm-up steps before cosine decay"
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="gradient clipping norm (0: no clipping)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data order and the global RNGs"
    )
    parser.add_argument(
        "--save-every", type=int, default=10, help="save a checkpoint every N steps"
    )
    parser.add_argument(
        "--keep-last-n", type=int, default=3, help="keep the N newest checkpoints (0: keep all)"
    )
    parser.add_argument(
        "--keep-every-k-steps",
        type=int,
        default=0,
        help="also keep every checkpoint whose step is divisible by K (0: off)",
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints on a background thread (training blocks only to copy the "
        "state to host memory)",
    )
    parser.add_argument(
        "--load-step",
        metavar="N",
        type=int,
        default=None,
        help="resume from this committed step instead of the latest (torchtitan's load_step); "
        "saving over newer steps moves them to OUT/checkpoints/superseded/",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu trains over gloo, cuda over nccl (one GPU per rank); auto picks cuda if present",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, with every number checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "save_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("keep_last_n", "keep_every_k_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.load_step is not None and args.load_step < 0:
        parser.error(f"--load-step must be a committed step (>= 0), got {args.load_step}")
    return args


# ---------------------------------------------------------------------------------------- data


class ShuffledWindows:
    """Token windows of a corpus, reshuffled every epoch and served in global batches.

    Window ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len + 1]`` (inputs and the next-token
    targets). Each epoch visits the windows in an order drawn from ``seed`` and the epoch
    number; each step takes the next ``global_batch`` of them and rank ``r`` of ``n`` trains on
    the ``r``-th of ``n`` equal slices. The state (epoch, batches taken) is the same on every
    rank and does not depend on the world size, so a checkpoint resumes on any number of ranks.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch: int, seed: int):
        self.tokens, self.seq_len, self.global_batch, self.seed = (
            tokens,
            seq_len,
            global_batch,
            seed,
        )
        self.num_windows = (len(tokens) - 1) // seq_len
        self.steps_per_epoch = self.num_windows // global_batch
        if self.steps_per_epoch < 1:
            raise SystemExit(
                f"the data has {len(tokens)} tokens: {self.num_windows} windows of --seq-len "
                f"{seq_len}, fewer than one --batch-size {global_batch}; use more text, a "
                "shorter --seq-len or a smaller --batch-size"
            )
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch

    def next_batch(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of the next step, each ``(batch, seq_len)``."""
        if self.position == self.steps_per_epoch:  # drop the incomplete last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(
            self.num_windows,
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch),
        )
        batch = order[self.position * self.global_batch : (self.position + 1) * self.global_batch]
        self.position += 1
        starts = batch.chunk(world_size)[rank] * self.seq_len
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same = {k: (state[k], getattr(self, k)) for k in ("seed", "num_windows", "global_batch")}
        changed = {k: v for k, v in same.items() if v[0] != v[1]}
        if changed:
            raise ValueError(
                f"the checkpoint's data stream differs from this run's (saved, now): {changed}; "
                "resume with the same --data, --seq-len, --batch-size and --seed"
            )
        self.epoch, self.position = state["epoch"], state["position"]


def read_corpus(path: Path | None) -> str:
    """The training text; the embedded corpus's '#' header lines are left out."""
    if path is not None:
        return path.read_text(encoding="utf-8")
    lines = DEFAULT_DATA.read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("#")).lstrip()


# ------------------------------------------------------------------------------------ the model


def build_base_model(
    args: argparse.Namespace, rank: int
) -> tuple[nn.Module, Path, Any, ModelHandler]:
    """The model to fine-tune, on the meta device (no memory yet), and the folder of its weights.

    Also its tokenizer, and the orbit_pt handler that saves it. The weights are loaded once the
    model is sharded (``load_pretrained``), so no rank ever holds all of them.
    """
    if args.model is None:
        base = args.out / "tiny-llama-base"
        if rank == 0:
            write_base_model(base, TinyLlamaConfig(), seed=BASE_MODEL_SEED)
        dist.barrier()
        config = TinyLlamaConfig.from_dict(json.loads((base / CONFIG_FILE).read_text()))
        with torch.device("meta"):
            model: nn.Module = TinyLlama(config)
        return model, base, ByteTokenizer(), ModelHandler()
    try:
        import transformers
    except ImportError:
        raise SystemExit("--model needs transformers: pip install transformers") from None
    hf_config = transformers.AutoConfig.from_pretrained(args.model, local_files_only=True)
    with torch.device("meta"):  # float32 master weights, whatever dtype the folder holds
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tokenizer_files = {n: args.model / n for n in TOKENIZER_FILES if (args.model / n).is_file()}
    if tokenizer_files:
        tokenizer: Any = transformers.AutoTokenizer.from_pretrained(
            args.model, local_files_only=True
        )
    elif hf_config.vocab_size >= ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()
    else:
        raise SystemExit(
            f"{args.model} has no tokenizer files and too small a vocabulary for bytes"
        )
    # Each checkpoint's model folder gets the tokenizer too, so it is a complete HF model.
    return model, args.model, tokenizer, ModelHandler(extra_files=tokenizer_files)


def encode(tokenizer: Any, text: str) -> torch.Tensor:
    """The corpus as one long tensor of token ids."""
    if isinstance(tokenizer, ByteTokenizer):
        return torch.tensor(tokenizer.encode(text), dtype=torch.long)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def seed_everything(seed: int) -> None:
    """Seed the global generators that RNGState saves: python's, numpy's and torch's."""
    random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def lr_factor(step: int, *, warmup: int, total: int) -> float:
    """Linear warm-up to the peak LR, then cosine decay to a tenth of it at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# -------------------------------------------------------------------------------- rank 0 output


class Progress:
    """Rank 0's progress line (redrawn in place on a terminal) and its losses.jsonl log."""

    def __init__(self, log_path: Path, total: int, *, enabled: bool, stream: TextIO = sys.stdout):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.tty = enabled and stream.isatty()
        self.log = log_path.open("a", encoding="utf-8") if enabled else None
        self.started = 0.0
        self.first: int | None = None

    def record(self, **fields: Any) -> None:
        """Append one JSON line to losses.jsonl, flushed at once (readers poll it)."""
        if self.log is not None:
            self.log.write(json.dumps(fields) + "\n")
            self.log.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.tty else "") + text, file=self.stream, flush=True)

    def step(self, step: int, loss: float, lr: float, epoch: int) -> None:
        self.record(event="step", step=step, loss=loss, loss_hex=loss.hex(), lr=lr, epoch=epoch)
        if not self.enabled:
            return
        if self.first is None:  # the rate counts from the end of the first step of this run
            self.first, self.started = step, time.perf_counter()
        done = step + 1
        elapsed = time.perf_counter() - self.started
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        bar = "#" * (20 * done // self.total) + "." * (20 - 20 * done // self.total)
        line = (
            f"step {step:>5}/{self.total} [{bar}] epoch {epoch} loss {loss:.4f} "
            f"lr {lr:.2e} {rate:5.1f} step/s"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            print(file=self.stream)
        if self.log is not None:
            self.log.close()


# --------------------------------------------------------------------------------- the training


def main(argv: list[str] | None = None) -> None:
    """Fine-tune (or resume fine-tuning) until ``--steps`` or a preemption."""
    args = parse_args(argv)

    # Process group: torchrun (or any launcher) sets RANK, WORLD_SIZE, MASTER_ADDR/PORT;
    # without one this process is a world of one.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device_type = args.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        raise SystemExit(
            f"--batch-size {args.batch_size} is the global batch and must be divisible by the "
            f"world size {world_size}"
        )
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(args.out / "losses.jsonl", args.steps, enabled=rank == 0)

    # The model is built on the meta device (shapes, no memory), sharded with FSDP2 -- every
    # decoder layer is its own shard group, the rest (embeddings, final norm, head) belongs to
    # the root, and rank r holds rows [r/n, (r+1)/n) of every parameter -- and only then given
    # memory and the base weights: each rank reads its own rows from the folder, so no rank
    # ever holds the whole model. (A resume then overwrites them with the checkpoint's.)
    model, base_folder, tokenizer, model_handler = build_base_model(args, rank)
    mesh = init_device_mesh(device_type, (world_size,))
    decoder: Any = getattr(model, "model", model)  # HF layout: the layers are model.model.layers
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_pretrained(model, base_folder, device=device)
    model.train()

    # The same initial state on every rank: the base weights come from a file, and the global
    # RNGs (saved in the checkpoint by RNGState) start from --seed once the model is built.
    seed_everything(args.seed)
    batches = ShuffledWindows(
        encode(tokenizer, read_corpus(args.data)),
        seq_len=args.seq_len,
        global_batch=args.batch_size,
        seed=args.seed,
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=args.warmup_steps, total=args.steps)
    )
    # Everything besides weights and optimizer that a resume needs to continue exactly.
    recipe = RecipeState(step=-1, epoch=0, rng=RNGState(), data=batches, scheduler=scheduler)
    items = {"model": model, "optimizer": optimizer, "recipe": recipe}

    options = CheckpointManagerOptions(
        save_interval_steps=args.save_every,
        keep_last_n=args.keep_last_n or None,
        keep_every_k_steps=args.keep_every_k_steps or None,
        async_save=args.async_save,
    )
    with CheckpointManager(
        args.out / "checkpoints", options=options, handlers={"model": model_handler}
    ) as mgr:
        resume_from = args.load_step if args.load_step is not None else mgr.latest_step()
        if resume_from is not None:
            mgr.restore(resume_from, items)  # in place: shards, moments, RNG, data, LR
        progress.record(event="start", resumed_from=resume_from, world_size=world_size)
        progress.message(
            f"fine-tuning {sum(p.numel() for p in model.parameters()):,} parameters on "
            f"{world_size} rank(s) ({device_type}), {batches.num_windows} sequences of "
            f"{args.seq_len} tokens, {batches.steps_per_epoch} steps per epoch; "
            + (
                f"resumed from step {resume_from}"
                if resume_from is not None
                else "from the base model"
            )
        )

        first, step, preempted = recipe.step + 1, recipe.step, False
        for step in range(first, args.steps):
            inputs, targets = (t.to(device) for t in batches.next_batch(rank, world_size))
            logits = model(inputs)
            if not isinstance(logits, torch.Tensor):  # a transformers model returns an output
                logits = logits.logits
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            if args.max_grad_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            lr = float(scheduler.get_last_lr()[0])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

            # The loss of the global batch: every rank's slice has as many tokens.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            loss_value = global_loss.item() / world_size
            recipe.step, recipe.epoch = step, batches.epoch
            progress.step(step, loss_value, lr, batches.epoch)

            # should_save: the interval, or the step at which every rank agreed to a preemption
            # (that save is synchronous). The last step is always saved.
            if mgr.save(step, items, metrics={"loss": loss_value}, force=step == args.steps - 1):
                progress.record(event="save", step=step)
            if mgr.reached_preemption(step):
                preempted = True
                progress.message(f"preempted: saved step {step} on every rank; exiting")
                break

        mgr.wait_until_finished()
        kept = mgr.all_steps()
        progress.record(event="end", step=step, preempted=preempted, kept=kept)
        progress.message(f"checkpoints kept: {kept} under {mgr.directory}")
    if not preempted:
        served = export_for_serving(
            model, step, args.out / "export", model_handler, trained=step >= first
        )
        progress.record(event="export", step=step, path=str(served))
        progress.message(f"final model in bfloat16, to serve: {served}")
    progress.close()
    dist.barrier()  # leave together: no rank closes its sockets while a peer still uses them
    dist.destroy_process_group()


def export_for_serving(
    model: nn.Module, step: int, root: Path, model_handler: ModelHandler, *, trained: bool
) -> Path:
    """Write ``model`` in bfloat16 as a Hugging Face folder to serve, and return the folder.

    Gather-free: a ``ModelHandler(export_dtype=torch.bfloat16)`` save, in which every rank
    writes its own rows, cast one tensor at a time. It goes through a manager of its own (root
    ``OUT/export``, keeping the newest), whose commit makes the folder appear whole or not at
    all. A run that trained nothing (started again after the end) keeps the export it finds.
    """
    exporter = ModelHandler(export_dtype=torch.bfloat16, extra_files=model_handler.extra_files)
    options = CheckpointManagerOptions(keep_last_n=1, preemption_signals=())
    with CheckpointManager(root, options=options, handlers={"model": exporter}) as export:
        if trained or export.latest_step() != step:
            export.save(step, {"model": model}, force=True)
        return export.step_dir(step) / "model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
