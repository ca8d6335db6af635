"""A child process that dies in the middle of retention deleting a step.

Run by tests/test_retention.py as ``python _retention_worker.py ROOT POINT NTH``. It saves steps
0..3 under ``ROOT`` with no deletion, then reopens the root with ``keep_last_n=1`` and saves
step 4, so that retention deletes steps 0, 1, 2 and 3 in that order. At the ``NTH`` of those
deletions (1-based) it kills itself with ``os._exit(CRASH_EXIT)`` -- no clean-up, no finally
blocks, like a SIGKILL -- at ``POINT``:

- ``before-rename``: just before the step folder is renamed to ``*.orbit-deleting``;
- ``after-rename``: just after that rename, before any file is removed;
- ``mid-rmtree``: after removing the step's item folder but not its metadata file, so that what
  is left would look committed if it still had its step name.

Exits 0 when it never reached the crash point (the test then fails).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from orbit_pt import CheckpointManager, CheckpointManagerOptions

CRASH_EXIT = 86
DELETING = ".orbit-deleting"


def item(step: int) -> dict[str, Any]:
    """The item saved as ``step``: restoring it tells which step it came from."""
    return {"x": {"v": step}}


def arm(point: str, nth: int) -> None:
    """Patch ``os.replace`` or ``shutil.rmtree`` to die at the ``nth`` deletion at ``point``."""
    seen = 0
    real_replace = os.replace
    real_rmtree = shutil.rmtree

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        nonlocal seen
        if not str(dst).endswith(DELETING):
            real_replace(src, dst, **kwargs)
            return
        seen += 1
        if seen == nth and point == "before-rename":
            os._exit(CRASH_EXIT)
        real_replace(src, dst, **kwargs)
        if seen == nth and point == "after-rename":
            os._exit(CRASH_EXIT)

    removed = 0

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        # The store also clears a stale *.orbit-deleting folder before renaming (a no-op here):
        # only the removal of a folder that exists counts. Removals run on a thread of their
        # own, behind the renames: count them separately.
        nonlocal removed
        doomed = point == "mid-rmtree" and str(path).endswith(DELETING) and Path(path).is_dir()
        removed += doomed
        if doomed and removed == nth:
            real_rmtree(Path(path) / "x")
            os._exit(CRASH_EXIT)
        real_rmtree(path, *args, **kwargs)

    os.replace = replace
    shutil.rmtree = rmtree  # type: ignore[assignment]


def main(root: Path, point: str, nth: int) -> int:
    with CheckpointManager(root, options=CheckpointManagerOptions(keep_last_n=4)) as mgr:
        for step in range(4):
            mgr.save(step, item(step))
    with CheckpointManager(root, options=CheckpointManagerOptions(keep_last_n=1)) as mgr:
        arm(point, nth)
        mgr.save(4, item(4))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
