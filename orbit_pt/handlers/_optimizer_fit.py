"""Whether saved optimizer state fits a live optimizer, and how: decided before loading anything.

A restore into the wrong optimizer must fail at restore, not at the first ``step()`` (an AdamW
state loaded into ``SGD(momentum=0.9)`` fails there with ``KeyError: 'momentum'``). So
:func:`fit` checks, without changing the optimizer:

- the class: the one recorded at save (steps written before it was recorded are not checked);
- the state each parameter keeps (``exp_avg``, ``max_exp_avg_sq``, ...) against what the live
  optimizer keeps: its own state where it has stepped, otherwise what a throwaway optimizer of
  its class and group settings creates for a one-element parameter (see :func:`_probe_keys`);
- the parameters: the same set (or, with ``strict=False``, any overlap) and the same shapes;
- the param groups: state is keyed by parameter name, so any grouping of the parameters works;
  the checkpoint's hyperparameters apply only when the groups correspond one to one.

Every problem is collected and raised in one :class:`orbit_pt.StateMismatchError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.sharding import is_dtensor
from orbit_pt.handlers._mismatch import class_name, raise_mismatches, same_class

# Parameter names shown in one log line or problem line; the rest are counted.
_LISTED_NAMES = 10


@dataclass(frozen=True)
class Fit:
    """How saved optimizer state is loaded into a live optimizer.

    Attributes:
        hyperparameters: per live param group, the saved group whose hyperparameters it takes
            (tensors still as references), or None to keep the live group's.
        missing: optimizer parameters the checkpoint has nothing for (only with strict=False).
        unexpected: saved parameters the optimizer does not update (only with strict=False).
        kept_live_because: with hyperparameters="auto", why the live ones were kept ("" if not).
    """

    hyperparameters: list[Mapping[str, Any] | None]
    missing: list[str]
    unexpected: list[str]
    kept_live_because: str = ""


def names_listed(names: Sequence[str]) -> str:
    """``a, b, c`` -- the first few of ``names``, and how many more there are."""
    if not names:
        return "none"
    shown = ", ".join(names[:_LISTED_NAMES])
    more = len(names) - _LISTED_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


def fit(
    structure: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    names: list[str],
    *,
    strict: bool,
    hyperparameters: str,
    item: str,
    directory: Path,
    unexpected_ok: bool = False,
) -> Fit:
    """Check that the saved ``structure`` fits ``optimizer`` and decide how to load it.

    Args:
        structure: the saved ``optimizer.msgpack``.
        optimizer: the live optimizer (not changed here).
        names: the canonical name of each of its parameters, in param-group order.
        strict: whether the parameters must be exactly the saved ones.
        hyperparameters: "auto", "live" or "saved" (see ``OptimizerHandler``).
        item: the optimizer's item name, for the fix in messages.
        directory: the item's folder, for messages.
        unexpected_ok: do not refuse saved parameters the optimizer lacks, even when
            ``strict`` (the caller checks them against every rank's optimizer: pipeline
            stages each update some).

    Raises:
        StateMismatchError: listing every way the state does not fit.
    """
    saved_groups = structure["param_groups"]
    saved_names = [name for group in saved_groups for name in group["params"]]
    live, saved = set(names), set(saved_names)
    missing = [name for name in names if name not in saved]
    unexpected = [name for name in saved_names if name not in live]
    problems: list[str] = []
    fixes: list[str] = []

    wrong_class = _class_problem(structure.get("optimizer_class"), type(optimizer))
    wrong_keys = _key_problems(structure["state"], optimizer, names)
    if wrong_class or wrong_keys:
        problems += ([wrong_class] if wrong_class else []) + wrong_keys
        fixes.append(
            "Build the optimizer being restored like the one that was saved (its class, and "
            "options that change its state, such as amsgrad), or leave the optimizer out of "
            "the restore."
        )
    refused = [] if unexpected_ok else unexpected
    if strict and (missing or refused):
        problems += [f"{name} is in the optimizer but not in the checkpoint" for name in missing]
        problems += [f"{name} is in the checkpoint but not in the optimizer" for name in refused]
        fixes.append(
            "To restore the parameters both have and leave the others as they are, pass "
            f"CheckpointManager(..., handlers={{{item!r}: OptimizerHandler(strict=False)}})."
        )
    shapes = structure.get("param_shapes", {})
    params = [param for group in optimizer.param_groups for param in group["params"]]
    wrong_shapes = [
        f"{name}: saved for shape {list(shapes[name])}, the parameter is {list(param.shape)}"
        for name, param in zip(names, params, strict=True)
        if name in shapes and list(param.shape) != list(shapes[name])
    ]
    if wrong_shapes:
        problems += wrong_shapes
        fixes.append("Build the model with the shapes it was saved with.")
    mapping, why = _group_mapping(saved_groups, optimizer, names, live & saved)
    if hyperparameters == "saved" and mapping is None:
        problems.append(
            f"hyperparameters='saved', but the optimizer's {len(optimizer.param_groups)} param "
            f"group(s) do not correspond one to one to the checkpoint's {len(saved_groups)}: "
            f"{why}"
        )
        fixes.append(
            "Group the parameters as they were saved, or pass OptimizerHandler("
            "hyperparameters='live') to keep the optimizer's own hyperparameters."
        )
    raise_mismatches(
        problems,
        f"the optimizer state saved in {directory} does not fit item {item!r}, the optimizer "
        f"being restored ({len(problems)} problem(s)); nothing was loaded",
        fix="\n".join(fixes),
    )
    if mapping is None or hyperparameters == "live":
        chosen: list[Mapping[str, Any] | None] = [None] * len(optimizer.param_groups)
    else:
        chosen = [_saved_hyperparameters(saved_groups[index]) for index in mapping]
    kept = why if hyperparameters == "auto" and mapping is None else ""
    return Fit(chosen, missing, unexpected, kept)


def _class_problem(saved: Any, live: type) -> str | None:
    """A line when the recorded class is not ``live`` (None when it is, or was not recorded).

    A class that moved between modules counts as the same (``same_class``); the state-key check
    still catches an optimizer that really differs.
    """
    if not isinstance(saved, str) or same_class(saved, live):
        return None
    return f"class: the state was saved from a {saved}, the optimizer is a {class_name(live)}"


def _key_problems(
    saved_state: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: list[str]
) -> list[str]:
    """One line per way the saved per-parameter state keys differ from what the optimizer keeps."""
    differences: dict[tuple[frozenset[Any], frozenset[Any]], list[str]] = {}
    probed: dict[tuple[int, int], frozenset[Any] | None] = {}
    position = 0
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            name = names[position]
            position += 1
            saved = saved_state.get(name)
            if not isinstance(saved, Mapping) or not saved:
                continue
            current = optimizer.state.get(param)
            if current:
                expected: frozenset[Any] | None = frozenset(current)
            else:
                key = (group_index, param.ndim)
                if key not in probed:
                    probed[key] = _probe_keys(optimizer, group, param)
                expected = probed[key]
            if expected is not None and frozenset(saved) != expected:
                differences.setdefault((frozenset(saved), expected), []).append(name)
    lines = []
    for (saved_keys, expected), affected in differences.items():
        parts = []
        if saved_keys - expected:
            parts.append(f"only in the checkpoint: {_keys(saved_keys - expected)}")
        if expected - saved_keys:
            parts.append(f"not in the checkpoint: {_keys(expected - saved_keys)}")
        lines.append(
            f"{names_listed(affected)}: saved with state {_keys(saved_keys)}, the "
            f"{type(optimizer).__name__} being restored keeps {_keys(expected)} "
            f"({'; '.join(parts)})"
        )
    return lines


def _keys(keys: frozenset[Any]) -> str:
    return "[" + ", ".join(sorted(map(str, keys))) + "]"


def _probe_keys(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: Any
) -> frozenset[Any] | None:
    """The state keys ``optimizer`` will create for ``param`` (in ``group``), or None if unknown.

    An optimizer that has not stepped has no state to compare with, yet its class and group
    settings decide which keys its first step expects (``Adam(amsgrad=True)`` reads
    ``max_exp_avg_sq``). For torch's own optimizers, a throwaway optimizer of the same class and
    settings takes one step on a one-element parameter of the same rank, dtype and device: the
    live optimizer is not touched, and no step hooks run. Other optimizers -- user classes, and
    torch's with a replaced ``step`` -- are never run this way, since their code may count or
    log steps; neither is one whose probe fails (it needs a closure, or sparse gradients).
    """
    cls: Any = type(optimizer)
    step = cls.step
    # torch wraps step() (once per class) to run the global and per-optimizer step hooks.
    own = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step
    if not (_in_torch_optim(cls) and _in_torch_optim(own)):
        return None
    local = param.to_local() if is_dtensor(param) else param
    settings = {key: value for key, value in group.items() if key not in ("params", "param_names")}
    try:
        dummy = torch.zeros((1,) * param.ndim, dtype=local.dtype, device=local.device)
        dummy.requires_grad_(True)
        dummy.grad = torch.zeros_like(dummy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = cls([{**settings, "params": [dummy]}])
            own(probe)
    except Exception:  # any failure only means that the keys cannot be told in advance
        return None
    keys = probe.state.get(dummy)
    return frozenset(keys) if keys else None


def _in_torch_optim(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "torch.optim" or module.startswith("torch.optim.")


def _group_mapping(
    saved_groups: Sequence[Mapping[str, Any]],
    optimizer: torch.optim.Optimizer,
    names: list[str],
    common: set[str],
) -> tuple[list[int] | None, str]:
    """For each live group, the saved group over the same parameters -- or None, and why not.

    Only the parameters both sides have count, so a frozen embedding left out of the optimizer
    does not stop its groups from corresponding.
    """
    owner = {name: index for index, group in enumerate(saved_groups) for name in group["params"]}
    saved_sets: dict[frozenset[str], int] = {}
    sizes: dict[int, int] = {}
    for index, group in enumerate(saved_groups):
        members = frozenset(name for name in group["params"] if name in common)
        sizes[index] = len(members)
        if members:
            saved_sets[members] = index
    mapping: list[int] = []
    reasons: list[str] = []
    start = 0
    for index, group in enumerate(optimizer.param_groups):
        members = frozenset(n for n in names[start : start + len(group["params"])] if n in common)
        start += len(group["params"])
        match = saved_sets.get(members)
        if members and match is not None:
            mapping.append(match)
        elif not members:
            reasons.append(f"optimizer group {index} holds no parameter that the checkpoint has")
        else:
            holders = sorted({owner[name] for name in members})
            if len(holders) > 1:
                reasons.append(
                    f"optimizer group {index} holds parameters of saved groups {holders}"
                )
            else:
                saved_group = holders[0]
                reasons.append(
                    f"optimizer group {index} holds {len(members)} of the {sizes[saved_group]} "
                    f"parameters of saved group {saved_group}"
                )
    if reasons:
        return None, "; ".join(reasons)
    return mapping, ""


def _saved_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved group's hyperparameters. ``param_names`` lists the saved group's own parameters
    in their saved order, so the live group keeps its own."""
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}
