"""One rank of examples/finetune_fsdp.py, interrupted at an exact step; for test_resume_equivalence.

    python tests/_finetune_worker.py [--interrupt-step K --interrupt-rank R --signal TERM|KILL]
        [--dump-restored DIR] -- FINETUNE_ARGS...

It runs the example's own ``main()`` (started by ``launch_ranks`` of examples/demo.py, as torchrun
would start it) with one change: its ``CheckpointManager`` is a subclass that

- sends this process a real signal (SIGTERM: a preemption; SIGKILL: a crash) when rank R reaches
  ``reached_preemption(K)`` -- the point of the loop where a signal from the cluster would be
  noticed -- so that an interruption lands at an exact step, whatever the machine's speed (on
  several ranks a SIGTERM is then saved at step K + 1: the ranks agree one check later);
- with ``--dump-restored``, writes what ``restore`` loaded on this rank to
  ``DIR/rank<r>.safetensors`` (full tensors of the model and optimizer, gathered from the FSDP2
  shards) and ``DIR/rank<r>.json`` (the recipe state), for comparison with the saved step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import finetune_fsdp

from orbit_pt import CheckpointManager


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered (collective), a plain tensor as it is."""
    gather = getattr(tensor, "full_tensor", None)
    return (gather() if callable(gather) else tensor).detach().cpu().contiguous()


def jsonable(value: Any) -> Any:
    """A state dict as JSON: tensors become lists, tuples lists, keys strings."""
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if type(value).__module__ == "numpy":
        return jsonable(torch.from_numpy(value) if hasattr(value, "shape") else value.item())
    return value


def dump_restored(directory: Path, items: Mapping[str, Any]) -> None:
    """Write this rank's view of the restored model, optimizer and recipe."""
    model, optimizer, recipe = items["model"], items["optimizer"], items["recipe"]
    tensors = {f"model/{name}": full(p) for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state[param].items():
                tensors[f"optimizer/{names[id(param)]}/{key}"] = full(value)
    rank = dist.get_rank()
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, directory / f"rank{rank}.safetensors")
    (directory / f"rank{rank}.json").write_text(json.dumps(jsonable(recipe.state_dict())))


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interrupt-step", type=int, default=None, help="step to interrupt at")
    parser.add_argument("--interrupt-rank", type=int, default=0, help="rank that gets the signal")
    parser.add_argument("--signal", choices=("TERM", "KILL"), default="TERM", help="which signal")
    parser.add_argument("--dump-restored", type=Path, default=None, help="folder for the dumps")
    parser.add_argument("finetune_args", nargs="*", help="arguments of finetune_fsdp.py")
    args = parser.parse_args(argv)

    class InstrumentedManager(CheckpointManager):
        fired = False

        def reached_preemption(self, step: int) -> bool:
            if (
                step == args.interrupt_step
                and dist.get_rank() == args.interrupt_rank
                and not InstrumentedManager.fired
            ):
                InstrumentedManager.fired = True
                os.kill(os.getpid(), signal.Signals[f"SIG{args.signal}"])
            return super().reached_preemption(step)

        def restore(
            self, step: int | None = None, items: Any = None, **kwargs: Any
        ) -> dict[str, Any]:
            restored = super().restore(step, items, **kwargs)
            if args.dump_restored is not None and isinstance(items, Mapping):
                dump_restored(args.dump_restored, restored)
            return restored

    setattr(finetune_fsdp, "CheckpointManager", InstrumentedManager)  # noqa: B010
    finetune_fsdp.main(args.finetune_args)


if __name__ == "__main__":
    main(sys.argv[1:])
