"""The model folder of a transformers model holds what ``save_pretrained`` writes (MoE included).

Real models built from configs: tiny Mixtral and Qwen2-MoE (experts fused in memory, one
tensor per expert on the Hub), GPT-2, Llama with tied and untied embeddings (no conversion).
The folder's keys and tensors are compared with ``save_pretrained``'s, bitwise; a Hub folder
restores into a plain, a meta-device and an FSDP2 model; under FSDP2 no rank gathers.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks

from orbit_pt import CheckpointManager, CheckpointManagerOptions, StateMismatchError
from orbit_pt.handlers import HandlerContext, ModelHandler

transformers = pytest.importorskip("transformers")


def _config(kind: str) -> Any:
    small = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2}
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **small,
            intermediate_size=8,
            num_hidden_layers=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    if kind == "mixtral3":  # 3 experts: uneven FSDP2 blocks on 2 ranks (2 + 1)
        return transformers.MixtralConfig(
            **small,
            intermediate_size=8,
            num_hidden_layers=1,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=2,
        )
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **small,
            intermediate_size=12,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            num_hidden_layers=2,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32
        )
    tied = kind == "llama_tied"
    return transformers.LlamaConfig(
        **small,
        intermediate_size=24,
        num_hidden_layers=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )


def _model(kind: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind))
    with torch.no_grad():  # distinct values everywhere, so a misplaced tensor shows
        for parameter in model.parameters():
            parameter.normal_()
    return model.eval()


def _folder(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, unequal


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


MODELS = ["mixtral", "qwen2_moe", "gpt2", "llama_tied", "llama_untied"]


@pytest.mark.parametrize("kind", MODELS)
def test_the_model_folder_is_what_save_pretrained_writes(tmp_path: Path, kind: str) -> None:
    model = _model(kind)
    model.save_pretrained(tmp_path / "reference")
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model})
        folder = mgr.step_dir(1) / "model"
    _assert_equal(_folder(folder), _folder(tmp_path / "reference"))

    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_async_save_writes_the_values_of_the_moment_it_was_called(tmp_path: Path) -> None:
    """The expert tensors are converted from the staged copy, not from the live weights."""
    changed = threading.Event()

    class WritesAfterTheChange(ModelHandler):
        def save(self, directory: Path, item: Any, context: HandlerContext) -> Any:
            assert changed.wait(60)  # the live weights have changed before a byte is written
            return super().save(directory, item, context)

    model = _model("mixtral")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    options = CheckpointManagerOptions(async_save=True)
    handlers = {"model": WritesAfterTheChange()}
    with CheckpointManager(tmp_path, options=options, handlers=handlers) as mgr:
        mgr.save(1, {"model": model})
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        changed.set()
        mgr.wait_until_finished()
        fresh = _model("mixtral", seed=1)
        mgr.restore(1, {"model": fresh})
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("kind", MODELS)
def test_a_step_restores_exactly_into_a_fresh_model(tmp_path: Path, kind: str) -> None:
    model = _model(kind)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model})
        fresh = _model(kind, seed=1)
        mgr.restore(1, {"model": fresh})
    assert _same_weights(fresh, model)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("on_meta", [False, True])
def test_a_hub_folder_restores_into_the_model(tmp_path: Path, kind: str, on_meta: bool) -> None:
    model = _model(kind)
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    if on_meta:
        with torch.device("meta"):
            target = transformers.AutoModelForCausalLM.from_config(_config(kind))
    else:
        target = _model(kind, seed=1)
    ModelHandler().restore(tmp_path, target, HandlerContext(step=0))
    assert _same_weights(target.eval(), model)


def test_a_step_in_the_in_memory_layout_still_restores(tmp_path: Path) -> None:
    """Steps written before the Hub layout hold the fused names; they load as they are."""
    model = _model("mixtral")
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        | {"lm_head.weight": model.lm_head.weight.detach().clone()},
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    target = _model("mixtral", seed=1)
    ModelHandler().restore(tmp_path, target, HandlerContext(step=0))
    assert _same_weights(target, model)


def test_a_hub_folder_missing_an_expert_is_refused_before_loading(tmp_path: Path) -> None:
    model = _model("mixtral")
    model.save_pretrained(tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    target = _model("mixtral", seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateMismatchError) as raised:
        ModelHandler().restore(tmp_path, target, HandlerContext(step=0))
    message = str(raised.value)
    assert "model.layers.1.mlp.experts.gate_up_proj" in message
    assert "nothing was loaded" in message
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def test_a_hub_expert_of_another_shape_is_named(tmp_path: Path) -> None:
    model = _model("mixtral")
    model.save_pretrained(tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    tensors[name] = torch.zeros(3, 3)
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    with pytest.raises(StateMismatchError, match=name.replace(".", r"\.")):
        ModelHandler().restore(tmp_path, _model("mixtral", seed=1), HandlerContext(step=0))


def test_export_dtype_applies_to_the_hub_tensors(tmp_path: Path) -> None:
    model = _model("mixtral")
    with CheckpointManager(
        tmp_path, handlers={"model": ModelHandler(export_dtype=torch.bfloat16)}
    ) as mgr:
        mgr.save(1, {"model": model})
        folder = mgr.step_dir(1) / "model"
    model.to(torch.bfloat16).save_pretrained(tmp_path / "reference")
    _assert_equal(_folder(folder), _folder(tmp_path / "reference"))


# ------------------------------------------------------------------------------------- FSDP2


def _sharded(kind: str, seed: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = _model(kind, seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _fsdp_save_and_restore(rank: int, world_size: int, kind: str, root: str) -> None:
    path = Path(root)
    model = _sharded(kind, seed=0)
    gathers: list[str] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "full_tensor" in record.getMessage():
                gathers.append(record.getMessage())

    spy = Spy()
    logging.getLogger("orbit_pt").addHandler(spy)
    logging.getLogger("orbit_pt").setLevel(logging.INFO)
    try:
        with CheckpointManager(path / "ckpt") as mgr:
            mgr.save(1, {"model": model})
    finally:
        logging.getLogger("orbit_pt").removeHandler(spy)
    assert gathers == [], gathers  # no rank gathered a tensor

    # From the folder save_pretrained wrote (rank 0 wrote it from an unsharded copy).
    fresh = _sharded(kind, seed=1)
    ModelHandler().restore(path / "reference", fresh, HandlerContext(step=0, rank=rank))
    reference = _model(kind, seed=0).state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value.full_tensor(), reference[name]), name
    dist.barrier()


@pytest.mark.parametrize("kind", ["mixtral", "mixtral3", "qwen2_moe"])
def test_fsdp2_writes_the_hub_layout_without_gathering(tmp_path: Path, kind: str) -> None:
    _model(kind, seed=0).save_pretrained(tmp_path / "reference")
    run_ranks(2, _fsdp_save_and_restore, kind, str(tmp_path), timeout=240)
    folder = tmp_path / "ckpt" / "step_00000001" / "model"
    _assert_equal(_folder(folder), _folder(tmp_path / "reference"))
    # ... and that step restores on one process.
    target = _model(kind, seed=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.restore(1, {"model": target})
    assert _same_weights(target, _model(kind, seed=0))
