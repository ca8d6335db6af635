"""PEFT models: the adapter in PEFT's own format, loadable by PeftModel.from_pretrained.

A real tiny LlamaForCausalLM (built from a config, saved once as the "pretrained" base folder)
with LoRA on q_proj and v_proj, trained for a few steps so that every adapter weight matters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from orbit_pt import CheckpointError, CheckpointManager, CheckpointManagerOptions
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError
from orbit_pt.handlers import HandlerContext, ModelHandler
from orbit_pt.handlers._peft import merged_model
from orbit_pt.handlers.model import open_model_folder

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def _adapter_config(folder: Path) -> dict[str, Any]:
    """``adapter_config.json`` of ``folder``, with ``target_modules`` sorted: PEFT keeps it as a
    set and writes it in string-hash order, which differs between processes (PYTHONHASHSEED),
    so the same config may list it in either order."""
    config: dict[str, Any] = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"])
    return config


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained base: a folder written once, as a Hub download would be."""
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("base")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _base(base_dir: Path) -> nn.Module:
    model: nn.Module = transformers.LlamaForCausalLM.from_pretrained(base_dir)
    return model


def _peft_model(base_dir: Path, seed: int, **lora: Any) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = peft.get_peft_model(_base(base_dir), peft.LoraConfig(**{**LORA, **lora}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


def _train(model: Any, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS).logits
    return out


def _trainable(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("async_save", [False, True])
def test_adapter_is_saved_as_peft_saves_it(
    tmp_path: Path, base_dir: Path, async_save: bool
) -> None:
    model, opt = _peft_model(base_dir, seed=1)
    _train(model, opt, range(3))
    options = CheckpointManagerOptions(async_save=async_save)
    with CheckpointManager(tmp_path / "ckpt", options=options) as mgr:
        mgr.save(3, {"model": model, "optimizer": opt}, force=True)
        mgr.wait_until_finished()
        folder = mgr.step_dir(3) / "model"
    model.save_pretrained(tmp_path / "peft")
    assert _files(folder) == ADAPTER_FILES  # no config.json of the base, no base weights
    ours = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert _same(ours, theirs)
    assert all(".lora_" in key for key in ours)
    config = _adapter_config(folder)
    assert config == _adapter_config(tmp_path / "peft")
    assert config["base_model_name_or_path"] == str(base_dir)  # where the base lives
    assert config["inference_mode"] is True

    loaded = peft.PeftModel.from_pretrained(_base(base_dir), folder)
    assert torch.equal(_logits(loaded), _logits(model))


def test_restore_is_exact_and_training_continues_the_same(tmp_path: Path, base_dir: Path) -> None:
    model, opt = _peft_model(base_dir, seed=1)
    _train(model, opt, range(3))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, {"model": model, "optimizer": opt}, force=True)
        other, other_opt = _peft_model(base_dir, seed=2)  # other adapter init
        assert not _same(_trainable(other), _trainable(model))
        mgr.restore(3, {"model": other, "optimizer": other_opt})
    assert _same(_trainable(other), _trainable(model))
    for a, b in zip(
        other_opt.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True
    ):
        assert _same(a, b)
    _train(model, opt, range(3, 5))
    _train(other, other_opt, range(3, 5))
    assert _same(_trainable(other), _trainable(model))


def test_modules_to_save_and_a_second_adapter(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1, modules_to_save=["lm_head"])
    model.add_adapter("second", peft.LoraConfig(**LORA))
    with torch.no_grad():  # every adapter weight away from its init (lora_B starts at 0)
        for name, param in model.named_parameters():
            if ".lora_" in name or "modules_to_save" in name:
                param.add_(torch.rand_like(param))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
        folder = mgr.step_dir(1) / "model"
        model.save_pretrained(tmp_path / "peft")
        assert _files(folder) == [*ADAPTER_FILES, *(f"second/{f}" for f in ADAPTER_FILES)]
        for sub in ("", "second"):
            ours = safetensors.torch.load_file(folder / sub / "adapter_model.safetensors")
            theirs = safetensors.torch.load_file(
                tmp_path / "peft" / sub / "adapter_model.safetensors"
            )
            assert _same(ours, theirs)
        other, _ = _peft_model(base_dir, seed=2, modules_to_save=["lm_head"])
        other.add_adapter("second", peft.LoraConfig(**LORA))
        mgr.restore(1, {"model": other})
    everything = {n: p for n, p in model.state_dict().items() if ".lora_" in n or "modules_to" in n}
    restored = {n: p for n, p in other.state_dict().items() if ".lora_" in n or "modules_to" in n}
    assert _same(restored, everything)
    loaded = peft.PeftModel.from_pretrained(_base(base_dir), folder / "second")
    model.set_adapter("second")
    assert torch.equal(_logits(loaded), _logits(model))


def test_restore_without_a_target_gives_the_adapter_tensors(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
        state = mgr.restore(1, ["model"])["model"]
        assert set(state) == set(open_model_folder(mgr.step_dir(1) / "model"))
    assert _same(state, peft.get_peft_model_state_dict(model))


def test_an_adapter_does_not_restore_into_a_plain_model(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
        with pytest.raises(CheckpointTypeError, match=r"PEFT adapter.*get_peft_model"):
            mgr.restore(1, {"model": _base(base_dir)})


def test_trained_weights_outside_the_adapter_are_refused(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1)
    model.base_model.model.lm_head.weight.requires_grad_(True)
    with (
        CheckpointManager(tmp_path / "ckpt") as mgr,
        pytest.raises(CheckpointError) as info,
    ):
        mgr.save(1, {"model": model}, force=True)
    message = f"{info.value} {info.value.__cause__}"
    assert "lm_head.weight" in message
    assert "modules_to_save" in message


def test_a_meta_base_is_refused(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
        with torch.device("meta"):
            base = transformers.LlamaForCausalLM(model.base_model.model.config)
        target = peft.get_peft_model(base, peft.LoraConfig(**LORA))
        with pytest.raises(CheckpointError, match="meta device"):
            mgr.restore(1, {"model": target})


def test_merged_model_equals_the_adapted_one(tmp_path: Path, base_dir: Path) -> None:
    model, opt = _peft_model(base_dir, seed=1)
    _train(model, opt, range(3))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, {"model": model}, force=True)
        merged = merged_model(mgr.step_dir(3) / "model", _base(base_dir))
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora_" in name for name in merged.state_dict())
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)


def test_peft_is_imported_only_for_peft_models(tmp_path: Path) -> None:
    script = (
        "import sys, torch\n"
        "from orbit_pt import CheckpointManager\n"
        f"with CheckpointManager({str(tmp_path)!r}) as mgr:\n"
        "    mgr.save(0, {'model': torch.nn.Linear(2, 2)}, force=True)\n"
        "    mgr.restore(0, {'model': torch.nn.Linear(2, 2)})\n"
        "assert 'peft' not in sys.modules, 'peft was imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)


def test_verify_reads_an_adapter_step(tmp_path: Path, base_dir: Path) -> None:
    from orbit_pt.verify import verify_step

    model, _ = _peft_model(base_dir, seed=1)
    model.add_adapter("second", peft.LoraConfig(**LORA))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
    assert not verify_step(tmp_path / "ckpt", 1).problems
    weights = tmp_path / "ckpt" / "step_00000001" / "model" / "second" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    assert [p.path for p in verify_step(tmp_path / "ckpt", 1).problems] == [
        "model/second/adapter_model.safetensors"
    ]


def test_a_step_holding_the_whole_peft_model_still_restores(tmp_path: Path, base_dir: Path) -> None:
    model, _ = _peft_model(base_dir, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.add_(torch.rand_like(param))
    folder = tmp_path / "old"  # what orbit_pt wrote for a PeftModel before adapters
    folder.mkdir()
    whole = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(whole, folder / "model.safetensors", metadata={"format": "pt"})
    other, _ = _peft_model(base_dir, seed=2)
    ModelHandler().restore(folder, other, HandlerContext(step=0))
    assert _same(_trainable(other), _trainable(model))


def test_export_refuses_an_adapter_step(tmp_path: Path, base_dir: Path) -> None:
    """An adapter copied out as a model folder would load as a model with random weights.

    Exporting it merged (``merge_adapter=True``) is tested in test_export_merge.py.
    """
    from orbit_pt.export import export_model

    model, _ = _peft_model(base_dir, seed=4)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, {"model": model}, force=True)
    with pytest.raises(CheckpointValueError, match=r"PEFT adapter.*--merge-adapter"):
        export_model(tmp_path / "ckpt", 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ FSDP2


def _sharded_peft_model(base: str, seed: int, reference: str | None = None) -> Any:
    """A LoRA model on ``base``, its adapter weights moved off their init, FSDP2-sharded."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # the same on every rank: every rank builds the same model
    model = peft.get_peft_model(_base(Path(base)), peft.LoraConfig(**LORA))
    with torch.no_grad():  # lora_B starts at 0: move every adapter weight
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.add_(torch.rand_like(param))
    if reference is not None and torch.distributed.get_rank() == 0:
        model.save_pretrained(reference)  # what PEFT writes for the same model, unsharded
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _lora_full(model: Any) -> dict[str, torch.Tensor]:
    """Every LoRA parameter, whole (collective: every rank calls it in the same order)."""
    return {
        name: param.full_tensor().detach().clone()
        for name, param in model.named_parameters()
        if ".lora_" in name
    }


def _peft_under_fsdp(rank: int, world_size: int, base: str, root: str, ref: str) -> None:
    from _distributed import gather

    model = _sharded_peft_model(base, seed=1, reference=ref)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    want = _lora_full(model)
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"model": model}, force=True)

    other = _sharded_peft_model(base, seed=2)  # another adapter init
    assert not _same(_lora_full(other), want)
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        mgr.restore(0, {"model": other})
    got = _lora_full(other)
    assert got.keys() == want.keys()
    exact = [name for name in want if torch.equal(got[name], want[name])]
    assert gather(len(exact)) == [len(want)] * world_size, sorted(set(want) - set(exact))


@pytest.mark.distributed
def test_an_adapter_under_fsdp2_is_peft_format_and_restores_exactly(
    tmp_path: Path, base_dir: Path
) -> None:
    from _distributed import run_ranks

    root, ref = tmp_path / "ckpt", tmp_path / "peft"
    run_ranks(2, _peft_under_fsdp, str(base_dir), str(root), str(ref), timeout=240.0)
    folder = root / "step_00000000" / "model"
    assert _files(folder) == ADAPTER_FILES
    ours = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    theirs = safetensors.torch.load_file(ref / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert _same(ours, theirs)
    assert _adapter_config(folder) == _adapter_config(ref)
