"""Hostile files: every file orbit_pt reads, damaged or forged, is a clear orbit_pt error.

Issue 17, causes 6-11. A checkpoint may come from anywhere, so every file a restore, ``verify``
or ``orbit-pt`` reads is attacked in every way the issue's fault-injection run found, and more:

- damaged bytes (truncated, emptied, garbage, a changed byte that keeps the size) of the step's
  metadata, the safetensors files (header and data), the msgpack structures, the model index
  and ``config.json``, and an adapter's ``adapter_config.json``;
- **forged** files: metadata whose own checksum was recomputed after the edit (by the rule of
  docs/format.md, independently of orbit_pt's code), and data files rewritten together with a
  consistent metadata entry (size and checksum), so that every structural check is reached
  with ``verify=True`` as well as with the default ``verify=False``;
- symbolic links (a data file, an item folder, the metadata, ``superseded/``) and FIFOs, every
  case under a hard deadline (``SIGALRM``) so that a hang fails instead of blocking;
- structures nested deeper than the limit (refused at save), and hostile msgpack nested
  thousands of levels deep (a few KB that used to crash the process: run in a forked child);
- the builtin errors of cause 11: an async save of a tensor without dense data or a string
  UTF-8 cannot encode, permission denied as an unprivileged user, a closed output pipe.

After each, the promise (docs/reliability.md, "Hostile files") is checked for every operation
that reads the file: ``restore`` (with and without ``verify``, with and without targets),
``verify_step``, ``orbit-pt verify`` and ``orbit-pt info``. Each raises an orbit_pt error
naming the file (``CorruptCheckpointError`` for a damaged step), or reports it -- never a
crash, a hang, a ``RecursionError`` or another builtin -- and the CLI exits with one of its
documented codes (1 for a damaged step), never 70. The module prints a tally when it ends.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from _tally import Tally, printing_fixture

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    StepNotFoundError,
)
from orbit_pt import cli as _cli
from orbit_pt._format import safe_open
from orbit_pt.export import export_model
from orbit_pt.handlers import Handler, ModelHandler, OptimizerHandler
from orbit_pt.handlers._codec import MAX_DEPTH
from orbit_pt.metadata import StepMetadata
from orbit_pt.verify import verify_step

READ_ONLY = CheckpointManagerOptions(read_only=True)
STEP = "step_00000001"
META = "_CHECKPOINT_METADATA"
# A hang fails the case after this long instead of blocking the run (the machine may be slow).
DEADLINE_S = 120
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ the tally


TALLY = Tally()
_print_the_tally = printing_fixture(TALLY, "hostile files tally (tests/test_hostile_files.py)")


class Checks:
    """The outcome of every operation tried on one hostile root, counted in the tally."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.failures: list[str] = []

    def record(self, what: str, problem: str) -> None:
        TALLY.add(self.fault, ok=not problem)
        if problem:
            self.failures.append(f"{what}: {problem}")

    def assert_all_survived(self) -> None:
        assert not self.failures, "\n".join(self.failures)


# --------------------------------------------------------------------------- the hard deadline


class Hung(BaseException):
    """Raised by the deadline's alarm: an operation blocked (a FIFO opened, say)."""


@contextlib.contextmanager
def deadline(seconds: float = DEADLINE_S) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with :class:`Hung` (a blocking ``open`` too).

    A BaseException, so that no ``except Exception`` in the code under test swallows it.
    """

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(fn: Callable[[], object]) -> BaseException | None:
    """What ``fn`` raised (None if it returned), under the deadline."""
    try:
        with deadline():
            fn()
    except (Exception, Hung) as exc:
        return exc
    return None


def judge(exc: BaseException | None, names: tuple[str, ...], *, may_succeed: bool) -> str:
    """A problem with an operation's outcome, or "" when the promise held.

    The promise: an orbit_pt error whose message names the file (one of ``names``), or
    success where the damage cannot be seen without checksums (``may_succeed``).
    """
    if exc is None:
        return "" if may_succeed else "no error: the hostile file was accepted"
    if isinstance(exc, Hung):
        return f"hung ({exc})"
    if not isinstance(exc, CheckpointError):
        return f"a builtin error, not an orbit_pt error: {type(exc).__name__}: {exc}"
    text = str(exc)
    if names and not any(name in text for name in names):
        return f"{type(exc).__name__} does not name {names[0]}: {text[:300]}"
    return ""


# ----------------------------------------------------------------------------------- the step


def _models() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, optimizer, sharded


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(6.0),
        "pair": (1, "two", torch.ones(2)),
        "ids": [1, 2, 3],
        "name": "x",
        "dtype": torch.float16,
        "np": np.arange(3),
    }


HANDLERS: dict[str, Handler] = {
    "model": ModelHandler(extra_files={"config.json": b'{"model_type": "toy"}'}),
    "sharded": ModelHandler(max_shard_size=64),  # several shards and an index
    "optimizer": OptimizerHandler(model_item="model"),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with step 1: a model (with config.json), an optimizer, a state, a sharded model."""
    root = tmp_path_factory.mktemp("hostile") / "template"
    model, optimizer, sharded = _models()
    items = {"model": model, "optimizer": optimizer, "state": _state(), "sharded": sharded}
    with CheckpointManager(root, handlers=HANDLERS) as mgr:
        mgr.save(1, items, force=True)
    files = set(json.loads((root / STEP / META).read_bytes())["files"])
    assert {"sharded/model.safetensors.index.json", "model/config.json"} <= files, files
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "root"
    shutil.copytree(template, copied, symlinks=True)
    return copied


# --------------------------------------------------------------------- forging, by the spec


def self_checksum(doc: dict[str, Any]) -> str:
    """The metadata's checksum of itself, as docs/format.md specifies it (not orbit_pt's code):
    xxh3-64 of the canonical JSON without the ``checksum`` key."""
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "xxh3-64:" + xxhash.xxh3_64(canonical.encode()).hexdigest()


def forge(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the step's metadata and recompute its own checksum: a consistent forgery."""
    path = root / STEP / META
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    edit(doc)
    doc["checksum"] = self_checksum(doc)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=True))


def rewrite(root: Path, rel: str, data: bytes) -> None:
    """Replace a file of the step and record its new size and checksum: a consistent forgery,
    so that ``verify=True`` reaches the content checks too."""
    (root / STEP / rel).write_bytes(data)
    checksum = "xxh3-64:" + xxhash.xxh3_64(data).hexdigest()
    forge(
        root, lambda doc: doc["files"].__setitem__(rel, {"size": len(data), "checksum": checksum})
    )


def patch(root: Path, rel: str, old: bytes, new: bytes) -> None:
    """Change bytes in place, keeping the size, without touching the metadata."""
    assert len(old) == len(new)
    path = root / STEP / rel
    data = path.read_bytes()
    assert old in data, (rel, old)
    path.write_bytes(data.replace(old, new, 1))


def header_of(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def safetensors_bytes(header: dict[str, Any] | str | bytes, body: bytes) -> bytes:
    if isinstance(header, dict):
        header = json.dumps(header, allow_nan=True)
    raw = header.encode() if isinstance(header, str) else header
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def first_tensor(header: dict[str, Any]) -> str:
    return next(k for k in header if k != "__metadata__")


# ----------------------------------------------------------------------- running the operations


def _targets() -> dict[str, Any]:
    model, optimizer, sharded = _models()
    return {"model": model, "optimizer": optimizer, "state": _state(), "sharded": sharded}


def _restore(root: Path, items: Any, *, verify: bool) -> None:
    with CheckpointManager(root, options=READ_ONLY, handlers=HANDLERS) as mgr:
        mgr.restore(1, items, verify=verify)


def _cli_code(*argv: str) -> int:
    """``orbit-pt ARGV``'s exit status; its output is dropped (the status is what is checked)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return _cli.main(list(argv))


def _cli_problem(argv: list[str], allowed: set[int]) -> str:
    codes: list[int] = []
    exc = outcome(lambda: codes.append(_cli_code(*argv)))
    if exc is not None:
        return f"raised {type(exc).__name__}: {exc}"
    return "" if codes[0] in allowed else f"exit {codes[0]}"


def attack(
    root: Path,
    fault: str,
    item: str,
    names: tuple[str, ...],
    *,
    may_succeed: bool = False,
    step_kept: bool = True,
) -> Checks:
    """Run every operation that reads the hostile file; judge each against the promise.

    Args:
        root: the hostile root.
        fault: the tally's row.
        item: the item holding the file (restored alone, and with live targets).
        names: what a message must contain (the file's path or name).
        may_succeed: the damage cannot be seen without checksums, so a restore without
            ``verify`` may succeed.
        step_kept: the step is still committed (False for hostile metadata, which makes the
            folder not a step: a restore then raises StepNotFoundError, and ``verify``
            reports the metadata).
    """
    checks = Checks(fault)
    wanted = [item] if item != "optimizer" else ["model", "optimizer"]
    targets = {k: v for k, v in _targets().items() if k in wanted}
    for what, items, verify, succeed in (
        ("restore(verify=False)", wanted, False, may_succeed),
        ("restore into targets", targets, False, may_succeed),
        ("restore(verify=True)", wanted, True, False),
    ):
        exc = outcome(functools.partial(_restore, root, items, verify=verify))
        if not step_kept and isinstance(exc, StepNotFoundError):
            exc = CheckpointError(f"{names[0]}: not a committed step (as documented)")
        checks.record(what, judge(exc, names, may_succeed=succeed))
    report: list[Any] = []
    exc = outcome(lambda: report.append(verify_step(root, 1)))
    if exc is not None:
        checks.record("verify_step", f"raised {type(exc).__name__}: {exc}")
    else:
        paths = {p.path for p in report[0].problems}
        named = any(n in p for p in paths for n in (*names, item, META))
        checks.record("verify_step", "" if named else f"no problem named: {paths}")
    checks.record("orbit-pt verify", _cli_problem(["verify", str(root), "1"], {1}))
    checks.record("orbit-pt info", _cli_problem(["info", str(root), "1"], {0, 1}))
    return checks


# ============================================================================ the metadata file

BAD_METADATA_BYTES: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda d: d[: len(d) // 2],
    "empty": lambda d: b"",
    "garbage": lambda d: bytes(range(256)) * 4,
    "not utf-8": lambda d: d.replace(b'"format"', b'"f\xffrmat"', 1),
    "a JSON array": lambda d: b"[" + d + b"]",
    "100k-deep JSON": lambda d: b"[" * 100_000 + b"]" * 100_000,
    "changed, checksum not recomputed": lambda d: d.replace(b'"step": 1', b'"step": 2', 1),
}


@pytest.mark.parametrize("kind", BAD_METADATA_BYTES)
def test_damaged_metadata(root: Path, kind: str) -> None:
    path = root / STEP / META
    path.write_bytes(BAD_METADATA_BYTES[kind](path.read_bytes()))
    checks = attack(root, "metadata: damaged bytes", "state", (META,), step_kept=False)
    exc = outcome(lambda: StepMetadata.read(path))
    checks.record("StepMetadata.read", judge(exc, (META,), may_succeed=False))
    checks.assert_all_survived()


def test_json_over_the_size_limit(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON file larger than orbit_pt reads is refused before it is read (the limit is made
    small here: a real 1 GiB file would only slow the suite down)."""
    monkeypatch.setattr(safe_open, "MAX_JSON_BYTES", 200)
    checks = attack(root, "metadata: damaged bytes", "state", (META,), step_kept=False)
    exc = outcome(lambda: StepMetadata.read(root / STEP / META))
    checks.record("StepMetadata.read", judge(exc, ("more than the 200",), may_succeed=False))
    checks.assert_all_survived()


def _file(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["files"]["state/state.msgpack"]  # type: ignore[no-any-return]


# Each forgery keeps a valid self-checksum: only the field checks can refuse it.
FORGED_FIELDS: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "a checksum of 5": ("checksum", lambda d: _file(d).__setitem__("checksum", 5)),
    "a checksum list": ("checksum", lambda d: _file(d).__setitem__("checksum", ["x"])),
    "a size of -1": ("size", lambda d: _file(d).__setitem__("size", -1)),
    "a size of 1.5": ("size", lambda d: _file(d).__setitem__("size", 1.5)),
    "a size string": ("size", lambda d: _file(d).__setitem__("size", "20")),
    "a file entry list": ("files", lambda d: d["files"].__setitem__("state/state.msgpack", [])),
    "files a list": ("files", lambda d: d.__setitem__("files", [])),
    "a path out of the step": ("../", lambda d: d["files"].__setitem__("../../x", _file(d))),
    "items.*.info a list": ("info", lambda d: d["items"]["state"].__setitem__("info", [1])),
    "items.*.handler 5": ("handler", lambda d: d["items"]["state"].__setitem__("handler", 5)),
    "items.*.handler empty": ("handler", lambda d: d["items"]["state"].__setitem__("handler", "")),
    "items a list": ("items", lambda d: d.__setitem__("items", [])),
    "an item named ..": ("..", lambda d: d["items"].__setitem__("..", d["items"]["state"])),
    "time 1e300": ("time", lambda d: d.__setitem__("time", 1e300)),
    "time -1": ("time", lambda d: d.__setitem__("time", -1)),
    "time a string": ("time", lambda d: d.__setitem__("time", "now")),
    "time NaN": ("NaN", lambda d: d.__setitem__("time", float("nan"))),
    "world_size 0": ("world_size", lambda d: d.__setitem__("world_size", 0)),
    "world_size -1": ("world_size", lambda d: d.__setitem__("world_size", -1)),
    "world_size 2**40": ("world_size", lambda d: d.__setitem__("world_size", 2**40)),
    "world_size true": ("world_size", lambda d: d.__setitem__("world_size", True)),
    "step a string": ("step", lambda d: d.__setitem__("step", "1")),
    "step 1.0": ("step", lambda d: d.__setitem__("step", 1.0)),
    "metrics a list": ("metrics", lambda d: d.__setitem__("metrics", [1])),
    "a metric string": ("metrics", lambda d: d.__setitem__("metrics", {"loss": "low"})),
    "a metric true": ("metrics", lambda d: d.__setitem__("metrics", {"loss": True})),
    "a metric Infinity": ("Infinity", lambda d: d.__setitem__("metrics", {"loss": float("inf")})),
    "orbit_pt_version 5": ("orbit_pt_version", lambda d: d.__setitem__("orbit_pt_version", 5)),
    "format_version a string": ("format_version", lambda d: d.__setitem__("format_version", "1")),
    "format_version 0": ("format_version", lambda d: d.__setitem__("format_version", 0)),
    "info nested 100 deep": (
        "nested",
        lambda d: d["items"]["state"].__setitem__("info", json.loads("[" * 100 + "]" * 100)),
    ),
}


@pytest.mark.parametrize("kind", FORGED_FIELDS)
def test_forged_metadata_fields(root: Path, kind: str) -> None:
    field_name, edit = FORGED_FIELDS[kind]
    forge(root, edit)
    path = root / STEP / META
    fault = "metadata: forged fields (valid self-checksum)"
    checks = attack(root, fault, "state", (META,), step_kept=False)
    # The parser itself: a CorruptCheckpointError naming the file and the field.
    exc = outcome(lambda: StepMetadata.read(path))
    problem = judge(exc, (str(path),), may_succeed=False)
    if not problem and field_name not in str(exc):
        problem = f"does not name the field {field_name!r}: {exc}"
    checks.record("StepMetadata.read", problem)
    checks.assert_all_survived()


def test_the_writer_refuses_metadata_it_could_not_read_back(tmp_path: Path) -> None:
    """A handler whose info nests deeper than a reader accepts fails the save, not the step."""

    class DeepInfo(ModelHandler):
        def save(self, directory: Path, item: Any, context: Any) -> Any:
            info = dict(super().save(directory, item, context))
            info["deep"] = json.loads("[" * 80 + "]" * 80)
            return info

    checks = Checks("deep nesting")
    with CheckpointManager(tmp_path / "r", handlers={"model": DeepInfo()}) as mgr:
        exc = outcome(lambda: mgr.save(1, {"model": torch.nn.Linear(2, 2)}, force=True))
        checks.record("save with 80-deep info", judge(exc, ("nests deeper",), may_succeed=False))
        checks.record("nothing committed", "" if mgr.all_steps() == [] else str(mgr.all_steps()))
    checks.assert_all_survived()


# ========================================================================= safetensors headers

SAFETENSORS = (
    "state/tensors.safetensors",
    "model/model.safetensors",
    "optimizer/optimizer.safetensors",
)


def _edit_header(fn: Callable[[dict[str, Any], str], None]) -> Callable[[bytes], bytes]:
    def make(data: bytes) -> bytes:
        header, body = header_of(data)
        header = copy.deepcopy(header)
        fn(header, first_tensor(header))
        return safetensors_bytes(header, body)

    return make


def _set(key: str, value: Any) -> Callable[[dict[str, Any], str], None]:
    return lambda h, t: h[t].__setitem__(key, value)


def _raw_header(text: str) -> Callable[[bytes], bytes]:
    return lambda data: safetensors_bytes(text, header_of(data)[1])


def _offsets(fn: Callable[[list[int]], list[int]]) -> Callable[[bytes], bytes]:
    return _edit_header(lambda h, t: h[t].__setitem__("data_offsets", fn(h[t]["data_offsets"])))


_HUGE_DIMENSION = '{"t": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}'


def _swap_offsets(h: dict[str, Any], t: str) -> None:
    names = [k for k in h if k != "__metadata__"]
    if len(names) > 1:  # two tensors claim the same bytes
        h[names[1]]["data_offsets"] = list(h[names[0]]["data_offsets"])
    else:
        h[t]["data_offsets"] = [h[t]["data_offsets"][0], h[t]["data_offsets"][1] + 4]


FORGED_HEADERS: dict[str, Callable[[bytes], bytes]] = {
    "shorter than 8 bytes": lambda d: d[:5],
    "header length past the end": lambda d: struct.pack("<Q", len(d)) + d[8:],
    "header length 2**63": lambda d: struct.pack("<Q", 2**63) + d[8:],
    "header length 0": lambda d: struct.pack("<Q", 0) + d[8:],
    "header not JSON": _raw_header("{not json"),
    "header not UTF-8": lambda d: safetensors_bytes(b'{"\xff": 1}', header_of(d)[1]),
    "header a JSON array": _raw_header("[1, 2]"),
    "header 100k deep": _raw_header("[" * 100_000 + "]" * 100_000),
    "an entry that is a list": _edit_header(lambda h, t: h.__setitem__(t, [1])),
    "dtype unknown": _edit_header(_set("dtype", "C64")),
    "dtype a number": _edit_header(_set("dtype", 5)),
    "a dimension of 1e400": _raw_header(_HUGE_DIMENSION),
    "a dimension of -1": _edit_header(_set("shape", [-1])),
    "a dimension true": _edit_header(_set("shape", [True])),
    "a dimension 2.5": _edit_header(_set("shape", [2.5])),
    "a shape string": _edit_header(_set("shape", "3")),
    "10^6 dimensions of 2": _edit_header(_set("shape", [2] * 1_000_000)),
    "shape does not fit the offsets": _edit_header(_set("shape", [10**12])),
    "one offset": _edit_header(_set("data_offsets", [0])),
    "an offset string": _edit_header(_set("data_offsets", [0, "4"])),
    "offsets reversed": _offsets(lambda offsets: offsets[::-1]),
    "offsets past the end": _offsets(lambda offsets: [0, 10**9]),
    "offsets overlapping": _edit_header(_swap_offsets),
    "trailing bytes": lambda d: d + b"\0" * 8,
    "__metadata__ a list": _edit_header(lambda h, t: h.__setitem__("__metadata__", [1])),
    "__metadata__ a number value": _edit_header(
        lambda h, t: h.__setitem__("__metadata__", {"format": 5})
    ),
}


@pytest.mark.parametrize("rel", SAFETENSORS)
@pytest.mark.parametrize("kind", FORGED_HEADERS)
def test_forged_safetensors_header(root: Path, rel: str, kind: str) -> None:
    rewrite(root, rel, FORGED_HEADERS[kind]((root / STEP / rel).read_bytes()))
    checks = attack(root, "safetensors: forged headers", rel.split("/")[0], (rel,))
    checks.assert_all_survived()


def test_forged_shard_of_a_sharded_model(root: Path) -> None:
    index = json.loads((root / STEP / "sharded/model.safetensors.index.json").read_bytes())
    rel = "sharded/" + sorted(set(index["weight_map"].values()))[0]
    rewrite(root, rel, FORGED_HEADERS["a dimension of 1e400"]((root / STEP / rel).read_bytes()))
    attack(root, "safetensors: forged headers", "sharded", (rel,)).assert_all_survived()


# Size-preserving edits, metadata untouched: verify=True sees a checksum change, and the
# default verify=False reaches the parser, which must refuse the header by itself.
IN_PLACE: dict[str, tuple[bytes, bytes]] = {
    "dtype renamed": (b'"F32"', b'"F99"'),
    "a dimension changed": (b'"shape":[', b'"shape":{'),
    "offsets changed": (b'"data_offsets":[0,', b'"data_offsets":[9,'),
    "header length changed": (b"", b""),  # the prefix itself, below
}


@pytest.mark.parametrize("rel", SAFETENSORS)
@pytest.mark.parametrize("kind", IN_PLACE)
def test_size_preserving_header_edit(root: Path, rel: str, kind: str) -> None:
    path = root / STEP / rel
    if kind == "header length changed":
        data = bytearray(path.read_bytes())
        data[0] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        patch(root, rel, *IN_PLACE[kind])
    fault = "safetensors: in-place edits (size kept)"
    attack(root, fault, rel.split("/")[0], (rel,)).assert_all_survived()


@pytest.mark.parametrize("rel", SAFETENSORS)
def test_damaged_safetensors_data(root: Path, rel: str) -> None:
    """A flipped data byte: only a checksum sees it. verify=True refuses it; without verify a
    restore may return the changed bytes (docs/format.md: sizes are checked, bytes with
    ``verify``); nothing crashes either way."""
    path = root / STEP / rel
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    checks = attack(root, "safetensors: data", rel.split("/")[0], (rel,), may_succeed=True)
    checks.assert_all_survived()


@pytest.mark.parametrize("rel", SAFETENSORS)
def test_truncated_safetensors(root: Path, rel: str) -> None:
    path = root / STEP / rel
    path.write_bytes(path.read_bytes()[:-4])
    attack(root, "safetensors: data", rel.split("/")[0], (rel,)).assert_all_survived()


# ============================================================================== msgpack files

MSGPACK = ("state/state.msgpack", "optimizer/optimizer.msgpack")


def _tuple_of(packed: bytes) -> msgpack.ExtType:
    """The extension of a one-element tuple holding the already packed ``packed``."""
    return msgpack.ExtType(2, b"\x91" + packed)


def _nested_tuples(depth: int) -> bytes:
    packed = msgpack.packb(0)
    for _ in range(depth):
        packed = msgpack.packb(_tuple_of(packed))
    return packed  # type: ignore[no-any-return]


def _wrap(rel: str, value: Any) -> bytes:
    """``value`` where the handler of ``rel`` looks for state, in an otherwise valid file."""
    if rel.startswith("optimizer/"):
        value = {
            "format_version": 1,
            "optimizer_class": "torch.optim.adam.Adam",
            "state": {"weight": value},
            "param_groups": [{"params": ["weight", "bias"], "lr": 0.1}],
            "param_shapes": {"weight": [3, 4], "bias": [3]},
        }
    else:
        value = {"w": value}
    return msgpack.packb(value)  # type: ignore[no-any-return]


HOSTILE_MSGPACK: dict[str, Callable[[str, bytes], bytes]] = {
    "truncated": lambda rel, d: d[: len(d) // 2],
    "empty": lambda rel, d: b"",
    "a reserved byte": lambda rel, d: b"\xc1" + d[1:],
    "trailing bytes": lambda rel, d: d + b"\x00",
    "arrays 100k deep": lambda rel, d: b"\x91" * 100_000 + b"\xc0",
    "arrays 500 deep": lambda rel, d: _wrap(rel, json.loads("[" * 500 + "]" * 500)),
    "tuples 10k deep (a few KB)": lambda rel, d: _wrap(rel, _tuple_of(_nested_tuples(10_000))),
    "an unknown extension": lambda rel, d: _wrap(rel, msgpack.ExtType(9, b"x")),
    "a timestamp extension": lambda rel, d: _wrap(rel, msgpack.Timestamp(1, 0)),
    "a dtype that is a module": lambda rel, d: _wrap(rel, msgpack.ExtType(4, b"_inductor")),
    "a dtype that is no dtype": lambda rel, d: _wrap(rel, msgpack.ExtType(4, b"nn")),
    "a tensor name not UTF-8": lambda rel, d: _wrap(rel, msgpack.ExtType(1, b"\xff\xfe")),
    "a missing tensor": lambda rel, d: _wrap(rel, msgpack.ExtType(1, b"nowhere")),
    "a tuple payload that is a map": lambda rel, d: _wrap(rel, msgpack.ExtType(2, b"\x80")),
    "a map with an array key": lambda rel, d: b"\x81\x91\x01\x02",  # {[1]: 2}
    "a map with an extension key": lambda rel, d: b"\x81\xd4\x01x\x01",  # {TensorRef: 1}
}

OPTIMIZER_LAYOUTS: dict[str, Any] = {
    "a list at the top": [1, 2],
    "no state": {"param_groups": [], "param_shapes": {}},
    "state a list": {"state": [1], "param_groups": [], "param_shapes": {}},
    "param_groups a number": {"state": {}, "param_groups": 5},
    "params numbers": {"state": {}, "param_groups": [{"params": [0, 1]}]},
    "param_shapes of strings": {"state": {}, "param_groups": [], "param_shapes": {"weight": "3x4"}},
    "optimizer_class a number": {"state": {}, "param_groups": [], "optimizer_class": 5},
}


def _msgpack_case(root: Path, rel: str, kind: str) -> None:
    rewrite(root, rel, HOSTILE_MSGPACK[kind](rel, (root / STEP / rel).read_bytes()))


@pytest.mark.parametrize("rel", MSGPACK)
@pytest.mark.parametrize("kind", [k for k in HOSTILE_MSGPACK if "10k" not in k])
def test_hostile_msgpack(root: Path, rel: str, kind: str) -> None:
    _msgpack_case(root, rel, kind)
    attack(root, "msgpack: damaged and forged", rel.split("/")[0], (rel,)).assert_all_survived()


@pytest.mark.parametrize("rel", MSGPACK)
def test_hostile_msgpack_nested_10k_deep_does_not_crash(root: Path, rel: str) -> None:
    """The few-KB file that used to overflow the C stack (SIGSEGV): run in a forked child, so
    that a crash is a failed case, not a dead test run."""
    _msgpack_case(root, rel, "tuples 10k deep (a few KB)")
    assert (root / STEP / rel).stat().st_size < 64 << 10
    checks = Checks("deep nesting")
    items = ["state"] if rel.startswith("state/") else ["model", "optimizer"]
    for verify in (False, True):
        result = in_child(functools.partial(_restore, root, items, verify=verify))
        checks.record(f"restore(verify={verify}) in a child", result.problem((rel,)))
    result = in_child(functools.partial(_verify_raises, root))
    checks.record("verify_step in a child", result.problem((rel,)))
    checks.assert_all_survived()


@pytest.mark.parametrize("kind", OPTIMIZER_LAYOUTS)
def test_forged_optimizer_layout(root: Path, kind: str) -> None:
    rel = "optimizer/optimizer.msgpack"
    layout = OPTIMIZER_LAYOUTS[kind]
    rewrite(
        root,
        rel,
        msgpack.packb({"format_version": 1, **layout} if isinstance(layout, dict) else layout),
    )
    attack(root, "msgpack: damaged and forged", "optimizer", (rel,)).assert_all_survived()


def test_in_place_msgpack_edit(root: Path) -> None:
    path = root / STEP / "state/state.msgpack"
    data = bytearray(path.read_bytes())
    data[0] = 0xC1  # never used by msgpack
    path.write_bytes(bytes(data))
    checks = attack(root, "msgpack: damaged and forged", "state", ("state/state.msgpack",))
    checks.assert_all_survived()


# ===================================================================== index and config JSON

INDEX = "sharded/model.safetensors.index.json"


def _index_edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def make(data: bytes) -> bytes:
        doc = json.loads(data)
        fn(doc)
        return json.dumps(doc).encode()

    return make


def _first_shard_is(value: object) -> Callable[[bytes], bytes]:
    return _index_edit(
        lambda doc: doc["weight_map"].__setitem__(next(iter(doc["weight_map"])), value)
    )


HOSTILE_INDEX: dict[str, Callable[[bytes], bytes]] = {
    "garbage": lambda d: b"\xff\x00garbage",
    "truncated": lambda d: d[: len(d) // 2],
    "a JSON array": lambda d: b"[]",
    "100k deep": lambda d: b"[" * 100_000 + b"]" * 100_000,
    "70 deep": lambda d: b'{"weight_map": {}, "x": ' + b"[" * 70 + b"]" * 70 + b"}",
    "weight_map a list": _index_edit(lambda doc: doc.__setitem__("weight_map", [])),
    "no weight_map": _index_edit(lambda doc: doc.__delitem__("weight_map")),
    "a shard out of the folder": _first_shard_is("../../x.safetensors"),
    "a missing shard": _first_shard_is("model-09999-of-09999.safetensors"),
    "a shard name a number": _first_shard_is(5),
}


@pytest.mark.parametrize("kind", HOSTILE_INDEX)
def test_hostile_index(root: Path, kind: str) -> None:
    rewrite(root, INDEX, HOSTILE_INDEX[kind]((root / STEP / INDEX).read_bytes()))
    attack(root, "index / config / adapter JSON", "sharded", (INDEX,)).assert_all_survived()


@pytest.mark.parametrize("kind", ["garbage", "100k deep", "a JSON array"])
def test_hostile_config_json(root: Path, tmp_path: Path, kind: str) -> None:
    """config.json is read by verify and by an export that casts (it records the dtype)."""
    rel = "model/config.json"
    rewrite(root, rel, HOSTILE_INDEX[kind](b"{}"))
    checks = Checks("index / config / adapter JSON")
    report = verify_step(root, 1)
    reported = any(p.path == rel for p in report.problems)
    checks.record("verify_step", "" if reported else "not reported")
    checks.record("orbit-pt verify", _cli_problem(["verify", str(root), "1"], {1}))
    out = str(tmp_path / "out")
    argv = ["export", str(root), "1", out, "--item", "model", "--dtype", "bf16", "--no-verify"]
    checks.record("orbit-pt export --no-verify", _cli_problem(argv, {1}))
    export = functools.partial(
        export_model, root, 1, tmp_path / "out2", item="model", dtype=torch.bfloat16, verify=False
    )
    checks.record("export_model(verify=False)", judge(outcome(export), (rel,), may_succeed=False))
    checks.assert_all_survived()


@pytest.mark.parametrize("kind", ["garbage", "100k deep", "a JSON array"])
def test_hostile_adapter_config(tmp_path: Path, kind: str) -> None:
    """adapter_config.json names the base model an export merges into."""
    from orbit_pt.handlers import _peft

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / _peft.ADAPTER_CONFIG).write_bytes(HOSTILE_INDEX[kind](b"{}"))
    checks = Checks("index / config / adapter JSON")
    exc = outcome(lambda: _peft.base_folder(folder))
    checks.record("base_folder", judge(exc, (_peft.ADAPTER_CONFIG,), may_succeed=False))
    checks.assert_all_survived()


# ============================================================================ links and FIFOs


def _outside(root: Path) -> Path:
    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    return outside


def _link_file(root: Path, rel: str) -> None:
    """Replace ``rel`` by a link to a whole, valid copy outside the root."""
    path = root / STEP / rel
    copy_path = _outside(root) / path.name
    shutil.copyfile(path, copy_path)
    path.unlink()
    path.symlink_to(copy_path)


def _link_folder(root: Path, item: str) -> None:
    path = root / STEP / item
    copy_path = _outside(root) / item
    shutil.copytree(path, copy_path)
    shutil.rmtree(path)
    path.symlink_to(copy_path, target_is_directory=True)


SHARD = "sharded/model-00001-of-00002.safetensors"

LINKS: dict[str, tuple[str, str, Callable[[Path, str], None]]] = {
    "a msgpack file": ("state", "state/state.msgpack", _link_file),
    "a safetensors file": ("model", "model/model.safetensors", _link_file),
    "a shard": ("sharded", SHARD, _link_file),
    "the model index": ("sharded", INDEX, _link_file),
    "an item folder": ("state", "state", _link_folder),
    "a model folder": ("model", "model", _link_folder),
    "the metadata": ("state", META, _link_file),
}


@pytest.mark.parametrize("kind", LINKS)
def test_links_are_never_followed(root: Path, kind: str) -> None:
    """The outside copy is whole and valid: a restore that succeeded would have read it."""
    item, rel, make = LINKS[kind]
    make(root, rel)
    checks = attack(root, "symbolic links", item, (rel,), step_kept=kind != "the metadata")
    checks.assert_all_survived()


def test_an_unlisted_link_inside_an_item_is_not_read(root: Path) -> None:
    """The index is not listed in the metadata here: only the confinement refuses it."""
    forge(root, lambda doc: doc["files"].pop(INDEX))
    _link_file(root, INDEX)
    checks = Checks("symbolic links")
    for verify in (False, True):
        exc = outcome(functools.partial(_restore, root, ["sharded"], verify=verify))
        checks.record(f"restore(verify={verify})", judge(exc, (INDEX,), may_succeed=False))
    checks.assert_all_survived()


def test_a_superseded_link_never_takes_steps_out_of_the_root(root: Path) -> None:
    elsewhere = _outside(root) / "superseded"
    elsewhere.mkdir()
    (root / "superseded").symlink_to(elsewhere, target_is_directory=True)
    checks = Checks("symbolic links")
    with CheckpointManager(root, handlers=HANDLERS) as mgr:
        exc = outcome(lambda: mgr.save(0, {"state": {"a": 1}}, force=True))  # a rollback
        checks.record("rollback save", judge(exc, ("superseded",), may_succeed=False))
        checks.record("nothing moved out", "" if not any(elsewhere.iterdir()) else "moved")
        checks.record("step 1 still listed", "" if mgr.all_steps() == [1] else str(mgr.all_steps()))
    checks.assert_all_survived()


def _fifo(root: Path, rel: str) -> None:
    path = root / STEP / rel
    path.unlink()
    os.mkfifo(path)


def _unlisted_fifo(root: Path, rel: str) -> None:
    forge(root, lambda doc: doc["files"].pop(rel))
    _fifo(root, rel)


def _forged_fifo(root: Path, rel: str) -> None:
    os.mkfifo(root / STEP / rel)
    empty = "xxh3-64:" + xxhash.xxh3_64(b"").hexdigest()
    forge(root, lambda doc: doc["files"].__setitem__(rel, {"size": 0, "checksum": empty}))


FIFOS: dict[str, tuple[str, str, Callable[[Path, str], None]]] = {
    "a listed msgpack file": ("state", "state/state.msgpack", _fifo),
    "a listed safetensors file": ("model", "model/model.safetensors", _fifo),
    "the model index": ("sharded", INDEX, _fifo),
    "the model index, unlisted": ("sharded", INDEX, _unlisted_fifo),
    "a file named by forged metadata": ("state", "state/extra.bin", _forged_fifo),
}


@pytest.mark.parametrize("kind", FIFOS)
def test_fifos_never_block(root: Path, kind: str) -> None:
    item, rel, make = FIFOS[kind]
    make(root, rel)
    attack(root, "FIFOs (hard deadline)", item, (rel,)).assert_all_survived()


def test_fifo_metadata_and_retention_record(root: Path) -> None:
    checks = Checks("FIFOs (hard deadline)")
    _fifo(root, META)
    exc = outcome(lambda: StepMetadata.read(root / STEP / META))
    checks.record("StepMetadata.read", judge(exc, (META,), may_succeed=False))
    exc = outcome(lambda: _restore(root, ["state"], verify=True))
    checks.record("restore", judge(exc, ("step 1",), may_succeed=False))
    os.mkfifo(root / ".orbit-retention.json")
    checks.record("orbit-pt ls", _cli_problem(["ls", str(root)], {0}))
    checks.assert_all_survived()


def test_a_fifo_read_for_an_excluded_field(root: Path) -> None:
    """exclude= reads the item's fields before the files are checked: that read is guarded too."""
    _fifo(root, "state/state.msgpack")
    checks = Checks("FIFOs (hard deadline)")

    def restore() -> None:
        with CheckpointManager(root, options=READ_ONLY, handlers=HANDLERS) as mgr:
            mgr.restore(1, {"state": _state()}, exclude=("state.name",))

    exc = outcome(restore)
    checks.record("restore(exclude=field)", judge(exc, ("state",), may_succeed=False))
    checks.assert_all_survived()


# ============================================================================== deep nesting


def _save_and_wait(mgr: CheckpointManager, items: dict[str, Any], step: int = 2) -> None:
    mgr.save(step, items, force=True)
    mgr.wait_until_finished()


def _nest(kind: str, depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = (value,) if kind == "tuple" else [value] if kind == "list" else {"k": value}
    return value


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_too_deep_is_refused_at_save_and_the_limit_round_trips(
    tmp_path: Path, kind: str, async_save: bool
) -> None:
    checks = Checks("deep nesting")
    options = CheckpointManagerOptions(async_save=async_save)
    with CheckpointManager(tmp_path / "r", options=options) as mgr:
        # The item itself is one level: the value inside may nest MAX_DEPTH - 1 more.
        mgr.save(1, {"s": {"v": _nest(kind, MAX_DEPTH - 1)}}, force=True)
        mgr.wait_until_finished()
        got = mgr.restore(1)["s"]["v"]
        same = got == _nest(kind, MAX_DEPTH - 1)
        checks.record(f"{MAX_DEPTH} levels round trip", "" if same else "changed")
        limit = (f"more than {MAX_DEPTH} levels",)
        for depth in (MAX_DEPTH, 200, 5000):
            exc = outcome(functools.partial(_save_and_wait, mgr, {"s": {"v": _nest(kind, depth)}}))
            checks.record(f"{depth + 1} levels refused", judge(exc, limit, may_succeed=False))
        checks.record(
            "nothing else committed", "" if mgr.all_steps() == [1] else str(mgr.all_steps())
        )
        cyclic: list[Any] = []
        cyclic.append(cyclic)
        exc = outcome(functools.partial(_save_and_wait, mgr, {"s": {"v": cyclic}}, 3))
        checks.record("a cycle refused", judge(exc, ("contains itself",), may_succeed=False))
    checks.assert_all_survived()


# ============================================================ builtin errors -> orbit_pt errors

UNSTORABLE: dict[str, Callable[[], Any]] = {
    "a meta tensor": lambda: torch.empty(3, device="meta"),
    "a sparse tensor": lambda: torch.eye(3).to_sparse(),
    "a nested tensor": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "a quantized tensor": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
    "a lone surrogate string": lambda: "a\ud800b",
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor prototype warning
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", UNSTORABLE)
def test_unstorable_values_are_orbit_pt_errors(tmp_path: Path, kind: str, async_save: bool) -> None:
    checks = Checks("builtin errors -> orbit_pt errors")
    value = UNSTORABLE[kind]()
    options = CheckpointManagerOptions(async_save=async_save)
    with CheckpointManager(tmp_path / "r", options=options) as mgr:
        for what, items in (
            ("a value", {"item": {"bad_value": value}}),
            ("a dict key", {"item": {value: 1}}) if isinstance(value, str) else ("-", {}),
        ):
            if not items:
                continue
            exc = outcome(functools.partial(_save_and_wait, mgr, items, 1))
            names = ("bad_value",) if what == "a value" else ("dict key",)
            checks.record(f"save of {what}", judge(exc, names, may_succeed=False))
        checks.record("nothing committed", "" if mgr.all_steps() == [] else str(mgr.all_steps()))
        _save_and_wait(mgr, {"item": {"ok": torch.ones(1)}})  # the manager goes on
        checks.record("the next save", "" if mgr.all_steps() == [2] else str(mgr.all_steps()))
    checks.assert_all_survived()


@dataclass
class ChildResult:
    """What a forked child did: the repr of its error, or a signal/timeout."""

    error: str | None = None
    error_type: str = ""
    is_checkpoint_error: bool = False
    crashed: str = ""

    def problem(self, names: tuple[str, ...]) -> str:
        if self.crashed:
            return self.crashed
        if self.error is None:
            return "no error: the hostile file was accepted"
        if not self.is_checkpoint_error:
            return f"a builtin error: {self.error_type}: {self.error}"
        if not any(n in self.error for n in names):
            return f"{self.error_type} does not name {names[0]}: {self.error[:300]}"
        return ""


def in_child(fn: Callable[[], object], *, as_nobody: bool = False) -> ChildResult:
    """Run ``fn`` in a forked child (optionally as uid/gid 65534); report how it ended.

    Fork, not exec: everything is imported already, so the child needs nothing it may not
    read once it gives up root. A crash (SIGSEGV) or a hang is reported, never inherited.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        status = 0
        try:
            if as_nobody:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            result: dict[str, Any] = {"error": None}
            try:
                fn()
            except Exception as exc:
                result = {
                    "error": str(exc),
                    "error_type": type(exc).__name__,
                    "is_checkpoint_error": isinstance(exc, CheckpointError),
                }
            os.write(write_end, json.dumps(result).encode())
        except BaseException:
            status = 3
        finally:
            os._exit(status)
    os.close(write_end)
    chunks = []
    try:
        with deadline():
            while chunk := os.read(read_end, 1 << 16):
                chunks.append(chunk)
            _, status = os.waitpid(pid, 0)
    except Hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return ChildResult(crashed=f"hung for {DEADLINE_S} s")
    finally:
        os.close(read_end)
    if os.WIFSIGNALED(status):
        return ChildResult(crashed=f"killed by signal {os.WTERMSIG(status)}")
    if not chunks:
        return ChildResult(crashed=f"exited {os.WEXITSTATUS(status)} without a result")
    return ChildResult(**json.loads(b"".join(chunks)))


@pytest.fixture
def shared_root(template: Path) -> Iterator[Path]:
    """A copy of the template that an unprivileged user may reach (pytest's tmp_path is 0700)."""
    top = Path(tempfile.mkdtemp(prefix="orbit-hostile-"))
    top.chmod(0o755)
    root = top / "root"
    shutil.copytree(template, root)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames:
            (Path(dirpath) / name).chmod(0o755)
        for name in filenames:
            (Path(dirpath) / name).chmod(0o644)
    yield root
    for dirpath, dirnames, _ in os.walk(top):
        for name in dirnames:
            with contextlib.suppress(OSError):
                (Path(dirpath) / name).chmod(0o755)
    shutil.rmtree(top)


def _denied(fn: Callable[[], object]) -> ChildResult:
    """``fn`` run where permission is really denied: as nobody when root, else as ourselves."""
    if os.geteuid() == 0:
        return in_child(fn, as_nobody=True)
    return in_child(fn)


@pytest.mark.parametrize(
    "target", ["state/state.msgpack", "model/model.safetensors", "state", "sharded"]
)
def test_permission_denied_is_an_orbit_pt_error_with_and_without_verify(
    shared_root: Path, target: str
) -> None:
    """Cause 11: ``verify=True`` raised a raw PermissionError where ``verify=False`` wrapped it."""
    path = shared_root / STEP / target
    path.chmod(0)
    checks = Checks("builtin errors -> orbit_pt errors")
    item = target.split("/")[0]
    for verify in (False, True):
        result = _denied(functools.partial(_restore, shared_root, [item], verify=verify))
        checks.record(f"restore(verify={verify})", result.problem((target,)))
    result = _denied(functools.partial(_verify_raises, shared_root))
    checks.record("verify_step", result.problem((target,)))
    checks.assert_all_survived()


def _verify_raises(root: Path) -> None:
    report = verify_step(root, 1)
    report.raise_for_problems()


def test_a_writer_on_an_unwritable_root_or_a_lock_link(shared_root: Path) -> None:
    """Part A of issue 17 owns the lock; the promise (an orbit_pt error) is checked here too."""
    checks = Checks("builtin errors -> orbit_pt errors")
    shared_root.chmod(0o555)
    result = _denied(lambda: CheckpointManager(shared_root).close())
    checks.record("unwritable root", result.problem(("",)))
    shared_root.chmod(0o755)
    lock = shared_root / ".orbit.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(shared_root.parent / "elsewhere")
    exc = outcome(lambda: CheckpointManager(shared_root).close())
    checks.record(".orbit.lock a link", judge(exc, (".orbit.lock",), may_succeed=False))
    checks.assert_all_survived()


# ============================================================================== the CLI's pipe


def test_a_closed_pipe_is_not_an_error(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checks = Checks("CLI exit codes")

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    with contextlib.redirect_stdout(ClosedPipe()):
        code = _cli.main(["ls", str(root), "--json"])
    checks.record("in process", "" if code == 0 else f"exit {code}")
    checks.record("no traceback", "" if "Traceback" not in capsys.readouterr().err else "traceback")
    # For real: the reader of a pipe is gone before orbit-pt writes (`... | head -1`).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "orbit_pt", "ls", str(root), "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            timeout=DEADLINE_S,
            check=False,
        )
    finally:
        os.close(write_end)
    code = done.returncode
    checks.record("a real closed pipe: exit code", "" if code == 0 else f"exit {code}")
    err = done.stderr.decode()
    checks.record("a real closed pipe: stderr", "" if not err.strip() else err[-500:])
    checks.assert_all_survived()


def test_the_documented_exit_codes_are_the_only_ones(root: Path) -> None:
    """Damaged metadata, header, msgpack, index: 1 from verify and info, 0 from ls; never 70."""
    checks = Checks("CLI exit codes")
    commands = (
        (["ls"], 0),
        (["ls", "--json"], 0),
        (["info", "1"], 1),
        (["verify", "1"], 1),
        (["verify", "--all"], 1),
    )
    rewrite(
        root, "state/tensors.safetensors", safetensors_bytes("[" * 100_000 + "]" * 100_000, b"")
    )
    for argv, want in commands:
        checks.record(
            f"bad header: {' '.join(argv)}", _cli_problem([argv[0], str(root), *argv[1:]], {want})
        )
    deep = json.loads("[" * 90 + "]" * 90)
    forge(root, lambda doc: doc["items"]["state"].__setitem__("info", {"x": deep}))
    for argv, want in commands:
        checks.record(
            f"bad metadata: {' '.join(argv)}", _cli_problem([argv[0], str(root), *argv[1:]], {want})
        )
    checks.assert_all_survived()
