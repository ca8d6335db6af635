"""Wrappers are invisible in a checkpoint: names are those of the model inside every wrapper.

Training code wraps models in ways that add a part to every state-dict key:

=============================================  ==================================
wrapper                                        part added to the keys
=============================================  ==================================
``DistributedDataParallel``, ``DataParallel``  ``module.`` (in front)
``torch.compile``                              ``_orig_mod.`` (in front)
activation checkpointing (``checkpoint_wrapper``)  ``_checkpoint_wrapped_module.``
FSDP1 (``FullyShardedDataParallel``)           ``_fsdp_wrapped_module.``
=============================================  ==================================

A checkpoint never holds these parts: a model saved from ``DDP(compile(model))`` has the keys
``model`` itself has, so it restores into the bare model, into a model wrapped another way, and
loads in ``transformers.from_pretrained``. The last three parts are names no real submodule
uses, so they are removed wherever they appear; ``module`` is an ordinary attribute name, so it
is removed only where the module holding it really is a DDP or DataParallel wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from orbit_pt.errors import CheckpointValueError

# Parts removed wherever they appear: no submodule is called that except by its wrapper.
NAMED_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# The attribute DDP and DataParallel keep the model under; removed only below such a wrapper.
_DATA_PARALLEL_PART = "module"


def canonical_name(key: str) -> str:
    """``key`` without the parts that name-recognisable wrappers add.

    ``_orig_mod.``, ``_checkpoint_wrapped_module.`` and ``_fsdp_wrapped_module.`` go wherever
    they are; ``module.`` stays, because only the live module can tell whether it is a DDP
    wrapper's (see :func:`key_namer`).
    """
    return ".".join(part for part in key.split(".") if part not in NAMED_WRAPPER_PARTS)


def _wrapped_attribute(module: torch.nn.Module) -> str | None:
    """The attribute holding the wrapped model, if ``module`` is a wrapper; else None."""
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return _DATA_PARALLEL_PART
    for part in NAMED_WRAPPER_PARTS:
        if isinstance(getattr(module, part, None), torch.nn.Module):
            return part
    return None


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside every wrapper around ``module`` (the one holding ``config`` and ties).

    Unwraps DDP/DataParallel, ``torch.compile``, activation checkpointing and FSDP1, in any
    order and nesting: ``unwrap(DDP(torch.compile(model))) is model``.
    """
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        attribute = _wrapped_attribute(module)
        if attribute is None:
            break
        module = getattr(module, attribute)
    return module


def key_namer(module: torch.nn.Module) -> Callable[[str], str]:
    """A function from the module's own state-dict keys to the names they are saved under.

    Removes the parts every wrapper inside ``module`` adds: named ones anywhere, and ``module``
    exactly where the module at that path is a DDP or DataParallel wrapper (a submodule of your
    own called ``module`` keeps its name).
    """
    data_parallel = frozenset(
        f"{path}.{_DATA_PARALLEL_PART}" if path else _DATA_PARALLEL_PART
        for path, sub in module.named_modules()
        if _wrapped_attribute(sub) == _DATA_PARALLEL_PART
    )
    if not data_parallel:
        return canonical_name

    def name(key: str) -> str:
        kept: list[str] = []
        path = ""
        for part in key.split("."):
            path = f"{path}.{part}" if path else part
            if part not in NAMED_WRAPPER_PARTS and path not in data_parallel:
                kept.append(part)
        return ".".join(kept)

    return name


def canonical_state(module: torch.nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` under canonical names; the tensors share storage with the module.

    With ``keep_vars`` the values are the module's own parameter and buffer objects (the same
    object under every name of a tied weight), as ``state_dict(keep_vars=True)`` gives them.
    """
    name = key_namer(module)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict(keep_vars=keep_vars).items():
        canonical = name(key)
        if canonical in out:
            raise CheckpointValueError(
                f"state-dict keys {key!r} and another key both become {canonical!r} once wrapper "
                "prefixes are removed; rename one of the submodules"
            )
        out[canonical] = tensor
    return out


# ------------------------------------------------------------------- when only wrappers differ

_ANY_WRAPPER_PARTS = NAMED_WRAPPER_PARTS | {_DATA_PARALLEL_PART}


def _bare(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _ANY_WRAPPER_PARTS)


def _parts(names: Iterable[str]) -> list[str]:
    return sorted({f"{p}." for name in names for p in name.split(".") if p in _ANY_WRAPPER_PARTS})


def wrapper_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """How to fix a restore whose keys differ from the model's only by wrapper parts, or None.

    Args:
        missing: the model's names that the checkpoint lacks.
        unexpected: the checkpoint's names that the model lacks.
    """
    if not missing or not unexpected:
        return None
    if sorted(map(_bare, missing)) != sorted(map(_bare, unexpected)):
        return None
    in_checkpoint = [p for p in _parts(unexpected) if p not in _parts(missing)]
    in_model = [p for p in _parts(missing) if p not in _parts(unexpected)]
    if in_checkpoint:
        first = in_checkpoint[0]
        rename = (
            f"k.removeprefix({first!r})"
            if all(name.startswith(first) for name in unexpected)
            else f"k.replace({first!r}, '')"
        )
        return (
            f"The checkpoint's keys differ from the model's only by the wrapper prefix(es) "
            f"{in_checkpoint}: the folder was written from a wrapped model (DDP/DataParallel "
            "'module.', torch.compile '_orig_mod.', ...) by a tool that kept the prefix; "
            "orbit_pt itself never writes one. Rename the keys once, for every safetensors "
            "file of the folder (and the weight_map of model.safetensors.index.json): "
            f"save_file({{{rename}: v for k, v in load_file(f).items()}}, "
            "f, metadata={'format': 'pt'}) with load_file/save_file from safetensors.torch."
        )
    return (
        f"The model's keys differ from the checkpoint's only by the prefix(es) {in_model}, "
        "which come from a wrapper orbit_pt does not recognise (DDP, DataParallel, "
        "torch.compile, checkpoint_wrapper and FSDP1 are recognised); restore into the "
        "wrapped model itself (e.g. model.module) instead."
    )
