"""Export of a PEFT step merged into its base: a plain transformers folder with the trained logits.

Real tiny models built from configs and saved once as "pretrained" base folders (a Llama, and a
GPT-2: tied embeddings, Conv1D layers that LoRA adapts with fan_in_fan_out), real LoRA adapters
trained for a few steps, saved through CheckpointManager, exported with merge_adapter=True and
loaded back with AutoModelForCausalLM.from_pretrained.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from orbit_pt import CheckpointError, CheckpointManager
from orbit_pt.errors import CheckpointValueError, ItemNotFoundError
from orbit_pt.export import export_model
from orbit_pt.handlers._peft import merged_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 96
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
LLAMA_LORA: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
GPT2_LORA: dict[str, Any] = {
    "r": 4,
    "lora_alpha": 16,
    "target_modules": ["c_attn"],
    "fan_in_fan_out": True,  # GPT-2's Conv1D stores its weight transposed
}
MERGED_FILES = ["config.json", "generation_config.json", "model.safetensors"]


def _save_base(folder: Path, config: Any, cls: Any) -> Path:
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained Llama base: a folder written once, as a Hub download would be."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return _save_base(tmp_path_factory.mktemp("llama"), config, transformers.LlamaForCausalLM)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return _save_base(tmp_path_factory.mktemp("gpt2"), config, transformers.GPT2LMHeadModel)


def _base(folder: Path) -> nn.Module:
    model: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return model


def _trained(base: Path, lora: dict[str, Any], *, seed: int = 1, steps: int = 3) -> Any:
    """A LoRA model on ``base`` trained for a few steps, so that every adapter weight matters."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_base(base), peft.LoraConfig(**lora))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS).logits
    return out


def _save(root: Path, model: Any, step: int = 3) -> Path:
    with CheckpointManager(root) as mgr:
        mgr.save(step, {"model": model}, force=True)
        return mgr.step_dir(step) / "model"


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _assert_bitwise(got: nn.Module, want: nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different[:5]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_merged_export_loads_with_the_trained_logits(
    tmp_path: Path, arch: str, llama_dir: Path, gpt2_dir: Path
) -> None:
    base, lora = (llama_dir, LLAMA_LORA) if arch == "llama" else (gpt2_dir, GPT2_LORA)
    model = _trained(base, lora)
    folder = _save(tmp_path / "ckpt", model)

    result = export_model(tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True)

    assert (result.adapter, result.base, result.dtype) == ("default", base, None)
    assert list(result.files) == _files(tmp_path / "out") == MERGED_FILES
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded) is type(_base(base))
    assert not any("lora" in name for name in loaded.state_dict())
    # bitwise what PEFT's merge_and_unload gives in memory ...
    _assert_bitwise(loaded, merged_model(folder, _base(base)))
    # ... whose logits are the trained PeftModel's up to the rounding of W + s*B@A
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-6, atol=1e-6)
    # and the adapter mattered: the base alone gives other logits
    assert not torch.allclose(_logits(_base(base)), _logits(model), atol=1e-3)


def test_a_bf16_export_is_the_merged_model_cast(tmp_path: Path, gpt2_dir: Path) -> None:
    model = _trained(gpt2_dir, GPT2_LORA)
    folder = _save(tmp_path / "ckpt", model)

    result = export_model(
        tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True, dtype=torch.bfloat16
    )

    assert result.dtype == "bfloat16"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16
    _assert_bitwise(loaded, merged_model(folder, _base(gpt2_dir)).to(torch.bfloat16))
    # GPT-2 ties lm_head to the embedding: still tied in the export
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_a_named_adapter_and_modules_to_save(tmp_path: Path, llama_dir: Path) -> None:
    model = _trained(llama_dir, {**LLAMA_LORA, "modules_to_save": ["lm_head"]})
    model.add_adapter("second", peft.LoraConfig(**LLAMA_LORA))
    with torch.no_grad():  # the second adapter away from its init (lora_B starts at 0)
        for name, param in model.named_parameters():
            if ".lora_" in name and ".second." in name:
                param.add_(torch.rand_like(param))
    _save(tmp_path / "ckpt", model)

    default = export_model(tmp_path / "ckpt", 3, tmp_path / "default", merge_adapter=True)
    second = export_model(
        tmp_path / "ckpt", 3, tmp_path / "second", merge_adapter=True, adapter_name="second"
    )

    assert (default.adapter, second.adapter) == ("default", "second")
    for out, adapter in ((tmp_path / "default", "default"), (tmp_path / "second", "second")):
        model.set_adapter(adapter)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-6, atol=1e-6)
    with pytest.raises(
        ItemNotFoundError, match=r"no adapter named 'third'.*\['default', 'second'\]"
    ):
        export_model(
            tmp_path / "ckpt", 3, tmp_path / "third", merge_adapter=True, adapter_name="third"
        )
    assert not (tmp_path / "third").exists()


def test_an_explicit_base_and_the_tokenizer_files(tmp_path: Path, llama_dir: Path) -> None:
    moved = tmp_path / "moved-base"
    shutil.copytree(llama_dir, moved)
    (moved / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    (moved / "README.md").write_text("the base's card, not the merged model's\n")
    model = _trained(moved, LLAMA_LORA)
    _save(tmp_path / "ckpt", model)
    shutil.rmtree(moved)  # the base recorded in adapter_config.json is gone ...
    with pytest.raises(CheckpointValueError, match=r"is not a local folder.*base=PATH.*--base"):
        export_model(tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left

    shutil.copytree(llama_dir, moved.with_name("elsewhere"))  # ... but a copy is here
    (tmp_path / "elsewhere" / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    result = export_model(
        tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True, base=tmp_path / "elsewhere"
    )
    assert result.base == tmp_path / "elsewhere"
    assert _files(tmp_path / "out") == sorted([*MERGED_FILES, "tokenizer_config.json"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-6, atol=1e-6)


def test_a_hub_id_or_no_base_at_all_says_to_pass_base(tmp_path: Path, llama_dir: Path) -> None:
    model = _trained(llama_dir, LLAMA_LORA, steps=1)
    folder = _save(tmp_path / "ckpt", model)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for recorded, expected in (
        ("meta-llama/Llama-3.2-1B", r"'meta-llama/Llama-3.2-1B'.*not a local folder.*--base"),
        (None, r"names no base model.*base=PATH.*--base PATH"),
    ):
        config_path.write_text(json.dumps({**config, "base_model_name_or_path": recorded}))
        with pytest.raises(CheckpointValueError, match=expected):
            export_model(tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True, verify=False)
    with pytest.raises(CheckpointValueError, match=r"no config\.json"):
        export_model(
            tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True, base=tmp_path, verify=False
        )
    assert not (tmp_path / "out").exists()


def test_a_base_of_another_shape_fails_with_the_step_and_base_named(
    tmp_path: Path, llama_dir: Path
) -> None:
    _save(tmp_path / "ckpt", _trained(llama_dir, LLAMA_LORA, steps=1))
    config = transformers.LlamaConfig.from_pretrained(llama_dir)
    config.hidden_size = 48  # the same architecture, another width
    other = _save_base(tmp_path / "other", config, transformers.LlamaForCausalLM)
    with pytest.raises(CheckpointError, match=r"adapter 'default'.*step 3.*other.*failed") as info:
        export_model(tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True, base=other)
    assert info.value.__cause__ is not None
    assert not (tmp_path / "out").exists()


def test_merge_flags_on_the_wrong_step_are_refused(tmp_path: Path, llama_dir: Path) -> None:
    plain = _save(tmp_path / "plain", _base(llama_dir), step=0)
    assert (plain / "model.safetensors").is_file()
    with pytest.raises(CheckpointValueError, match=r"whole model.*nothing to merge.*--merge-adapt"):
        export_model(tmp_path / "plain", 0, tmp_path / "out", merge_adapter=True)
    _save(tmp_path / "lora", _trained(llama_dir, LLAMA_LORA, steps=1))
    with pytest.raises(CheckpointValueError, match=r"PEFT adapter.*--merge-adapter"):
        export_model(tmp_path / "lora", 3, tmp_path / "out")
    with pytest.raises(CheckpointValueError, match=r"base is used only.*merge_adapter=True"):
        export_model(tmp_path / "lora", 3, tmp_path / "out", base=llama_dir)
    with pytest.raises(CheckpointValueError, match=r"adapter_name is used only"):
        export_model(tmp_path / "lora", 3, tmp_path / "out", adapter_name="default")
    assert not (tmp_path / "out").exists()


def test_without_peft_the_error_says_how_to_install_it(
    tmp_path: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "ckpt", _trained(llama_dir, LLAMA_LORA, steps=1))
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(CheckpointError, match="pip install peft") as info:
        export_model(tmp_path / "ckpt", 3, tmp_path / "out", merge_adapter=True)
    assert isinstance(info.value.__cause__, ImportError)
    assert not (tmp_path / "out").exists()


def _cli(*args: str | int | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orbit_pt", "export", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_cli_merges(tmp_path: Path, gpt2_dir: Path) -> None:
    moved = tmp_path / "base"
    shutil.copytree(gpt2_dir, moved)
    model = _trained(moved, GPT2_LORA)
    _save(tmp_path / "ckpt", model)

    refused = _cli(tmp_path / "ckpt", 3, tmp_path / "out")
    assert refused.returncode == 2, refused.stderr
    assert "--merge-adapter" in refused.stderr

    shutil.move(moved, tmp_path / "elsewhere")
    missing = _cli(tmp_path / "ckpt", 3, tmp_path / "out", "--merge-adapter")
    assert missing.returncode == 2, missing.stderr
    assert "--base PATH" in missing.stderr

    unknown = _cli(
        tmp_path / "ckpt", 3, tmp_path / "out", "--merge-adapter", "--adapter", "nope",
        "--base", tmp_path / "elsewhere",
    )  # fmt: skip
    assert unknown.returncode == 3, unknown.stderr
    assert "['default']" in unknown.stderr

    done = _cli(
        tmp_path / "ckpt", 3, tmp_path / "out", "--merge-adapter", "--base",
        tmp_path / "elsewhere", "--dtype", "fp32", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["adapter"] == "default"
    assert doc["base"] == str(tmp_path / "elsewhere")
    assert doc["files"] == MERGED_FILES
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-6, atol=1e-6)
