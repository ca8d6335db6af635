"""orbit_pt against the machine's limits and against its peers, side by side in one run.

    python benchmarks/bench.py [--size-gb 1.0] [--repeats 3] [--dir PATH] [--json OUT]

Builds a transformer-like model (many tensors from KiB to tens of MiB) with AdamW state, then
measures, in the same process and the same run:

- the machine's limits: O_DIRECT write + fsync, buffered write + fsync, cold read, and a copy
  of the whole state into preallocated tensors (memcpy-class);
- orbit_pt: sync save, async save (time the caller is blocked, and total until durable),
  cold and warm restore in place;
- peers: torch.save + fsync / torch.load(mmap) + copy, safetensors save_file + fsync /
  load_file + copy, DCP save / load;
- peak extra memory (RSS above the level before each operation, sampled every 2 ms).

It prints a table of GB/s, ratios to the limits and to the best peer, and writes JSON. Cold
reads evict the files from the page cache with posix_fadvise(DONTNEED) after an fsync (which
needs no privileges); the table says when that is not available. Machines are noisy: the
figures are medians of ``--repeats`` runs and only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orbit_pt import CheckpointManager, CheckpointManagerOptions

GB = 1e9


# ------------------------------------------------------------------------------------ the state


class Block(nn.Module):
    """A transformer block's parameter shapes (attention + MLP + norms)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.norm1 = nn.LayerNorm(hidden)
        self.norm2 = nn.LayerNorm(hidden)


class TransformerLike(nn.Module):
    def __init__(self, hidden: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)


def build_state(size_gb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model plus AdamW state of about ``size_gb`` GB in all (fp32; AdamW adds 2x params)."""
    param_bytes = size_gb * GB / 3
    hidden = 512 if size_gb <= 0.3 else 1024
    vocab = 8 * hidden
    per_layer = 12 * hidden * hidden * 4
    layers = max(1, round((param_bytes - 2 * vocab * hidden * 4) / per_layer))
    torch.manual_seed(0)
    model = TransformerLike(hidden, layers, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state, by a unique name (for the peers that take flat dicts)."""
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[id(p)]}/{key}"] = value
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ----------------------------------------------------------------------------------- measuring


class PeakRSS:
    """Peak resident memory above the level at start, sampled on a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Result:
    name: str
    kind: str  # "limit", "orbit_pt" or "peer"
    seconds: list[float] = field(default_factory=list)
    extra_memory: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def evict(path: Path) -> bool:
    """Drop a folder's (or file's) pages from the page cache; False if not possible."""
    if not hasattr(os, "posix_fadvise"):
        return False
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


# -------------------------------------------------------------------------------- the limits


def odirect_write(path: Path, total: int, chunk: int = 16 << 20, threads: int = 2) -> str:
    """Write ``total`` bytes with O_DIRECT in aligned chunks from ``threads`` writers, then fsync.

    Two writers keep two requests in flight, as orbit_pt's writer does: the fairest limit.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        note = ""
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        note = "O_DIRECT unsupported here: buffered"
    chunks = (total + chunk - 1) // chunk

    def writer(index: int) -> None:
        buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        buffer.write(os.urandom(1 << 20) * (chunk >> 20))
        for n in range(index, chunks, threads):
            os.pwrite(fd, buffer, n * chunk)

    try:
        pool = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        os.fsync(fd)
    finally:
        os.close(fd)
    return note


def buffered_write(path: Path, total: int, chunk: int = 64 << 20) -> None:
    data = os.urandom(1 << 20) * (chunk >> 20)
    with open(path, "wb") as f:
        written = 0
        while written < total:
            written += f.write(data)
        f.flush()
        os.fsync(f.fileno())


def cold_read(path: Path, threads: int = 2, chunk: int = 64 << 20) -> None:
    """Read a file with ``threads`` readers of interleaved chunks (after eviction)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)

    def reader(index: int) -> None:
        buffer = bytearray(chunk)
        offset = index * chunk
        while offset < size:
            os.preadv(fd, [buffer], offset)
            offset += threads * chunk

    try:
        pool = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ the run


def run(size_gb: float, repeats: int, workdir: Path) -> dict[str, Any]:
    model, optimizer = build_state(size_gb)
    tensors = state_tensors(model, optimizer)
    total = nbytes(tensors)
    items = {"model": model, "optimizer": optimizer}
    results: dict[str, Result] = {}

    def measure(
        name: str, kind: str, fn: Callable[[], Any], *, before: Callable[[], Any] | None = None
    ) -> None:
        result = results.setdefault(name, Result(name, kind))
        for _ in range(repeats):
            if before is not None:
                before()
            with PeakRSS() as rss:
                started = time.perf_counter()
                note = fn()
                result.seconds.append(time.perf_counter() - started)
            result.extra_memory.append(rss.extra)
            if isinstance(note, str) and note:
                result.note = note

    scratch = workdir / "scratch"

    def fresh(path: Path) -> Callable[[], None]:
        def clear() -> None:
            shutil.rmtree(path, ignore_errors=True)
            if path.suffix:
                path.unlink(missing_ok=True)

        return clear

    # The machine's limits.
    raw = workdir / "raw.bin"
    measure(
        "O_DIRECT write + fsync (2 threads)",
        "limit",
        lambda: odirect_write(raw, total),
        before=fresh(raw),
    )
    measure(
        "buffered write + fsync", "limit", lambda: buffered_write(raw, total), before=fresh(raw)
    )
    can_evict = evict(raw)
    measure("cold read (2 threads)", "limit", lambda: cold_read(raw), before=lambda: evict(raw))
    copies = {k: torch.zeros_like(v) for k, v in tensors.items()}  # touched: no page faults

    def copy_all() -> None:
        for k, v in tensors.items():
            copies[k].copy_(v)

    measure("copy into preallocated", "limit", copy_all)
    copies.clear()
    raw.unlink()

    # orbit_pt.
    root = workdir / "orbit"
    sync = CheckpointManager(root, options=CheckpointManagerOptions(preemption_signals=()))
    counter = iter(range(10**9))
    measure("orbit_pt save (sync)", "orbit_pt", lambda: sync.save(next(counter), items, force=True))
    restored_step = sync.latest_step()
    measure(
        "orbit_pt restore in place (cold)",
        "orbit_pt",
        lambda: sync.restore(restored_step, items),
        before=lambda: evict(sync.step_dir(restored_step or 0)),
    )
    measure(
        "orbit_pt restore in place (warm)", "orbit_pt", lambda: sync.restore(restored_step, items)
    )
    sync.close()
    shutil.rmtree(root)

    # The same save with the async manager's retention, so that "async until durable" has a
    # sync save to compare with that also deletes the previous step.
    kept = CheckpointManager(
        root, options=CheckpointManagerOptions(keep_last_n=1, preemption_signals=())
    )
    measure(
        "orbit_pt save (sync, keep_last_n=1)",
        "orbit_pt",
        lambda: kept.save(next(counter), items, force=True),
    )
    kept.close()
    shutil.rmtree(root)

    async_mgr = CheckpointManager(
        root,
        options=CheckpointManagerOptions(async_save=True, keep_last_n=1, preemption_signals=()),
    )
    measure(
        "orbit_pt async save: blocked",
        "orbit_pt",
        lambda: async_mgr.save(next(counter), items, force=True),
        before=async_mgr.wait_until_finished,
    )

    def async_total() -> None:
        async_mgr.save(next(counter), items, force=True)
        async_mgr.wait_until_finished()

    measure("orbit_pt async save: until durable", "orbit_pt", async_total)
    async_mgr.close()
    shutil.rmtree(root)

    # Peers.
    torch_file = scratch / "state.pt"
    scratch.mkdir(parents=True, exist_ok=True)

    def torch_save() -> None:
        torch.save(tensors, torch_file)
        fsync_tree(torch_file)

    measure("torch.save + fsync", "peer", torch_save, before=fresh(torch_file))

    def torch_load() -> None:
        loaded = torch.load(torch_file, mmap=True, weights_only=True)
        for k, v in loaded.items():
            tensors[k].copy_(v)

    measure("torch.load(mmap) + copy (cold)", "peer", torch_load, before=lambda: evict(torch_file))

    import safetensors.torch

    st_file = scratch / "state.safetensors"

    def st_save() -> None:
        safetensors.torch.save_file(tensors, str(st_file))
        fsync_tree(st_file)

    measure("safetensors.save_file + fsync", "peer", st_save, before=fresh(st_file))

    def st_load() -> None:
        loaded = safetensors.torch.load_file(str(st_file))
        for k, v in loaded.items():
            tensors[k].copy_(v)

    measure("safetensors.load_file + copy (cold)", "peer", st_load, before=lambda: evict(st_file))

    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_fn

    dcp_dir = scratch / "dcp"

    def dcp_save() -> None:
        dcp_save_fn(tensors, storage_writer=FileSystemWriter(str(dcp_dir), thread_count=2))

    measure("DCP save (2 threads)", "peer", dcp_save, before=fresh(dcp_dir))
    measure(
        "DCP load in place (cold)",
        "peer",
        lambda: dcp_load(tensors, storage_reader=FileSystemReader(str(dcp_dir))),
        before=lambda: evict(dcp_dir),
    )
    shutil.rmtree(scratch)

    return report(results, total, can_evict, len(tensors))


def report(results: dict[str, Result], total: int, can_evict: bool, count: int) -> dict[str, Any]:
    def rate(name: str) -> float:
        return total / results[name].median / GB

    write_limit = rate("O_DIRECT write + fsync (2 threads)")
    read_limit = rate("cold read (2 threads)")
    copy_limit = rate("copy into preallocated")
    best_peer_save = max(
        rate(n)
        for n in ("torch.save + fsync", "safetensors.save_file + fsync", "DCP save (2 threads)")
    )
    ratios = {
        "sync save / O_DIRECT write limit": rate("orbit_pt save (sync)") / write_limit,
        "sync save / fastest peer save": rate("orbit_pt save (sync)") / best_peer_save,
        "cold restore / cold read limit": rate("orbit_pt restore in place (cold)") / read_limit,
        "warm restore / in-memory copy": rate("orbit_pt restore in place (warm)") / copy_limit,
        "async blocked time / copy time": results["orbit_pt async save: blocked"].median
        / results["copy into preallocated"].median,
        "async until durable / sync save, same retention": rate(
            "orbit_pt async save: until durable"
        )
        / rate("orbit_pt save (sync, keep_last_n=1)"),
    }
    runs = len(next(iter(results.values())).seconds)
    print(f"\nstate: {total / GB:.2f} GB in {count} tensors; medians of {runs} runs")
    if not can_evict:
        print("note: could not evict the page cache here; 'cold' reads may be warm")
    print(f"{'operation':44} {'GB/s':>7} {'median s':>9} {'peak extra MB':>14}  note")
    for r in results.values():
        extra = max(r.extra_memory) / 1e6
        print(f"{r.name:44} {total / r.median / GB:7.2f} {r.median:9.3f} {extra:14.0f}  {r.note}")
    print()
    for name, value in ratios.items():
        print(f"{name:44} {value:7.2f}")
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "state_bytes": total,
        "tensors": count,
        "page_cache_evicted": can_evict,
        "results": {
            r.name: {
                "kind": r.kind,
                "seconds": r.seconds,
                "median_s": r.median,
                "gb_per_s": total / r.median / GB,
                "peak_extra_bytes": max(r.extra_memory),
                "note": r.note,
            }
            for r in results.values()
        },
        "ratios": ratios,
    }


@contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="orbit_pt-bench-", dir=path))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size-gb", type=float, default=1.0, help="state size in GB (model + AdamW)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    with workdir(args.dir) as base:
        results = run(args.size_gb, args.repeats, base)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
