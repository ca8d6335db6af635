"""Object storage clients side by side, on the same bytes, in one run, against loopback S3.

    python benchmarks/object_store.py [--file-mb 256] [--files 4] [--small 2000] [--small-kb 8]
                                      [--repeats 3] [--concurrency 10] [--part-mb 16]
                                      [--clients boto3,s3fs,obstore] [--workloads large,small]
                                      [--json OUT]

Starts moto's S3 server on 127.0.0.1 (``pip install -e .[test]`` brings it and boto3; the
obstore column needs ``pip install obstore``) and measures upload
and download throughput of

- large: ``--files`` files of ``--file-mb`` MB each, one after the other, each in parts of
  ``--part-mb`` MiB with ``--concurrency`` parts or ranges in flight;
- small: ``--small`` objects of ``--small-kb`` KB, ``--concurrency`` requests in flight;

for three clients:

- ``boto3``: boto3's managed transfer (``upload_file``/``download_file`` for the files, its
  TransferManager for the small objects), multithreaded with the same concurrency and part
  size -- the baseline;
- ``s3fs``: orbit_pt's object store (``orbit_pt._storage.objects``, s3fs underneath);
- ``obstore``: the same interface over obstore (the Rust ``object_store`` crate), defined below.

Each repeat runs every client (in a rotated order) on the same bytes; every download is
checked against the source. The table shows medians over ``--repeats``, and each client's
ratio to boto3. moto is a single Python process that hashes and copies every byte it
receives (and reads a whole object for every ranged GET), so on loopback the server, not the
network, is the limit: the figures measure client overhead plus moto, and only ratios within
one run mean anything. docs/object-storage-clients.md has a table and the choice it led to.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from orbit_pt._storage.objects import (
    DEFAULT_PART_SIZE,
    ObjectInfo,
    ObjectNotFoundError,
    PreconditionFailedError,
    open_store,
)

MB = 1e6
BUCKET = "orbit-pt-bench"
KEYS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


# ----------------------------------------------------------------- the contender, obstore


class ObstoreStore:
    """orbit_pt's ObjectStore interface over obstore, for the comparison only.

    obstore has no call to list or abort incomplete multipart uploads, nor a multipart upload
    whose parts other processes send (or UploadPartCopy): :meth:`abort_multipart_uploads`
    cannot be written, which is one reason orbit_pt does not use it (see the docs page).
    """

    def __init__(self, endpoint: str, bucket: str, *, concurrency: int) -> None:
        from obstore.store import S3Store

        self._store = S3Store(
            bucket,
            endpoint=endpoint,
            allow_http=True,
            access_key_id=KEYS["access_key_id"],
            secret_access_key=KEYS["secret_access_key"],
            region=KEYS["region"],
            client_options={"allow_invalid_certificates": True},
        )
        self._concurrency = concurrency
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="obstore")

    def put(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
    ) -> None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        mode: Any = "create" if if_absent else {"e_tag": f'"{if_match}"'} if if_match else None
        try:
            obstore.put(self._store, key, bytes(data), mode=mode)
        except (AlreadyExistsError, PreconditionError) as exc:
            raise PreconditionFailedError("upload", key, str(exc)) from exc

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        part_size: int = DEFAULT_PART_SIZE,
        if_absent: bool = False,
    ) -> None:
        import obstore

        size = Path(path).stat().st_size
        obstore.put(
            self._store,
            key,
            Path(path),
            chunk_size=part_size,
            max_concurrency=self._concurrency,
            mode="create" if if_absent else None,
        )
        if (info := self.head(key)) is None or info.size != size:
            raise OSError(f"uploaded {key}: expected {size} bytes, found {info}")

    def get(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self._store, key).bytes())

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> None:
        import obstore

        n = buffer.nbytes
        step = DEFAULT_PART_SIZE

        def one(offset: int) -> None:
            length = min(step, n - offset)
            data = obstore.get_range(self._store, key, start=start + offset, length=length)
            buffer[offset : offset + length] = memoryview(data)

        list(self._pool.map(one, range(0, n, step)))

    def get_file(
        self, key: str, path: str | os.PathLike[str], *, part_size: int = DEFAULT_PART_SIZE
    ) -> None:
        import obstore

        info = self.head(key)
        if info is None:
            raise ObjectNotFoundError("download", key, "no such object")
        with open(path, "wb") as f:
            f.truncate(info.size)
            fd = f.fileno()

            def one(offset: int) -> None:
                length = min(part_size, info.size - offset)
                data = obstore.get_range(self._store, key, start=offset, length=length)
                os.pwrite(fd, memoryview(data), offset)

            list(self._pool.map(one, range(0, info.size, part_size)))

    def head(self, key: str) -> ObjectInfo | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            meta = obstore.head(self._store, key)
        except (NotFoundError, FileNotFoundError):
            return None
        return ObjectInfo(
            key, meta["size"], (meta["e_tag"] or "").strip('"'), meta["last_modified"].timestamp()
        )

    def list(self, prefix: str) -> list[ObjectInfo]:
        import obstore

        return [
            ObjectInfo(m["path"], m["size"], m["e_tag"], m["last_modified"].timestamp())
            for chunk in obstore.list(self._store, prefix)
            for m in chunk
        ]

    def copy(self, source: str, target: str) -> None:
        import obstore

        obstore.copy(self._store, source, target)

    def delete(self, keys: Sequence[str]) -> None:
        import obstore

        obstore.delete(self._store, list(keys))

    def abort_multipart_uploads(self, prefix: str) -> int:
        raise NotImplementedError("obstore cannot list or abort incomplete multipart uploads")

    def close(self) -> None:
        self._pool.shutdown()


# --------------------------------------------------------------------------- the clients


class Client(Protocol):
    """What the benchmark asks of each client: files and small objects, up and down."""

    name: str

    def upload_files(self, pairs: list[tuple[Path, str]]) -> None: ...
    def download_files(self, pairs: list[tuple[str, Path]]) -> None: ...
    def put_small(self, items: dict[str, bytes]) -> None: ...
    def get_small(self, keys: list[str]) -> dict[str, bytes]: ...
    def delete(self, keys: list[str]) -> None: ...
    def close(self) -> None: ...


class Boto3Client:
    name = "boto3 managed transfer"

    def __init__(self, endpoint: str, concurrency: int, part_size: int) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        self._client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=KEYS["access_key_id"],
            aws_secret_access_key=KEYS["secret_access_key"],
            region_name=KEYS["region"],
            config=Config(max_pool_connections=max(10, concurrency)),
            verify=False,
        )
        self._config = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_concurrency=concurrency,
            use_threads=True,
        )
        self._manager = create_transfer_manager(self._client, self._config)

    def upload_files(self, pairs: list[tuple[Path, str]]) -> None:
        for path, key in pairs:
            self._client.upload_file(str(path), BUCKET, key, Config=self._config)

    def download_files(self, pairs: list[tuple[str, Path]]) -> None:
        for key, path in pairs:
            self._client.download_file(BUCKET, key, str(path), Config=self._config)

    def put_small(self, items: dict[str, bytes]) -> None:
        futures = [self._manager.upload(io.BytesIO(d), BUCKET, k) for k, d in items.items()]
        for future in futures:
            future.result()

    def get_small(self, keys: list[str]) -> dict[str, bytes]:
        sinks = {key: io.BytesIO() for key in keys}
        futures = [self._manager.download(BUCKET, key, sink) for key, sink in sinks.items()]
        for future in futures:
            future.result()
        return {key: sink.getvalue() for key, sink in sinks.items()}

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[i : i + 1000]]
            self._client.delete_objects(Bucket=BUCKET, Delete={"Objects": objects})

    def close(self) -> None:
        self._manager.shutdown()
        self._client.close()


class StoreClient:
    """A client through orbit_pt's ObjectStore interface."""

    def __init__(self, name: str, store: Any, concurrency: int, part_size: int) -> None:
        self.name = name
        self._store = store
        self._part_size = part_size
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="bench")

    def upload_files(self, pairs: list[tuple[Path, str]]) -> None:
        for path, key in pairs:
            self._store.put_file(key, path, part_size=self._part_size)

    def download_files(self, pairs: list[tuple[str, Path]]) -> None:
        for key, path in pairs:
            self._store.get_file(key, path, part_size=self._part_size)

    def put_small(self, items: dict[str, bytes]) -> None:
        list(self._pool.map(lambda kv: self._store.put(*kv), items.items()))

    def get_small(self, keys: list[str]) -> dict[str, bytes]:
        return dict(zip(keys, self._pool.map(self._store.get, keys), strict=True))

    def delete(self, keys: list[str]) -> None:
        self._store.delete(keys)

    def close(self) -> None:
        self._pool.shutdown()
        self._store.close()


def make_client(name: str, endpoint: str, concurrency: int, part_size: int) -> Client:
    if name == "boto3":
        return Boto3Client(endpoint, concurrency, part_size)
    if name == "s3fs":
        options = {
            "endpoint_url": endpoint,
            "key": KEYS["access_key_id"],
            "secret": KEYS["secret_access_key"],
            "client_kwargs": {"region_name": KEYS["region"], "verify": False},
            "max_concurrency": concurrency,
        }
        store, _ = open_store(f"s3://{BUCKET}", options)
        return StoreClient("orbit_pt over s3fs", store, concurrency, part_size)
    if name == "obstore":
        try:
            # Not an ObjectStore: a part of the interface cannot be written over obstore.
            partial = ObstoreStore(endpoint, BUCKET, concurrency=concurrency)
        except ImportError as exc:
            raise SystemExit(
                "the obstore column needs obstore (not an orbit_pt extra): pip install obstore, "
                "or leave it out with --clients boto3,s3fs"
            ) from exc
        return StoreClient("orbit_pt over obstore", partial, concurrency, part_size)
    raise SystemExit(f"unknown client {name!r}; choose from boto3, s3fs, obstore")


# ----------------------------------------------------------------------------- the run


def start_moto(tls: bool) -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process (its own GIL: a client in this process that holds
    the GIL would otherwise slow the server down too), on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(
        [*command, *(["--ssl"] if tls else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("moto's server did not start: pip install -e .[test]") from None
            time.sleep(0.1)
    endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, verify=False, **_boto_keys())
    client.create_bucket(Bucket=BUCKET)
    client.close()
    return server, endpoint


def _boto_keys() -> dict[str, str]:
    return {
        "aws_access_key_id": KEYS["access_key_id"],
        "aws_secret_access_key": KEYS["secret_access_key"],
        "region_name": KEYS["region"],
    }


Sample = tuple[float, float]  # (wall-clock seconds, this process's CPU seconds)


def timed(fn: Callable[[], Any]) -> tuple[Sample, Any]:
    """Run ``fn``: its wall time and the CPU time of this process -- the client's alone, as
    the server runs in another process."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return (time.perf_counter() - wall, time.process_time() - cpu), result


def same_file(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(8 << 20), fb.read(8 << 20)
            if x != y:
                return False
            if not x:
                return True


def bench_large(
    client: Client, sources: list[Path], folder: Path, prefix: str
) -> tuple[Sample, Sample]:
    """Seconds to upload the files, then to download them (checked against the sources)."""
    keys = [f"{prefix}/large-{i}" for i in range(len(sources))]
    back = [folder / f"back-{i}" for i in range(len(sources))]
    up, _ = timed(lambda: client.upload_files(list(zip(sources, keys, strict=True))))
    down, _ = timed(lambda: client.download_files(list(zip(keys, back, strict=True))))
    if not all(same_file(a, b) for a, b in zip(sources, back, strict=True)):
        raise SystemExit(f"{client.name}: a downloaded file differs from its source")
    for path in back:
        path.unlink()
    client.delete(keys)
    return up, down


def bench_small(client: Client, small: dict[str, bytes], prefix: str) -> tuple[Sample, Sample]:
    """Seconds to put the small objects, then to get them back (checked)."""
    items = {f"{prefix}/{k}": v for k, v in small.items()}
    up, _ = timed(lambda: client.put_small(items))
    down, got = timed(lambda: client.get_small(list(items)))
    if got != items:
        raise SystemExit(f"{client.name}: a small object came back different")
    client.delete(list(items))
    return up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file-mb", type=int, default=256, help="size of each large file, MB")
    parser.add_argument("--files", type=int, default=4, help="number of large files")
    parser.add_argument("--small", type=int, default=2000, help="number of small objects")
    parser.add_argument("--small-kb", type=int, default=8, help="size of each small object, KB")
    parser.add_argument("--repeats", type=int, default=3, help="runs per client; medians shown")
    parser.add_argument("--concurrency", type=int, default=10, help="requests in flight")
    parser.add_argument("--part-mb", type=int, default=16, help="part and range size, MiB")
    parser.add_argument("--clients", default="boto3,s3fs,obstore", help="comma-separated")
    parser.add_argument("--workloads", default="large,small", help="large, small or both")
    parser.add_argument(
        "--tls", action="store_true", help="https to moto (self-signed), as to a real store"
    )
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    names = args.clients.split(",")
    workloads = args.workloads.split(",")
    part_size = args.part_mb << 20

    if args.tls:  # moto's certificate is self-signed: no client verifies it here
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    server, endpoint = start_moto(args.tls)
    clients = [make_client(n, endpoint, args.concurrency, part_size) for n in names]
    times: dict[tuple[str, str], list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="orbit-pt-objbench-") as tmp:
        folder = Path(tmp)
        sources = []
        for i in range(args.files if "large" in workloads else 0):
            path = folder / f"src-{i}"
            with open(path, "wb") as f:
                for _ in range(args.file_mb):
                    f.write(os.urandom(1_000_000))
            sources.append(path)
        small = {f"small/{i:05d}": os.urandom(args.small_kb * 1000) for i in range(args.small)}
        large_bytes = args.files * args.file_mb * MB
        for repeat in range(args.repeats):
            shift = repeat % len(clients)
            for client in clients[shift:] + clients[:shift]:
                prefix = f"{client.name.split()[-1]}-{repeat}"
                if "large" in workloads:
                    up, down = bench_large(client, sources, folder, prefix)
                    times.setdefault((client.name, "large up"), []).append(up)
                    times.setdefault((client.name, "large down"), []).append(down)
                if "small" in workloads:
                    up, down = bench_small(client, small, prefix)
                    times.setdefault((client.name, "small up"), []).append(up)
                    times.setdefault((client.name, "small down"), []).append(down)
            print(f"repeat {repeat + 1} of {args.repeats} done", flush=True)
        for client in clients:
            client.close()
    server.terminate()
    server.wait()

    print(
        f"\nloopback moto S3 over {'https' if args.tls else 'http'}; large: {args.files} x "
        f"{args.file_mb} MB, parts of {args.part_mb} MiB; small: {args.small} x {args.small_kb} "
        f"KB; {args.concurrency} in flight; medians of {args.repeats}\n"
    )
    header = f"{'client':26} {'operation':11} {'median':>12} {'vs boto3':>9} {'client CPU':>14}"
    print(header)
    print("-" * len(header))
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for (name, op), samples in times.items():
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        if op.startswith("large"):
            figures = {"MB/s": large_bytes / MB / wall, "CPU s/GB": cpu / (large_bytes / 1e9)}
        else:
            figures = {"obj/s": args.small / wall, "CPU ms/obj": 1000 * cpu / args.small}
        medians.setdefault(name, {})[op] = figures
    base = medians.get(Boto3Client.name, {})
    for op in ("large up", "large down", "small up", "small down"):
        for name, ops in medians.items():
            if op not in ops:
                continue
            (rate_unit, rate), (cpu_unit, cpu) = ops[op].items()
            ratio = f"{rate / next(iter(base[op].values())):.2f}x" if op in base else "-"
            print(f"{name:26} {op:11} {rate:6.1f} {rate_unit:5} {ratio:>8} {cpu:6.2f} {cpu_unit}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "medians": medians}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
