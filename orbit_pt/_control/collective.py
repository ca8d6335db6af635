"""The control plane under torch.distributed: who is rank 0, and agreeing on decisions.

All control traffic (barriers, broadcasts of the step list, error agreement, the preemption
flag) goes over a CPU ``gloo`` group of orbit_pt's own, so it works when the model uses NCCL and
never puts a NCCL collective on a background thread. On one process every method is trivial.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from orbit_pt.errors import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AgreedError(CheckpointError):
    """A failure that every rank has agreed on (see :meth:`Collective.agree`).

    Raised on every rank with the same message, which names each failing rank and its cause.

    Attributes:
        failures: rank -> ``"ExceptionType: message"`` for every rank that failed.
        local: the exception this rank raised itself, or None when only other ranks failed.
    """

    def __init__(
        self, message: str, failures: dict[int, str], local: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.local = local

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.failures))


def _encode(value: Any) -> torch.Tensor:
    data = json.dumps(value, allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    # numpy is not a dependency: copy the bytes out of the tensor's memory directly.
    payload = payload.contiguous()
    data = ctypes.string_at(payload.data_ptr(), payload.numel()) if payload.numel() else b"null"
    return json.loads(data)


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, allow_nan=False))


class PeerError(CheckpointError):
    """A collective with the other ranks failed: a rank died, or did not arrive in time.

    Unlike :class:`AgreedError`, only the ranks that waited raise it; the chained error is
    gloo's own.
    """


@contextlib.contextmanager
def _with_peers(timeout: datetime.timedelta | None) -> Iterator[None]:
    """Turn a failed gloo collective (a RuntimeError) into a :class:`PeerError` that says why."""
    try:
        yield
    except RuntimeError as exc:
        waited = (
            f"{timeout.total_seconds():g} s (CheckpointManagerOptions.agreement_timeout)"
            if timeout is not None
            else "gloo's default timeout (30 minutes; CheckpointManagerOptions.agreement_timeout "
            "sets it)"
        )
        raise PeerError(
            f"the other ranks did not answer orbit_pt's collective: a rank died, or is alive but "
            f"did not reach the same save, restore or should_save call within {waited}. Every "
            f"rank must make the same calls at the same steps. gloo said: {exc}"
        ) from exc


class InFlightAny:
    """A MAX all-reduce of one flag that was started and may not have finished
    (:meth:`Collective.start_any`)."""

    def __init__(self, flag: torch.Tensor, work: Any = None) -> None:
        self._flag = flag
        self._work = work
        self._error: BaseException | None = None

    @classmethod
    def done(cls, flag: bool) -> InFlightAny:
        """An answer known already (one process)."""
        return cls(torch.tensor([1 if flag else 0], dtype=torch.int32))

    def wait(self) -> bool:
        """Wait for the all-reduce (once) and return whether the flag was set on any rank.

        Raises what the all-reduce raised (a peer that died: a gloo error), on every call.
        """
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except Exception as exc:  # kept: the all-reduce cannot be waited for again
                self._error = exc
            except BaseException:  # a KeyboardInterrupt: the all-reduce is still in flight
                self._work = work
                raise
        if self._error is not None:
            raise self._error
        return bool(self._flag.item())


class Collective:
    """Rank, world size and the few collectives the manager needs, over a private gloo group.

    Three kinds: on one process every method is trivial; a *writer's* collective owns a gloo
    group (created collectively, destroyed by :meth:`close`); a *local* one
    (:meth:`local`, for read-only managers) knows its rank and world size but never talks to the
    other ranks, so it can be used on any subset of them.
    """

    def __init__(self, group: Any = None, *, timeout: datetime.timedelta | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self._owns_group = False
        self._in_flight: InFlightAny | None = None
        self.timeout = timeout
        if not self.enabled:
            self.rank, self.world_size, self.group = 0, 1, None
            return
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if group is None:
            # new_group is itself collective: every rank constructs its manager at that point.
            # The timeout bounds every collective on the group: how long a rank waits for a
            # peer that is alive but does not arrive (None: gloo's default, 30 minutes).
            group = dist.new_group(backend="gloo", timeout=timeout)
            self._owns_group = True
        self.group = group

    @classmethod
    def local(cls) -> Collective:
        """This rank's rank and world size, with every collective a no-op (read-only use)."""
        out = cls.__new__(cls)
        out.enabled, out._owns_group, out.group = False, False, None
        out._in_flight = None
        initialized = dist.is_available() and dist.is_initialized()
        out.rank = dist.get_rank() if initialized else 0
        out.world_size = dist.get_world_size() if initialized else 1
        return out

    def new_group(self) -> Collective:
        """A collective over a second gloo group of its own (for a background thread, so that
        its traffic never interleaves with the training thread's)."""
        return Collective(timeout=self.timeout) if self.enabled else self

    def close(self) -> None:
        """Destroy the gloo group this collective created (idempotent; local, not collective)."""
        try:
            self._settle()
        except Exception as exc:  # a peer that died: its error was (or will be) raised elsewhere
            logger.debug("orbit_pt's last flag all-reduce failed at close: %s", exc)
        group, self.group = self.group, None
        if not self._owns_group or group is None:
            return
        self._owns_group = False
        self.enabled = False
        if not (dist.is_available() and dist.is_initialized()):
            return  # the default group is gone, and every subgroup with it
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # closing must release the other resources regardless
            logger.debug("could not destroy orbit_pt's gloo group: %s", exc)

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
        self._settle()
        payload = _encode(value) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        with _with_peers(self.timeout):
            dist.broadcast(size, src=self._global(0), group=self.group)
            if self.rank != 0:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(payload, src=self._global(0), group=self.group)
        return _decode(payload)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (JSON-able values, as for :meth:`broadcast`)."""
        if not self.enabled:
            return [_json_round_trip(value)]
        self._settle()
        padded, sizes = self._padded(value)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        with _with_peers(self.timeout):
            dist.all_gather(gathered, padded, group=self.group)
        return [_decode(g[: int(n.item())]) for g, n in zip(gathered, sizes, strict=True)]

    def _padded(self, value: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``value`` encoded and padded to the longest of every rank's, and every rank's length
        (gloo's gathers want tensors of one length)."""
        payload = _encode(value)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        with _with_peers(self.timeout):
            dist.all_gather(sizes, size, group=self.group)
        padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
        padded[: payload.numel()] = payload
        return padded, sizes

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0, in rank order; None on the other ranks.

        For data only rank 0 reads (the write reports of a save): unlike :meth:`all_gather`,
        no other rank receives or decodes it, so a job of W ranks moves W values, not W².
        """
        if not self.enabled:
            return [_json_round_trip(value)]
        self._settle()
        padded, sizes = self._padded(value)
        primary = self.rank == 0
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)] if primary else None
        with _with_peers(self.timeout):
            dist.gather(padded, gathered, dst=self._global(0), group=self.group)
        if gathered is None:
            return None
        return [_decode(g[: int(n.item())]) for g, n in zip(gathered, sizes, strict=True)]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (an all-reduce MAX)."""
        return self.start_any(flag).wait()

    def start_any(self, flag: bool) -> InFlightAny:
        """Start :meth:`any` and return at once; the result's ``wait()`` gives the answer.

        The all-reduce runs on gloo's own thread while the caller goes on. Every other
        collective of this object (and :meth:`close`) waits for it first, so it never overlaps
        another collective of the group, and a group is never destroyed under it. Call it at
        the same point on every rank, as :meth:`any`.
        """
        if not self.enabled:
            return InFlightAny.done(flag)
        self._settle()
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._in_flight = InFlightAny(t, work)
        return self._in_flight

    def run_everywhere(self, tag: str, fn: Callable[[], T], *, label: str | None = None) -> T:
        """Run ``fn`` on every rank; if it raises on any rank, raise on every rank.

        ``tag`` names the point of agreement and must be the same string on every rank (no
        paths or other per-rank spellings in it); ``label`` is what messages call it. See
        :meth:`agree`.
        """
        result, _ = self.agree(tag, fn, label=label)
        return result

    def agree(
        self,
        tag: str,
        fn: Callable[[], T],
        *,
        label: str | None = None,
        share: Callable[[T], Any] | None = None,
        to_primary: bool = False,
    ) -> tuple[T, list[Any]]:
        """Run ``fn`` on every rank, agree on the outcome, and gather ``share(result)``.

        Returns this rank's result and every rank's shared value (JSON-able; None without
        ``share``), in rank order -- one all-gather carries both the outcome and the data.
        With ``to_primary`` the shared values go to rank 0 only (a second, gather, after the
        outcome is agreed); the other ranks get an empty list.

        If ``fn`` raises anything on any rank (``BaseException``: a KeyboardInterrupt on one
        rank must not strand the others in a collective), every rank raises one
        :class:`AgreedError` naming each failing rank and its cause, chained from this rank's own
        error. A rank whose error is not an ``Exception`` (KeyboardInterrupt, SystemExit) raises
        that error itself, after its peers have been told. On one process ``fn``'s error
        propagates unchanged.

        Calls may nest (a handler agreeing on its own files inside the manager's "write"
        agreement). A rank that fails before it reaches the inner agreement meets its peers
        with a different ``tag``; every rank then sees that they are out of step and raises
        :class:`AgreedError`, which enclosing agreements re-raise without gathering again -- so
        the ranks leave together instead of pairing the wrong collectives.
        """
        if not self.enabled:
            alone = fn()
            return alone, [share(alone) if share is not None else None]
        label = label or tag
        result: Any = None
        error: BaseException | None = None
        mine_shared: Any = None
        kept: Any = None  # the shared value, when it goes to rank 0 only
        try:
            result = fn()
            mine_shared = share(result) if share is not None else None
            if to_primary:
                kept, mine_shared = mine_shared, None
        except AgreedError:
            raise  # every rank already knows: gathering again would pair the wrong collectives
        except BaseException as exc:
            error = exc
        mine = None if error is None else _describe(error)
        reports = self.all_gather([tag, mine, mine_shared])
        failed = {rank: msg for rank, (_, msg, _) in enumerate(reports) if msg is not None}
        elsewhere = {rank: where for rank, (where, _, _) in enumerate(reports) if where != tag}
        if elsewhere:
            # A rank that failed inside an agreement's fn left it early and meets its peers at
            # the next one; those peers are at an inner one. Say where each rank was and who
            # failed, from every rank's view alike.
            positions = "; ".join(f"rank {r} was at {where!r}" for r, where in elsewhere.items())
            if failed:
                causes = "; ".join(f"rank {r}: {message}" for r, message in failed.items())
                headline = f"{label} failed on rank(s) {sorted(failed)} of {self.world_size}"
                headline += f": {causes}"
            else:
                headline = (
                    f"{label} failed: no rank reported an error, but the ranks did not make the "
                    "same calls in the same order (every rank must save and restore alike)"
                )
            agreed = AgreedError(
                f"{headline}. The ranks are out of step (this rank was at {tag!r}; "
                f"{positions}), so every rank stops here",
                failed,
                error,
            )
            _raise(agreed, error)
        if failed:
            detail = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
            agreed = AgreedError(
                f"{label} failed on rank(s) {sorted(failed)} of {self.world_size}: {detail}",
                failed,
                error,
            )
            _raise(agreed, error)
        if to_primary:
            return result, self.gather(kept) or []
        return result, [shared for _, _, shared in reports]

    def _settle(self) -> None:
        """Wait for the all-reduce that :meth:`start_any` left in flight, if any."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            with _with_peers(self.timeout):
                in_flight.wait()

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else 0


def _describe(error: BaseException) -> str:
    if isinstance(error, AgreedError):
        return str(error)
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _raise(agreed: AgreedError, local: BaseException | None) -> NoReturn:
    stop = local is not None and not isinstance(local, Exception)
    if stop and threading.current_thread() is threading.main_thread():
        assert local is not None
        # KeyboardInterrupt, SystemExit: keep the user's own stop on this rank. (On a
        # background thread, where no signal lands, it is just that agreement's failure.)
        if hasattr(local, "add_note"):
            local.add_note(str(agreed))
        raise local
    raise agreed from local
