"""Multi-tier checkpoints: what a save costs the training loop, and how soon it is safe, per tier.

The persistent root is an ``s3://`` prefix on a moto S3 server in its own process on 127.0.0.1
(a slow, far tier: moto is a CPU-bound Python server); the local tier is a folder on this
machine's disk. Each round saves one step of a model and its AdamW state (async saves) with:

- ``local only``: ``LocalTierOptions(save_interval_steps=1)``, no persistent save at that step;
- ``persistent only``: no local tier, the step goes to S3;
- ``both``: the step goes to both tiers (two lanes, each with its own gloo group and thread).

Each manager saves ``--saves`` steps, waiting for each to be durable before the next; the
first save of a manager allocates its staging buffers and is not counted. It reports, per mode,
the time ``save()`` blocked the loop (the host copy) and the time until the step was durable
on every tier it went to (``wait_until_finished()``), then the restore time of the last step
from the local tier and from S3 (a manager with an empty mirror: another machine). The modes
rotate their order each round; medians are printed.

With ``--replicas`` it instead runs 2 gloo ranks as 2 simulated nodes (a local root each) and
compares, in the same run, local saves without and with a replica on the other node (each
rank's shard streamed over gloo and checked on arrival), then restores after node 1's root is
deleted (its shard fetched from the replica) against a restore with both nodes intact.

Run: ``.venv/bin/python benchmarks/multi_tier.py --size-mb 128 --rounds 3``
(``--replicas --size-mb 64``: the 2-rank replica comparison)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from s3_checkpoint import start_server

from orbit_pt import CheckpointManager, CheckpointManagerOptions, LocalTierOptions


def _training_state(size_mb: int, width: int = 1024) -> tuple[torch.nn.Sequential, Any]:
    """A model of ``size_mb`` MB of fp32 weights and its AdamW state after one step (3x)."""
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).square().mean().backward()
    opt.step()
    return model, opt


def _replica_rank(rank: int, world: int, port: int, work: str, size_mb: int, rounds: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = Path(work)
    torch.manual_seed(rank)  # every rank its own state, as data-parallel shards are
    model, opt = _training_state(size_mb)
    items = {"model": model, "optimizer": opt}
    times: dict[str, list[float]] = {"replicas=0": [], "replicas=1": []}
    restores: dict[str, list[float]] = {"both nodes intact": [], "node 1 lost": []}

    def manager(replicas: int) -> CheckpointManager:
        local = LocalTierOptions(
            root=base / f"{replicas}-node{rank}", save_interval_steps=1, replicas=replicas
        )
        options = CheckpointManagerOptions(save_interval_steps=10**9, local=local)
        return CheckpointManager(base / f"persistent-{replicas}", options=options)

    for round_ in range(rounds):
        for replicas in (round_ % 2, 1 - round_ % 2):
            with manager(replicas) as mgr:
                for step in range(1, 4):
                    dist.barrier()
                    started = time.perf_counter()
                    mgr.save(step, items)  # synchronous: returns once every shard is committed
                    if step > 1:
                        times[f"replicas={replicas}"].append(time.perf_counter() - started)
        with manager(1) as mgr:
            dist.barrier()
            started = time.perf_counter()
            mgr.restore(None, items)
            restores["both nodes intact"].append(time.perf_counter() - started)
        dist.barrier()
        if rank == 1:
            shutil.rmtree(base / "1-node1")
        dist.barrier()
        with manager(1) as mgr:
            started = time.perf_counter()
            mgr.restore(None, items)
            restores["node 1 lost"].append(time.perf_counter() - started)
            assert mgr.last_restore is not None
            assert mgr.last_restore.fetched == ((1, 0),)
    if rank == 0:
        state_mb = sum(t.numel() * t.element_size() for t in _tensors(model, opt)) / 2**20
        print(f"\n2 ranks, {state_mb:.0f} MB of state per rank, medians of {rounds} rounds\n")
        print("| local save | time (sync, until committed on every node) |")
        print("|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values):.2f} s |")
        print("\n| restore of the newest local step | time |")
        print("|---|---|")
        for name, values in restores.items():
            print(f"| {name} | {statistics.median(values):.2f} s |")
    dist.barrier()
    dist.destroy_process_group()


def _tensors(model: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    return [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]


def _replicas(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp
    from s3_checkpoint import _free_port

    work = tempfile.mkdtemp(prefix="orbit-replica-bench-")
    try:
        mp.spawn(  # type: ignore[attr-defined]
            _replica_rank,
            args=(2, _free_port(), work, args.size_mb, args.rounds),
            nprocs=2,
            join=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=128, help="model weights (state is 3x)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--saves",
        type=int,
        default=3,
        help="saves per manager (the first, which allocates the staging buffers, is not counted)",
    )
    parser.add_argument("--replicas", action="store_true", help="the 2-rank replica comparison")
    args = parser.parse_args()
    if args.replicas:
        _replicas(args)
        return

    import boto3

    server, endpoint = start_server()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    storage = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    work = Path(tempfile.mkdtemp(prefix="orbit-tier-bench-"))
    model, opt = _training_state(args.size_mb)
    items = {"model": model, "optimizer": opt}
    state_mb = sum(t.numel() * t.element_size() for t in _tensors(model, opt)) / 2**20
    modes = ("local only", "persistent only", "both")
    blocked: dict[str, list[float]] = {m: [] for m in modes}
    durable: dict[str, list[float]] = {m: [] for m in modes}
    restore: dict[str, list[float]] = {"from local": [], "from S3": []}
    try:
        for round_ in range(args.rounds):
            order = modes[round_ % 3 :] + modes[: round_ % 3]
            for mode in order:
                run = uuid.uuid4().hex[:8]
                url = f"s3://bench/{run}"
                local = None
                if mode != "persistent only":
                    local = LocalTierOptions(
                        root=work / f"local-{run}",
                        save_interval_steps=1,
                        keep_last_n=1,
                        replicas=0,  # one process: one node
                    )
                options = CheckpointManagerOptions(
                    save_interval_steps=1 if mode != "local only" else 10**9,
                    keep_last_n=1,
                    async_save=True,
                    local=local,
                )
                mirror = {**storage, "cache_dir": str(work / f"mirror-{run}")}
                with CheckpointManager(url, options=options, storage_options=mirror) as mgr:
                    for step in range(1, 1 + args.saves):
                        with torch.no_grad():
                            next(model.parameters()).add_(1.0)  # "training" between saves
                        started = time.perf_counter()
                        mgr.save(step, items)
                        elapsed = time.perf_counter() - started
                        mgr.wait_until_finished()
                        if step > 1:  # the first save allocates the staging buffers
                            blocked[mode].append(elapsed)
                            durable[mode].append(time.perf_counter() - started)
                if mode == "both":
                    with CheckpointManager(url, options=options, storage_options=mirror) as mgr:
                        started = time.perf_counter()
                        mgr.restore(args.saves, items)
                        restore["from local"].append(time.perf_counter() - started)
                        assert mgr.last_restore is not None
                        assert mgr.last_restore.tier == "local"
                    other = {**storage, "cache_dir": str(work / f"other-{run}")}
                    with CheckpointManager(url, storage_options=other) as mgr:
                        started = time.perf_counter()
                        mgr.restore(args.saves, items)
                        restore["from S3"].append(time.perf_counter() - started)
                shutil.rmtree(work / f"local-{run}", ignore_errors=True)
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nstate: {state_mb:.0f} MB (model + AdamW), {args.rounds} rounds x "
        f"{args.saves - 1} counted saves, medians\n"
    )
    print("| mode | save() blocks the loop | durable on its tiers after |")
    print("|---|---|---|")
    for mode in modes:
        print(
            f"| {mode} | {statistics.median(blocked[mode]) * 1e3:.0f} ms | "
            f"{statistics.median(durable[mode]):.2f} s |"
        )
    print("\n| restore of the step | time |")
    print("|---|---|")
    for name, values in restore.items():
        print(f"| {name} | {statistics.median(values):.2f} s |")
    local_s, s3_s = (statistics.median(v) for v in restore.values())
    print(f"\nrestore from local is {s3_s / local_s:.1f}x faster than from S3")


if __name__ == "__main__":
    main()
