"""The ``orbit-pt`` command: every command, its exit codes and its --json output.

Commands run in-process through ``main(argv)``; one test runs the installed script for real.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions
from orbit_pt.cli import EXIT_CODES, main
from orbit_pt.metadata import _self_checksum

STEPS = [0, 10, 20, 30, 40]
LOSSES = {0: 5.0, 10: 1.0, 20: 3.0, 30: 2.0, 40: 4.0}


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        self.now += 60.0
        return self.now


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Five committed steps (one a minute, with a loss), a crash leftover and a broken step."""
    path = tmp_path / "ckpt"
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    items = {"model": model, "optimizer": optimizer, "extra": {"epoch": 1, "t": torch.ones(3)}}
    with CheckpointManager(path, clock=_Clock()) as mgr:
        for step in STEPS:
            mgr.save(step, items, metrics={"loss": LOSSES[step]}, force=True)
    (path / "step_00000050.orbit-tmp" / "model").mkdir(parents=True)
    (path / "step_00000050.orbit-tmp" / "model" / "model.safetensors").write_bytes(b"x" * 10)
    (path / "step_00000060").mkdir()
    return path


def run(*argv: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(*argv: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code, out, _ = run(*argv, "--json", capsys=capsys)
    return code, json.loads(out)


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    if offset is None:  # the middle of the tensor data, past the header
        (header_len,) = struct.unpack("<Q", data[:8])
        offset = 8 + header_len + (len(data) - 8 - header_len) // 2
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.fixture
def cwd_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run from an empty folder, and fail if anything was written into it."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield
    assert list(work.iterdir()) == []


# ------------------------------------------------------------------------------ help, usage


@pytest.mark.parametrize("command", [[], ["ls"], ["info"], ["verify"], ["prune"], ["export"]])
def test_help_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(*command, "--help", capsys=capsys)
    assert code == 0
    assert "usage: orbit-pt" in out
    assert "exit codes" in out


def test_usage_errors_exit_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys=capsys)[0] == 2  # no command
    assert run("frobnicate", capsys=capsys)[0] == 2
    assert run("info", root, "minus-one", capsys=capsys)[0] == 2
    assert run("verify", root, "10", "--all", capsys=capsys)[0] == 2
    assert run("ls", root, "--keep-last-n", "0", capsys=capsys)[0] == 2
    code, doc = run_json("ls", root, "--keep-best-n", "2", capsys=capsys)  # no --best-metric
    assert code == 2
    assert doc["error"]["kind"] == "usage"
    assert "best_metric" in doc["error"]["message"]


def test_exit_codes_are_documented() -> None:
    assert sorted(EXIT_CODES) == [0, 1, 2, 3, 4, 5, 70]
    docs = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in docs


def test_a_missing_root_or_step_exits_3(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["ls"], ["info"], ["verify"], ["prune", "--keep-last-n", "1"]):
        code, doc = run_json(command[0], tmp_path / "nope", *command[1:], capsys=capsys)
        assert code == 3, command
        assert doc["error"]["kind"] == "not_found"
    assert not (tmp_path / "nope").exists()  # prune did not create it
    code, _, err = run("info", root, "15", capsys=capsys)
    assert code == 3
    assert "committed steps: 0, 10, 20, 30, 40" in err
    assert run("verify", root, "15", capsys=capsys)[0] == 3
    assert run("export", root, "15", tmp_path / "out", capsys=capsys)[0] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("info", empty, capsys=capsys)[0] == 3


# --------------------------------------------------------------------------------------- ls


def test_ls_lists_steps_partial_folders_and_superseded(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointManager(root, clock=_Clock()) as mgr:  # a rollback: 40 moves to superseded/
        mgr.save(40, {"x": {"a": 1}}, force=True)
    # The writing manager removed the .orbit-tmp leftover; make another.
    (root / "step_00000070.orbit-tmp").mkdir()
    (root / "step_00000080.orbit-deleting").mkdir()
    code, doc = run_json("ls", root, capsys=capsys)
    assert code == 0
    by_name = {e["name"]: e for e in doc["entries"]}
    assert [e["step"] for e in doc["entries"] if e["status"] == "committed"] == STEPS
    assert by_name["step_00000070.orbit-tmp"]["status"] == "partial"
    assert by_name["step_00000080.orbit-deleting"]["status"] == "deleting"
    assert by_name["step_00000060"]["status"] == "invalid"
    assert "never committed" in by_name["step_00000060"]["note"]
    superseded = [e for e in doc["entries"] if e["status"] == "superseded"]
    assert [e["step"] for e in superseded] == [40]
    assert superseded[0]["name"].startswith("superseded/step_00000040.")
    assert doc["latest"] == 40
    latest = by_name["step_00000040"]
    assert latest["items"] == ["x"]
    assert latest["kept_by"] == ["latest"]
    assert by_name["step_00000010"]["kept_by"] == []
    assert by_name["step_00000010"]["metrics"] == {"loss": 1.0}
    assert by_name["step_00000010"]["time_utc"] == "2023-11-14 22:15:20"
    assert by_name["step_00000010"]["size_bytes"] > 0
    code, out, _ = run("ls", root, capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "STEP",
        "STATUS",
        "COMMITTED",
        "(UTC)",
        "SIZE",
        "ITEMS",
        "METRICS",
        "KEPT",
        "BY",
    ]
    assert any(line.split()[:2] == ["70", "partial"] for line in lines)
    assert any(line.split()[:2] == ["60", "invalid"] for line in lines)
    assert any(line.split()[:2] == ["40", "superseded"] for line in lines)


def test_ls_shows_which_rule_keeps_each_step(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json(
        "ls", root, "--keep-last-n", "2", "--keep-every-k-steps", "20",
        "--keep-best-n", "1", "--best-metric", "loss", capsys=capsys,
    )  # fmt: skip
    assert code == 0
    kept = {e["step"]: e["kept_by"] for e in doc["entries"] if e["status"] == "committed"}
    assert kept == {
        0: ["keep-every-k-steps=20"],
        10: ["keep-best-n=1(loss,min)"],
        20: ["keep-every-k-steps=20"],
        30: ["keep-last-n=2"],
        40: ["keep-last-n=2", "keep-every-k-steps=20", "latest"],
    }
    assert doc["rules"] == ["keep-last-n=2", "keep-every-k-steps=20", "keep-best-n=1(loss,min)"]
    code, doc = run_json("ls", root, "--keep-last-n", "1", capsys=capsys)
    pruned = [e["step"] for e in doc["entries"] if e["pruned"]]
    assert pruned == [0, 10, 20, 30]
    assert "prune deletes" in run("ls", root, "--keep-last-n", "1", capsys=capsys)[1]


# ------------------------------------------------------------------------------------- info


def test_info_reads_headers_only(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No tensor data may be read: make reading any tensor fail.
    from orbit_pt._format import safetensors as _safetensors

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("info read tensor data")

    monkeypatch.setattr(_safetensors, "_read_into", no_data)
    code, doc = run_json("info", root, "--tensors", capsys=capsys)
    assert code == 0
    assert doc["step"] == 40
    assert doc["world_size"] == 1
    assert doc["metrics"] == {"loss": 4.0}
    model = doc["items"]["model"]
    assert model["handler"] == "model"
    assert model["tensor_count"] == 4
    assert model["tensor_elements"] == 8 * 8 + 8 + 8 * 2 + 2
    assert model["dtypes"] == {"float32": 4}
    assert model["largest"][0] == {
        "name": "0.weight", "file": "model/model.safetensors", "dtype": "float32",
        "shape": [8, 8], "bytes": 256,
    }  # fmt: skip
    assert {t["name"] for t in model["tensors"]} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert doc["items"]["optimizer"]["handler"] == "optimizer"
    assert doc["items"]["extra"]["handler"] == "state"
    assert all(f["checksum"].startswith("xxh3-64:") for f in doc["files"].values())
    assert "model/model.safetensors" in doc["files"]
    code, out, _ = run("info", root, "10", capsys=capsys)
    assert code == 0
    assert out.startswith("step 10")
    assert "model: handler model, 4 tensors" in out
    assert "loss=1" in out


def test_info_on_a_damaged_step_exits_1(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run("info", root, "60", capsys=capsys)
    assert code == 1
    assert "not a committed step" in err


# ----------------------------------------------------------------------------------- verify


def test_verify_a_whole_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(root / "step_00000060")
    code, doc = run_json("verify", root, "--all", capsys=capsys)
    assert code == 0
    assert doc["ok"] is True
    assert [s["step"] for s in doc["steps"]] == STEPS
    assert all(s["checksummed"] == s["files"] > 0 for s in doc["steps"])
    code, out, _ = run("verify", root, capsys=capsys)  # the latest
    assert code == 0
    assert out.startswith("step 40: OK")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra"])
def test_verify_finds_a_damaged_step(
    root: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = root / "step_00000020"
    target = folder / "model" / "model.safetensors"
    if damage == "flip":
        _flip(target)
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif damage == "delete":
        target.unlink()
    else:
        (folder / "optimizer" / "leftover.tmp").write_bytes(b"")
    expected = {
        "flip": ("model/model.safetensors", "checksum"),
        "truncate": ("model/model.safetensors", "size"),
        "delete": ("model/model.safetensors", "missing"),
        "extra": ("optimizer/leftover.tmp", "unlisted"),
    }[damage]
    code, doc = run_json("verify", root, "20", capsys=capsys)
    assert code == 1
    assert doc["ok"] is False
    assert [(p["path"], p["kind"]) for p in doc["steps"][0]["problems"]] == [expected]
    code, out, _ = run("verify", root, "20", capsys=capsys)
    assert code == 1
    assert expected[0] in out
    assert run("verify", root, "10", capsys=capsys)[0] == 0  # other steps are fine
    code, doc = run_json("verify", root, "--all", capsys=capsys)
    assert code == 1
    bad = {s["step"] for s in doc["steps"] if not s["ok"]}
    assert bad == {20, 60}  # 60: a step folder that was never committed


def test_verify_require_checksums(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta_path = root / "step_00000040" / "_CHECKPOINT_METADATA"
    doc = json.loads(meta_path.read_bytes())
    doc["files"]["extra/state.msgpack"]["checksum"] = None
    del doc["checksum"]
    doc["checksum"] = _self_checksum(doc)  # re-signed, as a writer without checksums would
    meta_path.write_text(json.dumps(doc))
    code, out, _ = run("verify", root, "40", capsys=capsys)
    assert code == 0
    assert "no checksum" in out
    assert run("verify", root, "40", "--require-checksums", capsys=capsys)[0] == 1


# ------------------------------------------------------------------------------------ prune


def _committed(root: Path) -> list[int]:
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        return mgr.all_steps()


def test_prune_refuses_without_a_rule(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run("prune", root, capsys=capsys)
    assert code == 2
    assert "at least one retention rule" in err
    assert _committed(root) == STEPS


def test_prune_dry_run_changes_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json("prune", root, "--keep-last-n", "2", "--dry-run", capsys=capsys)
    assert code == 0
    assert doc["would_delete"] == [0, 10, 20]
    assert doc["deleted"] == []
    assert _committed(root) == STEPS
    assert (root / "step_00000050.orbit-tmp").exists()


@pytest.mark.parametrize(
    ("flags", "kept"),
    [
        (["--keep-last-n", "2"], [30, 40]),
        (["--keep-last-n", "1", "--keep-every-k-steps", "20"], [0, 20, 40]),
        (["--keep-best-n", "2", "--best-metric", "loss"], [10, 30, 40]),
        (["--keep-best-n", "1", "--best-metric", "loss", "--best-mode", "max"], [0, 40]),
        # one step a minute: one per 150 s keeps 0, then the first >= 150 s later (30)
        (["--keep-time-interval", "150"], [0, 30, 40]),
    ],
)
def test_prune_applies_the_library_rules(
    root: Path, flags: list[str], kept: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json("prune", root, *flags, capsys=capsys)
    assert code == 0
    assert sorted(int(s) for s in doc["kept"]) == kept
    assert doc["deleted"] == [s for s in STEPS if s not in kept]
    assert _committed(root) == kept
    assert "latest" in doc["kept"]["40"]
    # Like a training job opening the root, prune cleaned up the crash leftover; it left the
    # step folder without metadata alone (it is not a step of this manager).
    assert not (root / "step_00000050.orbit-tmp").exists()
    assert (root / "step_00000060").is_dir()


def test_prune_while_a_writer_holds_the_lock_exits_4(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointManager(root):
        code, doc = run_json("prune", root, "--keep-last-n", "1", capsys=capsys)
        assert code == 4
        assert doc["error"]["kind"] == "locked"
        assert ".orbit.lock" in doc["error"]["message"]
        assert _committed(root) == STEPS
        # A dry run takes no lock, so it works beside a training job.
        assert run("prune", root, "--keep-last-n", "1", "--dry-run", capsys=capsys)[0] == 0
    assert _committed(root) == STEPS
    assert run("prune", root, "--keep-last-n", "1", capsys=capsys)[0] == 0
    assert _committed(root) == [40]


# ----------------------------------------------------------------------------------- export


def test_export_weights_load_with_safetensors(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    code, doc = run_json("export", root, "30", out, capsys=capsys)
    assert code == 0
    assert doc["files"] == ["model.safetensors"]
    loaded = safetensors.torch.load_file(out / "model.safetensors")
    expected = _model()  # the fixture's weights, before the optimizer step
    saved = safetensors.torch.load_file(root / "step_00000030" / "model" / "model.safetensors")
    assert loaded.keys() == saved.keys() == expected.state_dict().keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    bf16 = tmp_path / "bf16"
    code, doc = run_json("export", root, "30", bf16, "--dtype", "bf16", capsys=capsys)
    assert code == 0
    assert doc["dtype"] == "bfloat16"
    cast = safetensors.torch.load_file(bf16 / "model.safetensors")
    assert all(cast[k].dtype == torch.bfloat16 for k in cast)
    assert all(torch.equal(cast[k], saved[k].to(torch.bfloat16)) for k in saved)
    # No temporary folder is left beside the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "ckpt", "export"]


def test_export_refuses_a_non_empty_out_and_a_damaged_step(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run("export", root, "40", out, capsys=capsys)
    assert code == 2
    assert "not empty" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("export", root, "40", empty, capsys=capsys)[0] == 0  # an empty folder is fine
    _flip(root / "step_00000020" / "model" / "model.safetensors")
    code, _, err = run("export", root, "20", tmp_path / "bad", capsys=capsys)
    assert code == 1
    assert "checksum" in err
    assert not (tmp_path / "bad").exists()
    # --no-verify exports what is there (the caller asked for it).
    assert run("export", root, "20", tmp_path / "bad", "--no-verify", capsys=capsys)[0] == 0
    code, _, err = run("export", root, "40", tmp_path / "x", "--item", "extra", capsys=capsys)
    assert code == 3
    assert "not as a model" in err


def test_export_loads_in_from_pretrained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from orbit_pt.handlers import ModelHandler

    handlers = {"model": ModelHandler(max_shard_size=40_000, extra_files={"tokenizer.json": b"{}"})}
    with CheckpointManager(tmp_path / "ckpt", handlers=handlers) as mgr:
        mgr.save(3, {"model": model, "optimizer": optimizer}, force=True)
    out = tmp_path / "hf"
    code, doc = run_json("export", tmp_path / "ckpt", "3", out, "--dtype", "bf16", capsys=capsys)
    assert code == 0
    assert "model.safetensors.index.json" in doc["files"]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(doc["files"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == doc["tensor_bytes"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert all(torch.equal(expected[k], v) for k, v in loaded.state_dict().items())


# ----------------------------------------------------------------------------- the real script


def test_the_installed_script(root: Path, cwd_guard: None) -> None:
    script = Path(sys.executable).with_name("orbit-pt")
    if not script.exists():
        pytest.skip(f"orbit-pt is not installed next to {sys.executable}; pip install -e .")
    result = subprocess.run(
        [str(script), "verify", str(root), "40", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"][0]["ok"] is True
    module = subprocess.run(
        [sys.executable, "-m", "orbit_pt", "ls", str(root / "missing")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert module.returncode == 3
    assert "does not exist" in module.stderr
