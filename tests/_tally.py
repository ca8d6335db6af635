"""A tally of fault-injection cases per fault class, printed after the module's tests.

Used by tests/test_fault_injection.py and tests/test_hostile_files.py: each case adds one row
entry (survived when every promise held); the module's autouse fixture made by
:func:`printing_fixture` prints the table past pytest's capture, so it shows without ``-s``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest


@dataclass
class Tally:
    """Cases per fault class: tried, survived (every promise held), failed."""

    rows: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, fault: str, *, ok: bool) -> None:
        row = self.rows.setdefault(fault, Counter())
        row["tried"] += 1
        row["survived" if ok else "failed"] += 1

    def lines(self) -> list[str]:
        width = max((len(f) for f in self.rows), default=10)
        total: Counter[str] = Counter()
        out = [f"{'fault class':<{width}}  {'tried':>6}  {'survived':>8}  {'failed':>6}"]
        for fault, row in [*self.rows.items(), ("total", total)]:
            if fault != "total":
                total.update(row)
            out.append(
                f"{fault:<{width}}  {row['tried']:>6}  {row['survived']:>8}  {row['failed']:>6}"
            )
        return out


def printing_fixture(tally: Tally, title: str) -> Callable[..., Iterator[None]]:
    """A module-scoped autouse fixture that prints ``tally`` under ``title`` at the end."""

    @pytest.fixture(scope="module", autouse=True)
    def print_the_tally(request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        if not tally.rows:
            return
        lines = ["", f"{title}:", *("  " + line for line in tally.lines())]
        plugins = request.config.pluginmanager
        reporter = plugins.get_plugin("terminalreporter")
        capture = plugins.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            for line in lines:
                reporter.write_line(line) if reporter is not None else print(line)

    return print_the_tally
