"""The control plane under torch.distributed: who is rank 0, and agreeing on decisions.

All control traffic (barriers, broadcasts of the step list, error agreement, the preemption
flag) goes over a CPU ``gloo`` group of orbit_pt's own, so it works when the model uses NCCL and
never puts a NCCL collective on a background thread. On one process every method is trivial.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from orbit_pt._safetensors import tensor_bytes
from orbit_pt.errors import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AgreedError(CheckpointError):
    """A failure that every rank has already agreed on (see :meth:`Collective.run_everywhere`)."""


def _encode(value: Any) -> torch.Tensor:
    data = json.dumps(value, allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    # numpy is not a dependency: read the bytes through a zero-copy view of the tensor.
    return json.loads(bytes(tensor_bytes(payload.contiguous())) if payload.numel() else b"null")


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, allow_nan=False))


class Collective:
    """Rank, world size and the few collectives the manager needs, over a private gloo group."""

    def __init__(self, group: Any = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        if not self.enabled:
            self.rank, self.world_size, self.group = 0, 1, None
            return
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # new_group is itself collective: every rank constructs its manager at the same point.
        self.group = group if group is not None else dist.new_group(backend="gloo")

    def new_group(self) -> Any:
        """A second gloo group (for a background thread, so its traffic never interleaves)."""
        return dist.new_group(backend="gloo") if self.enabled else None

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank.

        Values travel as JSON (never pickle, even between trusted ranks), so they must be
        JSON-able; tuples arrive as lists. On one process the value makes the same round trip,
        so a value that only works on one process is caught by the single-process tests too.
        """
        if not self.enabled:
            return _json_round_trip(value)
        payload = _encode(value) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.broadcast(size, src=self._global(0), group=self.group)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self._global(0), group=self.group)
        return _decode(payload)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (JSON-able values, as for :meth:`broadcast`)."""
        if not self.enabled:
            return [_json_round_trip(value)]
        payload = _encode(value)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        return [_decode(g[: int(n.item())]) for g, n in zip(gathered, sizes, strict=True)]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (an all-reduce MAX)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def run_everywhere(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it raises on any rank, raise on every rank.

        The error on the other ranks names the rank(s) that failed and their message, so a
        failure is never a hang (a rank stuck in a barrier that its peer never reaches).

        Calls may nest (a handler agreeing on its own files inside the manager's "writing step"
        agreement). A rank that fails before it reaches the inner agreement meets its peers with
        a different ``what``; every rank then sees that they are out of step and raises
        :class:`AgreedError`, which enclosing calls re-raise without gathering again -- so the
        ranks leave together instead of pairing the wrong collectives.
        """
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except AgreedError:
            raise  # every rank already knows: gathering again would pair the wrong collectives
        except Exception as exc:
            error = exc
        mine = None if error is None else f"{type(error).__name__}: {error}"
        reports = self.all_gather((what, mine))
        failed = {rank: message for rank, (_, message) in enumerate(reports) if message is not None}
        elsewhere = {rank: where for rank, (where, _) in enumerate(reports) if where != what}
        if elsewhere:
            detail = "; ".join(
                f"rank {rank} was at {where!r}" + (f" ({failed[rank]})" if rank in failed else "")
                for rank, where in elsewhere.items()
            )
            own = f"; on this rank: {mine}" if mine is not None else ""
            raise AgreedError(
                f"{what} failed: the ranks are out of step, because rank(s) {sorted(elsewhere)} "
                f"failed before reaching it: {detail}{own}"
            ) from error
        if failed:
            if error is not None:
                raise error
            detail = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
            raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {detail}")
        return result  # type: ignore[no-any-return]

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else 0
