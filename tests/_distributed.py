"""Run a test body on several real gloo ranks (CPU processes); fail the test if any rank fails."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    # Tear down together: a rank that closes its gloo sockets while a peer is still inside a
    # collective on another group makes gloo abort the peer (SIGABRT) -- a harness artefact,
    # not a checkpoint bug. (On failure mp.spawn terminates the other ranks anyway.)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure.

    ``fn`` must be a module-level function (it is pickled by reference into each process).
    """
    mp.spawn(  # type: ignore[attr-defined]
        _entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True
    )
