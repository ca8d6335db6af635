"""One test, two kinds of root: a local folder and an ``s3://`` prefix on the loopback server.

The ``where`` fixture (registered in ``tests/conftest.py``) is parametrized over both, so a test
written against :class:`RootUnderTest` checks the same behaviour -- the same kept steps, the
same superseded steps, the same entries in the root -- on a local disk and in object storage.
On S3 the entries are read from the store itself (boto3, not orbit_pt), and
:meth:`RootUnderTest.reader` opens the root with an empty mirror, as another machine would: what
it lists is what the store holds, not what this process's mirror remembers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orbit_pt import CheckpointManager, CheckpointManagerOptions

# Objects under an S3 root that are not the manager's: saves, retention, rollbacks and deletes
# leave every one as it was. Step-like names that are not a step's exact name are foreign, as on
# a local root; an exact step name with no marker is a crashed save's on an object store (the
# next writer removes it), so none is here.
FOREIGN_OBJECTS = {
    "notes.txt": b"my notes",
    ".hidden": b"\x00\x01",
    "step_7/weights.bin": b"step_7",
    "step_000000100/weights.bin": b"not the canonical name of step 100",
    "step_00000003.bak/weights.bin": b"a backup",
    "other.orbit-tmp/weights.bin": b"the tmp suffix, not on a step name",
    "eval/weights.bin": b"eval",
    "eval/step_00000001/_CHECKPOINT_METADATA": b"{}",
    "superseded-notes/readme": b"not superseded/",
}

# Left out of a root's entries: the retention record for `orbit-pt ls` (informational), and a
# deleted step's folder while its files are removed on a thread of their own. The writer's lock
# is not left out: see RootUnderTest.lock_after_close.
_RETENTION_RECORD = ".orbit-retention.json"


@dataclass(frozen=True)
class RootUnderTest:
    """A checkpoint root for one test: ``kind`` is ``"local"`` or ``"s3"``.

    Attributes:
        kind: which storage.
        path: the local root, or (S3) this test's mirror folder.
        url: the ``s3://`` URL (S3 only).
        storage_options: the client's options and the mirror (S3 only).
        scratch: a folder for anything else the test needs (other machines' mirrors).
    """

    kind: str
    path: Path
    scratch: Path
    url: str | None = None
    storage_options: dict[str, Any] | None = None

    @property
    def lock_after_close(self) -> set[str]:
        """The writer's lock entry a closed writer leaves in the root: the lock file locally;
        on S3 nothing (the lease object is deleted at close; while open it is
        ``.orbit-lease``)."""
        return {".orbit.lock"} if self.url is None else set()

    @property
    def directory(self) -> str | Path:
        return self.url if self.url is not None else self.path

    def open(
        self, *, clock: Callable[[], float] | None = None, **options: Any
    ) -> CheckpointManager:
        """A writing manager on this root (``options`` are CheckpointManagerOptions')."""
        kwargs: dict[str, Any] = {"options": CheckpointManagerOptions(**options)}
        if clock is not None:
            kwargs["clock"] = clock
        if self.storage_options is not None:
            kwargs["storage_options"] = self.storage_options
        return CheckpointManager(self.directory, **kwargs)

    def reader(self, **options: Any) -> CheckpointManager:
        """A read-only manager that knows nothing this test's writers did: locally the same
        folder; on S3 a new, empty mirror (another machine)."""
        read_only = CheckpointManagerOptions(read_only=True, **options)
        if self.storage_options is None:
            return CheckpointManager(self.path, options=read_only)
        mirror = self.scratch / f"other-{uuid.uuid4().hex[:8]}"
        storage = {**self.storage_options, "cache_dir": str(mirror)}
        return CheckpointManager(self.directory, options=read_only, storage_options=storage)

    def entries(self, under: str = "") -> set[str]:
        """The names directly under the root (or under its folder ``under``): step folders,
        ``superseded``, the writer's lock and anything foreign; the retention record and
        folders being deleted left out. On S3, read from the store."""
        if self.url is None:
            folder = self.path / under if under else self.path
            return {
                entry.name
                for entry in folder.iterdir()
                if entry.name != _RETENTION_RECORD and not entry.name.endswith(".orbit-deleting")
            }
        prefix = "/".join(p for p in (self.url.split("/", 3)[3], under) if p) + "/"
        return {key.split("/")[0] for key in self.keys(prefix)} - {_RETENTION_RECORD}

    def keys(self, prefix: str) -> list[str]:
        """Every object under ``prefix`` of the bucket, relative to it (S3 only)."""
        import boto3

        assert self.url is not None
        bucket = self.url.split("/")[2]
        client = boto3.client("s3")  # the s3_root fixture points AWS_* at the loopback server
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [obj["Key"][len(prefix) :] for obj in page.get("Contents", [])]
        client.close()
        return sorted(keys)

    def put_foreign_objects(self) -> None:
        """Put :data:`FOREIGN_OBJECTS` under the root's prefix (S3 only)."""
        import boto3

        assert self.url is not None
        bucket, prefix = self.url.split("/")[2], self.url.split("/", 3)[3]
        client = boto3.client("s3")
        for rel, body in FOREIGN_OBJECTS.items():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=body)
        client.close()

    def foreign_objects_unchanged(self) -> bool:
        """Whether every one of :data:`FOREIGN_OBJECTS` is still there, byte for byte."""
        import boto3

        assert self.url is not None
        bucket, prefix = self.url.split("/")[2], self.url.split("/", 3)[3]
        client = boto3.client("s3")
        try:
            return all(
                client.get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read() == body
                for rel, body in FOREIGN_OBJECTS.items()
            )
        finally:
            client.close()

    def is_committed(self, step: int) -> bool:
        """Whether the commit marker of ``step`` is in place (on S3: in the store, not in the
        mirror)."""
        folder = f"step_{step:08d}"
        if self.url is None:
            return (self.path / folder / "_CHECKPOINT_METADATA").is_file()
        prefix = f"{self.url.split('/', 3)[3]}/{folder}/"
        return "_CHECKPOINT_METADATA" in self.keys(prefix)


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> RootUnderTest:
    """A fresh root: a local folder, or a fresh prefix on the loopback S3 server with a mirror
    of its own."""
    if request.param == "local":
        return RootUnderTest("local", tmp_path / "root", tmp_path)
    s3 = request.getfixturevalue("s3_root")
    mirror = tmp_path / "mirror"
    return RootUnderTest(
        "s3",
        mirror,
        tmp_path,
        url=s3.url,
        storage_options={**s3.storage_options, "cache_dir": str(mirror)},
    )
