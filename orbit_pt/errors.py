"""The exceptions orbit_pt raises.

Every error derives from :class:`CheckpointError`; where a builtin fits, the error also derives
from it, so ``except FileNotFoundError`` keeps working for code that does not know orbit_pt.
Errors carry the step and path they are about as attributes, and survive pickling (they cross
process boundaries in distributed and crash tests).
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Root of every orbit_pt error."""


class CheckpointValueError(CheckpointError, ValueError):
    """An argument or option has a value orbit_pt cannot use; the message says which and why."""


class CheckpointTypeError(CheckpointError, TypeError):
    """An argument, item or value has a type orbit_pt cannot use; the message says which."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """A step was asked for that is not committed under the root."""

    def __init__(self, step: int | None, root: Path | str, available: list[int]) -> None:
        self.step = step
        self.root = str(root)
        self.available = list(available)
        if step is None:
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
        return (type(self), (self.step, self.root, self.available))


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
    """A save failed; nothing of that step was committed. The cause is chained."""

    def __init__(self, step: int, path: Path | str, reason: str = "") -> None:
        self.step = step
        self.path = str(path)
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(
            f"saving step {step} into {self.path} failed{detail}; nothing of step {step} was "
            "committed and the steps committed before it are untouched"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.step, self.path, self.reason))


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
