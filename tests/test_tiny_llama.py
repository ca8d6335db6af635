"""The embedded base model and the pieces of examples/finetune_fsdp.py that run in one process.

TinyLlama must be a Hugging Face Llama in all but name: its checkpoints load in
``transformers.LlamaForCausalLM`` and give the same logits. The data stream must be resumable
and independent of the world size, and every flag of the example must have a help text.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions, RecipeState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import finetune_fsdp
from tiny_llama import (
    ByteTokenizer,
    TinyLlama,
    TinyLlamaConfig,
    write_base_model,
)

SMALL: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 80, "num_attention_heads": 4}


@pytest.mark.parametrize(
    "config",
    [
        TinyLlamaConfig(**SMALL, num_key_value_heads=2),  # grouped-query attention
        TinyLlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=True),
        TinyLlamaConfig(**SMALL, num_key_value_heads=1, num_hidden_layers=3, rope_theta=500.0),
    ],
    ids=["gqa", "tied", "mqa-3-layers"],
)
def test_checkpoints_load_in_transformers_with_the_same_logits(
    tmp_path: Path, config: TinyLlamaConfig
) -> None:
    transformers = pytest.importorskip("transformers")
    model = TinyLlama(config)
    model.reset_parameters(torch.Generator().manual_seed(3))
    with torch.no_grad():  # norms away from 1, so that a swapped norm weight would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(4))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"model": model})
        folder = mgr.step_dir(0) / "model"
    hf = transformers.LlamaForCausalLM.from_pretrained(folder)
    hf.eval()
    ids = torch.randint(0, config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert hf.config.tie_word_embeddings == config.tie_word_embeddings

    # And back: a folder transformers wrote loads in TinyLlama.
    hf.save_pretrained(tmp_path / "hf")
    again = TinyLlama.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours, rtol=0, atol=0)


def test_config_round_trips_and_refuses_what_it_cannot_compute() -> None:
    config = TinyLlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    document = json.loads(json.dumps(config.to_dict()))
    assert document["architectures"] == ["LlamaForCausalLM"]
    assert document["model_type"] == "llama"
    assert TinyLlamaConfig.from_dict(document) == config
    with pytest.raises(ValueError, match="rope scaling"):
        TinyLlamaConfig.from_dict({**document, "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="hidden_act"):
        TinyLlamaConfig.from_dict({**document, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="divisible"):
        TinyLlamaConfig(hidden_size=30, num_attention_heads=4)


def test_base_model_is_deterministic_and_written_once(tmp_path: Path) -> None:
    config = TinyLlamaConfig(**SMALL, num_key_value_heads=2)
    write_base_model(tmp_path / "a", config, seed=7)
    write_base_model(tmp_path / "b", config, seed=7)
    write_base_model(tmp_path / "c", config, seed=8)
    a, b, c = (tmp_path / n / "model.safetensors" for n in "abc")
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    before = a.stat().st_mtime_ns
    write_base_model(tmp_path / "a", config, seed=9)  # exists: left alone
    assert a.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temp folders
    model = TinyLlama.from_pretrained(tmp_path / "a")
    assert model.config == config


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = ByteTokenizer()
    text = "The Fox and the Grapes — «sour»"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert max(ids) < tokenizer.vocab_size
    assert tokenizer.decode(ids) == text


def _stream() -> finetune_fsdp.ShuffledWindows:
    return finetune_fsdp.ShuffledWindows(
        torch.arange(1000) % 251, seq_len=16, global_batch=8, seed=3
    )


def test_data_stream_resumes_exactly_across_epochs() -> None:
    straight = _stream()
    batches = [straight.next_batch(0, 1) for _ in range(20)]  # 7 steps per epoch: 3 epochs
    assert straight.epoch == 2

    interrupted = _stream()
    for _ in range(9):
        interrupted.next_batch(0, 1)
    resumed = _stream()
    recipe = RecipeState(step=8, data=resumed)
    recipe.load_state_dict(RecipeState(step=8, data=interrupted).state_dict())
    for expected in batches[9:]:
        got = resumed.next_batch(0, 1)
        assert torch.equal(got[0], expected[0])
        assert torch.equal(got[1], expected[1])


def test_data_stream_is_independent_of_the_world_size() -> None:
    one, rank0, rank1 = _stream(), _stream(), _stream()  # one stream per rank, as in a run
    for _ in range(10):
        inputs, targets = one.next_batch(0, 1)
        halves = [rank0.next_batch(0, 2), rank1.next_batch(1, 2)]
        assert torch.equal(torch.cat([h[0] for h in halves]), inputs)
        assert torch.equal(torch.cat([h[1] for h in halves]), targets)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert one.state_dict() == rank0.state_dict() == rank1.state_dict()


def test_data_stream_refuses_another_dataset() -> None:
    stream = _stream()
    other = finetune_fsdp.ShuffledWindows(
        torch.arange(2000) % 251, seq_len=16, global_batch=8, seed=3
    )
    with pytest.raises(ValueError, match="num_windows"):
        stream.load_state_dict(other.state_dict())


def test_every_flag_has_help_and_the_defaults_run_offline() -> None:
    parser = finetune_fsdp.build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    args = finetune_fsdp.parse_args([])
    assert args.model is None
    assert args.data is None  # the embedded corpus
    assert len(finetune_fsdp.read_corpus(None).encode()) <= 100_000
    assert not finetune_fsdp.read_corpus(None).startswith("#")
    with pytest.raises(SystemExit):
        finetune_fsdp.parse_args(["--steps", "0"])


def test_lr_schedule_warms_up_then_decays_to_a_tenth() -> None:
    factors = [finetune_fsdp.lr_factor(s, warmup=4, total=20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert factors[-1] > 0.1
    assert finetune_fsdp.lr_factor(20, warmup=4, total=20) == pytest.approx(0.1)


def test_restoring_only_the_model_needs_no_transformers(tmp_path: Path) -> None:
    config = TinyLlamaConfig(**SMALL, num_key_value_heads=2)
    write_base_model(tmp_path / "base", config, seed=1)
    model = TinyLlama.from_pretrained(tmp_path / "base")
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(5, {"model": model})
    fresh = TinyLlama(config)
    with CheckpointManager(
        tmp_path / "ckpt", options=CheckpointManagerOptions(read_only=True)
    ) as mgr:
        mgr.restore(5, {"model": fresh})
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
