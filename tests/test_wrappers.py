"""Wrappers are transparent: DDP, DataParallel, torch.compile, activation checkpointing, FSDP1.

A model saved from inside any wrapper has the names of the bare model (and its config.json), so
it loads in transformers and restores into the model wrapped any other way. A folder someone
else wrote with a wrapper prefix gets an error that says so and how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from orbit_pt import CheckpointManager, CheckpointManagerOptions, StateMismatchError
from orbit_pt.handlers import HandlerContext, ModelHandler
from orbit_pt.handlers.model import SINGLE_FILE, canonical_state, parameter_names, unwrap

CTX = HandlerContext(step=0)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mlp(self.embed(ids)))
        return out


class HasModuleAttribute(nn.Module):
    """A model of one's own with a submodule called ``module``: not a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4)


class OwnWrapper(nn.Module):
    """A wrapper orbit_pt does not know (accelerate-style): it keeps the model as ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _llama_config(**overrides: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    settings: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    return transformers.LlamaConfig(**{**settings, **overrides})


def _llama(seed: int, **overrides: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model: nn.Module = LlamaForCausalLM(_llama_config(**overrides))
    return model


IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))


# --------------------------------------------------------------------------------- the names


def test_wrapper_parts_leave_the_names_in_any_nesting() -> None:
    model = Tiny()
    model.mlp = checkpoint_wrapper(model.mlp)  # type: ignore[assignment]
    compiled: nn.Module = torch.compile(model)  # type: ignore[assignment]
    wrapped = nn.DataParallel(compiled)
    assert next(iter(wrapped.state_dict())).startswith("module._orig_mod.")
    assert unwrap(wrapped) is model
    assert set(canonical_state(wrapped)) == set(Tiny().state_dict())
    names = parameter_names(wrapped)
    assert names[id(model.embed.weight)] == "embed.weight"
    inner: Any = model.mlp
    assert names[id(inner._checkpoint_wrapped_module[0].weight)] == "mlp.0.weight"


def test_a_submodule_called_module_keeps_its_name() -> None:
    own = HasModuleAttribute()
    assert set(canonical_state(own)) == {"module.weight", "module.bias"}
    assert unwrap(own) is own
    assert set(canonical_state(nn.DataParallel(own))) == {"module.weight", "module.bias"}


def test_data_parallel_round_trips_both_ways(tmp_path: Path) -> None:
    wrapped = nn.DataParallel(Tiny())
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    wrapped(torch.arange(4)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": wrapped, "optimizer": opt}, force=True)
        written = safetensors.torch.load_file(mgr.step_dir(1) / "model" / SINGLE_FILE)
        assert set(written) == set(Tiny().state_dict())
        plain = Tiny()
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
        mgr.restore(1, {"model": plain, "optimizer": plain_opt})  # wrapped -> plain
        assert _equal(plain.state_dict(), wrapped.module.state_dict())
        assert _equal(plain_opt.state_dict()["state"][0], opt.state_dict()["state"][0])
        mgr.save(2, {"model": plain, "optimizer": plain_opt}, force=True)
        again = nn.DataParallel(Tiny())
        again_opt = torch.optim.AdamW(again.parameters(), lr=0.1)
        mgr.restore(2, {"model": again, "optimizer": again_opt})  # plain -> wrapped
        assert _equal(again.module.state_dict(), plain.state_dict())
        assert _equal(again_opt.state_dict()["state"][2], opt.state_dict()["state"][2])


def test_data_parallel_llama_folder_has_its_config_and_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _llama(0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": nn.DataParallel(model)}, force=True)
        folder = mgr.step_dir(3) / "model"
    assert (folder / "config.json").is_file()
    assert (folder / "generation_config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)


# ---------------------------------------------------------------------- folders of other tools


def test_a_foreign_module_prefix_is_named_with_its_fix(tmp_path: Path) -> None:
    model = Tiny()
    path = tmp_path / SINGLE_FILE
    # What torch.save(ddp.state_dict())-style tools write: every key behind "module.".
    prefixed = {f"module.{k}": v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(prefixed, path, metadata={"format": "pt"})
    target = Tiny()
    with pytest.raises(StateMismatchError) as info:
        ModelHandler().restore(tmp_path, target, CTX)
    message = str(info.value)
    assert "only by the wrapper prefix(es) ['module.']" in message
    assert "k.removeprefix('module.')" in message
    # The fix it gives works.
    fixed = {k.removeprefix("module."): v for k, v in safetensors.torch.load_file(path).items()}
    safetensors.torch.save_file(fixed, path, metadata={"format": "pt"})
    ModelHandler().restore(tmp_path, target, CTX)
    assert _equal(target.state_dict(), model.state_dict())


def test_an_unknown_wrapper_of_the_target_is_named(tmp_path: Path) -> None:
    ModelHandler().save(tmp_path, Tiny(), CTX)
    with pytest.raises(StateMismatchError, match=r"restore into the wrapped model itself"):
        ModelHandler().restore(tmp_path, OwnWrapper(Tiny()), CTX)


def test_keys_that_differ_otherwise_get_no_wrapper_hint(tmp_path: Path) -> None:
    ModelHandler().save(tmp_path, Tiny(), CTX)
    other = Tiny()
    other.extra = nn.Linear(2, 2)
    with pytest.raises(StateMismatchError) as info:
        ModelHandler().restore(tmp_path, other, CTX)
    assert "wrapper" not in str(info.value)


# ---------------------------------------------------------------------- DDP on two gloo ranks


def _ddp_ranks(rank: int, world_size: int, root: str, ref: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_llama(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 9), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"model": model, "optimizer": opt}, force=True)
        fresh = DistributedDataParallel(_llama(1))  # other values, to be overwritten
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        mgr.restore(2, {"model": fresh, "optimizer": fresh_opt})
    assert _equal(fresh.state_dict(), model.state_dict())
    for a, b in zip(
        fresh_opt.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True
    ):
        assert _equal(a, b)
    if rank == 0:
        with torch.no_grad():
            logits = model.module(IDS).logits
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
        safetensors.torch.save_file({**state, "__logits__": logits}, f"{ref}/ref.safetensors")
    dist.barrier()


@pytest.mark.distributed
def test_ddp_on_two_ranks_saves_a_plain_hf_folder(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    root = tmp_path / "ckpt"
    run_ranks(2, _ddp_ranks, str(root), str(tmp_path))
    ref = safetensors.torch.load_file(tmp_path / "ref.safetensors")
    logits = ref.pop("__logits__")
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        folder = mgr.step_dir(2) / "model"
        assert (folder / "config.json").is_file()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            assert torch.equal(loaded(IDS).logits, logits)
        plain = _llama(2)
        mgr.restore(2, {"model": plain})  # DDP -> the unwrapped model, bitwise
    assert _equal(plain.state_dict(), ref)
