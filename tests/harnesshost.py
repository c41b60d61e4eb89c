"""The host end of a guest harness driven over a socketpair, as the manager drives it over
virtio-serial (tests only)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pal.guest import protocol as p
from pal.guest.children import kill_group
from pal.guest.harness import Harness

TOKEN = "tok-1"


class Host:
    """The host end: sends requests, collects replies by request id."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.buf = b""
        self.next_id = 1
        self.heartbeats: list[p.Message] = []
        self.pending: list[p.Message] = []
        self.started: dict[int, int] = {}  # exec request id -> its process id

    def send(self, kind: str, data: bytes | None = None, **fields: Any) -> int:
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(p.encode({"id": rid, "k": kind, **fields}, data))
        return rid

    def recv(self) -> p.Message:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("harness closed the channel")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = p.decode(line)
        return msg if msg is not None else self.recv()

    def replies(self, rid: int) -> Iterator[p.Message]:
        """Messages for ``rid`` until its final one (ok/err/exit), in arrival order."""
        while True:
            for i, m in enumerate(self.pending):
                if m["id"] == rid:
                    del self.pending[i]
                    break
            else:
                m = self.recv()
                if m["k"] == p.K_HEARTBEAT:
                    self.heartbeats.append(m)
                    continue
                if m["id"] != rid:
                    self.pending.append(m)
                    continue
            if m["k"] == p.K_STARTED:  # an exec names its process first
                self.started[rid] = m["pid"]
                continue
            yield m
            if m["k"] in (p.K_OK, p.K_ERR, p.K_EXIT):
                return

    def call(self, kind: str, data: bytes | None = None, **fields: Any) -> p.Message:
        return list(self.replies(self.send(kind, data, **fields)))[-1]

    def run(self, *argv: str, **fields: Any) -> tuple[list[tuple[int, bytes]], p.Message]:
        fields.setdefault("tok", TOKEN)
        msgs = list(self.replies(self.send(p.K_EXEC, argv=list(argv), **fields)))
        chunks = [(m["fd"], p.payload(m)) for m in msgs if m["k"] == p.K_OUT]
        return chunks, msgs[-1]

    def next_heartbeat(self, timeout: float = 5.0) -> p.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.recv()
            if m["k"] == p.K_HEARTBEAT:
                self.heartbeats.append(m)
                return m
            self.pending.append(m)
        raise AssertionError("no heartbeat")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws


@pytest.fixture
def host(workspace: Path) -> Iterator[Host]:
    ours, theirs = socket.socketpair()
    harness = Harness(
        theirs.fileno(),
        workspace=str(workspace),
        workload_user=None,
        identity={"vm_id": "vm-1", "incarnation": 1, "token": TOKEN, "env": {"SECRET": "s3"}},
        heartbeat_interval=60,
    )
    t = threading.Thread(target=harness.serve, daemon=True)
    t.start()
    h = Host(ours)
    assert h.recv()["k"] == p.K_HEARTBEAT  # sent on connect
    try:
        yield h
    finally:
        # A test that failed half-way must not leave its commands running (a gated loop
        # would poll for ever): kill every process group the harness started.
        for proc in harness.processes.table.all():
            if proc.running:
                kill_group(proc.os_pid)
    ours.close()
    t.join(5)
    theirs.close()
    assert not t.is_alive()
