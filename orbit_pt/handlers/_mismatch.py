"""How a restore says that a checkpoint does not fit its target: one report for every handler.

Handlers collect every problem first (a missing key, a shape that differs, ...) and raise once,
before anything is loaded, so that one message shows the whole picture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orbit_pt.errors import StateMismatchError

# Problems listed in one message; the rest are only counted, so a wrong model cannot print
# thousands of lines.
MAX_LISTED = 50


def raise_mismatches(problems: Sequence[str], summary: str, *, fix: str = "") -> None:
    """Raise a :class:`StateMismatchError` listing ``problems``, if there are any.

    Args:
        problems: one readable line per problem.
        summary: what did not fit what, and how many problems there are (no trailing colon).
        fix: what to do about it, on a line of its own after the list.
    """
    if not problems:
        return
    shown = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    advice = f"\n{fix}" if fix else ""
    raise StateMismatchError(f"{summary}:\n  {shown}{more}{advice}")


def load_state_dict(target: Any, state: Mapping[Any, Any], directory: Path) -> None:
    """``target.load_state_dict(state)``; a refusal becomes a :class:`StateMismatchError`."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise StateMismatchError(
            f"{type(target).__name__}.load_state_dict rejected the state saved in "
            f"{directory}: {exc}"
        ) from exc


def class_name(cls: type) -> str:
    """The qualified name recorded for a class: ``torch.optim.adamw.AdamW``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def same_class(saved: str, live: type) -> bool:
    """Whether the class recorded as ``saved`` (by :func:`class_name`) is ``live``.

    Compared by the qualified name within the module: a class that moved between modules (a
    library reorganised, a script run as ``__main__`` and later imported) is the same class.
    """
    return saved == class_name(live) or saved.endswith(f".{live.__qualname__}")
