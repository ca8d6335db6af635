"""Issue 35: what operators run into -- requeues, outages, leftovers in shared roots, ambiguous
metadata. Each test failed before its fix (the lease cases are in test_object_root.py)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions, CorruptCheckpointError
from orbit_pt.errors import CheckpointError, StepNotFoundError

# ------------------------------------------------------------ a relay that goes down and back up


class _Relay(socketserver.ThreadingTCPServer):
    """A TCP relay to the loopback S3 server that can stop listening for a while (an endpoint
    restarting: new connections are refused) and come back on the same port."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self.live: list[socket.socket] = []
        super().__init__(("127.0.0.1", port), _Pump)


class _Pump(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        relay: _Relay = self.server  # type: ignore[assignment]
        out = socket.create_connection(relay.upstream)
        relay.live += [self.request, out]
        pair = {self.request: out, out: self.request}
        try:
            while True:
                ready, _, _ = select.select(list(pair), [], [], 30)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    pair[sock].sendall(data)
        except OSError:
            return
        finally:
            out.close()


def _serve(relay: _Relay) -> None:
    threading.Thread(target=relay.serve_forever, daemon=True).start()


def _stop(relay: _Relay) -> None:
    relay.shutdown()
    relay.server_close()
    for sock in relay.live:  # pooled connections die with the endpoint
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def test_a_refused_connection_is_retried(moto_s3: Any, s3_root: Any, tmp_path: Path) -> None:
    """Item 3: an endpoint that refuses connections for a moment (botocore's
    EndpointConnectionError, which is not the builtin ConnectionError) failed the list at once;
    it is retried like a reset."""
    host, port = moto_s3.endpoint_url.removeprefix("http://").split(":")
    relay = _Relay((host, int(port)))
    _serve(relay)
    relay_port = relay.server_address[1]
    options = {
        **s3_root.storage_options,
        "endpoint_url": f"http://127.0.0.1:{relay_port}",
        "retry": {"max_attempts": 12, "initial_backoff": 0.1, "max_backoff": 0.5},
    }
    with CheckpointManager(
        s3_root.url, storage_options={**options, "cache_dir": str(tmp_path / "w")}
    ) as mgr:
        mgr.save(1, {"w": torch.arange(5.0)})
    _stop(relay)  # the endpoint is down: connections are refused

    def come_back() -> None:
        time.sleep(0.6)
        back = _Relay((host, int(port)), relay_port)
        _serve(back)
        holder.append(back)

    holder: list[_Relay] = []
    threading.Thread(target=come_back, daemon=True).start()
    try:
        reader_options = {**options, "cache_dir": str(tmp_path / "r")}
        with CheckpointManager(
            s3_root.url,
            options=CheckpointManagerOptions(read_only=True),
            storage_options=reader_options,
        ) as reader:
            assert reader.all_steps() == [1]
            assert torch.equal(reader.restore(1, ["w"])["w"], torch.arange(5.0))
    finally:
        for back in holder:
            _stop(back)


# ---------------------------------------------------------------- an endpoint refusing the keys

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>'
    b"The AWS Access Key Id you provided does not exist in our records.</Message></Error>"
)


class _Denying(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _deny(self) -> None:
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(_DENIED)))
        self.end_headers()
        self.wfile.write(_DENIED)

    do_GET = do_PUT = do_POST = do_DELETE = _deny  # noqa: N815 - http.server's names

    def do_HEAD(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def denying_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Denying)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("read_only", [False, True])
def test_bad_credentials_fail_the_open_fast(
    denying_endpoint: str, tmp_path: Path, read_only: bool
) -> None:
    """Item 1: a writer whose keys the endpoint refuses (403 InvalidAccessKeyId on every
    request) must fail its open with a message about credentials, not hang in the lease's put.
    (The reported hang did not reproduce here; this pins the behaviour, under a deadline.)"""
    options = {
        "endpoint_url": denying_endpoint,
        "key": "bad",
        "secret": "bad",
        "client_kwargs": {"region_name": "us-east-1"},
        "cache_dir": str(tmp_path / "mirror"),
    }
    outcome: dict[str, Any] = {}

    def open_it() -> None:
        try:
            CheckpointManager(
                "s3://bucket/run",
                options=CheckpointManagerOptions(read_only=read_only),
                storage_options=options,
            ).close()
            outcome["error"] = None
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=open_it, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the open hung on an endpoint that refuses the keys"
    assert time.monotonic() - started < 30
    error = outcome["error"]
    assert isinstance(error, CheckpointError), error
    assert "InvalidAccessKeyId" in str(error)
    assert "credentials" in str(error)


# ------------------------------------------------------------------- leftovers in a shared root


def test_a_leftover_tmp_that_is_a_link_is_removed_not_followed(tmp_path: Path) -> None:
    """Item 8: a ``step_N.orbit-tmp`` left as a symbolic link made ``save(N)`` fail until a
    person removed it; the link is removed (never what it points to) and the save goes on."""
    root = tmp_path / "root"
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("not orbit_pt's")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    (root / "step_00000002.orbit-tmp").symlink_to(precious, target_is_directory=True)
    (root / "step_00000003.orbit-tmp").symlink_to(tmp_path / "nowhere")  # dangling
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"w": torch.ones(2)})
        mgr.save(3, {"w": torch.ones(3)})
        assert mgr.all_steps() == [1, 2, 3]
        assert torch.equal(mgr.restore(2, ["w"])["w"], torch.ones(2))
    assert (precious / "keep.txt").read_text() == "not orbit_pt's"
    assert not (root / "step_00000002.orbit-tmp").is_symlink()


# -------------------------------------------------------------------- ambiguous metadata


def _forge_duplicate(path: Path) -> None:
    """Repeat the top-level step field. With the same value, a reader that keeps the first key
    and one that keeps the last parse the same document, so the self-checksum still holds: a
    reader that does not look for duplicates accepts the step."""
    text = path.read_text()
    forged = text.replace('\n "step": 1,', '\n "step": 1,\n "step": 1,', 1)
    assert forged != text
    path.write_text(forged)


def test_duplicate_keys_in_the_metadata_are_refused(tmp_path: Path) -> None:
    """Item 9: two JSON readers can disagree about a document with a key twice (first or last
    wins); orbit_pt refuses such a step instead of picking one."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    metadata = root / "step_00000001" / "_CHECKPOINT_METADATA"
    _forge_duplicate(metadata)
    from orbit_pt.metadata import StepMetadata

    with pytest.raises(CorruptCheckpointError, match="'step' more than once"):
        StepMetadata.read(metadata)
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as reader:
        assert reader.all_steps() == []  # not a step anyone may load
    assert metadata.exists()  # and nothing was deleted


# ---------------------------------------------------------------- item 7: code in a model folder

EVIL = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


def _plant_code(step_dir: Path) -> None:
    """What someone who can write a shared root does: a modeling file, an ``auto_map`` naming
    it, and both listed in the metadata with a recomputed self-checksum, so that every size and
    checksum agrees (a consistent forgery, by docs/format.md)."""
    import json

    import xxhash

    def digest(data: bytes) -> str:
        return "xxh3-64:" + xxhash.xxh3_64(data).hexdigest()

    config_path = step_dir / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    planted = {
        "model/modeling_evil.py": EVIL.encode(),
        "model/config.json": json.dumps(config, indent=2).encode(),
    }
    meta_path = step_dir / "_CHECKPOINT_METADATA"
    doc = json.loads(meta_path.read_bytes())
    doc.pop("checksum")
    for rel, data in planted.items():
        (step_dir / rel).write_bytes(data)
        doc["files"][rel] = {"size": len(data), "checksum": digest(data)}
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True)
    doc["checksum"] = digest(canonical.encode())
    meta_path.write_text(json.dumps(doc, indent=1, sort_keys=True))


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def test_code_planted_in_a_model_folder_is_refused_and_never_exported(tmp_path: Path) -> None:
    """Item 7: verify reports the planted modeling file (kind ``code``) even though the forged
    metadata lists it; export refuses by default and, unverified, leaves the code and
    ``auto_map`` out, so ``from_pretrained(trust_remote_code=True)`` of the export runs
    nothing and loads the real weights."""
    from transformers import AutoModelForCausalLM

    from orbit_pt.cli import main as cli_main
    from orbit_pt.export import export_model
    from orbit_pt.handlers import ModelHandler
    from orbit_pt.verify import verify_step

    root = tmp_path / "root"
    model = _tiny_llama()
    with CheckpointManager(root, handlers={"model": ModelHandler()}) as mgr:
        mgr.save(1, {"model": model})
    step_dir = root / "step_00000001"
    assert verify_step(root, 1).ok
    _plant_code(step_dir)

    report = verify_step(root, 1)
    assert [(p.path, p.kind) for p in report.problems] == [("model/modeling_evil.py", "code")]
    assert "trust_remote_code" in report.problems[0].detail
    assert cli_main(["verify", str(root), "1"]) != 0

    with pytest.raises(CorruptCheckpointError, match=r"modeling_evil\.py: is code"):
        export_model(root, 1, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    result = export_model(root, 1, tmp_path / "out", verify=False)
    assert "modeling_evil.py" not in result.files
    assert not (tmp_path / "out" / "modeling_evil.py").exists()
    assert any("auto_map" in line for line in result.left_out)
    assert any("modeling_evil.py" in line for line in result.left_out)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not list(tmp_path.rglob("RAN"))  # the planted code never ran


def test_a_model_handler_refuses_code_as_an_extra_file() -> None:
    """The writer side of item 7: steps hold no code, so nothing orbit_pt writes is flagged."""
    from orbit_pt.errors import CheckpointValueError
    from orbit_pt.handlers import ModelHandler

    for name in ("modeling_mine.py", "kernel.so", "helper.pyc"):
        with pytest.raises(CheckpointValueError, match="is code"):
            ModelHandler(extra_files={name: "x = 1\n"})
    ModelHandler(extra_files={"tokenizer.json": "{}"})  # plain files are fine


# ------------------------------------------------------- item 5: a step vanishes under a reader


def test_a_step_renamed_away_while_a_reader_reads_it_is_simply_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5, at the exact instant: the reader has listed the root, and before it reads step
    2's metadata the writer's retention renames the step away (the real rename it makes).
    The reader used to raise "reading step_00000002 failed ... cannot be listed without it"."""
    from orbit_pt._format import safe_open

    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((3,), float(step))})
    real_read = safe_open.read_bytes
    renamed: list[Path] = []

    def retention_strikes(path: Path, **kwargs: Any) -> bytes:
        if path.parent.name == "step_00000002" and not renamed:
            gone = path.parent.with_name("step_00000002.orbit-deleting")
            path.parent.rename(gone)
            renamed.append(gone)
        return real_read(path, **kwargs)

    monkeypatch.setattr(safe_open, "read_bytes", retention_strikes)  # the module root.py reads with
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as reader:
        assert renamed  # the race happened, in the scan that opened the reader
        assert reader.all_steps() == [1, 3]
        assert reader.latest_step() == 3
        out = {"w": torch.zeros(3)}
        reader.restore(3, out)
        assert torch.equal(out["w"], torch.full((3,), 3.0))


def test_a_reader_polling_beside_a_writer_with_retention_never_fails(tmp_path: Path) -> None:
    """Item 5 as it was seen: a dashboard polls a live root while the writer keeps the last
    two steps. Every answer is a set of committed steps; nothing raises."""
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"w": torch.zeros(1024)})
    errors: list[BaseException] = []
    seen: set[int] = set()
    done = threading.Event()

    def poll() -> None:
        with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as r:
            while not done.is_set():
                try:
                    steps = r.all_steps()
                    seen.update(steps)
                    if steps:
                        with contextlib.suppress(StepNotFoundError):  # retired since
                            r.metadata(steps[-1])
                except BaseException as exc:  # the assertion reports it
                    errors.append(exc)
                    return

    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    options = CheckpointManagerOptions(keep_last_n=2, preemption_signals=())
    with CheckpointManager(root, options=options) as mgr:
        for step in range(1, 61):
            mgr.save(step, {"w": torch.full((1024,), float(step))})
    done.set()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the reader hung"
    assert errors == []
    assert len(seen) > 2  # it really read while steps came and went


def test_an_object_store_step_deleted_between_list_and_read_is_gone(
    moto_s3: Any, s3_root: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5 on S3: the marker is listed, then the writer's retention deletes the step's
    objects (for real, on the loopback server) before the reader gets the marker."""
    from orbit_pt._storage.remote import RemoteRoot

    options = {**s3_root.storage_options, "cache_dir": str(tmp_path / "w")}
    with CheckpointManager(s3_root.url, storage_options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((3,), float(step))})
        writer_remote = mgr._store.remote
        assert writer_remote is not None
    deleted: list[int] = []
    real_committed = RemoteRoot.committed

    def retention_strikes(self: Any, known: Any = None) -> Any:
        real_get = self.store.get

        def get(key: str) -> bytes:
            if "step_00000002/" in key and not deleted:
                self.remove_step_objects(2)
                deleted.append(2)
            data: bytes = real_get(key)
            return data

        monkeypatch.setattr(self.store, "get", get)
        try:
            return real_committed(self, known)
        finally:
            monkeypatch.setattr(self.store, "get", real_get)

    monkeypatch.setattr(RemoteRoot, "committed", retention_strikes)
    reader_options = {**s3_root.storage_options, "cache_dir": str(tmp_path / "r")}
    with CheckpointManager(
        s3_root.url,
        options=CheckpointManagerOptions(read_only=True),
        storage_options=reader_options,
    ) as reader:
        assert deleted == [2]
        assert reader.all_steps() == [1, 3]


# ------------------------------------------- item 6: the scheduler's SIGTERM and the agent's copy

TORCHRUN_WORKER = Path(__file__).with_name("_torchrun_preempt_worker.py")


def _torchrun(root: Path, out: Path, step_seconds: float) -> subprocess.Popen[str]:
    from _examples import example_env

    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(TORCHRUN_WORKER), str(root), str(out), str(step_seconds)]
    return subprocess.Popen(
        command,
        env=example_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except FileNotFoundError:
        return None


@pytest.mark.distributed
def test_sigterm_to_the_workers_and_to_torchrun_is_one_preemption(tmp_path: Path) -> None:
    """Item 6, as SLURM and Kubernetes do it: SIGTERM reaches each worker directly, and then
    again through torchrun's agent, which forwards it. The second used to restore the default
    action and kill the workers before their preemption save (exit -15, nothing saved). Now:
    one agreed save of the same step on both ranks, each exits 143, and a new job resumes."""
    root, out = tmp_path / "root", tmp_path / "out"
    job = _torchrun(root, out, step_seconds=0.5)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            steps = [_read(out / f"step{rank}") for rank in range(2)]
            if all(s is not None and int(s) >= 2 for s in steps):
                break
            assert job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.05)
        else:
            pytest.fail("the workers did not reach step 2")
        workers = [int(_read(out / f"pid{rank}") or 0) for rank in range(2)]
        for pid in workers:
            os.kill(pid, signal.SIGTERM)  # the scheduler's notice, to each process
        time.sleep(0.15)  # handled; the workers sleep in their step
        os.kill(job.pid, signal.SIGTERM)  # and to torchrun, which forwards it to the workers
        log = job.communicate(timeout=120)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
    assert "closing signal SIGTERM" in log, log[-3000:]  # torchrun forwarded it
    assert [_read(out / f"exit{rank}") for rank in range(2)] == ["143", "143"], log[-3000:]
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as reader:
        saved = reader.all_steps()
    assert len(saved) == 2, saved  # step 0 (the interval) and the preemption step
    assert saved[0] == 0, saved
    preempted = saved[-1]
    assert preempted >= 2

    second = _torchrun(root, tmp_path / "out2", step_seconds=0.0)
    try:
        deadline = time.monotonic() + 120
        while (
            _read(tmp_path / "out2" / "step0") is None or _read(tmp_path / "out2" / "step1") is None
        ):
            assert time.monotonic() < deadline
            assert second.poll() is None
            time.sleep(0.05)
    finally:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(timeout=30)
    assert [_read(tmp_path / "out2" / f"resumed{rank}") for rank in range(2)] == [
        str(preempted),
        str(preempted),
    ]


# ------------------------------------------------- item 10: a reader reads each metadata once


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_read_only_manager_reads_a_steps_metadata_once(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 10: every question a reader asks rescans the root (another process writes it), but
    a step whose metadata is unchanged (same inode, size and mtime; on S3 the same size and
    ETag) is not read or parsed again: with large metadata each re-read cost seconds. A step
    committed since is read once; a step retired since is gone."""
    from orbit_pt.metadata import StepMetadata

    if where == "s3":
        s3_root = request.getfixturevalue("s3_root")
        url: str | Path = s3_root.url
        opts: dict[str, Any] | None = {
            **s3_root.storage_options,
            "cache_dir": str(tmp_path / "c"),
        }
    else:
        url, opts = tmp_path / "root", None
    writer_options = CheckpointManagerOptions(keep_last_n=2, preemption_signals=())
    with CheckpointManager(url, options=writer_options, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    parsed: list[int] = []
    real_from_json = StepMetadata.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: type[StepMetadata], /, data: bytes, **kwargs: Any) -> StepMetadata:
        meta: StepMetadata = real_from_json(cls, data, **kwargs)
        parsed.append(meta.step)
        return meta

    monkeypatch.setattr(StepMetadata, "from_json", classmethod(counting))
    reader_opts = None if opts is None else {**opts, "cache_dir": str(tmp_path / "r")}
    with CheckpointManager(
        url, options=CheckpointManagerOptions(read_only=True), storage_options=reader_opts
    ) as reader:
        assert sorted(parsed) == [1, 2]
        for _ in range(5):
            assert reader.all_steps() == [1, 2]
            assert reader.latest_step() == 2
            assert reader.metadata(2).step == 2
        out = {"w": torch.zeros(4)}
        reader.restore(2, out)
        assert torch.equal(out["w"], torch.full((4,), 2.0))
        assert sorted(parsed) == [1, 2]  # fifteen questions and a restore: nothing re-read
        with CheckpointManager(url, options=writer_options, storage_options=opts) as mgr:
            mgr.save(3, {"w": torch.full((4,), 3.0)})  # and step 1 retired
        parsed.clear()
        assert reader.all_steps() == [2, 3]
        assert reader.all_steps() == [2, 3]
        assert parsed == [3]  # the new step only, once
