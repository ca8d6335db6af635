"""FSDP2: every rank writes its own rows into the HF files; restore on any world size.

Each distributed test runs real gloo ranks on CPU. The models are tiny, with uneven first
dimensions (7 and 3 rows over 2, 3 and 4 ranks, so some ranks hold one row or none).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_ranks
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from orbit_pt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    StateMismatchError,
)
from orbit_pt._format.direct_io import RangeWriter
from orbit_pt.handlers import ModelHandler, OptimizerHandler, StateHandler
from orbit_pt.recipe import RecipeState, RNGState

pytestmark = pytest.mark.distributed

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
READ_ONLY = CheckpointManagerOptions(read_only=True)


class MLP(torch.nn.Module):
    """Uneven dims: weights 7x5 and 3x7."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(5, 7)
        self.down = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_in = torch.nn.Linear(dim, 13)
        self.mlp_out = torch.nn.Linear(13, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 3.0, dim=-1) @ v
        h = h + self.out(attn)
        out: torch.Tensor = h + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(h)))
        return out


class TinyLM(torch.nn.Module):
    """Transformer-like: embedding tied to the head, two blocks, a non-parameter buffer."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim), Block(dim)])
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def _build(seed: int, *, shard: bool) -> tuple[MLP, TinyLM, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    mlp, lm = MLP(), TinyLM()
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(mlp, mesh=mesh)
        for block in lm.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(lm, mesh=mesh)
    opt1 = torch.optim.AdamW(mlp.parameters(), lr=0.05)
    opt2 = torch.optim.AdamW(lm.parameters(), lr=0.05)
    return mlp, lm, opt1, opt2


def _train(mlp: MLP, lm: TinyLM, opt1: Any, opt2: Any, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 5, generator=gen)
        tokens = torch.randint(0, 11, (2, 5), generator=gen)
        (mlp(x).square().mean() + lm(tokens).square().mean()).backward()
        for opt in (opt1, opt2):
            opt.step()
            opt.zero_grad()


def _handlers() -> dict[str, Any]:
    return {
        "mlp": ModelHandler(),
        "lm": ModelHandler(max_shard_size=400),  # several files, an index
        "mlp_opt": OptimizerHandler(model_item="mlp"),
        "lm_opt": OptimizerHandler(model_item="lm"),
        "recipe": StateHandler(),
    }


def _full_state(mlp: MLP, lm: TinyLM, opt1: Any, opt2: Any) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, gathered (on rank 0 under FSDP), flat."""
    out: dict[str, torch.Tensor] = {}
    for prefix, model, opt in (("mlp", mlp, opt1), ("lm", lm, opt2)):
        weights: dict[str, Any] = dict(get_model_state_dict(model, options=FULL))
        for key, value in weights.items():
            out[f"{prefix}.{key}"] = value.clone()
        state: Any = get_optimizer_state_dict(model, opt, options=FULL)
        for fqn, per_param in state.get("state", {}).items():
            for key, value in per_param.items():
                out[f"{prefix}_opt.{fqn}/{key}"] = torch.as_tensor(value).clone()
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _items(mlp: MLP, lm: TinyLM, opt1: Any, opt2: Any, **extra: Any) -> dict[str, Any]:
    return {"mlp": mlp, "lm": lm, "mlp_opt": opt1, "lm_opt": opt2, **extra}


# --------------------------------------------------------------------- save on 2, then resume


def _save_on_ranks(rank: int, world_size: int, root: str, ref: str) -> None:
    mlp, lm, opt1, opt2 = _build(0, shard=True)
    _train(mlp, lm, opt1, opt2, range(2))
    handlers = _handlers()
    torch.manual_seed(100 + rank)  # per-rank RNG, saved per rank
    recipe = RecipeState(step=2, rng=RNGState())
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(root, options=options, handlers=handlers) as mgr:
        mgr.save(2, _items(mlp, lm, opt1, opt2, recipe=recipe), force=True)
        # stage() copied only the rows this rank writes, never a full tensor
        staged = handlers["lm"]._pool.nbytes + handlers["mlp"]._pool.nbytes
        mgr.wait_until_finished()
        expected = recipe_draw = torch.rand(3)
        assert mgr.restore(2, {"recipe": recipe})["recipe"] is recipe
        assert torch.equal(torch.rand(3), recipe_draw), "per-rank RNG restored per rank"
        del expected
    full = _full_state(mlp, lm, opt1, opt2)
    _train(mlp, lm, opt1, opt2, range(2, 5))
    continued = _full_state(mlp, lm, opt1, opt2)
    model_bytes = sum(
        v.numel() * v.element_size()
        for k, v in full.items()
        if "_opt." not in k and "head" not in k
    )
    sizes: list[int] = [0] * world_size
    dist.all_gather_object(sizes, staged)
    if rank == 0:
        # together the ranks staged each weight once (the tied head is not a separate tensor)
        assert sum(sizes) == model_bytes, (sizes, model_bytes)
        assert max(sizes) < model_bytes
        save_file(full, f"{ref}/full.safetensors")
        save_file(continued, f"{ref}/continued.safetensors")


def _restore_on_ranks(rank: int, world_size: int, root: str, ref: str, exact_resume: bool) -> None:
    mlp, lm, opt1, opt2 = _build(7, shard=True)  # other values, to be overwritten
    with CheckpointManager(root, options=READ_ONLY, handlers=_handlers()) as mgr:
        mgr.restore(2, _items(mlp, lm, opt1, opt2))
    for param in [*mlp.parameters(), *lm.parameters()]:
        assert isinstance(param, DTensor)
    full = _full_state(mlp, lm, opt1, opt2)
    _train(mlp, lm, opt1, opt2, range(2, 5))
    continued = _full_state(mlp, lm, opt1, opt2)
    if rank == 0:
        _assert_same(full, load_file(f"{ref}/full.safetensors"), exact=True)
        _assert_same(continued, load_file(f"{ref}/continued.safetensors"), exact=exact_resume)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root, ref = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("ref")
    run_ranks(2, _save_on_ranks, str(root), str(ref))
    return root, ref


def _plain_restore(root: Path) -> tuple[MLP, TinyLM, Any, Any]:
    mlp, lm, opt1, opt2 = _build(7, shard=False)
    with CheckpointManager(root, options=READ_ONLY, handlers=_handlers()) as mgr:
        mgr.restore(2, _items(mlp, lm, opt1, opt2))
    return mlp, lm, opt1, opt2


def test_two_ranks_write_the_folder_one_process_writes(
    saved_on_two: tuple[Path, Path], tmp_path: Path
) -> None:
    root, ref = saved_on_two
    # 2 -> 1: a plain process restores every weight and optimizer tensor bitwise ...
    mlp, lm, opt1, opt2 = _plain_restore(root)
    _assert_same(_full_state(mlp, lm, opt1, opt2), load_file(ref / "full.safetensors"), True)
    # ... and the files are byte for byte those one process writes from the same state.
    with CheckpointManager(tmp_path, handlers=_handlers()) as single:
        single.save(2, _items(mlp, lm, opt1, opt2), force=True)
        for item in ("mlp", "lm", "mlp_opt", "lm_opt"):
            ours = sorted(p.name for p in (root / "step_00000002" / item).iterdir())
            theirs = sorted(p.name for p in (single.step_dir(2) / item).iterdir())
            assert ours == theirs, item
            for name in ours:
                a = (root / "step_00000002" / item / name).read_bytes()
                assert a == (single.step_dir(2) / item / name).read_bytes(), (item, name)
    assert (root / "step_00000002" / "lm" / "model.safetensors.index.json").is_file()
    # continued training on one process matches the run that never stopped
    _train(mlp, lm, opt1, opt2, range(2, 5))
    continued = _full_state(mlp, lm, opt1, opt2)
    _assert_same(continued, load_file(ref / "continued.safetensors"), exact=False)
    # per-rank RNG that differs between the 2 ranks cannot be guessed on one process
    with (
        CheckpointManager(root, options=READ_ONLY) as mgr,
        pytest.raises(StateMismatchError, match="differs between the 2 ranks"),
    ):
        mgr.restore(2, {"recipe": RecipeState(rng=RNGState())})


def test_files_written_in_rows_get_combined_crcs_that_verify(
    saved_on_two: tuple[Path, Path],
) -> None:
    """Files the ranks wrote row by row carry a crc32c combined from the ranks' ranges (the
    commit never read them back), and verify, which reads every byte, agrees with it."""
    from orbit_pt.verify import verify_step

    root, _ = saved_on_two
    with CheckpointManager(root, options=READ_ONLY) as mgr:
        files = mgr.metadata(2).files
    ranged = [rel for rel, f in files.items() if (f.checksum or "").startswith("crc32c:")]
    assert any(rel.startswith("lm/") and rel.endswith(".safetensors") for rel in ranged), files
    assert any(rel.startswith("lm_opt/") for rel in ranged), files
    report = verify_step(root / "step_00000002")
    assert report.ok, report
    assert set(ranged) <= set(report.checksummed)


@pytest.mark.parametrize("world_size", [3, 4])
def test_restore_on_other_world_sizes(saved_on_two: tuple[Path, Path], world_size: int) -> None:
    root, ref = saved_on_two
    # Averaging gradients over 3 or 4 ranks rounds differently than over 2: resumed training
    # matches to float tolerance; the restored state itself is bitwise equal.
    run_ranks(world_size, _restore_on_ranks, str(root), str(ref), False)


def test_one_process_checkpoint_restores_on_two_ranks(
    saved_on_two: tuple[Path, Path], tmp_path: Path
) -> None:
    root, ref = saved_on_two
    mlp, lm, opt1, opt2 = _plain_restore(root)
    with CheckpointManager(tmp_path / "single", handlers=_handlers()) as single:
        single.save(2, _items(mlp, lm, opt1, opt2), force=True)
    run_ranks(2, _restore_on_ranks, str(tmp_path / "single"), str(ref), True)


# ------------------------------------------------------------------------------------ failures


class _Explodes:
    def state_dict(self) -> dict:
        raise OSError("injected: rank 1 cannot encode its state")

    def load_state_dict(self, state: dict) -> None:
        pass


def _fail_on_rank_1(rank: int, world_size: int, root: str) -> None:
    mlp, lm, opt1, opt2 = _build(0, shard=True)
    _train(mlp, lm, opt1, opt2, range(1))
    with CheckpointManager(root, handlers={"lm_opt": OptimizerHandler(model_item="lm")}) as mgr:
        # 1. rank 1 fails while writing its rows, after the files were created
        real = RangeWriter.write

        def broken(self: RangeWriter, *args: object, **kwargs: object) -> None:
            raise OSError("injected: no space left on device")

        if rank == 1:
            RangeWriter.write = broken  # type: ignore[method-assign]
        try:
            with pytest.raises(CheckpointSaveError) as info:
                mgr.save(1, {"lm": lm, "lm_opt": opt2}, force=True)
        finally:
            RangeWriter.write = real  # type: ignore[method-assign]
        message = f"{info.value} {info.value.__cause__}"
        assert "no space left" in message
        if rank == 0:
            assert "rank(s) [1]" in message, message
        # 2. rank 1 fails in an earlier item, before the model handler's own agreement: the
        #    ranks are out of step, and every rank still fails instead of hanging
        first = _Explodes() if rank == 1 else {"ok": torch.ones(1)}
        with pytest.raises(CheckpointSaveError) as info:
            mgr.save(2, {"first": first, "lm": lm}, force=True)
        message = f"{info.value} {info.value.__cause__}"
        assert "rank 1 cannot encode" in message
        if rank == 0:
            assert "rank(s) [1]" in message, message
        assert mgr.all_steps() == []
        # 3. the job goes on: the next save commits on every rank
        assert mgr.save(3, {"lm": lm, "lm_opt": opt2}, force=True)
        steps: list[Any] = [None] * world_size
        dist.all_gather_object(steps, mgr.all_steps())
        assert steps == [[3], [3]]


def test_a_rank_failing_in_the_model_handler_fails_the_save_everywhere(tmp_path: Path) -> None:
    run_ranks(2, _fail_on_rank_1, str(tmp_path))
    assert not list(tmp_path.glob("*.orbit-tmp"))


# ------------------------------------------------------------ layouts that are not row blocks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _other_layouts(rank: int, world_size: int, root: str, ref: str) -> None:
    records = _Records()
    logging.getLogger("orbit_pt._format.sharding").addHandler(records)
    logging.getLogger("orbit_pt._format.sharding").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (world_size,))

    def tensor_parallel(seed: int) -> torch.nn.Linear:
        torch.manual_seed(seed)
        module = torch.nn.Linear(5, 3)  # weight 3x5: Shard(1) splits the 5 columns 3 + 2
        module.weight = torch.nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(1)]))
        module.bias = torch.nn.Parameter(distribute_tensor(module.bias, mesh, [Replicate()]))
        return module

    def hsdp(seed: int) -> MLP:  # replicate over 2, shard over 1
        torch.manual_seed(seed)
        module = MLP()
        mesh2d = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("rep", "shard"))
        fully_shard(module, mesh=mesh2d)
        return module

    tp, hs = tensor_parallel(0), hsdp(0)
    assert isinstance(hs.up.weight, DTensor)
    assert hs.up.weight.placements == (Replicate(), Shard(0))
    want = {f"tp.{k}": v.full_tensor() for k, v in tp.state_dict().items()}
    want.update({f"hs.{k}": v.full_tensor() for k, v in hs.state_dict().items()})
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"tp": tp, "hs": hs}, force=True)
        assert not any("full_tensor()" in m for m in records.messages)  # gather-free (#33)
        tp2, hs2 = tensor_parallel(1), hsdp(1)
        mgr.restore(0, {"tp": tp2, "hs": hs2})
    got = {f"tp.{k}": v.full_tensor() for k, v in tp2.state_dict().items()}
    got.update({f"hs.{k}": v.full_tensor() for k, v in hs2.state_dict().items()})
    _assert_same(got, want, exact=True)
    assert isinstance(tp2.weight, DTensor)
    assert tp2.weight.placements == (Shard(1),)
    if rank == 0:
        save_file(want, f"{ref}/want.safetensors")


def test_tensor_parallel_and_hsdp_layouts_are_written_correctly(tmp_path: Path) -> None:
    root, ref = tmp_path / "ckpt", tmp_path
    run_ranks(2, _other_layouts, str(root), str(ref))
    want = load_file(ref / "want.safetensors")
    step = root / "step_00000000"
    for item in ("tp", "hs"):
        got = load_file(step / item / "model.safetensors")
        for key, value in got.items():
            assert torch.equal(value, want[f"{item}.{key}"]), (item, key)


# ------------------------------------------------------------------------------- transformers


def _llama_on_ranks(rank: int, world_size: int, root: str, ref: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=67,
        hidden_size=16,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"model": model}, force=True)
    full = get_model_state_dict(model, options=FULL)
    if rank == 0:
        tensors = {k: v.clone() for k, v in full.items() if isinstance(v, torch.Tensor)}
        save_file(tensors, f"{ref}/llama.safetensors")


def test_transformers_loads_a_checkpoint_saved_under_fsdp(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    root = tmp_path / "ckpt"
    run_ranks(2, _llama_on_ranks, str(root), str(tmp_path))
    with CheckpointManager(root, options=READ_ONLY) as mgr:
        model = transformers.AutoModelForCausalLM.from_pretrained(mgr.step_dir(0) / "model")
    want = load_file(tmp_path / "llama.safetensors")
    got = model.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
