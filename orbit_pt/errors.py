"""The exceptions orbit_pt raises.

Every error derives from :class:`CheckpointError`; where a builtin fits, the error also derives
from it, so ``except FileNotFoundError`` keeps working for code that does not know orbit_pt.
Errors carry the step and path they are about as attributes, and survive pickling (they cross
process boundaries in distributed and crash tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class CheckpointError(Exception):
    """Root of every orbit_pt error."""


class CheckpointValueError(CheckpointError, ValueError):
    """An argument or option has a value orbit_pt cannot use; the message says which and why."""


class CheckpointTypeError(CheckpointError, TypeError):
    """An argument, item or value has a type orbit_pt cannot use; the message says which."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """A step was asked for that is not committed under the root."""

    def __init__(
        self, step: int | None, root: Path | str, available: list[int], *, detail: str = ""
    ) -> None:
        self.step = step
        self.root = str(root)
        self.available = list(available)
        self.detail = detail
        if step is not None and detail:
            shown = _short_list(self.available) if self.available else "none"
            message = (
                f"step {step} is not a committed checkpoint under {self.root} (committed "
                f"steps: {shown}): {detail}"
            )
        elif step is None:
            message = (
                f"there is no committed checkpoint under {self.root} yet; check the path, or "
                "start from scratch when latest_step() is None"
            )
        else:
            shown = _short_list(self.available) if self.available else "none"
            message = (
                f"step {step} is not a committed checkpoint under {self.root} "
                f"(committed steps: {shown}); pass one of those steps, or None for the latest"
            )
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return (_step_not_found, (self.step, self.root, self.available, self.detail))


def _step_not_found(
    step: int | None, root: str, available: list[int], detail: str
) -> StepNotFoundError:
    return StepNotFoundError(step, root, available, detail=detail)


class StepAlreadyExistsError(CheckpointError, FileExistsError):
    """A step folder is in the way of a commit and could not be moved aside."""


class CheckpointLockedError(CheckpointError, PermissionError):
    """Another writing manager holds the root's lock."""


class ReadOnlyError(CheckpointError, PermissionError):
    """A read-only manager was asked to change the root."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A file of a committed step is missing, truncated or unreadable."""


class ItemNotFoundError(CheckpointError, KeyError):
    """An item was asked for that the step does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0]) if self.args else ""


class StateMismatchError(CheckpointError, ValueError):
    """A saved tensor does not fit the in-place target (shape, dtype or missing keys)."""


class CheckpointSaveError(CheckpointError, RuntimeError):
    """A save failed; nothing of that step was committed. The cause is chained.

    The one exception is the subclass :class:`StepNotDurableError`: there the step *is*
    committed, and only making the commit durable failed. Catch that one first if the two need
    telling apart.

    When the save failed while moving replaced steps into ``superseded/`` (a rollback, or saving
    a step that exists), the steps already moved are named, and so are the committed steps as
    re-read from the root after the failure: the manager's view is that listing.

    Attributes:
        step: the step that was being saved.
        path: its temporary folder (its committed folder for :class:`StepNotDurableError`).
        reason: the cause, readable (every failing rank's, under torch.distributed).
        superseded: the committed steps that had already been moved into ``superseded/``
            (whole; move one back to use it again); empty when none was.
        committed: the committed steps of the root after the failure, as re-read from it; None
            when unknown (the root could not be listed) or when nothing but the temporary
            folder was touched.
    """

    def __init__(
        self,
        step: int,
        path: Path | str,
        reason: str = "",
        *,
        superseded: Sequence[int] = (),
        committed: Sequence[int] | None = None,
    ) -> None:
        self.step = step
        self.path = str(path)
        self.reason = reason
        self.superseded = list(superseded)
        self.committed = None if committed is None else list(committed)
        super().__init__(self._message())

    def _message(self) -> str:
        detail = f": {self.reason}" if self.reason else ""
        text = f"saving step {self.step} into {self.path} failed{detail}; "
        if not self.superseded:
            text += (
                f"nothing of step {self.step} was committed and the steps committed before it "
                "are untouched"
            )
        else:
            text += (
                f"nothing of the new step {self.step} was committed, but step(s) "
                f"[{_short_list(self.superseded)}] it replaces had already been moved into "
                "superseded/ (whole: move one back to use it again)"
            )
        return text + _now_committed(self.committed)

    def __reduce__(self) -> tuple:
        options = {"superseded": self.superseded, "committed": self.committed}
        return (_rebuild, (type(self), (self.step, self.path, self.reason), options))


class StepNotDurableError(CheckpointSaveError):
    """A save committed its step, but making the commit durable failed (an fsync after it).

    Unlike its base class, the step **is** committed: the step folder has its final name, the
    manager lists it, and it restores. What failed is the flush of the rename to stable
    storage, so a power loss could still undo the commit -- and a failing fsync often means a
    failing disk. Retention did not run for this save. Saving again (the same step or the next)
    works as usual; saving the same step moves this one into ``superseded/``.

    A subclass of :class:`CheckpointSaveError` so that code which stops or retries on a failed
    save keeps doing so (a retry is safe); check for this class first to know the step is there.
    """

    def _message(self) -> str:
        return (
            f"step {self.step} is committed in {self.path}; making it durable failed: "
            f"{self.reason}. It is listed and restores, but a power loss could still undo the "
            "commit and a failing fsync often means a failing disk: check the disk, and save "
            "again to write the step anew" + _now_committed(self.committed)
        )


def _now_committed(steps: list[int] | None) -> str:
    if steps is None:
        return ""
    return f"; the committed steps are now [{_short_list(steps)}]"


def _rebuild(cls: type[CheckpointSaveError], args: tuple, options: dict) -> CheckpointSaveError:
    """Unpickle a :class:`CheckpointSaveError` (keyword-only arguments need this hop)."""
    return cls(*args, **options)


class PreemptionExit(SystemExit):
    """Ends a preempted process whose loop saved again after its preemption step was saved.

    A ``SystemExit`` (not an ``Exception``): ``finally`` blocks and context managers run, an
    ``except Exception`` in the loop does not swallow it, and the process exits with
    ``CheckpointManagerOptions.preemption_exit_code``.
    """

    def __init__(self, code: int, step: int, saved: int) -> None:
        super().__init__(code)
        self.step = step
        self.saved = saved

    def __str__(self) -> str:
        return (
            f"preempted: step {self.saved} was saved for the preemption, and save() was called "
            f"again at step {self.step}; ending the process with status {self.code} (check "
            "mgr.reached_preemption(step) in the loop to stop it yourself)"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.code, self.step, self.saved))


def _short_list(values: list[int], limit: int = 10) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values))
    head = ", ".join(map(str, values[: limit // 2]))
    tail = ", ".join(map(str, values[-limit // 2 :]))
    return f"{head}, ..., {tail}"
