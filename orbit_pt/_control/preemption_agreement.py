"""The per-step preemption check: every rank's answer agreed, without a blocking collective.

``should_save(step)`` runs at every training step. Agreeing on the preemption flag with a
blocking all-reduce there made every step pay a round trip between all ranks (0.3 ms on two
local gloo ranks, and a step cannot finish before the slowest rank has reached it). So the
agreement is pipelined: each check *starts* an all-reduce of this rank's flag and answers with the
result of the all-reduce that the previous check started, which has finished long since (the
ranks have run a whole training step in between).

Why every rank still gets the same answer at the same step: the check is collective (every rank
makes the same sequence of checks), so the n-th check of every rank reads the same all-reduce,
the one started by the (n-1)-th. The cost: a signal is acted on one check later than a
blocking check would have acted on it. A check repeated for the same step (``should_save``, then
``reached_preemption``) answers from the first one and starts nothing; step numbers may jump.

On one process (or a world of one rank) there is nothing to agree on, and the answer is this
process's flag at once.
"""

from __future__ import annotations

import logging

from orbit_pt._control.collective import Collective, InFlightAny
from orbit_pt._control.preemption import PreemptionWatcher
from orbit_pt.errors import CheckpointError

logger = logging.getLogger(__name__)


class PreemptionAgreement:
    """Whether the job is being preempted, agreed by every rank, one check behind the signal.

    Args:
        watcher: this process's signal flag.
        dist: the training thread's collective; the all-reduce in flight between two checks
            is settled by its next collective (a save's first agreement) or its ``close()``.
        watched: whether the ranks agree at all. Decided by the options, which every rank
            shares, and not by whether this rank could install its handler: one rank skipping
            the all-reduce would hang the others.
    """

    def __init__(self, watcher: PreemptionWatcher, dist: Collective, *, watched: bool) -> None:
        self._watcher = watcher
        self._dist = dist
        self._watched = watched
        self._in_flight: InFlightAny | None = None
        self._last: tuple[int, bool] | None = None  # the last check's step and answer
        self._agreed = False

    @property
    def agreed(self) -> bool:
        """Whether a check has answered True (it then stays True)."""
        return self._agreed

    def check(self, step: int) -> bool:
        """The agreed answer for ``step``; collective: call it at the same point on every rank.

        Raises:
            CheckpointError: another rank stopped (its process died) while the previous
                check's all-reduce was in flight; the gloo error is chained.
        """
        if self._agreed:
            return True
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        answer = self._ask(step)
        self._last = (step, answer)
        if answer:
            self._agreed = True
            logger.warning(
                "preemption agreed at step %d (rank %d of %d)",
                step,
                self._dist.rank,
                self._dist.world_size,
            )
        return answer

    def _ask(self, step: int) -> bool:
        local = self._watcher.requested
        if not self._watched or not self._dist.enabled or self._dist.world_size == 1:
            return local  # nobody else to agree with
        previous, self._in_flight = self._in_flight, None
        try:
            answer = previous.wait() if previous is not None else False
            if not answer:  # once agreed, nothing is left to ask
                self._in_flight = self._dist.start_any(local)
        except Exception as exc:
            raise CheckpointError(
                f"the preemption check of step {step} failed: another rank left orbit_pt's gloo "
                "group (see the chained error; that rank's own log says why it stopped)"
            ) from exc
        return answer
