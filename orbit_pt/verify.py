"""Verify a committed step: every file it lists is whole, readable and unchanged since commit.

    from orbit_pt.verify import verify_step

    report = verify_step("runs/exp1/checkpoints", 1000)
    if not report.ok:
        print(report.summary())
    report.raise_for_problems()   # CorruptCheckpointError naming every damaged file

What is checked, for one step folder (format in docs/format.md):

- the folder is a committed step, by the rule every reader uses (``_storage/root.py``): a
  folder (not a link), whose ``_CHECKPOINT_METADATA`` parses and names the step of the folder;
- every file it lists exists, is a regular file inside the step folder (no link on its way),
  and has its recorded size;
- no file is present that it does not list (a stray or half-copied file), and no code file
  (``*.py``, ``*.so``, ...) at all, listed or not;
- every recorded checksum matches the file's bytes (the whole file is read);
- safetensors headers are valid (offsets inside the file, sizes matching dtype and shape, the
  data section covered exactly), msgpack files parse, JSON files parse, and a model item's
  index agrees with its shards.

Files recorded without a checksum (steps written before checksums existed) get the structural
checks only and are listed in :attr:`VerifyReport.unchecksummed`; ``require_checksums=True``
makes each of them a problem. Tensor data is never loaded into tensors; files are read in
chunks, so memory stays small however large the step.

Nothing outside the step folder is read: the whole check runs confined to it
(``_format.safe_open``), so a link anywhere below it is a problem, never followed, and a FIFO
or device is refused before it is opened. Every parse is bounded (docs/format.md, "Reading
limits"): a hostile file is a problem of kind ``unreadable``, never a crash or a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgpack

from orbit_pt._format import safe_open as _safe_open
from orbit_pt._format.safetensors import SafetensorsReader
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import root as _root
from orbit_pt.errors import CheckpointValueError, CorruptCheckpointError, StepNotFoundError
from orbit_pt.handlers._codec import check_refs, optimizer_layout_problem, read_structure
from orbit_pt.metadata import ItemMetadata

__all__ = ["Problem", "ProblemKind", "VerifyReport", "verify_step"]

ProblemKind = Literal[
    "metadata",
    "missing",
    "not-a-file",
    "size",
    "checksum",
    "unlisted",
    "unreadable",
    "no-checksum",
    "code",
]
"""What a :class:`Problem` is about:

- ``metadata``: the folder is not a committed step: ``_CHECKPOINT_METADATA`` is missing,
  unreadable, or names another step, or the step's name is a link or a file, not a folder;
- ``missing``: a listed file does not exist; ``not-a-file``: it is a folder, a FIFO or a
  device, a link, or lies below a link (an item folder replaced by one);
- ``size``: a listed file has another size than recorded (truncated or appended to);
- ``checksum``: a listed file's bytes changed, or its checksum algorithm is unknown;
- ``unlisted``: a file in the step that the metadata does not list;
- ``unreadable``: a file that cannot be read, or whose content is malformed (safetensors
  header, msgpack, JSON, model index);
- ``no-checksum``: a file recorded without a checksum, with ``require_checksums=True``;
- ``code``: a Python file or native library (``modeling_*.py``, ``*.so``, ...), listed or not:
  orbit_pt never writes one, and ``from_pretrained(trust_remote_code=True)`` would run it.
"""

ProgressCallback = Callable[[int], None]

# The built-in handlers whose .msgpack files are orbit_pt's structure encoding (handlers._codec),
# with the name of the safetensors file beside each structure, which holds its tensors.
_CODEC_FILES = {
    ("state", "state.msgpack"): "tensors.safetensors",
    ("optimizer", "optimizer.msgpack"): "optimizer.safetensors",
}
# JSON files that are objects whenever they are read (a model's config, its index, an adapter's
# config): a valid JSON array there is as unreadable as garbage.
_JSON_OBJECTS = frozenset(
    {
        "config.json",
        "generation_config.json",
        "adapter_config.json",
        "model.safetensors.index.json",
    }
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a step.

    Attributes:
        path: the file, relative to the step folder (``/``-separated); ``_CHECKPOINT_METADATA``
            for metadata problems.
        kind: what is wrong (see :data:`ProblemKind`).
        detail: a readable explanation.
    """

    path: str
    kind: ProblemKind
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify_step`.

    Attributes:
        step: the step verified.
        directory: the step folder.
        problems: everything found wrong; empty when the step is whole.
        checksummed: files whose checksum was recomputed and matched.
        unchecksummed: files recorded without a checksum (checked structurally only).
        bytes_read: bytes read to recompute checksums.
        files: how many files the metadata lists.
    """

    step: int
    directory: Path
    problems: tuple[Problem, ...] = ()
    checksummed: tuple[str, ...] = ()
    unchecksummed: tuple[str, ...] = ()
    bytes_read: int = 0
    files: int = 0

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def summary(self) -> str:
        """A few human-readable lines: OK, or each problem."""
        if self.ok:
            line = (
                f"step {self.step}: OK ({self.files} files, {len(self.checksummed)} checksums "
                f"verified, {self.bytes_read} bytes read)"
            )
            if self.unchecksummed:
                line += (
                    f"; {len(self.unchecksummed)} file(s) have no checksum (written before "
                    "checksums were recorded) and were checked structurally only"
                )
            return line
        lines = [f"step {self.step} in {self.directory}: {len(self.problems)} problem(s)"]
        lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)

    def raise_for_problems(self) -> None:
        """Raise :class:`~orbit_pt.CorruptCheckpointError` listing every problem, if any."""
        if self.ok:
            return
        listed = "; ".join(str(p) for p in self.problems[:20])
        more = f"; and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        raise CorruptCheckpointError(
            f"step {self.step} in {self.directory} is damaged ({len(self.problems)} problem(s): "
            f"{listed}{more}); restore another step, or run `orbit-pt verify` on it for details"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form (what ``orbit-pt verify --json`` prints)."""
        return {
            "step": self.step,
            "directory": str(self.directory),
            "ok": self.ok,
            "files": self.files,
            "checksummed": len(self.checksummed),
            "unchecksummed": list(self.unchecksummed),
            "bytes_read": self.bytes_read,
            "problems": [
                {"path": p.path, "kind": p.kind, "detail": p.detail} for p in self.problems
            ],
        }


def verify_step(
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    require_checksums: bool = False,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Check one step folder's structure and checksums (see the module docstring).

    Args:
        directory: the checkpoint root when ``step`` is given; otherwise the step folder itself
            (``.../step_00001000``).
        step: the step to verify under the root ``directory``.
        require_checksums: report files recorded without a checksum as problems (kind
            ``no-checksum``) instead of checking them structurally only.
        progress: called with the number of bytes read after each chunk (for a progress bar).

    Returns:
        The report; problems never raise. Call :meth:`VerifyReport.raise_for_problems` to turn
        them into a :class:`~orbit_pt.CorruptCheckpointError`.

    Raises:
        StepNotFoundError: nothing has that step's name (or ``directory`` does not exist).
        CheckpointValueError: ``directory`` is not named like a step folder and no ``step`` was
            given.
    """
    path = Path(directory)
    if step is None:
        parsed = _layout.parse_step_name(path.name)
        if parsed is None:
            raise CheckpointValueError(
                f"{path} is not a step folder (step_NNNNNNNN); pass the root and a step, e.g. "
                "verify_step(root, 1000)"
            )
        step, step_dir, root = parsed, path, path.parent
    else:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointValueError(f"step must be an int >= 0, got {step!r}")
        root, step_dir = path, path / _layout.step_name(step)
    entry = _root.step_entry(root, step)
    if entry is None:
        raise StepNotFoundError(step, root, _root.committed_steps(root))
    return _Verifier(step, step_dir, require_checksums, progress).run(entry)


class _Verifier:
    def __init__(
        self, step: int, step_dir: Path, require: bool, progress: ProgressCallback | None
    ) -> None:
        self.step = step
        self.step_dir = step_dir
        self.require = require
        self.progress = progress
        self.problems: list[Problem] = []
        self.checksummed: list[str] = []
        self.unchecksummed: list[str] = []
        self.bytes_read = 0
        # Structures whose tensor references are checked once every file has been: (its path
        # relative to the step, the structure, its safetensors file relative to the step).
        self.structures: list[tuple[str, Any, str]] = []

    def problem(self, path: str, kind: ProblemKind, detail: str) -> None:
        self.problems.append(Problem(path, kind, detail))

    def run(self, entry: _root.RootEntry) -> VerifyReport:
        with _safe_open.confined(self.step_dir):
            return self._run(entry)

    def _run(self, entry: _root.RootEntry) -> VerifyReport:
        meta = entry.meta if entry.committed else None
        if meta is None:
            self.problem(_layout.METADATA_FILE, "metadata", f"not a committed step: {entry.reason}")
        listed = dict(meta.files) if meta is not None else {}
        if meta is not None:
            present = self._present_files()
            for check in _root.check_listed_files(
                self.step_dir, listed, require_checksums=self.require, progress=self.progress
            ):
                self.bytes_read += check.bytes_read
                if check.problem is not None:
                    self.problem(check.rel, check.problem, check.detail)
                if check.checksummed:
                    self.checksummed.append(check.rel)
                if check.unchecksummed:
                    self.unchecksummed.append(check.rel)
                if check.sized:
                    handler = meta.items.get(check.rel.split("/", 1)[0])
                    self._check_content(check.rel, check.path, handler)
            for rel in sorted(p for p in present if _layout.is_code_file(p)):
                self.problem(
                    rel,
                    "code",
                    "is code, which orbit_pt never writes into a step; from_pretrained("
                    "trust_remote_code=True) would run it -- remove it, and check who can write "
                    "this root",
                )
            strays = present - set(listed) - {_layout.METADATA_FILE}
            for rel in sorted(p for p in strays if not _layout.is_code_file(p)):
                self.problem(
                    rel,
                    "unlisted",
                    "is not listed in the step's metadata (a stray or half-copied file); move "
                    "it out of the step folder",
                )
            self._check_references()
            damaged = {p.path.split("/", 1)[0] for p in self.problems}
            for name, item in meta.items.items():
                # The index <-> shards agreement, unless a file of the item is already reported.
                if item.handler == "model" and name not in damaged:
                    self._check_model_folder(name)
        return VerifyReport(
            step=self.step,
            directory=self.step_dir,
            problems=tuple(self.problems),
            checksummed=tuple(self.checksummed),
            unchecksummed=tuple(self.unchecksummed),
            bytes_read=self.bytes_read,
            files=len(listed),
        )

    def _present_files(self) -> set[str]:
        found: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.step_dir):
            dirnames.sort()
            base = Path(dirpath)
            for name in filenames:
                found.add((base / name).relative_to(self.step_dir).as_posix())
            # A symlink to a folder is listed in dirnames and not followed by os.walk.
            for name in dirnames:
                if (base / name).is_symlink():
                    found.add((base / name).relative_to(self.step_dir).as_posix())
        return found

    def _check_content(self, rel: str, path: Path, item: ItemMetadata | None) -> None:
        try:
            if rel.endswith(".safetensors"):
                # The reader checks the whole header, and that its tensors cover the data
                # section exactly, with no gap or overlap.
                SafetensorsReader(path)
            elif rel.endswith(".msgpack"):
                tensors = _CODEC_FILES.get((item.handler if item else "", path.name))
                if tensors is not None:
                    self._check_structure(item, rel, path, tensors)
                else:
                    # Another handler's file: parsing is the check, and extension payloads
                    # stay opaque (msgpack's own stack bounds the nesting; nothing recurses).
                    msgpack.unpackb(_safe_open.read_bytes(path), strict_map_key=False)
            elif path.name in _JSON_OBJECTS:
                _safe_open.read_json_object(path)
            elif rel.endswith(".json"):
                _safe_open.read_json(path)
        except CorruptCheckpointError as exc:
            self.problem(rel, "unreadable", str(exc))
        except (ValueError, TypeError, msgpack.UnpackException, OSError) as exc:
            self.problem(rel, "unreadable", f"does not parse: {type(exc).__name__}: {exc}")

    def _check_structure(
        self, item: ItemMetadata | None, rel: str, path: Path, tensors: str
    ) -> None:
        """What a restore decodes, with its limits: the structure and its layout (an
        optimizer's); its references to the tensors beside it are checked at the end."""
        structure = read_structure(path)
        if item is not None and item.handler == "optimizer":
            problem = optimizer_layout_problem(structure)
            if problem:
                raise CorruptCheckpointError(f"{path} is not an optimizer's state ({problem})")
        self.structures.append((rel, structure, rel.rsplit("/", 1)[0] + "/" + tensors))

    def _check_references(self) -> None:
        """Every tensor a structure refers to is in the safetensors file beside it -- when that
        file is itself whole (a damaged one is reported already, once)."""
        reported = {p.path for p in self.problems}
        for rel, structure, tensors in self.structures:
            if tensors in reported or not (self.step_dir / tensors).is_file():
                continue
            try:
                reader = SafetensorsReader(self.step_dir / tensors)
                check_refs(structure, reader, rel.rsplit("/", 1)[-1])
            except CorruptCheckpointError as exc:
                self.problem(rel, "unreadable", str(exc))

    def _check_model_folder(self, item: str) -> None:
        # Imported here: the model handler imports torch-heavy helpers that verify's other
        # checks never need.
        from orbit_pt.handlers.model import open_model_folder

        try:
            open_model_folder(self.step_dir / item)
        except CorruptCheckpointError as exc:
            self.problem(item, "unreadable", str(exc))
        except OSError as exc:  # a folder of the item that cannot be listed
            self.problem(item, "unreadable", f"cannot be read: {exc}")
