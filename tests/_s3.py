"""A real S3 server on loopback for the tests, and a proxy in front of it that injects faults.

Fixtures (registered in ``tests/conftest.py``):

- ``moto_s3`` (session): moto's S3 server on ``127.0.0.1`` on a free port, with one bucket.
- ``s3_root`` (function): a fresh, unique prefix in that bucket, with the ``AWS_*`` environment
  pointed at the loopback server for the test's duration (and nothing else: no profile, no
  config file, no instance metadata), so that nothing can leave the machine.
- ``s3_faults`` (function): a :class:`FaultProxy` in front of the server, and the same
  environment as ``s3_root`` but with the proxy as the endpoint.

Tests that use them skip when ``moto[server]`` is not installed (``pip install -e .[test]``
installs it).
"""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
BUCKET = "orbit-pt-test"


@dataclass(frozen=True)
class S3Server:
    """Where the loopback S3 server listens, and how to reach it."""

    endpoint_url: str
    bucket: str
    access_key_id: str = ACCESS_KEY
    secret_access_key: str = SECRET_KEY
    region: str = REGION

    @property
    def storage_options(self) -> dict[str, Any]:
        """The client's own keyword arguments (s3fs's names) that reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.access_key_id,
            "secret": self.secret_access_key,
            "client_kwargs": {"region_name": self.region},
        }

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point any AWS client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",  # obstore's switch for a plain-http endpoint
            "AWS_EC2_METADATA_DISABLED": "true",
        }


@dataclass(frozen=True)
class S3Root:
    """A fresh prefix in the test bucket: ``url`` is ``s3://bucket/prefix``."""

    server: S3Server
    prefix: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"s3://{self.server.bucket}/{self.prefix}"


# ------------------------------------------------------------------------------ the fault proxy


FaultAction = Literal["slowdown", "error", "drop", "drop_answer", "late_answer"]

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
     "upgrade", "expect", "content-length"}
)  # fmt: skip


_CODES = {
    400: "InvalidRequest",
    403: "AccessDenied",
    500: "InternalError",
    503: "ServiceUnavailable",
}


@dataclass
class _Fault:
    action: FaultAction
    remaining: int
    method: str | None
    query: str | None
    status: int
    path: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """One answer the proxy relayed: the request, its ``Range`` header, and the body's size."""

    method: str
    path: str  # the request's path, without the query string
    range: str | None
    status: int
    nbytes: int


class FaultProxy:
    """An HTTP/1.1 proxy on ``127.0.0.1`` that relays to an S3 server and fails chosen requests.

    :meth:`fail` arms a fault for the next ``times`` requests that match: ``"slowdown"`` answers
    503 SlowDown, ``"error"`` answers ``status`` (500 InternalError by default; 403 is
    AccessDenied), ``"drop"`` reads the request and resets the connection without a response
    (the server never sees it), and
    ``"drop_answer"`` relays the request and resets the connection instead of relaying the
    answer (the server acted; the client cannot know), and ``"late_answer"`` relays the request
    and holds the answer back for ``seconds`` (the server acted; the client is still waiting).
    Faults are consumed in the order they
    were armed; requests that match none are relayed unchanged, and recorded in
    :attr:`transfers` (what a client downloaded, counted on the wire).
    """

    def __init__(self, upstream: S3Server) -> None:
        self.upstream = upstream
        parts = urlsplit(upstream.endpoint_url)
        self._upstream_address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every request
        self.injected: list[tuple[FaultAction, str, str]] = []  # (action, method, path?query)
        self.transfers: list[Transfer] = []  # every answer relayed, in order
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def server(self) -> S3Server:
        """The upstream server's description, with the proxy as its endpoint."""
        host, port = self._server.server_address[:2]
        return S3Server(endpoint_url=f"http://{host!s}:{port}", bucket=self.upstream.bucket)

    def fail(
        self,
        action: FaultAction,
        times: int = 1,
        *,
        method: str | None = None,
        query: str | None = None,
        status: int = 500,
        path: str | None = None,
        seconds: float = 0.0,
    ) -> None:
        """Fail the next ``times`` requests whose method is ``method``, whose query string
        has the parameter ``query`` (e.g. ``"partNumber"``) and whose path ends with ``path``
        (e.g. ``"model/model.safetensors"``); ``None`` matches any."""
        with self._lock:
            self._faults.append(_Fault(action, times, method, query, status, path, seconds))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _take(self, method: str, target: str) -> _Fault | None:
        params = parse_qs(urlsplit(target).query, keep_blank_values=True)
        with self._lock:
            self.requests.append((method, target))
            for fault in self._faults:
                if fault.remaining <= 0:
                    continue
                if fault.method is not None and fault.method != method:
                    continue
                if fault.query is not None and fault.query not in params:
                    continue
                if fault.path is not None and not urlsplit(target).path.endswith(fault.path):
                    continue
                fault.remaining -= 1
                self.injected.append((fault.action, method, target))
                return fault
        return None


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" answered for us
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET  # noqa: N815 -- BaseHTTPRequestHandler's names

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        fault = proxy._take(self.command, self.path)
        if fault is not None and fault.action == "drop_answer":
            self._forward(proxy, body)
        if fault is not None and fault.action == "late_answer":
            status, headers, data = self._forward(proxy, body)
            time.sleep(fault.seconds)
            self._answer(proxy, status, headers, data)
            return
        if fault is not None and fault.action in ("drop", "drop_answer"):
            # SO_LINGER 0: close() sends a RST -- a connection reset, with no response at all.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault is not None:
            code, status = (
                ("SlowDown", 503)
                if fault.action == "slowdown"
                else (_CODES.get(fault.status, "InjectedError"), fault.status)
            )
            payload = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>injected by the test proxy</Message></Error>"
            ).encode()
            self.send_response_only(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        self._answer(proxy, *self._forward(proxy, body))

    def _answer(
        self, proxy: FaultProxy, status: int, headers: list[tuple[str, str]], data: bytes
    ) -> None:
        """Relay the upstream server's answer to the client, and record it."""
        transfer = Transfer(
            self.command, urlsplit(self.path).path, self.headers.get("Range"), status, len(data)
        )
        with proxy._lock:
            proxy.transfers.append(transfer)
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        length = {k.lower(): v for k, v in headers}.get("content-length")
        # A HEAD answer keeps the object's length and sends no body.
        self.send_header("Content-Length", str(length if self.command == "HEAD" else len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _forward(self, proxy: FaultProxy, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        for attempt in range(2):  # once more on a fresh connection if the kept one went stale
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*proxy._upstream_address, timeout=60)
            try:
                self._upstream.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        self._upstream.putheader(name, value)
                self._upstream.putheader("Content-Length", str(len(body)))
                self._upstream.endheaders(body)
                response = self._upstream.getresponse()
                data = response.read()
                return response.status, response.getheaders(), data
            except (ConnectionError, http.client.HTTPException):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def finish(self) -> None:
        super().finish()
        if self._upstream is not None:
            self._upstream.close()


# ------------------------------------------------------------------------------------- fixtures


_AWS_UNSET = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)  # fmt: skip


def _aws_env(monkeypatch: pytest.MonkeyPatch, server: S3Server, tmp_path: Path) -> None:
    """Point every AWS client at ``server`` and at nothing else, for one test."""
    for name in _AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    # No ~/.aws files, and no HTTP proxy between the client and loopback.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def _unique_prefix(request: pytest.FixtureRequest) -> str:
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port) with one empty bucket; stopped after."""
    pytest.importorskip("moto.server", reason="needs moto[server]: pip install -e .[test]")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)  # one line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        server = S3Server(endpoint_url=f"http://{host}:{port}", bucket=BUCKET)
        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )
        client.create_bucket(Bucket=BUCKET)
        client.close()
        yield server
    finally:
        moto.stop()
        werkzeug = getattr(moto, "_server", None)  # stop() leaves the listening socket open
        if werkzeug is not None:
            werkzeug.server_close()
        werkzeug_log.setLevel(level)


@pytest.fixture
def s3_root(
    moto_s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> S3Root:
    """A fresh prefix on the loopback server, with the AWS environment pointed at it."""
    _aws_env(monkeypatch, moto_s3, tmp_path)
    return S3Root(moto_s3, _unique_prefix(request), moto_s3.storage_options)


@pytest.fixture
def s3_faults(
    moto_s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[FaultProxy, S3Root]]:
    """A :class:`FaultProxy` in front of the loopback server, and a fresh prefix reached
    through it (storage options and environment both name the proxy)."""
    proxy = FaultProxy(moto_s3)
    try:
        _aws_env(monkeypatch, proxy.server, tmp_path)
        yield proxy, S3Root(proxy.server, _unique_prefix(request), proxy.server.storage_options)
    finally:
        proxy.close()
