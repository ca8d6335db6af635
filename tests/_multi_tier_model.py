"""The tiny FSDP2 model and deterministic training steps of the multi-tier tests and worker."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class MLP(torch.nn.Module):
    """Uneven first dims (7 and 3 rows), so FSDP2 shards them unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(5, 7)
        self.down = torch.nn.Linear(7, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x))) * self.scale
        return out


def build(*, shard: bool) -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    if shard:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model: MLP, opt: torch.optim.Optimizer, step: int) -> None:
    """One step whose data depends on the step only: a replay gives the same bytes."""
    gen = torch.Generator().manual_seed(step)
    model(torch.randn(4, 5, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def local_tensors(model: MLP, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's own bytes of the model and optimizer (local shards of DTensors)."""
    out = {}
    for key, value in model.state_dict().items():
        out[f"model/{key}"] = _local(value)
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"opt/{index}/{key}"] = _local(value)
    return out


def _local(value: Any) -> torch.Tensor:
    value = value.to_local() if isinstance(value, DTensor) else value
    out: torch.Tensor = value.detach().clone().contiguous()
    return out
