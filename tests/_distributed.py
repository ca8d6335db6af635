"""Run a test body on several real gloo ranks (CPU processes); fail the test if any rank fails."""

from __future__ import annotations

import os
import socket
import sys
import time
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
    # The body passed. Leave without running C++ static destructors: gloo's threads have
    # aborted a rank at interpreter exit now and then ("terminate called without an active
    # exception", SIGABRT) after every assertion had passed -- a teardown artefact of the
    # harness, not of the checkpoint under test. A failure still raises above and is reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gather(value: object) -> list[object]:
    """Every rank's ``value`` (inside a rank body), to assert that the ranks agree."""
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_ranks(world_size: int, fn: Callable[..., None], *args: Any, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure.

    ``fn`` must be a module-level function (it is pickled by reference into each process). A
    run that has not finished after ``timeout`` seconds is a hang: its ranks are killed and the
    test fails, so a hang never stalls the suite.
    """
    context = mp.start_processes(  # type: ignore[attr-defined]
        _entry,
        args=(world_size, free_port(), fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(
                f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f} s: a "
                "hang (ranks waiting in a collective that a peer never reached)"
            )
