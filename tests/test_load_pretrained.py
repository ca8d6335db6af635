"""``load_pretrained``: a Hugging Face folder into a plain, meta or FSDP2 model, as from_pretrained.

Folders are written by transformers' own ``save_pretrained`` (one file, or shards with an
index, in float32, bfloat16 or float16); every loaded tensor must equal what
``from_pretrained(folder, dtype=<the model's dtype>)`` holds, and so must the logits. Under
FSDP2 (real gloo ranks) each rank's peak memory during the load is checked against the model's
size, and the reference fine-tune (examples/finetune_fsdp.py) is run on a folder with
``--model``: it starts from those weights and ends with a bfloat16 export that
``from_pretrained`` loads.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import gather, run_ranks
from torch import nn

from orbit_pt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointTypeError,
    CheckpointValueError,
    StateMismatchError,
    load_pretrained,
)

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _config(**overrides: Any) -> Any:
    """A tiny Llama with uneven first dimensions (131 rows over 2 ranks)."""
    fields: dict[str, Any] = {
        "vocab_size": 131,
        "hidden_size": 32,
        "intermediate_size": 88,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **overrides,
    }
    return transformers.LlamaConfig(**fields)


def _moe_config() -> Any:
    """A tiny Mixtral: experts fused in memory (transformers 5), one tensor each in the folder."""
    return transformers.MixtralConfig(
        vocab_size=131,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )


def _write(folder: Path, config: Any, dtype: torch.dtype, shard: str | None = None) -> Path:
    """A folder written by transformers' save_pretrained from a model drawn from a fixed seed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1, so that a norm left at its init would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def _reference(folder: Path, dtype: torch.dtype) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def _on_meta(folder: Path, dtype: torch.dtype) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder), dtype=dtype
        )


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


IDS = torch.randint(0, 131, (2, 11), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------ one process


@pytest.mark.parametrize(
    ("saved", "shard", "model_dtype", "tied"),
    [
        (torch.float32, None, torch.float32, False),  # one file, no cast
        (torch.bfloat16, "20KB", torch.float32, True),  # shards + index, exact upcast
        (torch.float16, "20KB", torch.bfloat16, False),  # a rounding cast
        (torch.float32, None, torch.bfloat16, True),
    ],
    ids=["fp32-single", "bf16-sharded-tied", "fp16-to-bf16", "fp32-to-bf16-tied"],
)
def test_meta_model_loads_what_from_pretrained_loads(
    tmp_path: Path, saved: torch.dtype, shard: str | None, model_dtype: torch.dtype, tied: bool
) -> None:
    folder = _write(tmp_path / "hf", _config(tie_word_embeddings=tied), saved, shard)
    assert (folder / "model.safetensors.index.json").is_file() == (shard is not None)
    reference = _reference(folder, model_dtype)
    model = _on_meta(folder, model_dtype)
    params = [id(p) for p in model.parameters()]

    loaded = load_pretrained(model, folder)
    assert id(loaded) == id(model)  # the model itself, loaded in place
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}
    assert [id(p) for p in model.parameters()] == params  # the same parameter objects
    theirs = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == theirs[name].dtype, name
        assert torch.equal(tensor, theirs[name]), name
    # non-persistent buffers are the model's own, not garbage and not from the folder
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.equal(_logits(model.eval(), IDS), _logits(reference, IDS))


def test_a_moe_hub_folder_loads_into_fused_experts(tmp_path: Path) -> None:
    folder = _write(tmp_path / "hf", _moe_config(), torch.bfloat16, "30KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    model = _on_meta(folder, torch.float32)
    assert "model.layers.0.mlp.experts.down_proj" in dict(model.named_parameters())
    load_pretrained(model, folder)
    reference = _reference(folder, torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name
    assert torch.equal(_logits(model.eval(), IDS), _logits(reference, IDS))


def test_a_plain_module_and_a_string_path(tmp_path: Path) -> None:
    folder = _write(tmp_path / "hf", _config(), torch.bfloat16)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(_config())  # materialised, randomly initialised
    embed = model.model.embed_tokens.weight
    load_pretrained(model, str(folder))
    assert model.model.embed_tokens.weight is embed  # in place
    assert torch.equal(_logits(model.eval(), IDS), _logits(_reference(folder, torch.float32), IDS))


def test_a_model_that_does_not_fit_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    folder = _write(tmp_path / "hf", _config(), torch.float32)
    bigger = transformers.LlamaForCausalLM(_config(num_hidden_layers=3))
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"missing from the checkpoint: model\.layers\.2"):
        load_pretrained(bigger, folder)
    assert all(torch.equal(v, before[k]) for k, v in bigger.state_dict().items())

    # strict=False fills what the folder has, and leaves the rest as it was
    load_pretrained(bigger, folder, strict=False)
    reference = _reference(folder, torch.float32).state_dict()
    for name, tensor in bigger.state_dict().items():
        want = reference.get(name, before[name])
        assert torch.equal(tensor, want), name

    wider = transformers.LlamaForCausalLM(_config(intermediate_size=96))
    with pytest.raises(StateMismatchError, match=r"mismatched model\.layers\.0\.mlp"):
        load_pretrained(wider, folder, strict=False)  # shapes must match even so

    # a meta model must be filled completely: nothing would give the missing layer values
    with pytest.raises(CheckpointValueError, match="meta device"):
        load_pretrained(_on_meta_config(_config(num_hidden_layers=3)), folder, strict=False)


def _on_meta_config(config: Any) -> nn.Module:
    with torch.device("meta"):
        model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def test_a_folder_orbit_pt_saved_loads_too(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(_config(tie_word_embeddings=True))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(7, {"model": model}, force=True)
        step_dir = mgr.step_dir(7)
    target = _on_meta_config(_config(tie_word_embeddings=True))
    with pytest.raises(CheckpointValueError, match=r"model/ subfolder .* pass '.*/model'"):
        load_pretrained(target, step_dir)
    load_pretrained(target, step_dir / "model")
    assert torch.equal(_logits(target.eval(), IDS), _logits(model.eval(), IDS))


def test_paths_that_are_not_a_local_model_folder(tmp_path: Path) -> None:
    model = transformers.LlamaForCausalLM(_config())
    with pytest.raises(CheckpointValueError, match=r"never downloads.*huggingface-cli download"):
        load_pretrained(model, "meta-llama/Llama-3.2-1B")
    with pytest.raises(CheckpointValueError, match="does not exist"):
        load_pretrained(model, tmp_path / "nowhere")
    folder = _write(tmp_path / "hf", _config(), torch.float32)
    with pytest.raises(CheckpointValueError, match=r"is a file; .* pass '.*hf'"):
        load_pretrained(model, folder / "model.safetensors")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(
        CheckpointValueError, match=r"pickle files \['pytorch_model\.bin'\].*save_pretrained"
    ):
        load_pretrained(model, pickled)

    other = tmp_path / "other"
    other.mkdir()
    safetensors.torch.save_file({"w": torch.zeros(2)}, other / "consolidated.safetensors")
    with pytest.raises(CheckpointValueError, match=r"consolidated\.safetensors.*neither"):
        load_pretrained(model, other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointValueError, match="not a Hugging Face model folder"):
        load_pretrained(model, tmp_path / "empty")

    with pytest.raises(CheckpointTypeError, match=r"torch\.nn\.Module"):
        load_pretrained(model.state_dict(), folder)
    with pytest.raises(CheckpointTypeError, match="local folder"):
        load_pretrained(model, 3)  # type: ignore[arg-type]


def test_peft_adapters_load_into_a_peft_model_and_base_weights_before_wrapping(
    tmp_path: Path,
) -> None:
    peft = pytest.importorskip("peft")
    base = _write(tmp_path / "base", _config(), torch.bfloat16)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    trained = peft.get_peft_model(transformers.LlamaForCausalLM(_config()), lora)
    trained.save_pretrained(tmp_path / "adapter")

    model = load_pretrained(transformers.LlamaForCausalLM(_config()), base)
    wrapped = peft.get_peft_model(model, lora)  # a fresh adapter, then the trained one
    with pytest.raises(CheckpointTypeError, match=r"load the base weights before wrapping"):
        load_pretrained(wrapped, base)
    load_pretrained(wrapped, tmp_path / "adapter")
    want = peft.get_peft_model_state_dict(trained)
    got = peft.get_peft_model_state_dict(wrapped)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------------- FSDP2 on gloo ranks


def _fsdp_ranks(rank: int, world_size: int, folder: str, ref: str, tied: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    want = safetensors.torch.load_file(ref)
    ids, logits = want.pop("__ids__").long(), want.pop("__logits__")
    model = _on_meta(Path(folder), torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert model.model.embed_tokens.weight.to_local().is_meta

    load_pretrained(model, folder)

    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied  # ties kept
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        local = param.to_local()
        assert not local.is_meta, name
        assert local.dtype == torch.float32, name
        assert torch.equal(param.full_tensor(), want[name]), name
    assert torch.equal(model.model.rotary_emb.inv_freq, want["model.rotary_emb.inv_freq"])
    assert torch.equal(_logits(model.eval(), ids), logits)
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama-tied", "mixtral"])
def test_fsdp2_model_on_meta_reads_its_rows_of_a_sharded_bf16_folder(
    tmp_path: Path, kind: str
) -> None:
    config = _config(tie_word_embeddings=True) if kind == "llama-tied" else _moe_config()
    folder = _write(tmp_path / "hf", config, torch.bfloat16, "20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    reference = _reference(folder, torch.float32)  # bf16 -> fp32 is exact: the documented cast
    want = {k: v.clone() for k, v in reference.state_dict().items()}
    want["model.rotary_emb.inv_freq"] = reference.model.rotary_emb.inv_freq.clone()
    want.update(__ids__=IDS.float(), __logits__=_logits(reference, IDS))
    safetensors.torch.save_file(want, tmp_path / "ref.safetensors")
    tied = bool(config.tie_word_embeddings)
    run_ranks(2, _fsdp_ranks, str(folder), str(tmp_path / "ref.safetensors"), tied, timeout=180)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def _memory_ranks(rank: int, world_size: int, small: str, big: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    def sharded(folder: str) -> Any:
        model = _on_meta(Path(folder), torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    # A first load of a tiny model pages in the code that any load runs, so that the peak
    # below is the big load's memory, not the libraries' text.
    load_pretrained(sharded(small), small)
    model = sharded(big)
    gc.collect()
    dist.barrier()
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    load_pretrained(model, big)
    growth = (_kib("VmHWM") - before) * 1024
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    reports = gather({"rank": rank, "peak_growth": growth, "local_bytes": local})
    if rank == 0:
        Path(out).write_text(json.dumps(reports))
    dist.barrier()


@pytest.mark.distributed
def test_each_rank_of_an_fsdp2_load_holds_its_shard_not_the_model(tmp_path: Path) -> None:
    # 55M parameters: 221 MB in float32, read from a 110 MB bf16 folder in 50 MB shards.
    config = _config(
        vocab_size=16000,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        size = sum(p.numel() * 4 for p in transformers.LlamaForCausalLM(config).parameters())
    assert size >= 200e6
    big = _write(tmp_path / "big", config, torch.bfloat16, "50MB")
    small = _write(tmp_path / "small", _config(), torch.bfloat16)
    gc.collect()
    out = tmp_path / "memory.json"
    run_ranks(2, _memory_ranks, str(small), str(big), str(out), timeout=240)
    reports = json.loads(out.read_text())
    for report in reports:
        print(
            f"rank {report['rank']}: peak RSS growth {report['peak_growth'] / 1e6:.0f} MB "
            f"(its shard {report['local_bytes'] / 1e6:.0f} MB) for a {size / 1e6:.0f} MB model"
        )
        assert report["local_bytes"] < 0.55 * size
        # Its shard (half) plus one tensor's read buffer; from_pretrained holds the whole model.
        assert report["peak_growth"] < 0.75 * size, report


# --------------------------------------------------------------- the reference fine-tune


@pytest.mark.distributed
def test_finetune_starts_from_the_folder_and_exports_a_bf16_model(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import finetune_fsdp
    from demo import launch_ranks, read_log, wait_all
    from tiny_llama import ByteTokenizer

    base = _write(tmp_path / "base", _config(vocab_size=300), torch.bfloat16, "20KB")
    out = tmp_path / "run"
    out.mkdir()
    job = ["--batch-size=4", "--seq-len=16", "--steps=3", "--save-every=10", "--device=cpu"]
    procs = launch_ranks(
        2,
        [str(EXAMPLES / "finetune_fsdp.py"), f"--model={base}", f"--out={out}", *job],
        log=out / "ranks.log",
    )
    codes = wait_all(procs, timeout=240)
    assert codes == [0, 0], (out / "ranks.log").read_text()[-3000:]
    log = read_log(out / "losses.jsonl")

    # It started from the folder's weights: the first step's loss is the base model's loss on
    # the first batch (the two ranks' half-batch means, averaged: rounding differs only).
    reference = _reference(base, torch.float32)
    batches = finetune_fsdp.ShuffledWindows(
        finetune_fsdp.encode(ByteTokenizer(), finetune_fsdp.read_corpus(None)),
        seq_len=16,
        global_batch=4,
        seed=0,
    )
    inputs, targets = batches.next_batch(0, 1)
    logits = _logits(reference, inputs)
    expected = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    first = next(r for r in log if r["event"] == "step" and r["step"] == 0)
    assert first["loss"] == pytest.approx(expected, rel=1e-5)

    # It ended with a bf16 folder to serve: the trained model (its last step), cast to bf16.
    export = next(r for r in log if r["event"] == "export")
    assert export["step"] == 2
    served = transformers.AutoModelForCausalLM.from_pretrained(export["path"]).eval()
    assert served.dtype == torch.bfloat16
    with CheckpointManager(
        out / "checkpoints", options=CheckpointManagerOptions(read_only=True)
    ) as mgr:
        trained_folder = mgr.step_dir(2) / "model"
    trained = _reference(trained_folder, torch.float32)
    assert not torch.equal(trained.lm_head.weight, reference.lm_head.weight)  # it trained
    cast = _reference(trained_folder, torch.bfloat16)  # the trained weights rounded to bf16
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, cast.state_dict()[name]), name
    assert torch.equal(_logits(served, IDS), _logits(cast, IDS))


def _one_rank_fails(rank: int, world_size: int, folder: str) -> None:
    from orbit_pt.errors import CheckpointError

    model = transformers.LlamaForCausalLM(_config()).eval()
    path = folder if rank == 0 else folder + "-missing"  # only rank 1 is given a bad path
    with pytest.raises(CheckpointError) as raised:
        load_pretrained(model, path)
    if rank == 0:
        assert "rank(s) [1]" in str(raised.value), str(raised.value)
    else:
        assert "missing" in str(raised.value)


def test_a_failure_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    folder = _write(tmp_path / "base", _config(), torch.float32)
    run_ranks(2, _one_rank_fails, str(folder), timeout=120)
