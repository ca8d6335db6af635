"""Progress lines: shown for big transfers in a terminal on rank 0, silent otherwise."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from orbit_pt import CheckpointManager
from orbit_pt._format import progress as _progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_shows_bytes_rate_and_percentage() -> None:
    stream = _Terminal()
    progress = _progress.Progress(
        "saving step 7", total=4_000, stream=stream, min_bytes=0, interval=0
    )
    progress.advance(1_000)
    progress.advance(3_000)
    progress.close()
    text = stream.getvalue()
    assert "saving step 7" in text
    assert "(100%)" in text
    assert "GB/s" in text
    assert text.endswith("\n")


def test_small_transfers_print_nothing() -> None:
    stream = _Terminal()
    progress = _progress.Progress("saving", stream=stream, min_bytes=1 << 20, interval=0)
    progress.advance(10)
    progress.close()
    assert stream.getvalue() == ""


def test_enabled_only_in_a_terminal_on_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _progress.enabled(primary=True, stream=_Terminal())
    assert not _progress.enabled(primary=False, stream=_Terminal())
    assert not _progress.enabled(primary=True, stream=io.StringIO())
    monkeypatch.setenv("ORBIT_PT_PROGRESS", "0")
    assert not _progress.enabled(primary=True, stream=_Terminal())


def test_save_and_restore_report_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int | None]] = []
    moved: list[int] = []

    class Recording(_progress.Progress):
        def __init__(self, what: str, total: int | None = None, **kw: object) -> None:
            super().__init__(what, total, stream=_Terminal(), min_bytes=0, interval=0)
            seen.append((what, total))

        def advance(self, nbytes: int) -> None:
            moved.append(nbytes)
            super().advance(nbytes)

    monkeypatch.setattr(_progress, "Progress", Recording)
    monkeypatch.setattr(_progress, "enabled", lambda **kw: True)
    state = {"w": torch.zeros(1 << 16)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": state})
        mgr.restore(1)
    assert [what for what, _ in seen] == ["saving step 1", "restoring step 1"]
    assert seen[1][1] is not None
    assert seen[1][1] > (1 << 18)
    assert sum(moved) >= 2 * (1 << 18)  # the tensor bytes, written and read
