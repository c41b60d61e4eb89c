"""Upstream servers for network tests, on the host's loopback only (127.0.0.2).

The session's `pal up` resolves the test names to them (PAL_EGRESS_RESOLVE) and opens
127.0.0.2 as the one internal address guests may reach (PAL_EGRESS_ALLOW_INTERNAL), so a
guest's `curl http://api.test:PORT/` goes guest -> gateway -> 127.0.0.2:PORT. Nothing in
these tests targets any non-loopback address.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socketserver
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOST = "127.0.0.2"
# Names the session server resolves (tests/conftest.py passes these to `pal up`).
NAMES = {
    "api.test": HOST,
    "tls.test": HOST,
    "other.test": HOST,
    "loop.test": "127.0.0.1",  # an allowed name pointing at an internal address: refused
    "meta.test": "169.254.169.254",
}
RESOLVE_ENV = ",".join(f"{n}={ip}" for n, ip in NAMES.items())
ALLOW_INTERNAL_ENV = HOST
HELLO = b"hello-from-host\n"
CHUNK = 64 * 1024


@dataclass
class Upstream:
    http_port: int
    tls_port: int
    ca_pem: str  # the TLS server's self-signed certificate, for the guest's curl --cacert
    ca_path: Path | None = None  # the same as a file (PAL_EGRESS_CA_BUNDLE for brokered secrets)
    hang_release: threading.Event = field(default_factory=threading.Event)
    hung: list[str] = field(default_factory=list)  # paths of requests left hanging
    received: list[dict[str, str]] = field(default_factory=list)  # headers of /headers requests
    # /model/<key>: a model-like server; each key's answer waits until the test opens its gate
    gates: dict[str, threading.Event] = field(default_factory=dict)
    asked: dict[str, float] = field(default_factory=dict)  # key -> when its request arrived
    answered: dict[str, float] = field(default_factory=dict)  # key -> when the body was sent

    def gate(self, key: str) -> threading.Event:
        return self.gates.setdefault(key, threading.Event())


def model_body(n: int) -> bytes:
    """The /model answer: n deterministic bytes (the guest checks their sha256)."""
    return bytes((i * 7 + 3) % 251 for i in range(n))


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: Upstream

    def log_message(self, *_: object) -> None:
        pass

    def _send(self, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/hello":
            self._send(HELLO)
        elif path == "/headers":
            # What arrived is kept for the test; the client gets only digests of the values
            # (a brokered secret's value must not reach the guest through this echo).
            got = dict(self.headers.items())
            self.upstream.received.append(got)
            digests = {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in got.items()}
            self._send(json.dumps(digests).encode(), "application/json")
        elif path == "/reflect":
            # A careless upstream: every request header back, as response headers (an echo,
            # CORS from Origin, the request id, a redirect built from Host) and as the body.
            got = dict(self.headers.items())
            self.upstream.received.append(got)
            body = json.dumps(got).encode()
            self.send_response(200)
            for k, v in got.items():
                self.send_header(f"X-Echo-{k}", v)
            self.send_header("Access-Control-Allow-Origin", got.get("Origin", ""))
            self.send_header("X-Request-Id", got.get("X-Request-Id", ""))
            self.send_header("Content-Location", f"https://{got.get('Host', '')}/reflected")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path == "/time":
            # The host's wall clock, for a guest measuring its own clock against it.
            self._send(repr(time.time()).encode())
        elif path == "/host":
            self._send((self.headers.get("Host") or "").encode())
        elif path.startswith("/bytes/"):
            n = int(path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            block = bytes(range(256)) * (CHUNK // 256)
            left = n
            while left > 0:
                k = min(left, CHUNK)
                self.wfile.write(block[:k])
                left -= k
        elif path.startswith("/model/"):
            # Request in, then nothing until the test opens the key's gate; then the whole
            # body, chunked, in 64 KiB pieces (a model answering after "thinking").
            key = path.rsplit("/", 1)[1]
            n = int(self.path.split("bytes=", 1)[1]) if "bytes=" in self.path else 2 * 1024 * 1024
            self.upstream.asked[key] = time.time()
            self.upstream.gate(key).wait(300)
            body = model_body(n)
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, n, CHUNK):
                part = body[i : i + CHUNK]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.upstream.answered[key] = time.time()
        elif path == "/hang":
            # Headers and a first line at once, then nothing until the test lets go: a
            # client is mid-response, blocked reading.
            self.upstream.hung.append(path)
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            self.wfile.write(b"started\n")
            self.wfile.flush()
            self.upstream.hang_release.wait(300)
        else:
            self.send_error(404)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that hang up early (resets are part of the tests) are not errors


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "tls.key", tmp / "tls.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=tls.test", "-addext", "subjectAltName=DNS:tls.test,DNS:other.test,DNS:api.test",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    tmp = tmp_path_factory.mktemp("upstream")
    key, cert = _self_signed(tmp)
    up = Upstream(0, 0, cert.read_text(), ca_path=cert)
    handler = type("H", (_Handler,), {"upstream": up})
    plain = _Server((HOST, 0), handler)
    tls = _Server((HOST, 0), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    up.http_port, up.tls_port = plain.server_address[1], tls.server_address[1]  # type: ignore[misc]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (plain, tls)]
    for t in threads:
        t.start()
    try:
        yield up
    finally:
        up.hang_release.set()
        for g in list(up.gates.values()):
            g.set()
        for s in (plain, tls):
            s.shutdown()
            s.server_close()
