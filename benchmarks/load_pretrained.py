"""Peak memory per rank when an FSDP2 fine-tune starts from a pretrained Hugging Face folder.

Two ways to get the base weights into an FSDP2 model (gloo ranks on CPU), each in fresh
processes at 1, 2 and 4 ranks:

- ``load_pretrained``: the model is built on the meta device, sharded with ``fully_shard``, then
  ``orbit_pt.load_pretrained`` gives each rank memory for its shard and reads only its rows;
- ``from_pretrained+shard``: every rank calls ``AutoModelForCausalLM.from_pretrained`` (the
  whole model), then ``fully_shard`` keeps its rows and frees the rest.

The model is a Llama generated from a config (random weights, at least ``--size-gb`` in float32)
and written by ``save_pretrained`` in bfloat16, as Hub models ship; both ways load it into
float32 master weights.

What is measured, per rank, from just before the load (the model already built, on meta for
``load_pretrained``; a tiny load beforehand pages in the libraries' code for both):

- ``peak``: the growth of the peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs``). It counts file pages mapped into the process too: transformers
  reads safetensors through ``mmap``, so its peak includes the folder's pages it touched (page
  cache, shared between ranks and reclaimable). orbit_pt reads with ``pread`` into the tensors
  and maps nothing, so its peak is its own memory.
- ``anon``: the growth of the peak anonymous resident set (``RssAnon``, sampled every 2 ms by a
  thread): the memory that is the process's own, without mapped files. A short spike between
  two samples can be missed, so ``peak`` is the bound and ``anon`` the explanation.
- ``after``: the resident set once the model is loaded and sharded.

Run: ``.venv/bin/python benchmarks/load_pretrained.py --size-gb 1.0 --ranks 1 2 4``
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("load_pretrained", "from_pretrained+shard")
# TinyLlama-1.1B's shapes, with as many layers as the size asks for.
SHAPES: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _AnonPeak:
    """The highest ``RssAnon`` seen by a thread that samples it every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self.peak = _kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, _kib("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _kib("RssAnon"))


def config(size_gb: float) -> Any:
    """A Llama config with at least ``size_gb`` GB of float32 parameters."""
    import transformers

    h, i, v = SHAPES["hidden_size"], SHAPES["intermediate_size"], SHAPES["vocab_size"]
    kv = h * SHAPES["num_key_value_heads"] // SHAPES["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    fixed = 2 * v * h + h
    layers = max(1, math.ceil((size_gb * 1e9 / 4 - fixed) / per_layer))
    return transformers.LlamaConfig(num_hidden_layers=layers, **SHAPES)


def _shard(model: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _load(mode: str, folder: str) -> Any:
    """Load ``folder`` into an FSDP2 model the way ``mode`` does; returns the model."""
    import transformers

    from orbit_pt import load_pretrained

    if mode == "load_pretrained":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32
            )
        _shard(model)
        return load_pretrained(model, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _shard(model)
    return model


def _worker(rank: int, world_size: int, port: int, job: dict[str, Any]) -> None:
    """One load in fresh processes: peaks are not blurred by earlier loads."""
    import transformers

    from orbit_pt import load_pretrained

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    _load(job["mode"], job["small"])  # pages in the code of the path being measured
    model: Any = None
    if job["mode"] == "load_pretrained":  # built and sharded on meta: no memory, not measured
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(job["folder"]), dtype=torch.float32
            )
        _shard(model)
    gc.collect()
    dist.barrier()
    before, before_anon = _kib("VmRSS"), _kib("RssAnon")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    anon = _AnonPeak()
    start = time.perf_counter()
    if model is not None:
        load_pretrained(model, job["folder"])
    else:
        model = _load(job["mode"], job["folder"])
    gc.collect()
    seconds = time.perf_counter() - start
    result = {
        **job,
        "world_size": world_size,
        "rank": rank,
        "seconds": seconds,
        "peak_kib": _kib("VmHWM") - before,
        "anon_kib": anon.stop() - before_anon,
        "after_kib": _kib("VmRSS") - before,
    }
    Path(job["out"], f"{job['mode']}-{world_size}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="model size, GB of float32")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--max-shard-size", default="5GB", help="save_pretrained's shard size")
    parser.add_argument("--workdir", default=None, help="where to write (default: a tmp dir)")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cfg = config(args.size_gb)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        folder, small = Path(tmp, "model"), Path(tmp, "small")
        torch.manual_seed(0)
        model: Any = transformers.LlamaForCausalLM(cfg)
        size = sum(p.numel() for p in model.parameters()) * 4
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=args.max_shard_size)
        del model
        tiny = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1
        )
        tiny_model: Any = transformers.LlamaForCausalLM(tiny)
        tiny_model.to(torch.bfloat16).save_pretrained(small)
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        results: list[dict[str, Any]] = []
        for world_size in args.ranks:
            for mode in MODES:
                job = {"mode": mode, "folder": str(folder), "small": str(small), "out": tmp}
                mp.spawn(_worker, args=(world_size, _port(), job), nprocs=world_size)  # type: ignore[attr-defined]
                results += [
                    json.loads(Path(tmp, f"{mode}-{world_size}-{r}.json").read_text())
                    for r in range(world_size)
                ]
    print(
        f"model: Llama, {cfg.num_hidden_layers} layers of {SHAPES['hidden_size']}, "
        f"{size / 4 / 1e6:.0f}M parameters = {size / 1e9:.2f} GB in float32, loaded from "
        f"bfloat16 ({len(files)} file(s)); per rank, growth during the load (max over ranks):"
    )
    header = f"| ranks | {'method':21} | peak RSS | peak anon | after | seconds |"
    print(header)
    print("|---:|---|---:|---:|---:|---:|")
    for world_size in args.ranks:
        for mode in MODES:
            mine = [r for r in results if r["world_size"] == world_size and r["mode"] == mode]

            def gb(key: str, rows: list[dict[str, Any]] = mine) -> str:
                return f"{max(r[key] for r in rows) * 1024 / 1e9:.2f} GB"

            seconds = max(r["seconds"] for r in mine)
            print(
                f"| {world_size} | {mode:21} | {gb('peak_kib')} | {gb('anon_kib')} | "
                f"{gb('after_kib')} | {seconds:.1f} |"
            )


if __name__ == "__main__":
    main()
