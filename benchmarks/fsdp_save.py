"""Save time and peak memory per rank under FSDP2: direct shard writes vs gathering to rank 0.

Three ways to save the same FSDP2 model (gloo ranks on CPU) are timed in turn, several rounds:

- ``direct``: ``CheckpointManager.save`` -- every rank writes its own rows into the HF
  safetensors files, then the commit (fsync, checksums, metadata, rename);
- ``direct-handler``: ``ModelHandler.save`` alone into a folder, plus an fsync of the files:
  the write path without the manager's commit;
- ``gathered``: what torchtune does -- ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` gathers the model on rank 0, which writes it with
  ``safetensors.torch.save_file`` (plus an fsync, so that both sides make the bytes durable).

Peak memory is the growth of each process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before each save) over its resident set before the save.

Run: ``.venv/bin/python benchmarks/fsdp_save.py --size-mb 400 --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("direct", "direct-handler", "gathered")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _build(size_mb: int, width: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    layers = max(1, size_mb * 2**20 // (width * width * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _save(mode: str, model: torch.nn.Module, workdir: Path, round_: int, mgr: Any) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from orbit_pt._control.collective import Collective
    from orbit_pt.handlers import HandlerContext, ModelHandler

    rank = dist.get_rank()
    folder = workdir / f"{mode}-{round_}"
    if mode == "direct":
        mgr.save(round_, {"model": model}, force=True)
    elif mode == "direct-handler":
        if rank == 0:
            folder.mkdir()
        dist.barrier()
        context = HandlerContext(
            step=round_,
            rank=rank,
            world_size=dist.get_world_size(),
            collective=Collective(group=dist.group.WORLD),
        )
        ModelHandler().save(folder, model, context)
        _fsync_tree(folder)
    else:
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            folder.mkdir()
            tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            _fsync_tree(folder)
        del full
    dist.barrier()


def _worker(rank: int, world_size: int, port: int, args: Any, job: dict[str, Any]) -> None:
    """One save of one mode, in fresh processes: peak memory is not blurred by earlier rounds."""
    from orbit_pt import CheckpointManager

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = _build(args.size_mb, args.width)
    workdir = Path(job["workdir"])
    # Built outside the timed region (it opens the root and a gloo group of its own).
    mgr = CheckpointManager(workdir / "direct") if job["mode"] == "direct" else None
    dist.barrier()
    before = _rss_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    _save(job["mode"], model, workdir, job["round"], mgr)
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") - before
    if mgr is not None:
        mgr.close()
    result = {**job, "rank": rank, "seconds": seconds, "peak_kib": peak}
    Path(job["out"], f"{job['mode']}-{job['round']}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400, help="model size in MiB (float32)")
    parser.add_argument("--width", type=int, default=2048, help="width of each square layer")
    parser.add_argument("--ranks", type=int, default=2, help="number of gloo ranks")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three modes")
    parser.add_argument("--workdir", default=None, help="where to write (default: a tmp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out:
        args.workdir = args.workdir or tmp
        for round_ in range(args.rounds):
            for mode in MODES:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                workdir = Path(args.workdir, f"{mode}-{round_}-root")
                workdir.mkdir()
                job = {"mode": mode, "round": round_, "workdir": str(workdir), "out": out}
                mp.spawn(_worker, args=(args.ranks, port, args, job), nprocs=args.ranks)  # type: ignore[attr-defined]
                shutil.rmtree(workdir)
        runs = {
            r: [
                json.loads(Path(out, f"{m}-{k}-{r}.json").read_text())
                for k in range(args.rounds)
                for m in MODES
            ]
            for r in range(args.ranks)
        }
    layers = max(1, args.size_mb * 2**20 // (args.width * args.width * 4))
    size = layers * args.width * args.width * 4 / 2**20
    print(
        f"model: {layers} x Linear({args.width}, {args.width}) = {size:.0f} MiB float32, "
        f"{args.ranks} ranks, {args.rounds} rounds; medians:"
    )
    print(
        f"{'mode':16} " + " ".join(f"{'rank ' + str(r) + ' s':>10} {'peak MiB':>9}" for r in runs)
    )
    for mode in MODES:
        cells = []
        for rank_runs in runs.values():
            mine = [x for x in rank_runs if x["mode"] == mode]
            seconds = statistics.median(x["seconds"] for x in mine)
            peak = statistics.median(x["peak_kib"] for x in mine) / 1024
            cells.append(f"{seconds:10.2f} {peak:9.0f}")
        print(f"{mode:16} " + " ".join(cells))
    print("per round, gathered vs direct (rank 0 time ratio; peak: max over ranks):")
    for round_ in range(args.rounds):

        def get(mode: str, key: str, rank: int = 0, round_: int = round_) -> float:
            return float(
                next(x[key] for x in runs[rank] if x["mode"] == mode and x["round"] == round_)
            )

        time_ratio = get("gathered", "seconds") / get("direct", "seconds")
        peak_g = max(get("gathered", "peak_kib", r) for r in runs)
        peak_d = max(get("direct", "peak_kib", r) for r in runs)
        print(
            f"  round {round_}: time x{time_ratio:.2f}; peak {peak_g / 1024:.0f} MiB gathered vs "
            f"{peak_d / 1024:.0f} MiB direct"
        )


if __name__ == "__main__":
    main()
