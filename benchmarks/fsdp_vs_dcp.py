"""FSDP2 head-to-head: orbit_pt's CheckpointManager against torch.distributed.checkpoint (DCP).

The same FSDP2 model and AdamW state (gloo ranks on CPU, one optimizer step taken so that the
state exists) is saved and restored by each mode, each (round, mode) in fresh processes:

- ``orbit sync``: ``CheckpointManager(root).save(step, {"model": model, "optimizer": opt})``;
- ``orbit async``: the same with ``CheckpointManagerOptions(async_save=True)``; then
  ``wait_until_finished()``;
- ``dcp sync``: ``dcp.save`` of ``get_state_dict(model, opt)``: the DCP path torchtitan drives;
- ``dcp async``: ``dcp.async_save`` of the same, on a gloo group of its own (as torchtitan); then
  the future's ``result()``;
- ``dcp hf``: ``dcp.save`` through ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True)``: every rank writes a shard file, then rank 0 consolidates them into
  one HF safetensors file (torchtitan's ``last_save_in_hf`` path without an index mapping).
  safetensors holds tensors only, so the optimizer's ``param_groups`` are left out;
- ``tc sync``: ``torch_checkpointing.CheckpointManager`` (0.1.1, the backend torchtitan 0.3 ships
  beside DCP) with a sync saver and buffered writes (``use_direct_io=False``: its O_DIRECT stream
  fails with EINVAL on a file's unaligned tail here), each rank's state dict as one torch.save
  file per item. Its resharding metadata all-gathers on ``device="cuda"`` in 0.1.1, so on CPU it
  saves without a resharder and restores the same layout only; skipped when it is not installed;
- ``titan sync`` / ``titan async``: torchtitan's own ``CheckpointManager`` (DCP underneath), only
  with ``--torchtitan DIR`` (see that flag).

Per save: seconds on rank 0 and the maximum over ranks; for async modes the seconds until
``save()`` returned (the training loop is blocked that long) and until the checkpoint is durable;
the growth of each rank's peak resident set during the save (``VmHWM``, reset through
``/proc/self/clear_refs``, over ``VmRSS`` before). Then the live state is zeroed and restored from
the checkpoint into the sharded model (orbit: ``mgr.restore``; DCP: ``dcp.load`` +
``set_state_dict``), timed, and checked against a fingerprint taken before the save. Restores read
the files just written: warm, from whatever of them the page cache holds (buffered writes leave
all of it there, O_DIRECT writes none), unless ``--cold`` drops the cache first (needs root).

Ratios are medians over rounds of per-round ratios against ``dcp sync`` (each round runs every mode
back to back, starting at another mode each round, so a ratio compares runs that shared the
machine's state).

``--layout fsdp_tp`` (FSDP x TP on a 2-D mesh) and ``--layout pp`` (pipeline stages) run the same
modes on those layouts (see docs/layouts.md).

Run: ``.venv/bin/python benchmarks/fsdp_vs_dcp.py --size-mb 1024 --rounds 3 --png out.png``
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES: tuple[str, ...] = ("orbit sync", "orbit async", "dcp sync", "dcp async", "dcp hf")
MODES += ("tc sync",)  # only when torch_checkpointing is installed
MODES += ("titan sync", "titan async")  # only with --torchtitan
BASELINE = "dcp sync"
STEP = 1
LR = 1e-3


# ------------------------------------------------------------------------------------ the model


def _layers(size_mb: int, width: int) -> int:
    """Linear layers whose weights plus AdamW's two moments make about ``size_mb`` MiB."""
    return max(1, round(size_mb * 2**20 / (3 * width * width * 4)))


def _build(args: argparse.Namespace, *, titan: bool) -> tuple[torch.nn.Module, Any]:
    """A stack of Linear layers in ``args.layout`` and its AdamW, after one step.

    ``fsdp``: FSDP2, built on the meta device and materialized shard by shard. ``fsdp_tp``: a 2-D
    mesh (ranks / 2) x 2, layers alternately ``ColwiseParallel`` (``Shard(0)``) and
    ``RowwiseParallel`` (``Shard(1)``) over "tp", FSDP2 over "dp" (``_StridedShard``). ``pp``:
    pipeline stages, each rank an even share of the layers under their global names. Stepped
    with synthetic gradients: a forward and backward would only add seconds to every process.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    width, layers = args.width, _layers(args.size_mb, args.width)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.layout == "pp":
        share = torch.tensor_split(torch.arange(layers), world_size)[rank].tolist()
        model: torch.nn.Module = torch.nn.ModuleDict(
            {str(i): torch.nn.Linear(width, width, bias=False) for i in share}
        )
    elif args.layout == "fsdp_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Sequential(
            *(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        )
        styles = (ColwiseParallel, RowwiseParallel)
        plan = {str(i): styles[i % 2]() for i in range(layers)}
        parallelize_module(model, mesh["tp"], plan)  # type: ignore[arg-type]
        for layer in model:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        with torch.device("meta"):
            model = torch.nn.Sequential(
                *(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
            )
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.uniform_(-0.02, 0.02)
            param.grad = param.detach().clone()
    if titan:  # torchtitan's manager takes its own optimizer container, not a torch optimizer
        from torchtitan.components.optimizer import OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": LR})
        config = OptimizersContainer.Config(param_groups=[group], implementation="foreach")
        optimizer: Any = OptimizersContainer(config, model_parts=[model])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _local_tensors(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """This rank's shards: parameters, then every optimizer state tensor."""
    from torch.distributed.tensor import DTensor

    optimizers = getattr(optimizer, "optimizers", [optimizer])
    tensors = list(model.parameters()) + [
        value
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _fingerprint(model: torch.nn.Module, optimizer: Any) -> list[float]:
    return [float(t.detach().double().sum()) for t in _local_tensors(model, optimizer)]


@torch.no_grad()
def _zero(model: torch.nn.Module, optimizer: Any) -> None:
    """Wipe the live state, so that a restore that loads nothing fails the fingerprint check."""
    for tensor in _local_tensors(model, optimizer):
        tensor.zero_()


# ----------------------------------------------------------------------------------- the modes


class _Saver(Protocol):
    def save(self) -> None:
        """Start the save of ``STEP``; return when the training loop could go on."""

    def wait(self) -> None:
        """Return when the save is durable."""

    def restore(self) -> None:
        """Load ``STEP`` into the live model and optimizer."""

    def close(self) -> None: ...


class _Orbit:
    def __init__(self, root: Path, model: Any, optimizer: Any, *, async_: bool) -> None:
        from orbit_pt import CheckpointManager, CheckpointManagerOptions

        options = CheckpointManagerOptions(async_save=async_)
        self.mgr = CheckpointManager(root, options=options)
        self.items = {"model": model, "optimizer": optimizer}

    def save(self) -> None:
        self.mgr.save(STEP, self.items, force=True)

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def restore(self) -> None:
        self.mgr.restore(STEP, self.items)

    def close(self) -> None:
        self.mgr.close()


class _Dcp:
    def __init__(self, root: Path, model: Any, optimizer: Any, *, async_: bool) -> None:
        self.path = str(root / f"step-{STEP}")
        self.model, self.optimizer = model, optimizer
        # torchtitan saves asynchronously over a gloo group of its own: the upload thread's
        # collectives must not interleave with the training thread's.
        self.group = dist.new_group(backend="gloo") if async_ else None
        self.future: Any = None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self) -> None:
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        if self.group is None:
            save(self._state(), checkpoint_id=self.path)
        else:
            self.future = async_save(
                self._state(), checkpoint_id=self.path, process_group=self.group
            )

    def wait(self) -> None:
        if self.future is not None:
            # An AsyncSaveResponse (staging in the background) or a plain Future.
            getattr(self.future, "upload_completion", self.future).result()

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._state()
        load(state, checkpoint_id=self.path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)


class _DcpHf(_Dcp):
    """DCP into HF safetensors: a shard file per rank, then one consolidated file on rank 0."""

    def __init__(self, root: Path, model: Any, optimizer: Any) -> None:
        super().__init__(root, model, optimizer, async_=False)

    def _tensors(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of ``state`` under flat names (safetensors holds nothing else)."""
        flat = {f"model.{k}": v for k, v in state["model"].items()}
        for fqn, moments in state["optimizer"]["state"].items():
            flat.update({f"optimizer.{fqn}.{k}": v for k, v in moments.items()})
        return flat

    def save(self) -> None:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        # The shards go to path/sharded, the consolidated file to path.
        writer = HuggingFaceStorageWriter(
            path=self.path, save_distributed=True, enable_consolidation=True
        )
        save(self._tensors(self._state()), storage_writer=writer)

    def restore(self) -> None:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._state()  # its tensors are loaded in place through the flat view
        load(self._tensors(state), storage_reader=HuggingFaceStorageReader(self.path))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


class _TorchCheckpointing(_Dcp):
    """torch_checkpointing's CheckpointManager, in the configuration that runs on CPU."""

    def __init__(self, root: Path, model: Any, optimizer: Any) -> None:
        from torch_checkpointing.checkpoint_manager import CheckpointManager
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.schema import ItemSpec
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        super().__init__(root, model, optimizer, async_=False)
        config = CheckpointManager.Config(
            items={"model": ItemSpec(), "optimizer": ItemSpec()},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
        self.mgr = CheckpointManager(config)

    def save(self) -> None:
        self.mgr.save(self.path, self._state())

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        self.mgr.load(self.path, into=state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


class _Titan:
    """torchtitan's CheckpointManager, built as its trainer builds it (no data loader)."""

    def __init__(self, root: Path, model: Any, optimizer: Any, *, async_: bool) -> None:
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

        config = CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=1,
            keep_latest_k=0,
            async_mode="async" if async_ else "disabled",
        )
        self.mgr = CheckpointManager(
            config,
            dataloader=None,
            model_parts=[model],
            optimizers=optimizer,
            lr_schedulers=LRSchedulersContainer(optimizer, lambda _: 1.0),
            states={},
            sd_adapter=None,
            base_folder=str(root),
        )

    def save(self) -> None:
        self.mgr.save(STEP)

    def wait(self) -> None:
        self.mgr.maybe_wait_for_saving()

    def restore(self) -> None:
        self.mgr.load(STEP)

    def close(self) -> None:
        self.mgr.close()


def _saver(mode: str, root: Path, model: Any, optimizer: Any) -> _Saver:
    async_ = mode.endswith("async")
    if mode.startswith("orbit"):
        return _Orbit(root, model, optimizer, async_=async_)
    if mode == "dcp hf":
        return _DcpHf(root, model, optimizer)
    if mode == "tc sync":
        return _TorchCheckpointing(root, model, optimizer)
    if mode.startswith("dcp"):
        return _Dcp(root, model, optimizer, async_=async_)
    return _Titan(root, model, optimizer, async_=async_)


# -------------------------------------------------------------------------------- measurement


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


class _Span:
    """Seconds and peak-RSS growth of one phase, started after a barrier."""

    def __enter__(self) -> _Span:
        gc.collect()
        # Hand freed heap pages back (the gradients, an earlier phase's buffers): otherwise new
        # allocations reuse them and the growth of the peak understates what the phase needs.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        dist.barrier()
        self.before = _rss_kib("VmRSS")
        _reset_peak()
        self.start = time.perf_counter()
        return self

    def lap(self) -> float:
        return time.perf_counter() - self.start

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.lap()
        self.peak_mib = (_rss_kib("VmHWM") - self.before) / 1024


def _drop_page_cache() -> None:
    """Evict the files just written from the page cache (on every rank's machine: here one),
    so that every mode restores from the disk: O_DIRECT writes never enter the cache, buffered
    ones stay there, and a warm restore would compare memory against the disk."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
    dist.barrier()


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, job: dict) -> None:
    """One save and one restore of one mode, in fresh processes."""
    if args.torchtitan:
        sys.path.insert(0, args.torchtitan)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # torchrun sets OMP_NUM_THREADS=1 for each worker when it starts several per node; without
    # it, 4 ranks x 2 intra-op threads on 2 cores spin against each other in every large copy.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, optimizer = _build(args, titan=job["mode"].startswith("titan"))
    shard_mib = sum(t.nbytes for t in _local_tensors(model, optimizer)) / 2**20
    # Built outside the timed region: managers open their root and gloo groups of their own.
    saver = _saver(job["mode"], Path(job["workdir"]), model, optimizer)
    with _Span() as save:
        saver.save()
        blocked = save.lap()
        saver.wait()
    expected = _fingerprint(model, optimizer)
    _zero(model, optimizer)
    if args.cold:
        _drop_page_cache()
    with _Span() as restore:
        saver.restore()
    wrong = sum(a != b for a, b in zip(_fingerprint(model, optimizer), expected, strict=True))
    saver.close()
    result = {
        **job,
        "rank": rank,
        "seconds": save.seconds,
        "blocked": blocked,
        "peak_mib": save.peak_mib,
        "restore_seconds": restore.seconds,
        "wrong": wrong,
        "shard_mib": shard_mib,
    }
    Path(job["out"], f"{job['mode']}-{job['round']}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(args: argparse.Namespace, modes: list[str], out: str) -> dict[str, str]:
    """Every round runs every mode in fresh processes; returns the modes that failed, and why."""
    failed: dict[str, str] = {}
    for round_ in range(args.rounds):
        # Each round starts at another mode, so that no mode always follows the same one.
        shift = round_ % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            if mode in failed:
                continue
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            workdir = Path(args.workdir, f"{mode.replace(' ', '-')}-{round_}")
            workdir.mkdir()
            job = {"mode": mode, "round": round_, "workdir": str(workdir), "out": out}
            try:
                # Forked from this process, which has imported torch but started nothing: fresh
                # processes without paying each one's seconds of imports.
                mp.start_processes(  # type: ignore[attr-defined]
                    _worker, (args.ranks, port, args, job), args.ranks, start_method="fork"
                )
            except mp.ProcessRaisedException as exc:  # type: ignore[attr-defined]
                failed[mode] = str(exc).strip().splitlines()[-1]
            shutil.rmtree(workdir)
            os.sync()  # what a mode left unsynced is not flushed during the next one's fsyncs
            print(f"round {round_}: {mode} done", file=sys.stderr, flush=True)
    return failed


# ----------------------------------------------------------------------------------- reporting


def _summarize(args: argparse.Namespace, modes: list[str], out: str) -> dict[str, dict]:
    """Per mode: medians over rounds, and medians of per-round ratios against ``BASELINE``."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for file in Path(out).glob("*.json"):
        run = json.loads(file.read_text())
        runs.setdefault((run["mode"], run["round"]), []).append(run)
    rounds = range(args.rounds)

    def per_round(mode: str, round_: int) -> dict[str, float]:
        ranks = sorted(runs[mode, round_], key=lambda r: r["rank"])
        return {
            "rank0": ranks[0]["seconds"],
            "max": max(r["seconds"] for r in ranks),
            "blocked": max(r["blocked"] for r in ranks),
            "restore": max(r["restore_seconds"] for r in ranks),
            **{f"peak{r['rank']}": r["peak_mib"] for r in ranks},
            "shard": max(r["shard_mib"] for r in ranks),
            "wrong": sum(r["wrong"] for r in ranks),
        }

    if any((BASELINE, k) not in runs for k in rounds):
        raise SystemExit(f"{BASELINE} did not run in every round: no ratios to report")

    def rows(mode: str) -> list[dict[str, float]]:
        return [per_round(mode, k) for k in rounds]

    def ratio(key: str, num: str, den: str) -> float:
        """Median over rounds of ``num[key] / den[key]``: both ran in the same round."""
        return statistics.median(n[key] / d[key] for n, d in zip(rows(num), rows(den), strict=True))

    table: dict[str, dict] = {}
    for mode in modes:
        if any((mode, k) not in runs for k in rounds):
            continue  # it failed, and was not run again
        done = rows(mode)
        row: dict[str, Any] = {key: statistics.median(d[key] for d in done) for key in done[0]}
        row["wrong"] = max(d["wrong"] for d in done)
        row["speedup"] = ratio("max", BASELINE, mode)  # > 1: faster than dcp sync
        row["blocked_ratio"] = ratio("blocked", mode, BASELINE)  # < 1: blocks less
        row["restore_speedup"] = ratio("restore", BASELINE, mode)
        table[mode] = row
    if "orbit sync" in table and "dcp hf" in table:
        table["orbit sync"]["vs_hf"] = ratio("max", "dcp hf", "orbit sync")
    if "orbit async" in table and "dcp async" in table:
        table["orbit async"]["vs_dcp_async"] = ratio("blocked", "orbit async", "dcp async")
    return table


def _print(args: argparse.Namespace, table: dict[str, dict], failed: dict[str, str]) -> None:
    layers = _layers(args.size_mb, args.width)
    state_mib = 3 * layers * args.width**2 * 4 / 2**20
    gb = state_mib * 2**20 / 1e9
    print(
        f"model: {layers} x Linear({args.width}, {args.width}) fp32 + AdamW moments = "
        f"{state_mib:.0f} MiB of state, layout {args.layout} on {args.ranks} gloo ranks (CPU); "
        f"{args.rounds} rounds, fresh processes per (round, mode); medians"
    )
    ranks = range(args.ranks)
    head = (
        f"| {'mode':11} | save s r0 | save s max | GB/s | blocked s | x dcp sync | "
        f"blocked/dcp | {' | '.join(f'peak MiB r{r}' for r in ranks)} | restore s | "
        f"restore x dcp | restored? |"
    )
    print(head)
    print("|" + "|".join("-" * len(cell) for cell in head.split("|")[1:-1]) + "|")
    for mode, row in table.items():
        peaks = " | ".join(f"{row[f'peak{r}']:12.0f}" for r in ranks)
        print(
            f"| {mode:11} | {row['rank0']:9.2f} | {row['max']:10.2f} | {gb / row['max']:4.2f} | "
            f"{row['blocked']:9.2f} | {row['speedup']:9.2f}x | "
            f"{row['blocked_ratio']:11.2f} | {peaks} | {row['restore']:9.2f} | "
            f"{row['restore_speedup']:12.2f}x | "
            f"{'yes' if not row['wrong'] else str(row['wrong']) + ' wrong':9} |"
        )
    print(f"shard per rank: {max(r['shard'] for r in table.values()):.0f} MiB of state")
    if args.cold:
        print("restore: cold (the page cache was dropped before every restore)")
    else:
        print("restore: warm (the files were just written; --cold drops the page cache first)")
    print("restored?: local tensors (all ranks) whose sum after the restore differs from before")
    for mode, why in failed.items():
        print(f"{mode}: could not run: {why}")
    print("targets:")
    orbit_sync, orbit_async = table.get("orbit sync"), table.get("orbit async")
    if orbit_sync and "speedup" in orbit_sync:
        ratio = orbit_sync["speedup"]
        print(f"  orbit sync >= 1.0x dcp sync throughput: {ratio:.2f}x, {_met(ratio >= 1.0)}")
    if orbit_sync and "vs_hf" in orbit_sync:
        ratio = orbit_sync["vs_hf"]
        print(f"  orbit sync >= 1.5x dcp hf (consolidated): {ratio:.2f}x, {_met(ratio >= 1.5)}")
    if orbit_async and "vs_dcp_async" in orbit_async:
        ratio = orbit_async["vs_dcp_async"]
        print(
            f"  orbit async blocked <= dcp async_save's: {ratio:.2f}x of it, {_met(ratio <= 1.0)}"
        )
    for mode in ("orbit sync", "orbit async"):
        if mode in table:
            row = table[mode]
            factor = max(row[f"peak{r}"] for r in ranks) / row["shard"]
            print(
                f"  {mode} peak RSS growth O(shard) (<= 1.25x the rank's shard): "
                f"{factor:.2f}x, {_met(factor <= 1.25)}"
            )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _png(path: str, args: argparse.Namespace, table: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gb = 3 * _layers(args.size_mb, args.width) * args.width**2 * 4 / 1e9
    modes = list(table)
    ranks = range(args.ranks)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (axes[0, 0], "save GB/s (until durable; higher is better)", "max"),
        (axes[0, 1], "seconds the training loop is blocked (lower is better)", "blocked"),
        (axes[1, 1], "restore GB/s (warm page cache; higher is better)", "restore"),
    )
    for ax, title, key in panels:
        values = [table[m][key] if key == "blocked" else gb / table[m][key] for m in modes]
        ax.bar(modes, values, color=["C0" if m.startswith("orbit") else "C7" for m in modes])
        ax.set_title(title)
    width = 0.8 / args.ranks
    ax = axes[1, 0]
    for r in ranks:
        xs = [i + (r - (args.ranks - 1) / 2) * width for i in range(len(modes))]
        ax.bar(xs, [table[m][f"peak{r}"] for m in modes], width, label=f"rank {r}")
    shard = max(row["shard"] for row in table.values())
    ax.axhline(shard, color="k", linestyle="--", label=f"shard ({shard:.0f} MiB)")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_title("peak RSS growth during the save, MiB per rank")
    ax.legend()
    for ax in axes.flat:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(
        f"FSDP2, {gb:.2f} GB of model + AdamW state, {args.ranks} gloo ranks on CPU, "
        f"median of {args.rounds} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mb", type=int, default=1024, help="total state in MiB: weights + AdamW moments"
    )
    parser.add_argument("--width", type=int, default=2048, help="width of each square layer")
    parser.add_argument("--ranks", type=int, default=2, help="number of gloo ranks")
    parser.add_argument(
        "--layout",
        choices=("fsdp", "fsdp_tp", "pp"),
        default="fsdp",
        help="fsdp: FSDP2; fsdp_tp: FSDP x TP on a (ranks / 2) x 2 mesh; pp: pipeline stages",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before every restore (needs root: /proc/sys/vm/drop_caches)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (default 1: torchrun's OMP_NUM_THREADS per worker)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated modes to run (default: all)"
    )
    parser.add_argument("--workdir", default=None, help="where to write (default: a tmp dir)")
    parser.add_argument("--png", default=None, help="write a figure there (needs matplotlib)")
    parser.add_argument(
        "--torchtitan",
        default=None,
        help="a folder holding torchtitan and its pure-Python imports, put first on sys.path "
        "for the titan modes (they are skipped without it); e.g. `pip download torchtitan "
        "--no-deps`, unzip the wheel there, then `pip install --no-deps --target DIR tyro "
        "docstring_parser typeguard spmd_types==0.2.3`",
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    skipped = {}
    if not args.torchtitan:
        skipped = {m: "pass --torchtitan DIR to run it" for m in modes if m.startswith("titan")}
        modes = [m for m in modes if m not in skipped]
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        skipped.update(
            {m: "pip install torch_checkpointing to run it" for m in modes if m == "tc sync"}
        )
        modes = [m for m in modes if m not in skipped]
    if args.layout == "fsdp_tp" and args.ranks % 2:
        parser.error("--layout fsdp_tp needs an even --ranks (the mesh is ranks / 2 x 2)")
    if BASELINE not in modes:
        parser.error(f"--modes must include {BASELINE!r}: every ratio is against it")
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out:
        args.workdir = args.workdir or tmp
        failed = _run(args, modes, out)
        table = _summarize(args, modes, out)
    _print(args, table, {**skipped, **failed})
    if args.png:
        _png(args.png, args, table)


if __name__ == "__main__":
    main()
