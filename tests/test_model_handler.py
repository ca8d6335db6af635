"""The model handler: Hugging Face folders, sharding, tied weights, wrappers and bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
    StateMismatchError,
)
from orbit_pt._format.safetensors import build_header
from orbit_pt.errors import CheckpointValueError
from orbit_pt.handlers import HandlerContext, ModelHandler, default_handler
from orbit_pt.handlers.model import (
    INDEX_FILE,
    SINGLE_FILE,
    canonical_name,
    open_model_folder,
    parse_size,
    plan_files,
)

CTX = HandlerContext(step=0)


class Tiny(nn.Module):
    """Embedding + MLP + head, optionally tied, with an integer buffer."""

    def __init__(self, tied: bool = False, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, 16, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("counter", torch.arange(3))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _save(model: nn.Module, path: Path, **kwargs: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    ModelHandler(**kwargs).save(path, model, CTX)  # type: ignore[arg-type]
    return path


# ---------------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123, 123),
        ("2GB", 2 * 10**9),
        ("500MB", 500 * 10**6),
        ("1GiB", 2**30),
        ("3kib", 3 * 1024),
        ("10KB", 10_000),
        ("77", 77),
        ("1.5GB", 1_500_000_000),
    ],
)
def test_parse_size(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["two GB", "5TB", 0, -3, "", True])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(CheckpointError, match="max_shard_size"):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("_orig_mod.layers.0.weight", "layers.0.weight"),
        ("layers.0._checkpoint_wrapped_module.mlp.weight", "layers.0.mlp.weight"),
        ("_orig_mod.a._checkpoint_wrapped_module.b", "a.b"),
        ("my_orig_mod.x", "my_orig_mod.x"),
    ],
)
def test_canonical_name(key: str, expected: str) -> None:
    assert canonical_name(key) == expected


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
_entries = st.lists(
    st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 6), min_size=0, max_size=3)),
    min_size=1,
    max_size=12,
).map(lambda xs: [(f"t{i}", d, tuple(s)) for i, (d, s) in enumerate(xs)])


@given(entries=_entries, max_shard=st.one_of(st.none(), st.integers(1, 300)))
def test_plan_is_contiguous_and_respects_the_shard_size(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard: int | None
) -> None:
    plan = plan_files(entries, max_shard_size=max_shard)
    assert [t.name for f in plan.files for t in f.tensors] == [e[0] for e in entries]
    for planned in plan.files:
        header, offsets = build_header(
            [(t.name, t.dtype, t.shape) for t in planned.tensors], {"format": "pt"}
        )
        assert planned.header == header
        position = len(header)
        for t in planned.tensors:
            assert (t.start, t.end) == offsets[t.name] == (position, t.end)
            position = t.end
        if max_shard is not None and len(planned.tensors) > 1:
            assert planned.data_size <= max_shard
    assert plan.total_size == sum(f.data_size for f in plan.files)
    if len(plan.files) == 1:
        assert plan.files[0].filename == SINGLE_FILE
        assert plan.index() is None
    else:
        n = len(plan.files)
        assert [f.filename for f in plan.files] == [
            f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)
        ]
        assert plan.index() == {
            "metadata": {"total_size": plan.total_size},
            "weight_map": plan.weight_map,
        }


# ------------------------------------------------------------------------------- round trips


def test_default_handler_for_modules() -> None:
    assert isinstance(default_handler(Tiny(), item_name="model"), ModelHandler)


def test_round_trip_in_place_through_the_manager(tmp_path: Path) -> None:
    model, other = Tiny(), Tiny()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
        folder = mgr.step_dir(1) / "model"
        assert sorted(p.name for p in folder.iterdir()) == [SINGLE_FILE]
        with safetensors.safe_open(str(folder / SINGLE_FILE), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        loaded = safetensors.torch.load_file(folder / SINGLE_FILE)
        assert loaded.keys() == model.state_dict().keys()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
        params_before = [p.data_ptr() for p in other.parameters()]
        out = mgr.restore(1, {"model": other})
        assert out["model"] is other
        assert _same(model, other)
        assert [p.data_ptr() for p in other.parameters()] == params_before  # in place
        plain = mgr.restore(1, ["model"])["model"]
        assert plain.keys() == model.state_dict().keys()


def test_sharded_output_loads_everywhere(tmp_path: Path) -> None:
    model = Tiny(width=16)
    folder = _save(model, tmp_path / "m", max_shard_size=600)
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert sorted(set(index["weight_map"].values())) == shards
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(safetensors.torch.load_file(folder / shard))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in merged.values()
    )
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    other = Tiny(width=16)
    ModelHandler().restore(folder, other, CTX)
    assert _same(model, other)


def test_wrappers_do_not_change_names(tmp_path: Path) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Tiny()
    wrapped = Tiny()
    wrapped.mlp = checkpoint_wrapper(wrapped.mlp)  # type: ignore[assignment]
    compiled: nn.Module = torch.compile(wrapped)  # type: ignore[assignment]
    assert any("_orig_mod." in k for k in compiled.state_dict())
    folder = _save(compiled, tmp_path / "m")
    assert set(safetensors.torch.load_file(folder / SINGLE_FILE)) == set(model.state_dict())
    ModelHandler().restore(folder, model, CTX)
    assert all(
        torch.equal(model.state_dict()[canonical_name(k)], v)
        for k, v in compiled.state_dict().items()
    )
    ModelHandler().restore(_save(model, tmp_path / "plain"), compiled, CTX)  # and back


def test_tied_weights_are_written_once_and_fill_both(tmp_path: Path) -> None:
    model = Tiny(tied=True)
    folder = _save(model, tmp_path / "m")
    keys = set(safetensors.torch.load_file(folder / SINGLE_FILE))
    assert "embed.weight" in keys
    assert "head.weight" not in keys
    other = Tiny(tied=True)
    ModelHandler().restore(folder, other, CTX)
    assert torch.equal(other.head.weight, model.embed.weight)
    assert other.head.weight.data_ptr() == other.embed.weight.data_ptr()
    untied = Tiny(tied=False)
    with pytest.raises(StateMismatchError, match=r"missing from the checkpoint: head\.weight"):
        ModelHandler().restore(folder, untied, CTX)


def test_tied_keys_decide_the_kept_name(tmp_path: Path) -> None:
    class HeadFirst(Tiny):
        _tied_weights_keys = {"embed.weight": "head.weight"}  # noqa: RUF012

    folder = _save(HeadFirst(tied=True), tmp_path / "m")
    keys = set(safetensors.torch.load_file(folder / SINGLE_FILE))
    assert "head.weight" in keys
    assert "embed.weight" not in keys


def test_export_dtype_casts_on_save_and_back_on_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = Tiny()
    folder = _save(model, tmp_path / "m", export_dtype=torch.bfloat16)
    loaded = safetensors.torch.load_file(folder / SINGLE_FILE)
    assert loaded["mlp.0.weight"].dtype == torch.bfloat16
    assert loaded["counter"].dtype == torch.int64  # only floating tensors are cast
    other = Tiny()
    with caplog.at_level(logging.INFO):
        ModelHandler().restore(folder, other, CTX)
    # bf16 -> fp32 is exact: said at INFO (a resume from it is still not bitwise), no WARNING
    assert "into a wider floating dtype" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    restored = other.state_dict()["mlp.0.weight"]
    assert restored.dtype == torch.float32
    assert torch.equal(restored, model.state_dict()["mlp.0.weight"].to(torch.bfloat16).float())


def test_config_and_extra_files(tmp_path: Path) -> None:
    source = tmp_path / "vocab.txt"
    source.write_text("a\nb\n")
    folder = _save(
        Tiny(),
        tmp_path / "m",
        config={"model_type": "tiny", "width": 8},
        extra_files={"tokenizer.json": b"{}", "vocab.txt": source},
    )
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "tiny", "width": 8}
    assert (folder / "tokenizer.json").read_bytes() == b"{}"
    assert (folder / "vocab.txt").read_text() == "a\nb\n"


@pytest.mark.parametrize("name", ["model.safetensors", "../x", "a/b", ".hidden", ""])
def test_extra_file_names_are_checked(name: str) -> None:
    with pytest.raises(CheckpointValueError, match="extra_files"):
        ModelHandler(extra_files={name: b""})


def test_export_dtype_must_be_floating() -> None:
    with pytest.raises(CheckpointValueError, match="export_dtype"):
        ModelHandler(export_dtype=torch.int8)


# ---------------------------------------------------------------------------------- bad input


def test_mismatches_are_listed_at_once_and_nothing_changes(tmp_path: Path) -> None:
    folder = _save(Tiny(), tmp_path / "m")
    other = Tiny(width=4)
    other.register_buffer("counter", torch.zeros(3))  # float instead of int64
    other.extra = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatchError) as info:
        ModelHandler().restore(folder, other, CTX)
    message = str(info.value)
    for key in ["embed.weight", "mlp.0.weight", "mlp.2.bias", "head.weight", "counter"]:
        assert f"mismatched {key}:" in message
    assert "checkpoint int64 [3], model float32 [3]" in message
    assert "missing from the checkpoint: extra.weight" in message
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_strict_false_skips_missing_and_unexpected(tmp_path: Path) -> None:
    model = Tiny()
    folder = _save(model, tmp_path / "m")
    other = Tiny()
    del other.head
    other.extra = nn.Linear(2, 2)
    with pytest.raises(StateMismatchError, match=r"unexpected \(not in the model\): head\.weight"):
        ModelHandler().restore(folder, other, CTX)
    ModelHandler(strict=False).restore(folder, other, CTX)
    assert torch.equal(other.state_dict()["mlp.0.weight"], model.state_dict()["mlp.0.weight"])


def test_corrupt_header_names_the_file(tmp_path: Path) -> None:
    folder = _save(Tiny(), tmp_path / "m")
    data = bytearray((folder / SINGLE_FILE).read_bytes())
    data[8:20] = b"not json!!!!"
    (folder / SINGLE_FILE).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=str(folder / SINGLE_FILE)):
        ModelHandler().restore(folder, Tiny(), CTX)


def test_truncated_shard_names_the_file(tmp_path: Path) -> None:
    folder = _save(Tiny(width=16), tmp_path / "m", max_shard_size=600)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-5])
    other = Tiny(width=16)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=str(shard)):
        ModelHandler().restore(folder, other, CTX)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_truncated_file_through_the_manager(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": Tiny()}, force=True)
        path = mgr.step_dir(1) / "model" / SINGLE_FILE
        path.write_bytes(path.read_bytes()[:-4])
        with pytest.raises(CorruptCheckpointError, match=str(path)):
            mgr.restore(1, {"model": Tiny()})


@pytest.mark.parametrize("edit", ["drop", "move", "missing_file", "not_json", "escape"])
def test_hand_edited_index_is_refused(tmp_path: Path, edit: str) -> None:
    folder = _save(Tiny(width=16), tmp_path / "m", max_shard_size=600)
    index_path = folder / INDEX_FILE
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    first = next(iter(weight_map))
    if edit == "drop":
        del weight_map[first]
    elif edit == "move":
        others = sorted(set(weight_map.values()) - {weight_map[first]})
        weight_map[first] = others[0]
    elif edit == "missing_file":
        weight_map[first] = "model-00009-of-00009.safetensors"
    elif edit == "escape":
        weight_map[first] = "../model.safetensors"
    text = "{broken" if edit == "not_json" else json.dumps(index)
    index_path.write_text(text)
    with pytest.raises(CorruptCheckpointError, match=str(index_path)):
        open_model_folder(folder)


def test_missing_model_files(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"neither model\.safetensors"):
        open_model_folder(tmp_path)


def test_missing_item_names_what_the_checkpoint_has(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": Tiny()}, force=True)
        with pytest.raises(CheckpointError, match=r"no item\(s\) \['modle'\].*\['model'\]"):
            mgr.restore(1, {"modle": Tiny()})


# ------------------------------------------------------------------------------ transformers


def _llama_config(tied: bool) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=tied,
    )


def _llama(tied: bool) -> Any:
    from transformers import LlamaForCausalLM

    config = _llama_config(tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(("tied", "max_shard"), [(True, None), (False, None), (True, 20_000)])
def test_from_pretrained_loads_the_folder(
    tmp_path: Path, tied: bool, max_shard: int | None
) -> None:
    transformers = pytest.importorskip("transformers")
    model = _llama(tied)
    handlers = {"model": ModelHandler(max_shard_size=max_shard)}
    with CheckpointManager(tmp_path / "ckpt", handlers=handlers) as mgr:
        mgr.save(5, {"model": model}, force=True)
        folder = mgr.step_dir(5) / "model"
        assert (folder / "config.json").is_file()
        assert (folder / "generation_config.json").is_file()
        assert (folder / INDEX_FILE).is_file() == (max_shard is not None)
        written = {k for p in folder.glob("*.safetensors") for k in safetensors.torch.load_file(p)}
        assert ("lm_head.weight" in written) != tied
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert loaded.config.tie_word_embeddings == tied
        assert _same(model, loaded)
        if tied:
            assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        fresh = _llama(tied)
        for p in fresh.parameters():
            nn.init.zeros_(p)
        mgr.restore(5, {"model": fresh})
        assert _same(model, fresh)


def test_from_pretrained_with_export_dtype(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _llama(tied=True)
    folder = _save(model, tmp_path / "m", export_dtype=torch.bfloat16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    assert all(torch.equal(expected[k], v) for k, v in loaded.state_dict().items())


# ------------------------------------------------------- config.json only when the weights fit


def _untie(model: Any) -> None:
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())


def _add_layer(model: Any) -> None:
    model.model.extra = nn.Linear(32, 32)


def _resize_head(model: Any) -> None:
    model.lm_head = nn.Linear(32, 100, bias=False)


@pytest.mark.parametrize(
    ("edit", "tied", "reason"),
    [
        (_add_layer, False, "model keys are not in it, e.g. ['model.extra.bias'"),
        (_resize_head, False, "lm_head.weight: model [100, 32], config [128, 32]"),
        (_untie, True, "tied differently: written ['lm_head.weight']"),
    ],
    ids=["extra-layer", "resized-head", "untied-by-hand"],
)
def test_no_config_json_when_the_weights_do_not_fit_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: object, tied: bool, reason: str
) -> None:
    model = _llama(tied)
    edit(model)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING), CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(4, {"model": model}, force=True)
        folder = mgr.step_dir(4) / "model"
        assert not (folder / "config.json").exists()
        assert not (folder / "generation_config.json").exists()
        # still a checkpoint: it restores with orbit_pt
        other = _llama(tied)
        edit(other)  # type: ignore[operator]
        mgr.restore(4, {"model": other})
        assert _same(model, other)
    assert "not writing config.json for the LlamaForCausalLM model" in caplog.text
    assert reason in caplog.text


def test_an_explicit_config_is_written_as_given(tmp_path: Path) -> None:
    model = _llama(tied=False)
    _add_layer(model)
    folder = _save(model, tmp_path / "m", config={"model_type": "llama", "note": "mine"})
    assert json.loads((folder / "config.json").read_text())["note"] == "mine"


# ------------------------------------------------------------------------ meta-device targets


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_restore_into_a_meta_llama_materialises_it(tmp_path: Path, tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    model = _llama(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model, "optimizer": opt}, force=True)
        with torch.device("meta"):
            target = transformers.LlamaForCausalLM(model.config)
        target_opt = torch.optim.AdamW(target.parameters(), lr=0.01)  # over meta parameters
        params = [id(p) for p in target.parameters()]
        mgr.restore(1, {"model": target, "optimizer": target_opt})
    assert not any(t.is_meta for t in (*target.parameters(), *target.buffers()))
    assert {t.device.type for t in target.parameters()} == {"cpu"}
    assert [id(p) for p in target.parameters()] == params  # the optimizer's own parameters
    assert _same(model, target)
    # the non-persistent rotary buffers are recomputed, not left as garbage
    assert torch.equal(target.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    if tied:
        assert target.lm_head.weight is target.model.embed_tokens.weight
    assert torch.equal(_logits(target, ids), _logits(model, ids))
    for a, b in zip(
        target_opt.state_dict()["state"].values(), opt.state_dict()["state"].values(), strict=True
    ):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_partly_meta_module_materialises_only_its_meta_tensors(tmp_path: Path) -> None:
    model = Tiny(tied=True)
    folder = _save(model, tmp_path / "m")
    target = Tiny(tied=True)
    with torch.device("meta"):
        target.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    embed = target.embed.weight
    ModelHandler().restore(folder, target, CTX)
    assert target.embed.weight is embed  # untouched objects stay
    assert target.mlp[0].weight.device.type == "cpu"
    assert _same(model, target)


def test_meta_tensors_go_to_the_configured_device(tmp_path: Path) -> None:
    folder = _save(Tiny(), tmp_path / "m")
    with torch.device("meta"):
        target = Tiny()
    ModelHandler(device="cpu").restore(folder, target, CTX)
    assert {p.device.type for p in target.parameters()} == {"cpu"}
    with pytest.raises(CheckpointValueError, match="device must be"):
        ModelHandler(device="nowhere")


class _Rotary(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_meta_module_with_buffers_it_cannot_recompute_is_refused(tmp_path: Path) -> None:
    folder = _save(_Rotary(), tmp_path / "m")
    with torch.device("meta"):
        target = _Rotary()
    with pytest.raises(CheckpointValueError, match=r"non-persistent buffers \['inv_freq'\]"):
        ModelHandler().restore(folder, target, CTX)
    assert all(t.is_meta for t in (*target.parameters(), *target.buffers()))  # unchanged


def test_meta_module_the_checkpoint_does_not_fill_is_refused(tmp_path: Path) -> None:
    model = Tiny()
    del model.head
    folder = _save(model, tmp_path / "m")
    with torch.device("meta"):
        target = Tiny()
    with pytest.raises(CheckpointValueError, match=r"no values for 1 .*'head\.weight'"):
        ModelHandler(strict=False).restore(folder, target, CTX)
    assert all(t.is_meta for t in target.parameters())


def _meta_fsdp_ranks(rank: int, world_size: int, root: str, ref: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    want = load_file(f"{ref}/ref.safetensors")
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(tied=True))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert model.lm_head.weight.to_local().is_meta
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        mgr.restore(1, {"model": model})
    assert isinstance(model.lm_head.weight, DTensor)
    assert not any(
        (p.to_local() if isinstance(p, DTensor) else p).is_meta
        for p in (*model.parameters(), *model.buffers())
    )
    ids, logits = want.pop("__ids__").long(), want.pop("__logits__")
    full: dict[str, Any] = dict(
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    )
    assert full.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(full[key], value), key
    assert torch.equal(_logits(model, ids), logits)  # rotary buffers recomputed, ties kept
    dist.barrier()


@pytest.mark.distributed
def test_restore_into_an_fsdp2_model_sharded_on_meta(tmp_path: Path) -> None:
    from _distributed import run_ranks

    model = _llama(tied=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": model}, force=True)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    reference.update({"__logits__": _logits(model, ids), "__ids__": ids.float()})
    safetensors.torch.save_file(reference, tmp_path / "ref.safetensors")
    run_ranks(2, _meta_fsdp_ranks, str(tmp_path / "ckpt"), str(tmp_path))
