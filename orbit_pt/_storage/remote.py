"""A root in object storage (``s3://bucket/prefix``): where steps are committed.

An object store has no rename and no folders, so the commit rule of docs/format.md is kept with
objects: a step is committed exactly when its ``_CHECKPOINT_METADATA`` object exists, parses
and names its step, and that object is written **last**, after every other object of the step
is uploaded and its size confirmed. Under the root's prefix ``P``::

    P/step_00000100/<item>/<files>          the step's files
    P/step_00000100/_CHECKPOINT_METADATA    the commit marker, written last, deleted first
    P/superseded/step_00000100.<stamp>/...  steps replaced by a rollback (copied, then deleted)
    P/.orbit-lease                          the writer's lease (a conditional put)
    P/.orbit-retention.json                 the writer's retention options (for ``ls``)

The step is written into a local folder, the *mirror* (``storage_options["cache_dir"]``, by
default under ``~/.cache/orbit_pt``), with the local commit protocol; its large files upload
while they are written (``streaming.py``), the rest once every rank has written, and then the
uploads are completed and the marker put. The mirror keeps the committed steps' files
so that a restore of a recent step reads local files; a step whose files are not there is
downloaded into it first. So the mirror needs room for the steps retention keeps.

Deletion removes the marker first (the step stops being a step), then its other objects. A
writer that opens the root removes what a crashed writer left: objects under a step prefix with
no marker, and incomplete multipart uploads.

One writer per root: the writer holds a lease object, created with a conditional put
(``If-None-Match: *``) and renewed by a background thread every third of its duration. A writer
that died stops renewing; once its lease has expired (``lease_seconds``, default 120 s) the next
writer takes it over: at once when the holder ran on this host and its process is gone (a
requeued job), or when the lease object is not a writer's (unreadable); otherwise after waiting
for it to expire, up to ``lease_wait`` seconds (default: ``lease_seconds``), failing as soon as
the holder renews it (it is alive). ``takeover=True`` takes a live lease at once (the other
writer's next renewal then fails and it stops committing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointValueError,
    CorruptCheckpointError,
)
from orbit_pt.metadata import StepMetadata

if TYPE_CHECKING:
    from orbit_pt._storage.objects import ObjectStore

logger = logging.getLogger(__name__)

LEASE_OBJECT = ".orbit-lease"
DEFAULT_LEASE_SECONDS = 120.0
_UPLOAD_WORKERS = 8


class RemoteRoot:
    """The object-store side of a root: discovery, the commit marker, deletion and the lease.

    Only the primary rank talks to the store; the :class:`~orbit_pt._storage.store.StepStore`
    calls it at the commit point, at deletion and when it scans.
    """

    def __init__(
        self,
        url: str,
        store: ObjectStore,
        prefix: str,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        takeover: bool = False,
        lease_wait: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.store = store
        self.prefix = prefix.strip("/")
        self.lease_seconds = float(lease_seconds)
        self.takeover = takeover
        # How long an opening writer waits for a live-looking lease to expire.
        self.lease_wait = self.lease_seconds if lease_wait is None else float(lease_wait)
        self._owner = uuid.uuid4().hex
        self._lease_thread: threading.Thread | None = None
        self._lease_stop = threading.Event()
        self._lease_lost: str | None = None

    # --------------------------------------------------------------------------------- naming

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def step_key(self, step: int, rel: str = "") -> str:
        return self.key(_layout.step_name(step), rel)

    def describe(self, step: int | None = None) -> str:
        return self.url if step is None else f"{self.url}/{_layout.step_name(step)}"

    # ------------------------------------------------------------------------------ discovery

    def committed(
        self, known: Mapping[int, tuple[str, StepMetadata]] | None = None
    ) -> dict[int, tuple[str, StepMetadata]]:
        """step -> (identity of its marker, metadata), for every committed step.

        ``known`` markers whose identity (size and ETag) is unchanged are not read again.
        """
        from orbit_pt._storage.objects import ObjectNotFoundError

        known = known or {}
        found: dict[int, tuple[str, StepMetadata]] = {}
        for info in self.store.list(self.prefix + "/" if self.prefix else ""):
            rel = info.key[len(self.prefix) + 1 :] if self.prefix else info.key
            parts = rel.split("/")
            if len(parts) != 2 or parts[1] != _layout.METADATA_FILE:
                continue
            step = _layout.parse_step_name(parts[0])
            if step is None:
                continue
            identity = f"{info.size}:{info.etag}"
            if step in known and known[step][0] == identity:
                found[step] = known[step]
                continue
            try:
                meta = StepMetadata.from_json(self.store.get(info.key), path=Path(info.key))
            except ObjectNotFoundError:
                # Listed, then deleted before it was read (a writer's retention beside a
                # polling reader): the step is gone, which is what a later listing says.
                continue
            except CorruptCheckpointError as exc:
                logger.warning("ignoring %s/%s: %s", self.url, rel, exc)
                continue
            if meta.step != step:
                logger.warning(
                    "ignoring %s/%s: its metadata records step %d", self.url, rel, meta.step
                )
                continue
            found[step] = (identity, meta)
        return dict(sorted(found.items()))

    # --------------------------------------------------------------------------------- commit

    def upload_file(self, step: int, rel: str, path: Path) -> None:
        """Upload the file ``rel`` of ``step`` from ``path``; the stored size is confirmed."""
        key = self.step_key(step, rel)
        expected = path.stat().st_size
        self.store.put_file(key, path)
        info = self.store.head(key)
        if info is None or info.size != expected:
            raise CheckpointError(
                f"uploading {rel} of step {step} to {self.describe(step)}: the store holds "
                f"{'nothing' if info is None else f'{info.size} bytes'} where {expected} "
                "were written"
            )

    def put_marker(self, step: int, folder: Path) -> None:
        """Put the step's metadata object: the commit point, once every file is uploaded."""
        self.check_lease()  # a writer that lost its lease must not commit over the new one
        marker = (folder / _layout.METADATA_FILE).read_bytes()
        self.store.put(self.step_key(step, _layout.METADATA_FILE), marker)

    def remove_step_objects(self, step: int) -> None:
        """Delete every object of ``step``, its marker first (after which it is no step)."""
        self.store.delete([self.step_key(step, _layout.METADATA_FILE)])
        keys = [info.key for info in self.store.list(self.step_key(step) + "/")]
        if keys:
            self.store.delete(keys)

    def supersede(self, steps: Sequence[int]) -> None:
        """Copy each step into ``superseded/``, then delete it (marker first), newest first."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        for step in sorted(steps, reverse=True):
            source = self.step_key(step) + "/"
            target = self.key(_layout.SUPERSEDED_DIR, _layout.superseded_name(step, stamp))
            infos = self.store.list(source)
            for info in infos:
                self.store.copy(info.key, target + "/" + info.key[len(source) :])
            self.remove_step_objects(step)

    def download(self, step: int, rels: Iterable[str], folder: Path) -> None:
        """Download the step's files ``rels`` into ``folder`` (several at once)."""
        rels = sorted(rels)

        def fetch(rel: str) -> None:
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            # A name of its own: ranks sharing the mirror may fetch the same file at once; each
            # renames a whole copy into place.
            partial = path.with_name(
                f"{path.name}.orbit-download-{os.getpid()}-{threading.get_ident()}"
            )
            try:
                self.store.get_file(self.step_key(step, rel), partial)
                os.replace(partial, path)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise

        each_in_parallel(fetch, rels)

    def open_files(self, step: int, files: Mapping[str, int]) -> dict[str, ObjectFile]:
        """The step's files ``rel -> recorded size``, to be read by byte range (several looked
        up at once).

        Each object must exist with its recorded size; its ETag is pinned, so that an object
        overwritten between this and a read fails the read rather than mixing two versions.

        Raises:
            CorruptCheckpointError: an object is missing or has another size.
        """
        rels = sorted(files)
        found: dict[str, ObjectFile] = {}

        def look_up(rel: str) -> None:
            key, url = self.step_key(step, rel), f"{self.describe(step)}/{rel}"
            info = self.store.head(key)
            if info is None or info.size != files[rel]:
                held = "is missing" if info is None else f"has {info.size} bytes"
                raise CorruptCheckpointError(
                    f"step {step} is damaged: {url} {held}, the metadata recorded "
                    f"{files[rel]} bytes; restore another step"
                )
            found[rel] = ObjectFile(self.store, key, url, info.size, info.etag)

        each_in_parallel(look_up, rels)
        return found

    def remove_leftovers(self, committed: Iterable[int]) -> list[str]:
        """Remove objects of uncommitted steps and incomplete uploads a crashed writer left."""
        keep = set(committed)
        doomed: list[str] = []
        prefixes: set[str] = set()
        for info in self.store.list(self.prefix + "/" if self.prefix else ""):
            rel = info.key[len(self.prefix) + 1 :] if self.prefix else info.key
            step = _layout.parse_step_name(rel.split("/", 1)[0])
            if step is not None and "/" in rel and step not in keep:
                doomed.append(info.key)
                prefixes.add(rel.split("/", 1)[0])
        if doomed:
            self.store.delete(doomed)
        aborted = self.store.abort_multipart_uploads(self.prefix + "/" if self.prefix else "")
        if doomed or aborted:
            logger.info(
                "removed what a crashed writer left in %s: %d object(s) of uncommitted step(s) "
                "%s, %d incomplete upload(s)",
                self.url,
                len(doomed),
                sorted(prefixes),
                aborted,
            )
        return sorted(prefixes)

    def put_root_file(self, folder: Path, name: str) -> None:
        """Upload the root file ``name`` (the retention record) from ``folder``, if there."""
        path = folder / name
        if path.is_file():
            self.store.put(self.key(name), path.read_bytes())

    def get_root_file(self, name: str) -> bytes | None:
        try:
            return self.store.get(self.key(name))
        except FileNotFoundError:
            return None

    # ---------------------------------------------------------------------------------- lease

    def acquire_lease(self) -> None:
        """Become the root's one writer, or raise :class:`CheckpointLockedError`."""
        from orbit_pt._storage.objects import PreconditionFailedError

        key = self.key(LEASE_OBJECT)
        deadline = time.monotonic() + self.lease_wait
        waited_for: dict[str, Any] | None = None  # the live holder's lease, as first read
        while True:
            try:
                self.store.put(key, self._lease_document(), if_absent=True)
                break
            except PreconditionFailedError:
                pass
            holder = self._read_lease()
            if holder is None:
                continue  # released between the put and the read: try again
            why = None if self.takeover else _taken_over_because(holder)
            if self.takeover or why is not None:
                self._take_over(holder, why or "takeover=True")
                break
            if waited_for is not None and holder != waited_for:
                raise CheckpointLockedError(
                    f"another CheckpointManager is writing to {self.url}: its lease "
                    f"{self.url}/{LEASE_OBJECT} (host {holder.get('host')!r}, pid "
                    f"{holder.get('pid')}) was renewed while this writer waited, so it is alive. "
                    f"{_LOCKED_FIX}"
                )
            expires = float(holder["expires"])
            left = deadline - time.monotonic()
            if expires - time.time() > left:
                raise CheckpointLockedError(
                    f"another CheckpointManager is writing to {self.url}: it holds the lease "
                    f"{self.url}/{LEASE_OBJECT} (host {holder.get('host')!r}, pid "
                    f"{holder.get('pid')}), renewed until {_when(expires)}, later than this "
                    f"writer waits (storage_options lease_wait={self.lease_wait:g} s). "
                    f"{_LOCKED_FIX}"
                )
            if waited_for is None:
                waited_for = holder
                logger.warning(
                    "%s: the lease is held by host %r pid %s until %s; waiting up to %.0f s for "
                    "it to expire (a writer that died stops renewing it; a live one renews it "
                    "within %.0f s, and then this open fails)",
                    self.url,
                    holder.get("host"),
                    holder.get("pid"),
                    _when(expires),
                    max(0.0, expires - time.time()),
                    self.lease_seconds / 3,
                )
            pause = min(max(0.05, expires - time.time() + 0.05), max(0.5, self.lease_seconds / 12))
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        self._lease_stop.clear()
        self._lease_thread = threading.Thread(
            target=self._renew, name="orbit_pt-lease", daemon=True
        )
        self._lease_thread.start()

    def _take_over(self, holder: dict[str, Any], why: str) -> None:
        """Replace ``holder``'s lease with this writer's (a conditional put: never two)."""
        from orbit_pt._storage.objects import PreconditionFailedError

        logger.warning(
            "taking over the lease of %s from host %r pid %s (%s)",
            self.url,
            holder.get("host"),
            holder.get("pid"),
            why,
        )
        key = self.key(LEASE_OBJECT)
        self.store.delete([key])
        try:
            self.store.put(key, self._lease_document(), if_absent=True)
        except PreconditionFailedError:
            raise CheckpointLockedError(
                f"another writer took the lease of {self.url} at the same moment; close one of them"
            ) from None

    def check_lease(self) -> None:
        """Raise if this writer lost its lease (another writer took it over)."""
        if self._lease_lost is not None:
            raise CheckpointLockedError(
                f"this CheckpointManager lost the lease of {self.url}: {self._lease_lost}; "
                "nothing more is committed by it"
            )

    def release_lease(self) -> None:
        if self._lease_thread is None:
            return
        self._lease_stop.set()
        self._lease_thread.join()
        self._lease_thread = None
        holder = self._read_lease()
        if holder is not None and holder.get("owner") == self._owner:
            self.store.delete([self.key(LEASE_OBJECT)])

    def _renew(self) -> None:
        while not self._lease_stop.wait(self.lease_seconds / 3):
            from orbit_pt._storage.objects import PreconditionFailedError

            try:
                info = self.store.head(self.key(LEASE_OBJECT))
                holder = self._read_lease()
                if info is None or holder is None or holder.get("owner") != self._owner:
                    self._lease_lost = "another writer holds it now"
                    logger.error("lost the lease of %s: %s", self.url, self._lease_lost)
                    return
                # Compare-and-swap: a takeover between the read and this put wins.
                self.store.put(self.key(LEASE_OBJECT), self._lease_document(), if_match=info.etag)
            except PreconditionFailedError:
                self._lease_lost = "another writer took it over while it was being renewed"
                logger.error("lost the lease of %s: %s", self.url, self._lease_lost)
                return
            except Exception as exc:  # a store hiccup: try again at the next renewal
                logger.warning("renewing the lease of %s failed (%s); retrying", self.url, exc)

    def _lease_document(self) -> bytes:
        return json.dumps(
            {
                "owner": self._owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "expires": time.time() + self.lease_seconds,
            }
        ).encode()

    def _read_lease(self) -> dict[str, Any] | None:
        """The lease's document (``{}`` when it is not JSON), or None when there is none."""
        try:
            document = json.loads(self.store.get(self.key(LEASE_OBJECT)))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return document if isinstance(document, dict) else {}


_LOCKED_FIX = (
    "Close it first; or open with storage_options={'takeover': True} to take the lease now; or "
    "open this one with CheckpointManagerOptions(read_only=True) to only read"
)


def _taken_over_because(holder: Mapping[str, Any]) -> str | None:
    """Why a lease may be taken over without waiting, or None while its holder may be alive.

    A writer always writes a well-formed lease, so one that is not (planted, damaged) has no
    live writer behind it. A holder on this host whose process is gone is dead (a requeued
    job on the same node); a process with its pid alive may be it, so that lease is waited for.
    """
    expires = holder.get("expires")
    if (
        isinstance(expires, bool)
        or not isinstance(expires, (int, float))
        or not math.isfinite(expires)
        or not isinstance(holder.get("owner"), str)
    ):
        return f"the lease object is not a writer's: {json.dumps(holder)[:200]}"
    if expires < time.time():
        return "it expired: that writer stopped renewing"
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"it ran on this host, and process {pid} is gone"
        except PermissionError:
            pass  # someone else's process: alive
    return None


@dataclass(frozen=True)
class ObjectFile:
    """One object of a step, read by byte range (``_format.remote_files.RemoteFile``).

    ``etag`` pins every read to the version looked up when the restore was planned.
    """

    store: ObjectStore
    key: str
    url: str
    size: int
    etag: str | None

    def read_into(self, offset: int, view: memoryview) -> None:
        if offset < 0 or offset + len(view) > self.size:
            raise CorruptCheckpointError(
                f"bytes {offset}..{offset + len(view)} of {self.url} were asked for, but it holds "
                f"{self.size}; the step does not fit what is being restored into it"
            )
        from orbit_pt._storage.objects import ObjectNotFoundError

        # The store retries each range; what still fails names the object (ObjectStoreError).
        try:
            self.store.read_range_into(self.key, offset, view, etag=self.etag)
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{self.url} was deleted while it was being restored (by the root's writer: "
                f"retention, or a rollback?): {exc}; restore a step the writer keeps"
            ) from exc


def each_in_parallel(fn: Callable[[str], None], names: Sequence[str]) -> None:
    """``fn(name)`` for every name, several files at once; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=min(_UPLOAD_WORKERS, max(1, len(names)))) as pool:
        for future in [pool.submit(fn, name) for name in names]:
            future.result()


def is_url(root: object) -> bool:
    """Whether ``root`` names an object-store root (``scheme://...``) rather than a folder."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def open_root(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None
) -> tuple[Path, RemoteRoot | None]:
    """The local folder a store works in, and the object-store root when ``root`` is a URL.

    orbit_pt's own ``storage_options`` (``cache_dir``, ``lease_seconds``, ``lease_wait``,
    ``takeover``, ``retry``) are taken out; the others go to the object-store client as its
    keyword arguments.
    """
    options = dict(storage_options or {})
    if not is_url(root):
        if options:
            raise CheckpointValueError(
                f"storage_options {sorted(options)} were given for the local folder {root!s}; "
                "they apply only to object-store roots such as 's3://bucket/prefix'"
            )
        text = os.fspath(root)
        return Path(text[len("file://") :] if text.startswith("file://") else text), None
    url = str(root).rstrip("/")
    cache_dir = options.pop("cache_dir", None)
    lease_seconds = options.pop("lease_seconds", DEFAULT_LEASE_SECONDS)
    takeover = options.pop("takeover", False)
    lease_wait = options.pop("lease_wait", None)
    if lease_wait is not None and (
        isinstance(lease_wait, bool)
        or not isinstance(lease_wait, (int, float))
        or not (0 <= lease_wait < math.inf)
    ):
        raise CheckpointValueError(
            f"storage_options['lease_wait'] must be a number of seconds >= 0 (how long a writer "
            f"waits for another writer's lease to expire), got {lease_wait!r}"
        )
    if (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, (int, float))
        or not (lease_seconds > 0)
    ):
        raise CheckpointValueError(
            f"storage_options['lease_seconds'] must be a positive number of seconds, got "
            f"{lease_seconds!r}"
        )
    if not isinstance(takeover, bool):
        raise CheckpointValueError(
            f"storage_options['takeover'] must be True or False, got {takeover!r}"
        )
    from orbit_pt._storage.objects import RetryPolicy, open_store  # only for URLs

    retry = options.pop("retry", None)
    if isinstance(retry, Mapping):
        try:
            retry = RetryPolicy(**retry)
        except TypeError as exc:
            raise CheckpointValueError(
                f"storage_options['retry'] takes max_attempts, initial_backoff and max_backoff; "
                f"got {sorted(retry)}: {exc}"
            ) from exc
    elif retry is not None and not isinstance(retry, RetryPolicy):
        raise CheckpointValueError(
            f"storage_options['retry'] must be a dict such as {{'max_attempts': 4}} or a "
            f"RetryPolicy, got {retry!r}"
        )
    store, prefix = open_store(url, options, retry=retry)
    if cache_dir is None:
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        mirror = Path.home() / ".cache" / "orbit_pt" / digest
    else:
        mirror = Path(cache_dir)
    remote = RemoteRoot(
        url, store, prefix, lease_seconds=lease_seconds, takeover=takeover, lease_wait=lease_wait
    )
    return mirror, remote


def sync_mirror(
    url: str, storage_options: Mapping[str, Any] | None, *, files: bool | int | None = False
) -> Path:
    """A local folder that is an ordinary root with the committed steps of the store at ``url``.

    For tools that read a root folder (``orbit-pt ls``, ``info``, ``verify``, ``export``): every
    committed step gets its metadata there, and its files too where ``files`` says so (True:
    every step; a step number: that step; None: the latest), mirrored steps
    the store no longer holds are removed, and the writer's retention record is copied. Steps a
    rollback moved into ``superseded/`` get their metadata only. The
    folder is the tools' own cache (``cache_dir``, default under ``~/.cache/orbit_pt/tools``),
    never a training job's mirror, which its writer changes under its own rules.
    """
    options = dict(storage_options or {})
    if "cache_dir" not in options:
        digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        options["cache_dir"] = str(Path.home() / ".cache" / "orbit_pt" / "tools" / digest)
    mirror, remote = open_root(url, options)
    assert remote is not None
    try:
        mirror.mkdir(parents=True, exist_ok=True)
        committed = remote.committed()
        for entry in os.scandir(mirror):
            step = _layout.parse_step_name(entry.name)
            if step is not None and step not in committed:
                _fs.remove_tree(Path(entry.path))
        latest = max(committed, default=None)
        for step, (_, meta) in committed.items():
            folder = mirror / _layout.step_name(step)
            folder.mkdir(exist_ok=True)
            marker, document = folder / _layout.METADATA_FILE, meta.to_json()
            if not marker.is_file() or marker.read_bytes() != document:
                marker.write_bytes(document)
            with_files = (
                files is True
                or (files is None and step == latest)
                or (not isinstance(files, bool) and files == step)
            )
            if with_files:
                wanted = [r for r, f in meta.files.items() if not _fs.has_size(folder / r, f.size)]
                if wanted:
                    remote.download(step, wanted, folder)
        _sync_superseded(remote, mirror / _layout.SUPERSEDED_DIR)
        record = remote.get_root_file(_layout.RETENTION_FILE)
        if record is not None:
            (mirror / _layout.RETENTION_FILE).write_bytes(record)
    finally:
        remote.store.close()
    return mirror


def _sync_superseded(remote: RemoteRoot, folder: Path) -> None:
    """The markers of the store's ``superseded/`` entries, each in a folder of its own name
    (what ``ls`` lists; their files stay in the store), and nothing the store no longer has."""
    base = remote.key(_layout.SUPERSEDED_DIR) + "/"
    markers = {
        info.key[len(base) :].split("/")[0]: info.key
        for info in remote.store.list(base)
        if info.key.endswith("/" + _layout.METADATA_FILE)
        and info.key[len(base) :].count("/") == 1
        and _layout.parse_superseded_name(info.key[len(base) :].split("/")[0]) is not None
    }
    if folder.is_dir():
        for entry in os.scandir(folder):
            if entry.name not in markers:
                _fs.remove_tree(Path(entry.path))
    for name, key in markers.items():
        marker = folder / name / _layout.METADATA_FILE
        if not marker.is_file():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_bytes(remote.store.get(key))


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
