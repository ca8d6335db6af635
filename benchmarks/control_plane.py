"""What rank 0 gathers and checks during one save, at 8 to 1,024 ranks, for a Llama-70B shape.

    python benchmarks/control_plane.py [--world-sizes 8 64 256 1024] [--dtype float32]
        [--json OUT]

One process, no tensors: a Llama-70B-shaped model (80 layers, hidden 8192, intermediate 28672,
64 heads, 8 KV heads, vocab 128256) and its AdamW state (``exp_avg``, ``exp_avg_sq`` and the
scalar ``step`` of every parameter), sharded on dim 0 over ``W`` ranks as FSDP2 shards them. For
each world size it computes, with orbit_pt's own code:

- the **file plan** every rank computes (``handlers.model.plan_files`` with the default
  ``max_shard_size``, ``_format.safetensors.plan_file`` for ``optimizer.safetensors``), and one
  rank's pieces (``_format.sharding.row_block`` on stand-in DTensors, so torch's own chunking);
- each rank's **write report**, what ``StepStore._write`` returns for the
  ``orbit_pt.save.write`` agreement: the checksums it streamed (none: a file written by several
  ranks gets its checksum from the ranks' CRCs) and, per file, the summary of its byte ranges
  (``_format.coverage.summary``: bytes written, two position sums, the CRC-32C of its bytes
  with zeros elsewhere), encoded as ``Collective.gather`` encodes it;
- **rank 0's check** in ``StepStore._finalize``: decoding every rank's report, grouping the
  summaries by file, ``_format.coverage.summary_problems`` and ``fold_summaries`` per file;
- the step's **metadata** (``StepMetadata.to_json``).

The ranges are those ``_format.sharding.write_files`` records; ``--self-check`` (on by default)
runs the real ``write_files`` on a small model with real tensors on 8 ranks, one after another in
this process, and checks that the ranges it records are the ones computed here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Shard

from orbit_pt._control import collective as _collective
from orbit_pt._format import coverage as _coverage
from orbit_pt._format import sharding as _sharding
from orbit_pt._format.safetensors import PlannedFile, plan_file
from orbit_pt.handlers.model import ModelHandler, plan_files
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata

Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's dimensions."""

    layers: int = 80
    hidden: int = 8192
    intermediate: int = 28672
    heads: int = 64
    kv_heads: int = 8
    vocab: int = 128256


LLAMA_70B = Shape()


def parameters(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter names and shapes of a Hugging Face ``LlamaForCausalLM``."""
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    h, i = shape.hidden, shape.intermediate
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab, h))]


def optimizer_specs(
    params: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype
) -> list[Spec]:
    """AdamW's state tensors as the optimizer handler names them, in ``state_dict`` order."""
    out: list[Spec] = []
    for name, shape in params:
        out += [
            (f"{name}/step", torch.float32, ()),  # a plain tensor: rank 0 writes it whole
            (f"{name}/exp_avg", dtype, shape),
            (f"{name}/exp_avg_sq", dtype, shape),
        ]
    return out


# ------------------------------------------------------------ stand-ins for FSDP2's DTensors


class _Mesh:
    """A 1-D device mesh seen from ``rank`` (what ``row_block`` and torch's chunking ask)."""

    def __init__(self, size: int, rank: int) -> None:
        self.shape = (size,)
        self._rank = rank

    def get_coordinate(self) -> list[int]:
        return [self._rank]

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, dim: int) -> int:
        return self._rank


class _RowSharded:
    """What ``row_block`` reads of an FSDP2 parameter: global shape, ``Shard(0)``, the mesh."""

    def __init__(self, shape: tuple[int, ...], mesh: _Mesh) -> None:
        self.shape = shape
        self.placements = (Shard(0),)
        self.device_mesh = mesh


# ------------------------------------------------------------------- what each rank reports


def file_plan(params: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> dict:
    """Every planned file by its path in the step folder (model shards, optimizer tensors)."""
    model = plan_files(
        [(n, dtype, s) for n, s in params], max_shard_size=ModelHandler().max_shard_size
    )
    optimizer = plan_file("optimizer.safetensors", optimizer_specs(params, dtype))
    return {
        **{f"model/{f.filename}": f for f in model.files},
        f"optimizer/{optimizer.filename}": optimizer,
    }


def rows_of(rank: int, world: int, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first row, rows)`` rank ``rank`` writes of a row-sharded tensor (torch's chunking)."""
    if not shape:
        return None
    rows, first = Shard.local_shard_size_and_offset(shape[0], world, rank)
    return int(first), int(rows)


def ranges(rank: int, world: int, files: dict[str, PlannedFile]) -> dict[str, list[list[int]]]:
    """Rank ``rank``'s merged byte ranges per file, as ``sharding.write_files`` records them.

    Rank 0 creates each file (its header); a plain tensor (0-dim ``step``) is rank 0's whole;
    every other tensor is row-sharded.
    """
    out = {}
    for path, f in files.items():
        mine: list[tuple[int, int]] = [(0, len(f.header))] if rank == 0 else []
        for entry in f.tensors:
            block = rows_of(rank, world, entry.shape)
            if block is None:
                if rank == 0:
                    mine.append((entry.start, entry.nbytes))
                continue
            first, rows = block
            row_bytes = entry.nbytes // entry.shape[0]
            if rows:
                mine.append((entry.start + first * row_bytes, rows * row_bytes))
        if mine:
            out[path] = _coverage.intervals([(o, o + n) for o, n in mine])
    return out


def rank_report(rank: int, world: int, files: dict[str, PlannedFile]) -> dict[str, Any]:
    """``StepStore._write``'s report: streamed checksums (none here) and, per file, the
    summary of this rank's ranges (their CRCs stand in as 0: the arithmetic costs the same)."""
    summaries = {}
    for path, intervals in ranges(rank, world, files).items():
        f = files[path]
        segments = [[start, end, 0] for start, end in intervals]
        summaries[path] = _coverage.summary(len(f.header) + f.data_size, segments)
    return {"checksums": {}, "summaries": summaries}


def encoded(report: dict[str, Any]) -> torch.Tensor:
    """The bytes ``Collective.gather`` sends rank 0 for one rank: its report."""
    return _collective._encode(report)


def check_on_rank_0(
    files: dict[str, PlannedFile], payloads: Sequence[torch.Tensor]
) -> tuple[int, float, float]:
    """What rank 0 does with the gathered reports: decode them (``Collective.all_gather``), then
    ``StepStore._finalize``'s coverage check. The problems found, and the seconds of each part.
    """
    started = time.perf_counter()
    reports = [_collective._decode(p) for p in payloads]
    decoded = time.perf_counter()
    by_file: dict[str, dict[int, list[Any]]] = {}
    for rank, report in enumerate(reports):
        for name, summary in report["summaries"].items():
            by_file.setdefault(name, {})[rank] = summary
    found = 0
    for name, f in files.items():
        size, summaries = len(f.header) + f.data_size, by_file.pop(name, {})
        found += len(_coverage.summary_problems(size, summaries))
        _coverage.fold_summaries(size, summaries)
    return found, decoded - started, time.perf_counter() - decoded


def metadata(world: int, files: dict[str, PlannedFile], params: int) -> bytes:
    """The step's ``_CHECKPOINT_METADATA``: every file with its size and checksum."""
    sizes = {path: len(f.header) + f.data_size for path, f in files.items()}
    sizes |= {"model/config.json": 700, "model/model.safetensors.index.json": 60_000}
    sizes["optimizer/optimizer.msgpack"] = 200 * params
    meta = StepMetadata(
        step=1000,
        time=1.7e9,
        items={
            "model": ItemMetadata("model", {"tensors": params}),
            "optimizer": ItemMetadata("optimizer", {"tensors": 3 * params}),
        },
        world_size=world,
        files={p: FileMetadata(size=s, checksum="xxh3-64:" + "0" * 16) for p, s in sizes.items()},
        orbit_pt_version="bench",
    )
    return meta.to_json()


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    """``fn()``'s result and its median wall time in seconds."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def measure(world: int, shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    params = parameters(shape)
    files, plan_s = timed(lambda: file_plan(params, dtype), repeats=3)
    # One rank's pieces through orbit_pt's row_block, as the handlers find them: each
    # parameter, and its exp_avg and exp_avg_sq.
    mesh = _Mesh(world, world // 2)
    sharded = [_RowSharded(s, mesh) for _, s in params for _ in range(3)]
    _, pieces_s = timed(lambda: [_sharding.row_block(t) for t in sharded], repeats=3)
    _, report_s = timed(lambda: encoded(rank_report(world // 2, world, files)), repeats=3)
    started = time.perf_counter()
    payloads = [encoded(rank_report(r, world, files)) for r in range(world)]
    build_s = time.perf_counter() - started
    sizes = [p.numel() for p in payloads]
    intervals = sum(len(v) for v in ranges(0, world, files).values())
    problems, decode_s, coverage_s = check_on_rank_0(files, payloads)
    assert problems == 0, f"the plan does not tile its files at {world} ranks: {problems}"
    meta = metadata(world, files, len(params))
    return {
        "world_size": world,
        "tensors": sum(len(f.tensors) for f in files.values()),
        "files": len(files),
        # Written piecewise by several ranks: their checksums come from the ranks' CRCs.
        "file_bytes": sum(len(f.header) + f.data_size for f in files.values()),
        "plan_s": plan_s,
        "rank_pieces_s": pieces_s,
        "rank_report_s": report_s,
        "intervals_per_rank": intervals,
        "report_bytes_per_rank": statistics.median(sizes),
        "gathered_bytes": sum(sizes),
        # Collective.gather pads every payload to the longest and delivers them to rank 0
        # only: what crosses the network in all.
        "gather_bytes_total": world * max(sizes),
        "rank0_decode_s": decode_s,
        "rank0_coverage_s": coverage_s,
        "metadata_bytes": len(meta),
        "harness_build_s": build_s,
    }


# ------------------------------------------------------------------------------- self-check


class _LocalAgreement:
    """The one agreement ``write_files`` makes, for ranks run one after another in-process."""

    enabled = True

    def agree(
        self, tag: str, fn: Callable[[], Any], *, label: str, share: Callable[[Any], Any]
    ) -> tuple[Any, list[Any]]:
        result = fn()
        return result, [share(result)]


def self_check(world: int = 8) -> None:
    """The ranges ``ranges()`` computes are those the real ``write_files`` records."""
    shape = Shape(layers=2, hidden=64, intermediate=160, heads=8, kv_heads=2, vocab=300)
    params = parameters(shape)
    files = file_plan(params, torch.float32)
    specs = {name: s for f in files.values() for name, s in ((t.name, t.shape) for t in f.tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(world):
            recorded = {}
            for path, f in files.items():
                folder = Path(tmp, path).parent
                folder.mkdir(parents=True, exist_ok=True)
                pieces = {}
                for name, s in ((t.name, t.shape) for t in f.tensors):
                    block = rows_of(rank, world, specs[name])
                    if block is None:
                        data = torch.zeros(()) if rank == 0 else None
                        pieces[name] = _sharding.Piece(s, torch.float32, data)
                    else:
                        first, rows = block
                        data = torch.zeros((rows, *s[1:])) if rows else None
                        pieces[name] = _sharding.Piece(s, torch.float32, data, first)
                with _coverage.recording() as table:
                    _sharding.write_files(
                        folder,
                        [f],
                        pieces,
                        rank=rank,
                        world_size=world,
                        collective=_LocalAgreement(),  # type: ignore[arg-type]
                        what="self-check",
                    )
                for p, r in table.items():
                    recorded[Path(p).relative_to(Path(tmp).absolute()).as_posix()] = (
                        _coverage.intervals([(w[0], w[0] + w[1]) for w in r])
                    )
            assert recorded == ranges(rank, world, files), f"rank {rank}: ranges differ"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024], help="ranks to model"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter dtype"
    )
    parser.add_argument(
        "--no-self-check", action="store_true", help="skip checking against write_files"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if not args.no_self_check:
        self_check()
    dtype = getattr(torch, args.dtype)
    rows = [measure(w, LLAMA_70B, dtype) for w in args.world_sizes]
    first = rows[0]
    print(
        f"Llama-70B shape, {args.dtype} parameters + AdamW: {first['tensors']} tensors in "
        f"{first['files']} files of {_size(first['file_bytes'])} (checksummed from the ranks' "
        f"CRCs, never read back); file plan {first['plan_s'] * 1e3:.0f} ms on every rank"
    )
    header = (
        "ranks",
        "rank pieces",
        "rank report",
        "ranges/rank",
        "report/rank",
        "rank 0 gathers",
        "gather traffic",
        "rank 0 decode",
        "rank 0 coverage",
        "metadata",
    )
    print(" | ".join(header))
    for r in rows:
        cells = (
            str(r["world_size"]),
            f"{r['rank_pieces_s'] * 1e3:.0f} ms",
            f"{r['rank_report_s'] * 1e3:.0f} ms",
            str(r["intervals_per_rank"]),
            _size(r["report_bytes_per_rank"]),
            _size(r["gathered_bytes"]),
            _size(r["gather_bytes_total"]),
            f"{r['rank0_decode_s']:.2f} s",
            f"{r['rank0_coverage_s']:.2f} s",
            _size(r["metadata_bytes"]),
        )
        print(" | ".join(cells))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
