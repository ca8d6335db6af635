"""``config.json`` beside the weights, and only when the weights fit it.

A Hugging Face folder is loaded by building ``architectures[0]`` from ``config.json`` and
reading the weights into it by name. If the saved names or shapes are not those of that class
built from that config, ``from_pretrained`` still "succeeds": it initialises what is missing at
random, drops what is unexpected (perhaps with a log line), re-ties what the config ties -- a
model that loads wrong in silence. That happens when the live model is not what its config
builds: layers replaced or added after construction, weights untied by hand, a wrapper orbit_pt
does not know adding a prefix.

So before writing ``config.json`` taken from the model, the handler builds ``type(model)(config)``
on the meta device (no memory, no init; once per class and config) and compares: the same
names with the same shapes, and the same names saved once tied weights are written once. When
they differ it writes no ``config.json`` (nor ``generation_config.json``) and logs a WARNING
saying why: the step still restores with orbit_pt, but it is not offered to transformers as
something it would load right. An explicit ``ModelHandler(config=...)`` is written as given.
When the class cannot be built from its config alone the check is skipped (a DEBUG line).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from orbit_pt._format.safetensors import torch_dtype_name
from orbit_pt.handlers._ties import kept_name, tie_groups
from orbit_pt.handlers._wrappers import unwrap

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_MAX_CACHED = 8
_SHOWN = 3


class _Layout:
    """What a class built from a config holds: name -> shape, and the names saved."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], saved: frozenset[str]) -> None:
        self.shapes = dict(shapes)
        self.saved = saved


_reference_cache: dict[tuple[type, str], _Layout | None] = {}
_cache_lock = threading.Lock()


def model_documents(
    module: torch.nn.Module,
    *,
    shapes: Mapping[str, Sequence[int]],
    saved: frozenset[str],
    dtype: torch.dtype,
    step: int,
) -> dict[str, Any]:
    """``config.json`` and ``generation_config.json`` of ``module``, by file name.

    Empty when the module has no transformers-style ``config``, or when the weights do not fit
    it (logged as a WARNING).

    Args:
        module: the live module (wrappers allowed).
        shapes: the global shape of every name of its canonical state (under pipeline
            stages: of every stage's).
        saved: the names written (one per tied group).
        dtype: the dtype recorded in the config (the export dtype, or the model's).
        step: for the log line.
    """
    inner = unwrap(module)
    config = getattr(inner, "config", None)
    if not callable(getattr(config, "to_dict", None)):
        return {}
    document = dict(config.to_dict())  # type: ignore[union-attr]
    reason = _misfit(inner, config, shapes, saved)
    if reason is not None:
        logger.warning(
            "step %d: not writing %s for the %s model: its weights do not fit the %s that "
            "config builds (%s), so transformers.from_pretrained would load the folder wrong "
            "in silence. The step restores with orbit_pt as usual; to write a config anyway, "
            "pass ModelHandler(config=...)",
            step,
            CONFIG_FILE,
            type(inner).__name__,
            type(inner).__name__,
            reason,
        )
        return {}
    # What save_pretrained records, so from_pretrained picks the class and dtype.
    if not document.get("architectures"):
        document["architectures"] = [type(inner).__name__]
    dtype_key = "torch_dtype" if "torch_dtype" in document else "dtype"
    document[dtype_key] = torch_dtype_name(dtype)
    documents: dict[str, Any] = {CONFIG_FILE: document}
    generation = getattr(inner, "generation_config", None)
    if callable(getattr(generation, "to_dict", None)):
        documents[GENERATION_CONFIG_FILE] = generation.to_dict()  # type: ignore[union-attr]
    return documents


def _misfit(
    inner: torch.nn.Module,
    config: Any,
    model_shapes: Mapping[str, Sequence[int]],
    saved: frozenset[str],
) -> str | None:
    """Why the weights do not fit ``type(inner)(config)``; None when they do or when unknown."""
    reference = _reference(type(inner), config)
    if reference is None:
        return None
    shapes = {name: tuple(shape) for name, shape in model_shapes.items()}
    extra = sorted(set(shapes) - set(reference.shapes))
    absent = sorted(set(reference.shapes) - set(shapes))
    if extra or absent:
        parts = []
        if absent:
            parts.append(f"{len(absent)} of its keys are not in the model, e.g. {absent[:_SHOWN]}")
        if extra:
            parts.append(f"{len(extra)} model keys are not in it, e.g. {extra[:_SHOWN]}")
        return "; ".join(parts)
    reshaped = [
        f"{name}: model {list(shape)}, config {list(reference.shapes[name])}"
        for name, shape in shapes.items()
        if reference.shapes[name] != shape
    ]
    if reshaped:
        return f"{len(reshaped)} shape(s) differ, e.g. {reshaped[:_SHOWN]}"
    if saved != reference.saved:
        only_model = sorted(saved - reference.saved)
        only_config = sorted(reference.saved - saved)
        return (
            f"the weights are tied differently: written {only_model[:_SHOWN]} where the config "
            f"ties them, or tied {only_config[:_SHOWN]} where the config does not"
        )
    return None


def _reference(cls: type, config: Any) -> _Layout | None:
    """The layout ``cls(config)`` has, built once on the meta device; None if it cannot be."""
    try:
        text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
    key = (cls, text)
    with _cache_lock:
        if key in _reference_cache:
            return _reference_cache[key]
    layout: _Layout | None
    try:
        with torch.device("meta"):
            reference = cls(copy.deepcopy(config))
        if not isinstance(reference, torch.nn.Module):
            raise TypeError(f"{cls.__name__}(config) is not a torch.nn.Module")
        state = reference.state_dict(keep_vars=True)
        layout = _Layout(
            {name: tuple(t.shape) for name, t in state.items()},
            frozenset(kept_name(group, reference) for group in tie_groups(state)),
        )
    except Exception as exc:  # any failure only means the check cannot run
        logger.debug(
            "cannot build %s from its config alone to check the saved weights against it (%s: "
            "%s); writing its config.json unchecked",
            cls.__name__,
            type(exc).__name__,
            exc,
        )
        layout = None
    with _cache_lock:
        if len(_reference_cache) >= _MAX_CACHED:
            _reference_cache.pop(next(iter(_reference_cache)))
        _reference_cache[key] = layout
    return layout
