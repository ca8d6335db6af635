"""A small Llama-style causal language model in plain PyTorch, laid out like Hugging Face's Llama.

The default base model of ``examples/finetune_fsdp.py``: it needs no download and no
transformers, yet its checkpoints are ordinary Hugging Face folders. Parameter names
(``model.layers.0.self_attn.q_proj.weight``, ...) and ``config.json`` follow
``transformers.LlamaForCausalLM``, and the forward pass computes what Llama computes (RMSNorm,
rotary position embeddings with ``rotate_half``, grouped-query attention, a SwiGLU MLP), so::

    transformers.LlamaForCausalLM.from_pretrained(mgr.step_dir(step) / "model")

loads a checkpoint of this model and gives the same logits (tests/test_tiny_llama.py checks it).

Also here: :func:`write_base_model`, which creates the "base model" folder deterministically
from a seed, and :class:`ByteTokenizer`, a byte-level tokenizer that needs no vocabulary file.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orbit_pt.handlers import HandlerContext, ModelHandler

CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class TinyLlamaConfig:
    """The hyperparameters of :class:`TinyLlama`, named as in ``transformers.LlamaConfig``.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``; 258 = 256 bytes + BOS + EOS.
        hidden_size: the width of the residual stream.
        intermediate_size: the width of the SwiGLU MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when fewer than queries).
        max_position_embeddings: the longest sequence the model is meant for.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: base of the rotary position embeddings.
        tie_word_embeddings: whether ``lm_head`` shares the embedding matrix.
        initializer_range: standard deviation of the random initial weights.
        bos_token_id: the id that starts a text.
        eos_token_id: the id that ends a text.
    """

    vocab_size: int = 258
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int = 256
    eos_token_id: int = 257

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` document that ``transformers.LlamaForCausalLM`` reads."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "use_cache": True,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> TinyLlamaConfig:
        """The config from a ``config.json`` document; keys of other Llama features are ignored.

        Raises:
            ValueError: the document describes something this model cannot compute (another
                activation, biases, rope scaling).
        """
        if document.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {document['hidden_act']!r} is not supported; use silu")
        if document.get("attention_bias") or document.get("mlp_bias"):
            raise ValueError("attention_bias and mlp_bias are not supported")
        rope = document.get("rope_parameters") or document.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope!r} is not supported; only the default rope")
        fields = {name: document[name] for name in cls.__dataclass_fields__ if name in document}
        if "rope_theta" not in fields and "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        return cls(**fields)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as Llama does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    config: TinyLlamaConfig, length: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding tables for positions ``0..length-1``: two ``(length, head_dim)``."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim)
    )
    positions = torch.arange(length, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        d, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        d = self.config.head_dim
        q = self.q_proj(x).view(batch, length, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, -1, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each with a residual connection."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaBody(nn.Module):
    """The decoder stack (``model.`` in Hugging Face's names)."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TinyLlama(nn.Module):
    """A Llama causal LM: token ids ``(batch, length)`` -> logits ``(batch, length, vocab)``.

    The ``config`` attribute (with ``to_dict()``) is what orbit_pt's model handler writes as
    ``config.json``; ``_tied_weights_keys`` tells it which name to drop when the head is tied,
    as transformers does.

    Args:
        config: the hyperparameters.
    """

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self._tied_weights_keys = ["lm_head.weight"]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The next-token logits at every position."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(self.config, input_ids.shape[1], x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Llama's initialisation (normal weights, unit norms), drawn from ``generator`` only."""
        std = self.config.initializer_range
        with torch.no_grad():
            for name, param in self.named_parameters():  # tied weights are listed once
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, std, generator=generator)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> TinyLlama:
        """Load a model folder written by :func:`write_base_model` or saved by orbit_pt.

        Any Hugging Face Llama folder in safetensors whose config this class supports works too
        (one file or sharded with an index).
        """
        folder = Path(folder)
        document = json.loads((folder / CONFIG_FILE).read_text())
        model = cls(TinyLlamaConfig.from_dict(document))
        ModelHandler().restore(folder, model, HandlerContext(step=0))
        return model


def write_base_model(folder: Path, config: TinyLlamaConfig, *, seed: int) -> None:
    """Create the base model folder: weights drawn from ``seed``, written by orbit_pt.

    The same seed and config give the same bytes on any machine and world size. The folder is
    written beside its final name and renamed into place, so a crash never leaves half of it.
    Nothing happens when ``folder`` already exists.
    """
    if folder.exists():
        return
    model = TinyLlama(config)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ModelHandler().save(tmp, model, HandlerContext(step=0))
    os.replace(tmp, folder)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS (256) and EOS (257); no vocabulary file."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        """``text`` as BOS followed by its UTF-8 bytes."""
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; special and out-of-range ids are dropped."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
