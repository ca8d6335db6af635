"""Save and restore throughput to an S3 server: orbit_pt against boto3's managed transfer.

One moto S3 server runs in its own process on 127.0.0.1 (nothing leaves the machine). In each
round:

- ``orbit_pt save``: ``CheckpointManager("s3://...").save(step, {"model": m})`` -- the step is
  written into the local mirror (fsynced, checksummed) while its large files are uploaded,
  then the uploads are completed and the marker put;
- ``boto3 upload``: ``upload_file`` of the files such a save wrote, with a multithreaded
  ``TransferConfig`` (the same bytes, already on disk: boto3 does less than the save);
- ``write + boto3 upload``: what a training script without orbit_pt does to put the same
  weights in S3 -- ``safetensors.torch.save_file`` + fsync, then ``upload_file``;
- ``orbit_pt restore``: a manager with an empty mirror (another machine) restores the step
  into a fresh model (download + read);
- ``boto3 download``: ``download_file`` of the same objects into an empty folder.

The save and the upload alternate which goes first (and so do the restore and the download),
and every object is deleted after each round: moto keeps objects in memory and slows as it fills.
moto is a Python server and CPU-bound, so loopback numbers measure both clients' overhead plus
the server's, on the same terms; a real S3 endpoint is much faster for both. Medians of the
rounds are printed as a table with the ratios, with the CPU time the server and the client
spent on each (the server's from ``/proc/<pid>/stat``): moto serves requests under one GIL, so
its cores-in-use figure shows when it, and not the client, sets the pace.

With ``--fsdp-ranks N`` it instead saves an FSDP2 model from N gloo ranks and reports each
rank's peak memory growth during the save (``VmHWM``, reset through ``/proc/self/clear_refs``)
against its shard size. ``--scattered`` gives each rank a mirror of its own, as on separate
machines: every rank then uploads its own rows as parts of the files.

Run: ``.venv/bin/python benchmarks/s3_checkpoint.py --size-mb 256 --rounds 3``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors.torch
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    """A moto S3 server in its own process on 127.0.0.1, and its endpoint URL."""
    port = _free_port()
    moto = Path(sys.executable).with_name("moto_server")
    process = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, endpoint
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("moto_server did not start")


def _model(size_mb: int, width: int = 2048) -> torch.nn.Sequential:
    # Square layers (fp32): 16 MB each at the default width, a realistic mix of large tensors;
    # a small --width makes many small tensors (one request each when restored by range).
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_cpu() -> float:
    times = os.times()
    return times.user + times.system


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fsdp_rank(rank: int, world_size: int, port: int, url: str, options: dict, size_mb: int,
               out: str) -> None:  # fmt: skip
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from orbit_pt import CheckpointManager

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if options.pop("scattered", False):
        options = {**options, "cache_dir": f"{options['cache_dir']}-rank{rank}"}
    model = _model(size_mb)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 1e6  # type: ignore[attr-defined]
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(0, {"model": model})  # warm-up: code paths, connections
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_mb("VmRSS")
        started = time.perf_counter()
        mgr.save(1, {"model": model})
        seconds = time.perf_counter() - started
        growth = _rss_mb("VmHWM") - before
    Path(out, f"rank{rank}.txt").write_text(f"{shard:.0f} {growth:.0f} {seconds:.2f}")
    dist.barrier()
    dist.destroy_process_group()


def _fsdp(args: argparse.Namespace, endpoint: str, work: Path) -> None:
    import torch.multiprocessing as mp

    options = {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "cache_dir": str(work / "mirror"),
        "scattered": args.scattered,
    }
    url = f"s3://bench/fsdp-{uuid.uuid4().hex[:8]}"
    mp.start_processes(  # type: ignore[attr-defined]
        _fsdp_rank,
        args=(args.fsdp_ranks, _free_port(), url, options, args.size_mb, str(work)),
        nprocs=args.fsdp_ranks,
        start_method="spawn",
    )
    how = "a mirror per rank (scattered)" if args.scattered else "one shared mirror"
    print(f"FSDP2 save of a {args.size_mb} MB model from {args.fsdp_ranks} ranks to S3, {how}")
    print(f"{'rank':<6} {'shard MB':>9} {'peak growth MB':>15} {'save s':>7}")
    for rank in range(args.fsdp_ranks):
        shard, growth, seconds = Path(work, f"rank{rank}.txt").read_text().split()
        print(f"{rank:<6} {shard:>9} {growth:>15} {seconds:>7}")


def _uploader(client, bucket, prefix, step_dir, config):  # type: ignore[no-untyped-def]
    def upload(path: Path) -> None:
        key = f"{prefix}/{path.relative_to(step_dir)}"
        client.upload_file(str(path), bucket, key, Config=config)

    return upload


def _downloader(client, bucket, prefix, step_dir, target, config):  # type: ignore[no-untyped-def]
    def download(path: Path) -> None:
        out = target / path.relative_to(step_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        key = f"{prefix}/{path.relative_to(step_dir)}"
        client.download_file(bucket, key, str(out), Config=config)

    return download


def _delete_prefix(client, bucket: str, prefix: str) -> None:  # type: ignore[no-untyped-def]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsdp-ranks", type=int, default=0)
    parser.add_argument("--scattered", action="store_true")
    parser.add_argument("--width", type=int, default=2048, help="of the square layers")
    args = parser.parse_args()

    import boto3
    from boto3.s3.transfer import TransferConfig

    from orbit_pt import CheckpointManager

    server, endpoint = start_server()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    bucket = "bench"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    if args.fsdp_ranks:
        work = Path(tempfile.mkdtemp(prefix="orbit-s3-bench-"))
        try:
            _fsdp(args, endpoint, work)
        finally:
            server.kill()
            shutil.rmtree(work, ignore_errors=True)
        return
    config = TransferConfig(multipart_chunksize=8 * 2**20, max_concurrency=16, use_threads=True)
    work = Path(tempfile.mkdtemp(prefix="orbit-s3-bench-"))
    model = _model(args.size_mb, args.width)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    names = (
        "orbit_pt save",
        "boto3 upload",
        "write + boto3 upload",
        "orbit_pt restore",
        "boto3 download",
    )
    times: dict[str, list[float]] = {name: [] for name in names}
    server_cpu: dict[str, list[float]] = {name: [] for name in names}
    client_cpu: dict[str, list[float]] = {name: [] for name in names}

    @contextlib.contextmanager
    def timed(name: str) -> Iterator[None]:
        server0, client0, started = _server_cpu(server.pid), _client_cpu(), time.perf_counter()
        yield
        times[name].append(time.perf_counter() - started)
        server_cpu[name].append(_server_cpu(server.pid) - server0)
        client_cpu[name].append(_client_cpu() - client0)

    storage = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    try:
        # The files boto3 uploads: the ones a save writes (the same bytes, already on disk).
        with CheckpointManager(f"s3://{bucket}/source", storage_options={
            **storage, "cache_dir": str(work / "source")
        }) as source:  # fmt: skip
            source.save(1, {"model": model})
            step_dir = source.step_dir(1)
        files = sorted(p for p in step_dir.rglob("*") if p.is_file())
        for round_ in range(args.rounds):
            url = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"
            prefix = f"boto-{uuid.uuid4().hex[:8]}"
            mirror = work / f"mirror-{round_}"

            def save() -> None:
                options = {**storage, "cache_dir": str(mirror)}  # noqa: B023
                # Timed inside the manager: opening and closing it are not the save.
                with (
                    CheckpointManager(url, storage_options=options) as m,  # noqa: B023
                    timed("orbit_pt save"),
                ):
                    m.save(1, {"model": model})

            def upload() -> None:
                with timed("boto3 upload"), ThreadPoolExecutor(max_workers=4) as pool:
                    up = _uploader(client, bucket, prefix, step_dir, config)  # noqa: B023
                    list(pool.map(up, files))  # files in parallel, as orbit_pt

            def write_and_upload() -> None:
                local = work / f"script-{round_}" / "model.safetensors"  # noqa: B023
                local.parent.mkdir(parents=True)
                with timed("write + boto3 upload"):
                    safetensors.torch.save_file(model.state_dict(), str(local))
                    fd = os.open(local, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    key = f"{prefix}-script/model.safetensors"  # noqa: B023
                    client.upload_file(str(local), bucket, key, Config=config)

            def restore() -> None:
                fresh = _model(args.size_mb, args.width)
                other = {**storage, "cache_dir": str(work / f"other-{round_}")}  # noqa: B023
                with (
                    CheckpointManager(url, storage_options=other) as reader,  # noqa: B023
                    timed("orbit_pt restore"),
                ):
                    reader.restore(1, {"model": fresh})
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
                )

            def download() -> None:
                target = work / f"download-{round_}"  # noqa: B023
                with timed("boto3 download"), ThreadPoolExecutor(max_workers=4) as pool:
                    down = _downloader(client, bucket, prefix, step_dir, target, config)  # noqa: B023
                    list(pool.map(down, files))

            # Rotate which goes first, so that none always meets a warmer server.
            uploads = [save, upload, write_and_upload]
            shift = round_ % len(uploads)
            for run in uploads[shift:] + uploads[:shift]:
                run()
            first = round_ % 2 == 0
            for run in (restore, download) if first else (download, restore):
                run()
            for folder in work.glob(f"*-{round_}"):
                shutil.rmtree(folder, ignore_errors=True)
            # The server holds every object in memory: empty it, so rounds stay alike.
            _delete_prefix(client, bucket, url.split("/", 3)[3])
            _delete_prefix(client, bucket, prefix)  # and the script's, under prefix + "-script"
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    tensors = len(list(model.parameters()))
    print(f"state: {size / 1e6:.0f} MB in {tensors} tensors, {args.rounds} rounds, medians")
    print(f"{'mode':<22} {'seconds':>8} {'MB/s':>6} {'server CPU s':>13} {'server cores':>13} "
          f"{'client CPU s':>13}")  # fmt: skip
    for name, seconds in medians.items():
        server_s = statistics.median(server_cpu[name])
        client_s = statistics.median(client_cpu[name])
        print(f"{name:<22} {seconds:>8.2f} {size / 1e6 / seconds:>6.0f} {server_s:>13.2f} "
              f"{server_s / seconds:>13.2f} {client_s:>13.2f}")  # fmt: skip
    print(
        f"save / boto3 upload time: {medians['orbit_pt save'] / medians['boto3 upload']:.2f}x; "
        f"save / (write + boto3 upload): "
        f"{medians['orbit_pt save'] / medians['write + boto3 upload']:.2f}x; "
        f"restore / boto3 download time: "
        f"{medians['orbit_pt restore'] / medians['boto3 download']:.2f}x"
    )


if __name__ == "__main__":
    main()
