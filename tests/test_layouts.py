"""Any parallel layout, gather-free: TP, FSDP x TP, HSDP, pipeline stages, expert parallel.

Real transformers models built from configs, laid out with torch's own tensor-parallel styles
(the config's ``base_model_tp_plan``), ``fully_shard`` and pipeline stages that keep global
names, on real gloo ranks. Each saved folder is compared bitwise with what ``save_pretrained``
writes for the unsharded model, loaded with ``from_pretrained``, and restored onto other layouts
and onto one process. No rank logs a gather.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import gather, run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from orbit_pt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    load_pretrained,
)
from orbit_pt._format import layouts as _layouts
from orbit_pt.errors import CheckpointError
from orbit_pt.handlers import OptimizerHandler
from orbit_pt.verify import verify_step

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

LAYERS = 4


def _config(tied: bool = False) -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=LAYERS,
        tie_word_embeddings=tied,
    )


def _llama(seed: int, tied: bool = False) -> Any:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config(tied))
    with torch.no_grad():  # distinct values everywhere, so a misplaced element shows
        for parameter in model.parameters():
            parameter.normal_()
    return model


def _tensor_parallel(model: Any, mesh: DeviceMesh) -> None:
    """torch's TP styles from the config's own plan (colwise: Shard(0), rowwise: Shard(1))."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {key: styles[style]() for key, style in model.config.base_model_tp_plan.items()}
    parallelize_module(model.model, mesh, plan)


def _stage(model: Any, stage: int, split: int) -> Any:
    """Pipeline stage ``stage`` of 2, layers split at ``split``, names kept global (torchtitan)."""
    keep = range(split) if stage == 0 else range(split, LAYERS)
    layers = dict(model.model.layers.named_children())
    model.model.layers = torch.nn.ModuleDict({str(i): layers[str(i)] for i in keep})
    if stage == 0:
        model.model.norm = None
        if not model.config.tie_word_embeddings:
            model.lm_head = None
    elif not model.config.tie_word_embeddings:
        model.model.embed_tokens = None
    return model


def _virtual_stages(seed: int, rank: int, world_size: int) -> list[Any]:
    """torchtitan's interleaved ``model_parts``: one stage per layer, rank r runs r, r + ws, ...

    Each part is a whole model pruned to its stage, so every name stays global.
    """
    parts = []
    for stage in range(rank, LAYERS, world_size):
        part = _llama(seed)
        layers = dict(part.model.layers.named_children())
        part.model.layers = torch.nn.ModuleDict({str(stage): layers[str(stage)]})
        if stage != 0:
            part.model.embed_tokens = None
        if stage != LAYERS - 1:
            part.model.norm = None
            part.lm_head = None
        parts.append(part)
    return parts


def build(layout: str, seed: int, rank: int, world_size: int, *, tied: bool = False) -> Any:
    """A tiny Llama in ``layout`` on this rank (``vpp``: a list of model parts)."""
    if layout == "vpp":
        return _virtual_stages(seed, rank, world_size)
    model = _llama(seed, tied)
    if layout == "tp":
        _tensor_parallel(model, init_device_mesh("cpu", (world_size,)))
    elif layout == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif layout == "fsdp_tp":  # 2 x 2: FSDP over dp, TP over tp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "hsdp":  # 2 x 2: replicate over rep, shard over shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout.startswith("pp"):  # "pp2": stages split at layer 2
        _stage(model, rank, int(layout[2:]))
    else:
        assert layout == "plain", layout
    return model


def _parts(model: Any) -> list[Any]:
    return model if isinstance(model, list) else [model]


def _parameters(model: Any) -> list[torch.nn.Parameter]:
    return [param for part in _parts(model) for param in part.parameters()]


def full(model: Any) -> dict[str, torch.Tensor]:
    """This rank's tensors, DTensors gathered (for checking only), plain tensors as they are."""
    out = {}
    for part in _parts(model):
        for name, value in part.state_dict().items():
            gathered = value.full_tensor() if isinstance(value, DTensor) else value.detach()
            out[name] = gathered.clone()
    return out


def _step(optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step with made-up gradients laid out like their parameters."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = param.detach() * 0.01 + 0.001
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for part in _parts(model) for n, p in part.named_parameters()}
    out = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[f"{names[id(param)]}/{key}"] = torch.as_tensor(value).clone()
    return out


class _Gathers:
    """Records every ``full_tensor()``/``redistribute()`` that orbit_pt itself calls.

    Patched on the DTensor class, so it fails whatever orbit_pt logs (the test's own checks,
    which gather to compare, are not counted).
    """

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _spy(self, original: Any) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("orbit_pt"):
                self.lines.append(f"{caller} called {original.__name__}")
            return original(tensor, *args, **kwargs)

        return call

    def __enter__(self) -> _Gathers:
        self._saved = (DTensor.full_tensor, DTensor.redistribute)
        DTensor.full_tensor = self._spy(DTensor.full_tensor)  # type: ignore[method-assign]
        DTensor.redistribute = self._spy(DTensor.redistribute)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        DTensor.full_tensor, DTensor.redistribute = self._saved  # type: ignore[method-assign]


def _handlers() -> dict[str, Any]:
    return {"optimizer": OptimizerHandler(model_item="model")}


def _save_and_reshard(
    rank: int,
    world_size: int,
    root: str,
    save: str,
    others: list[str],
    async_save: bool,
    save_min_run: int | None = None,
) -> None:
    """Save ``save``'s model + AdamW; restore onto each layout of ``others``; check bitwise.

    Boxes that are not whole rows are saved moved to rows (these tiny models' runs are
    short), or, with ``save_min_run=1``, written run by run straight into the files.
    """
    model = build(save, 0, rank, world_size)
    optimizer = torch.optim.AdamW(_parameters(model), lr=1e-3, foreach=False)
    _step(optimizer)
    weights, state = full(model), optimizer_state(model, optimizer)
    # Every rank checks what it restores against what the rank that held it saved.
    saved = {k: v for held in gather(weights) for k, v in held.items()}  # type: ignore[attr-defined]
    saved_state = {k: v for held in gather(state) for k, v in held.items()}  # type: ignore[attr-defined]
    options = CheckpointManagerOptions(async_save=async_save)
    with _Gathers() as gathers:
        default = _layouts.MIN_DIRECT_RUN
        _layouts.MIN_DIRECT_RUN = default if save_min_run is None else save_min_run
        try:
            with CheckpointManager(root, options=options, handlers=_handlers()) as mgr:
                mgr.save(1, {"model": model, "optimizer": optimizer}, force=True)
                mgr.wait_until_finished()
        finally:
            _layouts.MIN_DIRECT_RUN = default
        # Boxes that are not whole rows: moved as rows between ranks (these tiny models' runs
        # are short), then read run by run straight from the file (MIN_DIRECT_RUN = 1).
        for layout, min_run in itertools.product(others, (_layouts.MIN_DIRECT_RUN, 1)):
            target = build(layout, 7, rank, world_size)
            target_opt = torch.optim.AdamW(_parameters(target), lr=1e-3, foreach=False)
            _step(target_opt)  # other state, to be overwritten
            default, _layouts.MIN_DIRECT_RUN = _layouts.MIN_DIRECT_RUN, min_run
            try:
                with CheckpointManager(root, handlers=_handlers()) as mgr:
                    mgr.restore(1, {"model": target, "optimizer": target_opt})
            finally:
                _layouts.MIN_DIRECT_RUN = default
            got, got_state = full(target), optimizer_state(target, target_opt)
            assert got.keys() <= saved.keys(), (layout, got.keys() - saved.keys())
            for name, value in got.items():
                assert torch.equal(value, saved[name]), (layout, name)
            assert got_state.keys() <= saved_state.keys(), layout
            for name, value in got_state.items():
                assert torch.equal(value, saved_state[name]), (layout, name)
            del target, target_opt
    assert gathers.lines == [], gathers.lines


def _folder(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def _trained(tied: bool = False) -> Any:
    """The unsharded model after the step every layout takes (elementwise: bitwise the same)."""
    model = _llama(0, tied)
    _step(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False))
    return model


def _check_folder(tmp_path: Path, root: Path, *, tied: bool = False) -> None:
    """The step's model folder is save_pretrained's, bitwise, and loads with from_pretrained."""
    unsharded = _trained(tied)
    reference = tmp_path / "reference"
    unsharded.save_pretrained(reference)
    folder = root / "step_00000001" / "model"
    got, want = _folder(folder), _folder(reference)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder)
    for name, value in unsharded.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # ... and the whole step (model + AdamW) restores onto one process.
    target = _llama(5, tied)
    optimizer = torch.optim.AdamW(target.parameters(), lr=1e-3, foreach=False)
    with CheckpointManager(root, handlers=_handlers()) as mgr:
        mgr.restore(1, {"model": target, "optimizer": optimizer})
    for name, value in unsharded.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert len(optimizer.state) == len(list(target.parameters()))


@pytest.mark.parametrize(
    ("offset", "shape"),
    [((0, 0), (6, 5)), ((2, 0), (3, 5)), ((1, 2), (4, 3)), ((0, 4), (6, 1)), ((3, 1), (0, 2))],
)
def test_a_box_is_read_as_its_runs_in_row_major_order(
    offset: tuple[int, int], shape: tuple[int, int]
) -> None:
    # 3-D: the box spans the last dim (runs of 4 x 5 x ...) or cuts it (runs inside a row).
    full = (3, 6, 5)
    values = torch.arange(90).reshape(full)
    for lead in ((0, 3), (1, 2)):
        box = _layouts.Box((lead[0], *offset), (lead[1], *shape))
        offsets, run = _layouts.runs(box, full)
        got = [values.flatten()[o : o + run] for o in offsets]
        want = values[box.within(_layouts.Box((0, 0, 0), full))].flatten()
        assert torch.equal(torch.cat(got) if got else torch.tensor([]).long(), want), box
        assert run == _layouts.run_length(box, full)


def test_tensor_parallel_saves_rows_and_restores_onto_fsdp_and_stages(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, _save_and_reshard, str(root), "tp", ["fsdp", "pp1", "tp"], False, timeout=300)
    _check_folder(tmp_path, root)


def test_fsdp_x_tp_on_a_2x2_mesh_async(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(
        4, _save_and_reshard, str(root), "fsdp_tp", ["hsdp", "tp", "fsdp_tp"], True, 1, timeout=400
    )
    _check_folder(tmp_path, root)


def test_hsdp_restores_onto_fsdp_x_tp(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(4, _save_and_reshard, str(root), "hsdp", ["fsdp_tp"], False, timeout=300)
    _check_folder(tmp_path, root)


def test_pipeline_stages_save_one_folder_and_restore_onto_another_split(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(2, _save_and_reshard, str(root), "pp2", ["pp1", "pp3", "tp"], False, timeout=300)
    _check_folder(tmp_path, root)


def test_virtual_stages_as_lists_of_model_parts(tmp_path: Path) -> None:
    # torchtitan's model_parts: two parts per rank (interleaved stages) as one item; restored
    # onto one stage per rank, onto FSDP and back onto parts.
    root = tmp_path / "ckpt"
    run_ranks(2, _save_and_reshard, str(root), "vpp", ["pp1", "fsdp", "vpp"], False, timeout=300)
    _check_folder(tmp_path, root)


def test_model_parts_holding_one_name_as_two_tensors_are_refused(tmp_path: Path) -> None:
    parts = [_llama(0), _llama(1)]  # two whole models: not parts of one
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"two model parts hold parameter model\."):
            mgr.save(1, {"model": parts}, force=True)
        assert mgr.all_steps() == []


def _load_pretrained_into_parts(rank: int, world_size: int, folder: str) -> None:
    parts = _virtual_stages(9, rank, world_size)
    assert load_pretrained(parts, folder) is parts
    want = _llama(0).state_dict()
    got = full(parts)
    assert len(got) == sum(len(part.state_dict()) for part in parts)
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


def test_load_pretrained_into_model_parts(tmp_path: Path) -> None:
    _llama(0).save_pretrained(tmp_path)
    run_ranks(2, _load_pretrained_into_parts, str(tmp_path), timeout=200)


def test_tied_embeddings_on_first_and_last_stage_are_written_once(tmp_path: Path) -> None:
    root = tmp_path / "tied"
    run_ranks(2, _save_tied_stages, str(root), timeout=300)
    _check_folder(tmp_path, root, tied=True)


def _save_tied_stages(rank: int, world_size: int, root: str) -> None:
    model = build("pp2", 0, rank, world_size, tied=True)
    assert "model.embed_tokens.weight" in model.state_dict()  # held by both stages
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _step(optimizer)  # the same made-up gradient on both stages: the copies stay equal
    with CheckpointManager(root, handlers=_handlers()) as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer}, force=True)


def _save_stages_before_the_first_step(rank: int, world_size: int, root: str) -> None:
    model = build("pp2", 0, rank, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with CheckpointManager(root, handlers=_handlers()) as mgr:  # no state yet: no tensors
        mgr.save(1, {"model": model, "optimizer": optimizer}, force=True)


def test_stages_with_an_optimizer_before_its_first_step_save_every_stage(tmp_path: Path) -> None:
    # The stages hold no optimizer tensors yet, but different parameters: the saved structure
    # must still list both stages' (a strict restore on one process refuses a missing one).
    root = tmp_path / "ckpt"
    run_ranks(2, _save_stages_before_the_first_step, str(root), timeout=200)
    target = _llama(5)
    optimizer = torch.optim.AdamW(target.parameters(), lr=1e-3, foreach=False)
    with CheckpointManager(root, handlers=_handlers()) as mgr:
        mgr.restore(1, {"model": target, "optimizer": optimizer})
    for name, value in _llama(0).state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert len(optimizer.param_groups[0]["params"]) == len(list(target.parameters()))


# ------------------------------------------------------------------------ peak memory

_WIDE = 4096  # one 4096 x 4096 fp32 weight: 64 MiB whole, 32 MiB per rank


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def _save_growth(rank: int, world_size: int, root: str, out: str) -> None:
    """Peak resident growth of each rank while it saves a column-sharded (Shard(1)) weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(_WIDE, _WIDE, bias=False))
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), {"0": RowwiseParallel()})
    assert model[0].weight.placements == (Shard(1),)  # type: ignore[union-attr]
    growth = {}
    whole_weight = full(model)["0.weight"]  # collective: taken before any measurement
    # Written run by run (the default here: 2048-element runs), or moved to rows first (as on
    # an object store, forced here by a minimum run no box meets).
    default = _layouts.MIN_DIRECT_RUN
    for (path, min_run), async_save in itertools.product(
        (("runs", default), ("moved", 10**9)), (False, True)
    ):
        options = CheckpointManagerOptions(async_save=async_save)
        _layouts.MIN_DIRECT_RUN = min_run
        try:
            with CheckpointManager(f"{root}/{path}-{async_save}", options=options) as mgr:
                mgr.save(1, {"model": model}, force=True)  # pages in the code any save runs
                mgr.wait_until_finished()
                gc.collect()
                dist.barrier()
                before = _kib("VmRSS")
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident
                mgr.save(2, {"model": model}, force=True)
                mgr.wait_until_finished()
                mode = "async" if async_save else "sync"
                growth[f"{mode} {path}"] = (_kib("VmHWM") - before) * 1024
                dist.barrier()
        finally:
            _layouts.MIN_DIRECT_RUN = default
        if rank == 0:  # both paths write the same bytes: the tensor, and a checksum that holds
            step = Path(f"{root}/{path}-{async_save}/step_00000002")
            saved = safetensors.torch.load_file(step / "model" / "model.safetensors")
            assert torch.equal(saved["0.weight"], whole_weight), (path, async_save)
            report = verify_step(step)
            assert report.ok, report.problems
    # The restore reads this rank's columns run by run (2048 elements per row), or, with moves
    # forced, the rows of its share, moved among the ranks: every byte read from the file is
    # counted at the syscall (os.preadv / os.pread).
    for path, min_run in (("direct", _layouts.MIN_DIRECT_RUN), ("moved", 10**9)):
        torch.manual_seed(1)
        target = torch.nn.Sequential(torch.nn.Linear(_WIDE, _WIDE, bias=False))
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(target, mesh, {"0": RowwiseParallel()})
        read = _count_reads()
        default, _layouts.MIN_DIRECT_RUN = _layouts.MIN_DIRECT_RUN, min_run
        try:
            with read, CheckpointManager(f"{root}/runs-False") as mgr:
                mgr.restore(2, {"model": target})
        finally:
            _layouts.MIN_DIRECT_RUN = default
        assert torch.equal(full(target)["0.weight"], whole_weight), path
        growth[f"read {path}"] = read.bytes
    growth["local"] = target[0].weight.to_local().nbytes  # type: ignore[union-attr,operator]
    reports = gather(growth)
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


class _count_reads:  # noqa: N801 - used as a context manager
    """Bytes read through ``os.preadv`` / ``os.pread`` (every file read orbit_pt makes)."""

    def __init__(self) -> None:
        self.bytes = 0

    def __enter__(self) -> _count_reads:
        self._saved = (os.preadv, os.pread)
        preadv, pread = self._saved

        def counted_preadv(fd: int, buffers: Any, offset: int) -> int:
            n = preadv(fd, buffers, offset)
            self.bytes += n
            return n

        def counted_pread(fd: int, size: int, offset: int) -> bytes:
            data = pread(fd, size, offset)
            self.bytes += len(data)
            return data

        os.preadv, os.pread = counted_preadv, counted_pread  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv, os.pread = self._saved


def test_a_column_sharded_save_holds_a_shard_not_the_tensor(tmp_path: Path) -> None:
    # The rows a rank writes are half the tensor (32 MiB) plus a round's buffers; a gather
    # would hold the whole 64 MiB tensor (and DTensor.redistribute on gloo more). A restore
    # reads about the rank's own bytes.
    out = tmp_path / "growth.json"
    run_ranks(2, _save_growth, str(tmp_path), str(out), timeout=240)
    whole = _WIDE * _WIDE * 4
    reports = json.loads(out.read_text())
    for rank, growth in enumerate(reports):
        for mode in ("sync runs", "async runs", "sync moved", "async moved"):
            print(f"rank {rank} {mode}: peak growth {growth[mode] / 2**20:.1f} MiB")
            assert growth[mode] < 0.75 * whole, (rank, mode, growth[mode])
        # Written in runs, a save holds no copy of the shard, only a 4 MiB window of the file
        # mapped at a time (an async save copies into staging buffers kept from save 1).
        for mode in ("sync runs", "async runs"):
            assert growth[mode] < 0.1 * whole, (rank, mode, growth[mode])
        for path in ("direct", "moved"):
            read = growth[f"read {path}"]
            print(f"rank {rank} restore ({path}): read {read / 2**20:.2f} MiB")
            assert read <= 1.1 * growth["local"] + 2**20, (rank, path, growth)


# ------------------------------------------------------------------------- plan errors


def test_a_tensor_two_stages_hold_with_different_shapes_is_a_plan_error(tmp_path: Path) -> None:
    # Both stages hold layer 2 only in this broken split, with different shapes.
    run_ranks(2, _conflicting_stage_shared, str(tmp_path / "ckpt"), timeout=200)


def _conflicting_stage_shared(rank: int, world_size: int, root: str) -> None:
    model = build("pp3" if rank == 0 else "pp2", 0, rank, world_size)
    if rank == 1:
        model.model.layers["2"].mlp.up_proj = torch.nn.Linear(32, 41, bias=False)
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"different dtypes or global shapes"):
            mgr.save(1, {"model": model}, force=True)
        assert mgr.all_steps() == []


def _one_rank_fails_before_the_tensors_agreement(rank: int, world_size: int, root: str) -> None:
    model = build("tp", 0, rank, world_size)
    if rank == 1:  # a tensor safetensors cannot store: rank 1 fails before any row moves
        model.register_buffer("bad", torch.zeros(2, dtype=torch.complex64))
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[1\]"):
            mgr.save(1, {"model": model}, force=True)
        assert mgr.all_steps() == []


def test_one_rank_failing_before_rows_move_fails_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _one_rank_fails_before_the_tensors_agreement, str(tmp_path), timeout=120)


def _one_rank_fails_writing_its_runs(rank: int, world_size: int, root: str) -> None:
    from orbit_pt._format.direct_io import RangeWriter

    model = build("tp", 0, rank, world_size)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model}, force=True)
        real, default = RangeWriter.write_runs, _layouts.MIN_DIRECT_RUN
        _layouts.MIN_DIRECT_RUN = 1  # every column box is written run by run

        def broken(self: RangeWriter, *args: object) -> None:
            raise OSError("injected: no space left on device")

        if rank == 1:
            RangeWriter.write_runs = broken  # type: ignore[method-assign,assignment]
        try:
            with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[1\].*injected"):
                mgr.save(2, {"model": model}, force=True)
        finally:
            RangeWriter.write_runs, _layouts.MIN_DIRECT_RUN = real, default  # type: ignore[method-assign]
        assert mgr.all_steps() == [1]
        mgr.save(3, {"model": model}, force=True)  # and the next save goes through
        assert mgr.all_steps() == [1, 3]


def test_one_rank_failing_to_write_its_runs_fails_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _one_rank_fails_writing_its_runs, str(tmp_path), timeout=120)


def _rank_0_fails_merging_the_stages(rank: int, world_size: int, root: str) -> None:
    from orbit_pt.handlers import optimizer as optimizer_handler

    model = build("pp2", 0, rank, world_size)
    optimizer = torch.optim.AdamW(_parameters(model), lr=1e-3, foreach=False)
    _step(optimizer)
    if rank == 0:  # after the union agreement, only rank 0 merges the stages' structures

        def broken(packed: Any) -> bytes:
            raise OSError("merging the stages failed here")

        optimizer_handler.merge_structures = broken  # type: ignore[attr-defined]
    with CheckpointManager(root, handlers=_handlers()) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[0\]"):
            mgr.save(1, {"model": model, "optimizer": optimizer}, force=True)
        assert mgr.all_steps() == []


def test_rank_0_failing_to_merge_the_stages_optimizers_fails_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _rank_0_fails_merging_the_stages, str(tmp_path), timeout=120)


def _one_rank_does_not_fit(rank: int, world_size: int, root: str) -> None:
    model = build("tp", 0, rank, world_size)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model}, force=True)
    target = build("tp", 3, rank, world_size)
    if rank == 1:  # rank 1's model does not fit the step (a plain tensor: building the TP
        # layers with other shapes on one rank would itself mismatch distribute_tensor's scatter)
        target.model.norm = type(target.model.norm)(48)
    before = full(target)
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
        mgr.restore(1, {"model": target})
    after = full(target)
    for name, value in before.items():  # nothing was loaded, on any rank
        assert torch.equal(after[name], value), name


def test_one_rank_whose_model_does_not_fit_fails_the_restore_everywhere(tmp_path: Path) -> None:
    run_ranks(2, _one_rank_does_not_fit, str(tmp_path), timeout=120)


def _unexpected_is_what_no_stage_holds(rank: int, world_size: int, root: str) -> None:
    model = build("plain", 0, rank, world_size)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model}, force=True)
    # Stages of a model that lacks the head: lm_head.weight is in the step but on no stage.
    target = build("pp2", 3, rank, world_size)
    target.lm_head = None
    refused = r"unexpected \(not in the model\): lm_head"
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError, match=refused):
        mgr.restore(1, {"model": target})


def test_a_restore_onto_stages_refuses_only_what_no_stage_holds(tmp_path: Path) -> None:
    run_ranks(2, _unexpected_is_what_no_stage_holds, str(tmp_path), timeout=120)


# ----------------------------------------------------------------------- expert parallel


def _moe(seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=8,
        num_hidden_layers=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def _expert_parallel(model: Any, mesh: DeviceMesh, placements: list[Any]) -> None:
    """Experts sharded across ranks (``placements`` on ``mesh``); everything else replicated."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, placements)
            setattr(experts, name, torch.nn.Parameter(sharded))


def _expert_layouts(rank: int, world_size: int, root: str) -> None:
    ep = init_device_mesh("cpu", (world_size,))
    with _Gathers() as gathers:
        model = _moe(0)
        _expert_parallel(model, ep, [Shard(0)])  # experts 0-1 on rank 0, 2-3 on rank 1
        with CheckpointManager(f"{root}/ep") as mgr:
            mgr.save(1, {"model": model}, force=True)
        # Experts split inside (each expert's rows across ranks, as EP x TP would).
        inner = _moe(0)
        _expert_parallel(inner, ep, [Shard(1)])
        with CheckpointManager(f"{root}/inner") as mgr:
            mgr.save(1, {"model": inner}, force=True)
        # Restore each onto the other layout.
        for source, placements in (("ep", [Shard(1)]), ("inner", [Shard(0)])):
            target = _moe(4)
            _expert_parallel(target, ep, placements)
            with CheckpointManager(f"{root}/{source}") as mgr:
                mgr.restore(1, {"model": target})
            for name, value in _moe(0).state_dict().items():
                assert torch.equal(full(target)[name], value), (source, name)
    assert gathers.lines == [], gathers.lines
    dist.barrier()


def test_expert_parallel_writes_the_hub_layout_gather_free(tmp_path: Path) -> None:
    run_ranks(2, _expert_layouts, str(tmp_path), timeout=300)
    reference = tmp_path / "reference"
    _moe(0).save_pretrained(reference)
    want = _folder(reference)
    for source in ("ep", "inner"):
        got = _folder(tmp_path / source / "step_00000001" / "model")
        assert sorted(got) == sorted(want)
        assert any(".experts.3." in name for name in got)  # one tensor per expert
        for name, value in want.items():
            assert torch.equal(got[name], value), (source, name)
    loaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "inner" / "step_00000001" / "model"
    )
    for name, value in _moe(0).state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
