"""The ``orbit-pt`` command: list, inspect, verify, prune and export checkpoints.

    orbit-pt ls ROOT [--keep-last-n N ...]     steps, partial folders, what retention keeps
    orbit-pt info ROOT [STEP] [--tensors]      items, handlers, tensors (headers only), files
    orbit-pt verify ROOT [STEP | --all]        structure and checksums; exit 1 on any problem
    orbit-pt prune ROOT --keep-last-n N ...    apply retention now (takes the root's lock)
    orbit-pt export ROOT STEP OUT [--dtype bf16]   a standalone Hugging Face model folder
                    [--merge-adapter [--base PATH] [--adapter NAME]]   a PEFT adapter merged

Every command takes ``--json`` (one JSON document on stdout) and ``--help``. Exit codes are
listed in :data:`EXIT_CODES` and in docs/cli.md; scripts can rely on them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from orbit_pt import _version
from orbit_pt._format import safe_open
from orbit_pt._format.safetensors import SafetensorsReader, torch_dtype_name
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import root as _root
from orbit_pt._storage.remote import is_url, sync_mirror
from orbit_pt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CorruptCheckpointError,
    ItemNotFoundError,
    StepAlreadyExistsError,
    StepNotFoundError,
)
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.retention import RecordedRetention, RetentionDecision, read_record, rule_labels

__all__ = ["EXIT_CODES", "main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_LOCKED = 4
EXIT_ERROR = 5
EXIT_INTERNAL = 70

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success; for verify: every step checked is whole",
    EXIT_PROBLEMS: "a checkpoint has problems: verify found any, or a step is damaged or "
    "not committed",
    EXIT_USAGE: "usage error: bad arguments, or a request refused (prune without a retention "
    "rule, export into a non-empty folder)",
    EXIT_NOT_FOUND: "the root, step or item does not exist",
    EXIT_LOCKED: "another process (a training job) holds the root's lock; nothing was changed",
    EXIT_ERROR: "any other error (permission denied, disk full, ...); the message says which",
    EXIT_INTERNAL: "an internal error (a bug in orbit-pt); the traceback is printed",
}
"""Exit status -> meaning, for every ``orbit-pt`` command."""

logger = logging.getLogger(__name__)


class _UsageError(Exception):
    """A request the CLI refuses (exit 2)."""


class _NotFoundError(Exception):
    """A root or step that does not exist (exit 3)."""


# ---------------------------------------------------------------------------------- the root

# How `ls` names each kind of entry of the root (docs/cli.md); a step-named entry that is not a
# committed step is "invalid". Foreign entries without a step name are not listed.
_STATUS = {
    "committed": "committed",
    "temporary": "partial",
    "deleting": "deleting",
    "superseded": "superseded",
    "foreign": "invalid",
}


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _root_dir(
    value: str, args: argparse.Namespace | None = None, *, files: bool | int | None = False
) -> Path:
    """The root folder to read; for an ``s3://`` URL, a local copy of its committed steps.

    The copy holds every committed step's metadata (and the files of the steps ``files``
    selects), taken from the store now; see :func:`orbit_pt._storage.remote.sync_mirror`.
    """
    if is_url(value):
        options = dict(getattr(args, "storage_options", None) or [])
        return sync_mirror(value, options, files=files)
    root = Path(value)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise _NotFoundError(f"checkpoint root {root} {what}; check the path")
    return root


def _listed(root: Path) -> list[_root.RootEntry]:
    """The entries of ``root`` that ls shows: everything named for a step."""
    return [e for e in _root.scan_root(root) if e.step is not None]


def _latest(root: Path) -> _root.RootEntry:
    committed = [e for e in _root.scan_root(root, superseded=False) if e.committed]
    if not committed:
        raise StepNotFoundError(None, root, [])
    return committed[-1]


def _resolve(root: Path, step: int | None) -> _root.RootEntry:
    """The committed entry of ``step`` (None: the latest); a damaged step is exit 1."""
    return _latest(root) if step is None else _root.committed_entry(root, step)


def _size(entry: _root.RootEntry) -> int:
    if entry.committed and entry.meta is not None:
        listed = sum(f.size for f in entry.meta.files.values())
        return listed + _file_size(entry.path / _layout.METADATA_FILE)
    if entry.path.is_symlink():
        return 0  # never read through a link
    return _tree_size(entry.path) if entry.path.is_dir() else _file_size(entry.path)


# -------------------------------------------------------------------------------- retention


def _options(args: argparse.Namespace, *, read_only: bool) -> CheckpointManagerOptions | None:
    """The options the retention flags describe, or None when no rule was given."""
    given = (
        args.keep_last_n,
        args.keep_every_k_steps,
        args.keep_best_n,
        args.keep_time_interval,
    )
    if all(value is None for value in given):
        if args.best_metric is not None:
            raise _UsageError("--best-metric needs --keep-best-n N (how many best steps to keep)")
        return None
    return CheckpointManagerOptions(
        keep_last_n=args.keep_last_n,
        keep_every_k_steps=args.keep_every_k_steps,
        keep_best_n=args.keep_best_n,
        best_metric=args.best_metric,
        best_mode=args.best_mode,
        keep_time_interval=args.keep_time_interval,
        read_only=read_only,
        # The CLI never takes over SIGTERM: Ctrl-C and kill must stop it as usual.
        preemption_signals=(),
    )


def _retention(
    root: Path | str,
    options: CheckpointManagerOptions | None,
    *,
    dry_run: bool,
    storage_options: dict[str, Any] | None = None,
) -> list[RetentionDecision]:
    """What the manager's retention does with ``options`` (deletes unless ``dry_run``)."""
    from orbit_pt.manager import CheckpointManager

    if options is None:
        options = CheckpointManagerOptions(read_only=True, preemption_signals=())
    # A writing manager takes the root's lock (exit 4 while a training job writes it) and
    # removes folders a crash left behind, exactly as a training job does when it starts.
    with CheckpointManager(root, options=options, storage_options=storage_options or None) as mgr:
        return mgr.apply_retention(dry_run=dry_run)


# --------------------------------------------------------------------------------- commands


def _cmd_ls(args: argparse.Namespace) -> tuple[int, Any, str]:
    root = _root_dir(args.root, args)
    options, source, recorded, notes = _ls_retention(root, args)
    entries = _listed(root)
    decisions = {d.step: d for d in _retention(root, options, dry_run=True)}
    # A verdict only when every rule is known: custom rules recorded by their repr may keep
    # steps that the known ones do not.
    judged = options is not None and options.retention_policy() is not None
    judged = judged and not (recorded is not None and recorded.custom)
    rows = [
        _entry_json(
            e, decisions.get(e.step) if e.committed and e.step is not None else None, judged=judged
        )
        for e in entries
    ]
    committed = [e.step for e in entries if e.committed and e.step is not None]
    if recorded is not None:
        rules = list(recorded.rules)
    else:
        rules = rule_labels(options.retention_policy()) if options is not None else []
    doc = {
        "root": str(root),
        "latest": max(committed, default=None),
        "rules": rules,
        "retention": source,
        "entries": rows,
    }
    deletes = "prune deletes" if source == "flags" else "the next save deletes"
    header = ["STEP", "STATUS", "COMMITTED (UTC)", "SIZE", "ITEMS", "METRICS", "KEPT BY"]
    table = [
        [
            "-" if row["step"] is None else str(row["step"]),
            row["status"],
            row["time_utc"] or "-",
            _human(row["size_bytes"]),
            ",".join(row["items"]) or "-",
            ",".join(f"{k}={v:.6g}" for k, v in row["metrics"].items()) or "-",
            _kept_text(row, deletes),
        ]
        for row in rows
    ]
    lines = _table(header, table) if rows else [f"{root}: no checkpoints"]
    notes += [f"{row['name']}: {row['note']}" for row in rows if row["note"]]
    if notes:
        lines += ["", *notes]
    return EXIT_OK, doc, "\n".join(lines)


def _ls_retention(
    root: Path, args: argparse.Namespace
) -> tuple[CheckpointManagerOptions | None, str, RecordedRetention | None, list[str]]:
    """The retention ls shows: the flags', else the one the root's writer recorded.

    Returns the options (None: no rule), where they came from (``flags``, ``recorded`` or
    ``none``), the record when used, and lines to print under the table.
    """
    flags = _options(args, read_only=True)
    if flags is not None:
        return flags, "flags", None, []
    try:
        recorded = read_record(root)
    except CorruptCheckpointError as exc:
        return None, "none", None, [f"KEPT BY: {exc}"]
    if recorded is None:
        return None, "none", None, []
    options = recorded.rebuild(read_only=True, preemption_signals=())
    notes = [
        f"KEPT BY: the retention the root's writer last used ({', '.join(recorded.rules) or 'none'}"
        f", from {_layout.RETENTION_FILE}); give rule flags to see others"
    ]
    if recorded.custom:
        notes.append(
            f"KEPT BY: the writer also used custom rule(s) {', '.join(recorded.custom)}, which "
            "orbit-pt cannot evaluate: steps they keep show only the other rules, and no step "
            "is marked for deletion"
        )
    return options, "recorded", recorded, notes


def _kept_text(row: dict[str, Any], deletes: str) -> str:
    if row["status"] != "committed":
        return "-"
    if row["kept_by"]:
        return ",".join(row["kept_by"])
    return f"- ({deletes})" if row["pruned"] else "-"


def _entry_json(
    entry: _root.RootEntry, decision: RetentionDecision | None, *, judged: bool
) -> dict[str, Any]:
    meta = entry.meta
    kept_by = list(decision.kept_by) if decision is not None else []
    return {
        "name": entry.name,
        "step": entry.step,
        "status": _STATUS[entry.kind],
        "time": meta.time if meta else None,
        "time_utc": _utc(meta.time) if meta else None,
        "size_bytes": _size(entry),
        "items": sorted(meta.items) if meta else [],
        "metrics": dict(meta.metrics) if meta else {},
        "kept_by": kept_by,
        # With every rule known: a committed step retention does not keep is what it deletes.
        "pruned": judged and decision is not None and not decision.kept,
        "note": entry.reason,
    }


def _cmd_info(args: argparse.Namespace) -> tuple[int, Any, str]:
    root = _root_dir(args.root, args)
    with safe_open.confined(root):  # headers are read without following links in the root
        return _info(args, root)


def _info(args: argparse.Namespace, root: Path) -> tuple[int, Any, str]:
    entry = _resolve(root, args.step)
    meta = entry.meta
    assert meta is not None
    assert entry.step is not None
    items: dict[str, Any] = {}
    for name, item in meta.items.items():
        files = {p: f for p, f in meta.files.items() if p.startswith(f"{name}/")}
        tensors: list[dict[str, Any]] = []
        for rel in sorted(files):
            if rel.endswith(".safetensors"):
                reader = SafetensorsReader(entry.path / rel)  # the header only
                tensors += [
                    {
                        "name": e.name,
                        "file": rel,
                        "dtype": torch_dtype_name(e.dtype),
                        "shape": list(e.shape),
                        "bytes": e.nbytes,
                    }
                    for e in reader.entries.values()
                ]
        numel = sum(_numel(t["shape"]) for t in tensors)
        largest = sorted(tensors, key=lambda t: (-_numel(t["shape"]), t["name"]))[:3]
        items[name] = {
            "handler": item.handler,
            "info": dict(item.info),
            "files": len(files),
            "bytes": sum(f.size for f in files.values()),
            "tensor_count": len(tensors),
            "tensor_elements": numel,
            "tensor_bytes": sum(t["bytes"] for t in tensors),
            "dtypes": dict(sorted(Counter(t["dtype"] for t in tensors).items())),
            "largest": largest,
            **({"tensors": tensors} if args.tensors else {}),
        }
    doc = {
        "root": str(root),
        "step": entry.step,
        "directory": str(entry.path),
        "time": meta.time,
        "time_utc": _utc(meta.time),
        "world_size": meta.world_size,
        "orbit_pt_version": meta.orbit_pt_version,
        "metrics": dict(meta.metrics),
        "size_bytes": _size(entry),
        "items": items,
        "files": {p: {"size": f.size, "checksum": f.checksum} for p, f in meta.files.items()},
    }
    return EXIT_OK, doc, _info_text(doc, show_tensors=args.tensors)


def _info_text(doc: dict[str, Any], *, show_tensors: bool) -> str:
    metrics = ", ".join(f"{k}={v:.6g}" for k, v in doc["metrics"].items()) or "-"
    checksummed = sum(1 for f in doc["files"].values() if f["checksum"])
    lines = [
        f"step {doc['step']}  ({doc['directory']})",
        f"  committed    {doc['time_utc']} UTC",
        f"  world size   {doc['world_size']}",
        f"  written by   orbit_pt {doc['orbit_pt_version'] or '?'}",
        f"  metrics      {metrics}",
        f"  size         {_human(doc['size_bytes'])} in {len(doc['files'])} files "
        f"({checksummed} with checksums)",
        "items:",
    ]
    for name, item in doc["items"].items():
        dtypes = ", ".join(f"{d} x{n}" for d, n in item["dtypes"].items()) or "-"
        lines.append(
            f"  {name}: handler {item['handler']}, {item['tensor_count']} tensors "
            f"({item['tensor_elements']:,} elements, {_human(item['tensor_bytes'])}), "
            f"dtypes {dtypes}"
        )
        for t in item["largest"]:
            lines.append(f"      {t['name']}  {t['dtype']}  {t['shape']}")
        if show_tensors:
            lines.append("    tensors:")
            lines += [
                f"      {t['name']}  {t['dtype']}  {t['shape']}  ({t['file']})"
                for t in item["tensors"]
            ]
    lines.append("files:")
    width = max((len(p) for p in doc["files"]), default=0)
    for path, f in sorted(doc["files"].items()):
        checksum = f["checksum"] or "no checksum"
        lines.append(f"  {path:<{width}}  {_human(f['size']):>10}  {checksum}")
    return "\n".join(lines)


def _cmd_verify(args: argparse.Namespace) -> tuple[int, Any, str]:
    from orbit_pt.verify import verify_step

    root = _root_dir(args.root, args, files=True if args.all else args.step)
    if args.all:
        # Every step-named entry of the root: committed steps, and what is in their way.
        entries = _root.scan_root(root, superseded=False)
        steps = [
            e.step for e in entries if e.step is not None and e.kind in ("committed", "foreign")
        ]
    elif args.step is not None:
        steps = [args.step]
    else:
        latest = _latest(root).step
        assert latest is not None
        steps = [latest]
    reports = [verify_step(root, s, require_checksums=args.require_checksums) for s in steps]
    ok = all(r.ok for r in reports)
    doc = {"root": str(root), "ok": ok, "steps": [r.to_json() for r in reports]}
    text = "\n".join(r.summary() for r in reports) or f"{root}: no steps to verify"
    return (EXIT_OK if ok else EXIT_PROBLEMS), doc, text


def _cmd_prune(args: argparse.Namespace) -> tuple[int, Any, str]:
    root = _root_dir(args.root, args)
    options = _options(args, read_only=args.dry_run)
    if options is None:
        raise _UsageError(
            "prune needs at least one retention rule (--keep-last-n, --keep-every-k-steps, "
            "--keep-best-n with --best-metric, --keep-time-interval); with none, every step "
            "would be kept, so nothing would happen"
        )
    # An object-store root is pruned by a writer on the store itself, not on the local copy.
    target = args.root if is_url(args.root) else root
    decisions = _retention(
        target, options, dry_run=args.dry_run, storage_options=dict(args.storage_options)
    )
    doomed = [d.step for d in decisions if not d.kept]
    kept = {d.step: list(d.kept_by) for d in decisions if d.kept}
    doc = {
        "root": str(root),
        "dry_run": args.dry_run,
        "rules": rule_labels(options.retention_policy()),
        "deleted": [] if args.dry_run else doomed,
        "would_delete": doomed if args.dry_run else [],
        "kept": {str(step): why for step, why in kept.items()},
    }
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{verb} {len(doomed)} step(s): {', '.join(map(str, doomed)) or 'none'}"]
    lines += [f"  kept {step}: {', '.join(why)}" for step, why in kept.items()]
    return EXIT_OK, doc, "\n".join(lines)


def _cmd_export(args: argparse.Namespace) -> tuple[int, Any, str]:
    from orbit_pt.export import EXPORT_DTYPES, export_model

    root = _root_dir(args.root, args, files=args.step)
    result = export_model(
        root,
        args.step,
        args.out,
        item=args.item,
        dtype=EXPORT_DTYPES[args.dtype] if args.dtype else None,
        verify=not args.no_verify,
        merge_adapter=args.merge_adapter,
        base=args.base,
        adapter_name=args.adapter,
    )
    doc = {
        "step": result.step,
        "item": result.item,
        "out": str(result.out),
        "dtype": result.dtype,
        "tensors": result.tensors,
        "tensor_bytes": result.tensor_bytes,
        "files": list(result.files),
        "adapter": result.adapter,
        "base": None if result.base is None else str(result.base),
        "left_out": list(result.left_out),
    }
    merged = (
        f" (adapter {result.adapter!r} merged into the base {result.base})"
        if result.adapter is not None
        else ""
    )
    text = (
        f"exported item {result.item!r} of step {result.step}{merged} to {result.out} "
        f"({result.tensors} tensors, {_human(result.tensor_bytes)}"
        f"{', as ' + result.dtype if result.dtype else ''}): {', '.join(result.files)}"
    )
    if "config.json" not in result.files:
        text += (
            "\nnote: the model item has no config.json, so from_pretrained cannot load it; "
            "save the model with ModelHandler(config=...) or copy its config.json in"
        )
    text += "".join(f"\nnote: {line}" for line in result.left_out)
    return EXIT_OK, doc, text


# ------------------------------------------------------------------------------------ parser


def _step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a step is a non-negative integer, got {value!r}"
        ) from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {value}")
    return step


def _positive(value: str) -> int:
    number = _step(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return number


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return seconds


_EPILOG = "exit codes:\n" + "\n".join(f"  {code:<3} {text}" for code, text in EXIT_CODES.items())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``orbit-pt`` (exposed for the docs and for tests)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead of text"
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", help="log orbit_pt's INFO messages to stderr"
    )
    common.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        default=[],
        type=_storage_option,
        metavar="KEY=VALUE",
        help="for an s3:// ROOT: an option for the object-store client (repeatable; VALUE is "
        "JSON if it parses, else a string), e.g. endpoint_url=http://127.0.0.1:9000; without "
        "any, the client's AWS_* environment variables apply",
    )
    rules = argparse.ArgumentParser(add_help=False)
    group = rules.add_argument_group("retention rules (as CheckpointManagerOptions; any-of)")
    group.add_argument("--keep-last-n", type=_positive, metavar="N", help="keep the N newest steps")
    group.add_argument(
        "--keep-every-k-steps", type=_positive, metavar="K", help="keep steps divisible by K"
    )
    group.add_argument(
        "--keep-best-n", type=_positive, metavar="N", help="keep the N best steps by --best-metric"
    )
    group.add_argument("--best-metric", metavar="M", help="the metric that ranks steps (e.g. loss)")
    group.add_argument(
        "--best-mode", choices=("min", "max"), default="min", help="min: lower is better (default)"
    )
    group.add_argument(
        "--keep-time-interval",
        type=_seconds,
        metavar="S",
        help="keep one step per S seconds of commit time",
    )

    parser = argparse.ArgumentParser(
        prog="orbit-pt",
        description="Inspect, verify, prune and export orbit_pt checkpoints.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"orbit-pt {_version.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(
        name: str, help_text: str, description: str, *parents: argparse.ArgumentParser
    ) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=_EPILOG,
            parents=[common, *parents],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    ls = command(
        "ls",
        "list steps, partial folders and what retention keeps",
        "List the steps under ROOT: commit time, size, items, metrics and which retention rule "
        "keeps each (given as flags, as for prune; without them only 'latest' is shown). "
        "Folders that are not committed steps (.orbit-tmp, .orbit-deleting, step folders "
        "without valid metadata) and superseded/ entries are listed with their status.",
        rules,
    )
    ls.add_argument(
        "root", metavar="ROOT", help="the checkpoint root folder, or an s3://BUCKET/PREFIX URL"
    )
    ls.set_defaults(run=_cmd_ls)

    info = command(
        "info",
        "show a step's items, handlers, tensors and files",
        "Show what a step holds: items and their handlers, tensor count, dtypes and the largest "
        "shapes (read from safetensors headers; no tensor data is loaded), world size, metrics "
        "and every file with its size and checksum.",
    )
    info.add_argument(
        "root", metavar="ROOT", help="the checkpoint root folder, or an s3://BUCKET/PREFIX URL"
    )
    info.add_argument("step", metavar="STEP", type=_step, nargs="?", help="default: the latest")
    info.add_argument("--tensors", action="store_true", help="list every tensor")
    info.set_defaults(run=_cmd_info)

    verify = command(
        "verify",
        "check structure and checksums; exit 1 on any problem",
        "Check that a step is whole: every file its metadata lists exists with its size and "
        "checksum, no unlisted file is present, safetensors headers, msgpack and JSON parse. "
        "Exit 1 when anything is wrong.",
    )
    verify.add_argument(
        "root", metavar="ROOT", help="the checkpoint root folder, or an s3://BUCKET/PREFIX URL"
    )
    which = verify.add_mutually_exclusive_group()
    which.add_argument("step", metavar="STEP", type=_step, nargs="?", help="default: the latest")
    which.add_argument(
        "--all", action="store_true", help="every step folder (committed or damaged)"
    )
    verify.add_argument(
        "--require-checksums",
        action="store_true",
        help="treat files without a recorded checksum (older steps) as problems",
    )
    verify.set_defaults(run=_cmd_verify)

    prune = command(
        "prune",
        "delete the steps no retention rule keeps (takes the root's lock)",
        "Apply retention now, with exactly the library's rules: keep the union of what each "
        "rule keeps, plus the latest step, always; delete the other committed steps. Takes "
        "the root's lock like a training job (exit 4 while one writes the root) and removes "
        "folders a crashed writer left behind. At least one rule is required.",
        rules,
    )
    prune.add_argument(
        "root", metavar="ROOT", help="the checkpoint root folder, or an s3://BUCKET/PREFIX URL"
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; change nothing"
    )
    prune.set_defaults(run=_cmd_prune)

    export = command(
        "export",
        "write a step's model as a standalone Hugging Face folder",
        "Write the model item of STEP (weights, index, config.json, tokenizer and other files) "
        "into the new folder OUT, which from_pretrained loads. OUT must not exist or be empty; "
        "it is written under a temporary name and renamed into place. A PEFT adapter item is "
        "exported with --merge-adapter: merged into its base model (needs peft).",
    )
    export.add_argument(
        "root", metavar="ROOT", help="the checkpoint root folder, or an s3://BUCKET/PREFIX URL"
    )
    export.add_argument("step", metavar="STEP", type=_step, help="the step to export")
    export.add_argument("out", metavar="OUT", help="the folder to create")
    export.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="cast floating tensors (default: as saved)",
    )
    export.add_argument("--item", metavar="NAME", help="the model item (default: the only one)")
    export.add_argument(
        "--no-verify", action="store_true", help="skip checking the item's checksums first"
    )
    export.add_argument(
        "--merge-adapter",
        action="store_true",
        help="the item is a PEFT adapter: merge it into its base model (PEFT's "
        "merge_and_unload) and write the merged model; needs peft and transformers",
    )
    export.add_argument(
        "--base",
        metavar="PATH",
        help="with --merge-adapter: the base model's local folder (default: the "
        "base_model_name_or_path in adapter_config.json; nothing is downloaded)",
    )
    export.add_argument(
        "--adapter",
        metavar="NAME",
        help="with --merge-adapter: the adapter to merge (default: 'default', or the only one)",
    )
    export.set_defaults(run=_cmd_export)
    return parser


# -------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``orbit-pt`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    A reader that stops reading (``orbit-pt ls --json | head -1``) is not an error: the
    output it did not want is dropped, and the status is the command's own.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argparse usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with _logging(verbose=args.verbose):
        code, doc, text = _run(args)
    try:
        if args.json:
            print(json.dumps(doc, indent=2, sort_keys=True))
        elif text:
            print(text)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could no longer be caught
    except BrokenPipeError:
        _drop_stdout()
    return code


def _drop_stdout() -> None:
    """Point stdout at /dev/null after its reader went away, so that the interpreter's final
    flush does not fail again (the recipe of Python's ``signal`` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _run(args: argparse.Namespace) -> tuple[int, Any, str]:
    try:
        result: tuple[int, Any, str] = args.run(args)
        return result
    except _UsageError as exc:
        return _error(args, EXIT_USAGE, "usage", str(exc))
    except _NotFoundError as exc:
        return _error(args, EXIT_NOT_FOUND, "not_found", str(exc))
    except CheckpointLockedError:
        return _error(
            args,
            EXIT_LOCKED,
            "locked",
            f"{args.root} is locked: another process holds {Path(args.root) / _layout.LOCK_FILE}"
            " (a training job writing this root, or another prune); nothing was changed. Run "
            "prune when it has stopped, or use --dry-run to see what it would delete",
        )
    except (StepNotFoundError, ItemNotFoundError) as exc:
        return _error(args, EXIT_NOT_FOUND, "not_found", str(exc))
    except CorruptCheckpointError as exc:
        return _error(args, EXIT_PROBLEMS, "corrupt", str(exc))
    except StepAlreadyExistsError as exc:
        return _error(args, EXIT_USAGE, "usage", str(exc))
    except (ValueError, TypeError) as exc:
        if isinstance(exc, CheckpointError):  # invalid option values: a usage error
            return _error(args, EXIT_USAGE, "usage", str(exc))
        return _internal(args, exc)
    except (CheckpointError, OSError) as exc:
        return _error(args, EXIT_ERROR, "error", f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return _error(args, 130, "interrupted", "interrupted")
    except Exception as exc:
        return _internal(args, exc)


def _error(args: argparse.Namespace, code: int, kind: str, message: str) -> tuple[int, Any, str]:
    with contextlib.suppress(BrokenPipeError):  # stderr's reader went away: the code still counts
        print(f"orbit-pt {args.command}: error: {message}", file=sys.stderr)
    return code, {"error": {"exit_code": code, "kind": kind, "message": message}}, ""


def _internal(args: argparse.Namespace, exc: BaseException) -> tuple[int, Any, str]:
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    message = f"internal error ({type(exc).__name__}: {exc}); please report it with the traceback"
    return _error(args, EXIT_INTERNAL, "internal", message)


@contextlib.contextmanager
def _logging(*, verbose: bool) -> Iterator[None]:
    """orbit_pt's warnings (INFO with --verbose) on stderr, for the duration of one command."""
    package = logging.getLogger("orbit_pt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("orbit-pt: %(levelname)s: %(message)s"))
    handler.setLevel(logging.INFO if verbose else logging.WARNING)
    previous = package.level
    if verbose:
        package.setLevel(logging.INFO)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)


# ----------------------------------------------------------------------------------- helpers


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _utc(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        total += sum(_file_size(Path(dirpath) / name) for name in filenames)
    return total
