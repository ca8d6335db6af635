"""On a GPU: how long an async save blocks training, against a plain pinned copy of the state.

    python benchmarks/cuda_staging.py [--size-mb 1024] [--rounds 5] [--ranks 1]

With ``--ranks 1`` one process holds a model and its AdamW state on ``cuda:0``. With
``--ranks N`` (N GPUs) every rank holds an FSDP2 shard on its own GPU, the model's process
group is NCCL, and orbit_pt's control traffic goes over its own gloo group, as in training.
Each round, on every rank:

- **limit**: ``copy_(..., non_blocking=True)`` of every state tensor into preallocated pinned
  host tensors, then ``torch.cuda.synchronize()``: device-to-host at the bus's rate, nothing
  else. This is what an async save's blocking part cannot beat;
- **orbit async**: ``CheckpointManager(async_save=True).save(step, items)`` -- the time until
  it returns (the training loop is blocked: staging into the handler's reused pinned buffers),
  then the time until the step is durable (``wait_until_finished``);
- **orbit sync**: the same save with ``async_save=False``.

It prints medians and the ratio of the blocked time to the limit (the target is about 1x: the
staging is that copy plus bookkeeping). Without a CUDA device it says so and measures nothing:
these numbers need a GPU machine (``docs/performance.md`` says whether they were taken).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(size_mb: int, device: torch.device, sharded: bool) -> tuple[Any, Any]:
    width = 4096
    layers = max(1, size_mb * 2**20 // (3 * width * width * 4))  # weights + 2 Adam moments
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    model = model.to(device)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    found = [_local(p.detach()) for p in model.parameters()]
    for state in optimizer.state.values():
        found += [_local(v) for v in state.values() if torch.is_tensor(v) and v.is_cuda]
    return found


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from orbit_pt import CheckpointManager, CheckpointManagerOptions

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    model, optimizer = _state(args.size_mb, device, sharded=world > 1)
    items = {"model": model, "optimizer": optimizer}
    tensors = _tensors(model, optimizer)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times: dict[str, list[float]] = {"limit": [], "blocked": [], "durable": [], "sync": []}
    root = Path(args.dir or tempfile.mkdtemp(prefix="orbit-cuda-"))
    asynchronous = CheckpointManagerOptions(async_save=True, keep_last_n=1)
    synchronous = CheckpointManagerOptions(keep_last_n=1)
    with (
        CheckpointManager(root / "async", options=asynchronous) as amgr,
        CheckpointManager(root / "sync", options=synchronous) as smgr,
    ):
        amgr.save(0, items)  # allocates the staging buffers
        amgr.wait_until_finished()
        for step in range(1, args.rounds + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for src, dst in zip(tensors, pinned, strict=True):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times["limit"].append(time.perf_counter() - started)
            started = time.perf_counter()
            amgr.save(step, items)
            times["blocked"].append(time.perf_counter() - started)
            amgr.wait_until_finished()
            times["durable"].append(time.perf_counter() - started)
            started = time.perf_counter()
            smgr.save(step, items)
            times["sync"].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    lines = [f"rank {rank}: {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name(device)}"]
    for name, seconds in medians.items():
        lines.append(f"  {name:<8} {seconds:.3f} s  {nbytes / 1e9 / seconds:.2f} GB/s")
    lines.append(f"  blocked / limit: {medians['blocked'] / medians['limit']:.2f}x")
    Path(out, f"rank{rank}.txt").write_text("\n".join(lines))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--dir", type=str, default=None, help="where to save (default: temp)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device on this machine: nothing measured (run it on a GPU machine)")
        return
    if args.ranks > torch.cuda.device_count():
        raise SystemExit(f"--ranks {args.ranks} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")  # fmt: skip
    out = tempfile.mkdtemp(prefix="orbit-cuda-out-")
    if args.ranks == 1:
        _rank(0, 1, 0, args, out)
    else:
        import torch.multiprocessing as mp

        mp.start_processes(  # type: ignore[attr-defined]
            _rank,
            args=(args.ranks, _free_port(), args, out),
            nprocs=args.ranks,
            start_method="spawn",
        )
    for rank in range(args.ranks):
        print(Path(out, f"rank{rank}.txt").read_text())


if __name__ == "__main__":
    main()
