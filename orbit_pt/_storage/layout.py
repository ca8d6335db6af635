"""Names on disk: the one place that builds and parses step folder names.

A committed step lives in ``step_<step, zero-padded to 8 digits>/``; larger steps simply have more
digits. Anything else in the root -- other files, ``*.orbit-tmp`` folders, ``superseded/`` --
is never a step. Which entries of a root are committed steps is decided by ``_storage/root.py``
from these names.
"""

from __future__ import annotations

import re

from orbit_pt.errors import CheckpointValueError

STEP_PREFIX = "step_"
TMP_SUFFIX = ".orbit-tmp"
# A committed step being deleted is first renamed to this suffix, so that a crash in the middle
# of removing its files never leaves a half-deleted folder under a step name.
DELETING_SUFFIX = ".orbit-deleting"
METADATA_FILE = "_CHECKPOINT_METADATA"
SUPERSEDED_DIR = "superseded"
LOCK_FILE = ".orbit.lock"
# The retention options the root's writer last used, so that `orbit-pt ls` can show which rule
# keeps each step without the training job's code (orbit_pt/retention.py writes it).
RETENTION_FILE = ".orbit-retention.json"
# The root's own files: neither steps nor anything foreign (the ``.tmp`` is a crash leftover of
# the retention record's atomic write).
# In the local mirror of an object-store root: written by rank 0 when a writer opens, read by
# the other ranks to check that they all see the folder rank 0 uploads from.
MIRROR_TOKEN_FILE = ".orbit-mirror"
# The run's identity, created by the first writer with a node-local tier: a local root's shards
# are this run's only if their marker names it (orbit_pt/_tiers/local_store.py).
RUN_ID_FILE = ".orbit-run-id"
ROOT_FILES = frozenset(
    {
        LOCK_FILE,
        RUN_ID_FILE,
        RUN_ID_FILE + ".tmp",
        RETENTION_FILE,
        RETENTION_FILE + ".tmp",
        MIRROR_TOKEN_FILE,
        MIRROR_TOKEN_FILE + ".tmp",
    }
)

_STEP_NAME = re.compile(r"step_(\d{8,})")


def step_name(step: int) -> str:
    """The folder name of a committed ``step``."""
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_name(name: str) -> int | None:
    """The step a folder name stands for, or None when it is not a canonical step name.

    ``step_000000100`` (an extra leading zero) is rejected: one step has exactly one name.
    """
    match = _STEP_NAME.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_name(step) == name else None


def superseded_name(step: int, stamp: str, n: int = 0) -> str:
    """The name of ``step`` moved into ``superseded/`` at time ``stamp`` (``n``: a repeat)."""
    name = f"{step_name(step)}.{stamp}"
    return f"{name}.{n}" if n else name


def parse_superseded_name(name: str) -> int | None:
    """The step an entry of ``superseded/`` was, or None when it was not one of orbit_pt's."""
    return parse_step_name(name.split(".", 1)[0])


def tmp_name(step: int) -> str:
    """The folder a step is written into before its commit."""
    return step_name(step) + TMP_SUFFIX


def check_item_name(name: object) -> str:
    """``name`` if it can be an item's folder inside a step, else a CheckpointValueError."""
    if not isinstance(name, str) or not name:
        raise CheckpointValueError(f"item names must be non-empty strings, got {name!r}")
    if (
        name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.startswith((".", "_"))
        or name != name.strip()
    ):
        raise CheckpointValueError(
            f"item name {name!r} cannot be a folder name inside a step: use letters, digits, "
            "'-' and '_' (not first), with no '/', '\\', leading '.' or '_', e.g. 'model'"
        )
    return name


def check_relative_path(path: str) -> str:
    """``path`` if it is a '/'-separated path that stays inside a step folder."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise CheckpointValueError(f"{path!r} is not a relative path inside a step folder")
    return path


# Files a Python process would import or load as code. orbit_pt never writes one into a step, and
# transformers' ``from_pretrained(trust_remote_code=True)`` runs the ``modeling_*.py`` a model
# folder's ``auto_map`` names: one found in a step was put there by someone else.
CODE_SUFFIXES = frozenset({".py", ".pyc", ".pyo", ".pyw", ".pyd", ".so", ".dylib", ".dll"})


def is_code_file(path: str) -> bool:
    """Whether the ``/``-separated ``path`` inside a step names code (see CODE_SUFFIXES)."""
    name = path.rsplit("/", 1)[-1].lower()
    return "__pycache__" in path.split("/") or any(name.endswith(s) for s in CODE_SUFFIXES)
