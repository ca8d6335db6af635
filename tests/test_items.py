"""Bare tensors and dicts of tensors are items, as arrays are in Orbax.

``save(step, {"step": torch.tensor(5)})`` works without configuring a handler; a restore into a
live tensor copies into it in place (refusing another shape or dtype), and a restore without a
target returns a tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions, StateMismatchError
from orbit_pt.handlers import StateHandler, default_handler


def test_a_bare_tensor_gets_the_state_handler() -> None:
    assert isinstance(default_handler(torch.tensor(5), item_name="step"), StateHandler)
    param = torch.nn.Parameter(torch.ones(2))
    assert isinstance(default_handler(param, item_name="scale"), StateHandler)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_bare_tensor_restores_in_place(tmp_path: Path, async_save: bool) -> None:
    step = torch.tensor(5)
    weights = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    options = CheckpointManagerOptions(async_save=async_save)
    with CheckpointManager(tmp_path, options=options) as mgr:
        mgr.save(5, {"step": step, "weights": weights}, force=True)
        mgr.wait_until_finished()
        live_step, live_weights = torch.tensor(0), torch.zeros(2, 3, dtype=torch.bfloat16)
        out = mgr.restore(5, {"step": live_step, "weights": live_weights})
    assert out["step"] is live_step
    assert out["weights"] is live_weights
    assert int(live_step) == 5
    assert torch.equal(live_weights, weights)


def test_a_bare_tensor_without_a_target_is_a_tensor(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"step": torch.tensor(7, dtype=torch.int32)}, force=True)
        plain = mgr.restore(1)["step"]
        named = mgr.restore(1, ["step"])["step"]
    for value in (plain, named):
        assert isinstance(value, torch.Tensor)
        assert value.dtype == torch.int32
        assert value.shape == ()
        assert int(value) == 7


def test_a_parameter_restores_in_place_without_autograd_complaining(tmp_path: Path) -> None:
    scale = torch.nn.Parameter(torch.full((3,), 2.0))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"scale": scale}, force=True)
        live = torch.nn.Parameter(torch.zeros(3))
        mgr.restore(1, {"scale": live})
    assert torch.equal(live.detach(), torch.full((3,), 2.0))
    assert live.requires_grad


@pytest.mark.parametrize(
    ("target", "detail"),
    [
        (torch.zeros(3), "saved torch.int64 [], target torch.float32 [3]"),
        (torch.tensor(0, dtype=torch.int32), "saved torch.int64 [], target torch.int32 []"),
        ({"step": torch.tensor(0)}, "saved a tensor, target a dict"),
    ],
    ids=["shape", "dtype", "container"],
)
def test_a_tensor_of_another_shape_or_dtype_is_refused(
    tmp_path: Path, target: object, detail: str
) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"step": torch.tensor(5)}, force=True)
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, {"step": target})
    assert f"<root>: {detail}" in str(info.value), str(info.value)


def test_a_dict_of_tensors_restores_in_place(tmp_path: Path) -> None:
    state: dict[str, Any] = {"step": torch.tensor(3), "ema": {"w": torch.randn(2, 2)}}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"trainer": state}, force=True)
        live: dict[str, Any] = {"step": torch.tensor(0), "ema": {"w": torch.zeros(2, 2)}}
        w = live["ema"]["w"]
        mgr.restore(3, {"trainer": live})
        with pytest.raises(StateMismatchError, match=r"ema/w: saved torch.float32 \[2, 2\]"):
            mgr.restore(3, {"trainer": {"step": torch.tensor(0), "ema": {"w": torch.zeros(3)}}})
    assert live["ema"]["w"] is w
    assert torch.equal(w, state["ema"]["w"])
    assert int(live["step"]) == 3
