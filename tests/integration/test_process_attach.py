"""Issue 22: a process attached over a WebSocket (docs/processes.md, "WebSocket attach"), on
real VMs: a terminal driven by keystrokes, its size followed by `stty size`, binary stdin,
reattach from an offset with no byte lost or repeated, a pause ending the socket with
`detached`, and who may attach (the API key, a signed link, nobody else)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.conftest import PalServer
from tests.integration.test_processes import procs, start, wait

pytestmark = pytest.mark.vm

RECV_S = 120  # one message from a VM under TCG on a busy machine; a deadline, not a wait


@pytest.fixture(scope="module")
def shared(pal_server: PalServer, tenant_key: str) -> Iterator[tuple[httpx.Client, str]]:
    with pal_server.client(tenant_key) as api:
        r = api.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm_id = r.json()["vmId"]
        try:
            yield api, vm_id
        finally:
            api.delete(f"/v1/runtime/vms/{vm_id}")


def ws_url(server: PalServer, vm: str, pid: int, query: str = "") -> str:
    return server.url.replace("http", "ws", 1) + f"{procs(vm)}/{pid}/attach" + (f"?{query}" if query else "")


@contextlib.contextmanager
def attach(
    server: PalServer, vm: str, pid: int, key: str | None, query: str = ""
) -> Iterator[ClientConnection]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with connect(ws_url(server, vm, pid, query), additional_headers=headers, open_timeout=RECV_S) as ws:
        hello = json.loads(ws.recv(timeout=RECV_S))
        assert hello["type"] == "attached" and hello["processId"] == pid, hello
        yield ws


class Screen:
    """What a client got: output bytes, and the notices."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.out = b""
        self.notices: list[dict[str, Any]] = []

    def until(self, needle: bytes) -> bytes:
        while needle not in self.out:
            self.pump()
        return self.out

    def pump(self) -> dict[str, Any] | None:
        msg = self.ws.recv(timeout=RECV_S)
        if isinstance(msg, bytes):
            self.out += msg
            return None
        notice: dict[str, Any] = json.loads(msg)
        self.notices.append(notice)
        return notice

    def end(self) -> dict[str, Any]:
        """The closing notice (exit, detached, error)."""
        while True:
            notice = self.pump()
            if notice is not None and notice["type"] in ("exit", "detached", "error"):
                return notice


def test_a_terminal_over_the_websocket(pal_server: PalServer, tenant_key: str, shared: Any) -> None:
    api, vm = shared
    pid = start(api, vm, "exec /bin/sh -i", pty={"cols": 80, "rows": 24})
    with attach(pal_server, vm, pid, tenant_key) as ws:
        s = Screen(ws)
        ws.send(b"tty; stty size\r")
        assert b"24 80" in s.until(b"24 80")
        assert b"/dev/pts/" in s.out
        ws.send(json.dumps({"type": "resize", "cols": 132, "rows": 40}))
        ws.send(b"stty size\r")
        s.until(b"40 132")
        # a bad control message is answered, and the terminal goes on
        ws.send(json.dumps({"type": "resize", "cols": 0, "rows": 40}))
        ws.send(json.dumps({"type": "nonsense"}))
        ws.send(b"echo still-$((6*7))\r")
        s.until(b"still-42")
        errors = [n for n in s.notices if n["type"] == "error"]
        assert len(errors) == 2 and all(e["status"] == 400 for e in errors), s.notices
        ws.send(b"exit 7\r")
        end = s.end()
    assert end["type"] == "exit" and end["exitCode"] == 7, end
    info = api.get(f"{procs(vm)}/{pid}").json()
    assert end["offset"] == info["journal"]["end"], (end, info)


def test_binary_stdin_and_reattach_from_an_offset(
    pal_server: PalServer, tenant_key: str, shared: Any
) -> None:
    api, vm = shared
    data = bytes(range(256)) * 512  # every byte value, 128 KiB: two frames of the bound
    pid = start(api, vm, "cat > /tmp/in.bin; sha256sum /tmp/in.bin; seq 1 20000", stdin=True)
    with attach(pal_server, vm, pid, tenant_key) as ws:
        s = Screen(ws)
        ws.send(data[: 64 * 1024])
        ws.send(data[64 * 1024 :])
        ws.send(json.dumps({"type": "eof"}))
        s.until(b"\n1\n")
        cut = len(s.out)  # drop the connection part-way
    with attach(pal_server, vm, pid, tenant_key, f"from={cut}") as ws:
        s2 = Screen(ws)
        end = s2.end()
    assert end["type"] == "exit" and end["exitCode"] == 0, end
    whole = s.out[:cut] + s2.out
    expected = f"{hashlib.sha256(data).hexdigest()}  /tmp/in.bin\n".encode()
    expected += "".join(f"{i}\n" for i in range(1, 20001)).encode()
    assert whole == expected
    assert end["offset"] == len(expected)


def test_a_frame_over_the_bound_closes_the_socket(
    pal_server: PalServer, tenant_key: str, shared: Any
) -> None:
    api, vm = shared
    pid = start(api, vm, "cat >/dev/null", stdin=True)
    with attach(pal_server, vm, pid, tenant_key) as ws:
        ws.send(b"x" * (64 * 1024 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=RECV_S)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    api.delete(f"{procs(vm)}/{pid}")


def test_who_may_attach(pal_server: PalServer, tenant_key: str, shared: Any) -> None:
    api, vm = shared
    pid = start(api, vm, "echo linked; sleep 600")

    def refused(key: str | None, query: str = "", pid_: int = pid) -> int:
        with pytest.raises(InvalidStatus) as exc, attach(pal_server, vm, pid_, key, query):
            pass
        return exc.value.response.status_code

    assert refused(None) == 401
    assert refused("pal_not-a-key") == 401
    other = pal_server.tenant("attach-other")
    assert refused(other) == 404  # another tenant's VM: as if it did not exist
    assert refused(tenant_key, pid_=999_999) == 404
    assert refused(tenant_key, "from=-1") == 400
    assert refused(tenant_key, "from=%C2%B2") == 400  # a digit to str.isdigit(), not to int()
    assert refused(tenant_key, "from=99999999") == 400  # past the output's end

    # a signed link opens this process, and only it
    r = api.post(f"{procs(vm)}/{pid}/attach-url", json={"expiresInSecs": 60})
    assert r.status_code == 200, r.text
    link = r.json()
    path, _, query = link["url"].partition("?")
    assert path == f"{procs(vm)}/{pid}/attach"
    with attach(pal_server, vm, pid, None, query) as ws:
        Screen(ws).until(b"linked\n")
    other_pid = start(api, vm, "sleep 600")
    assert refused(None, query, pid_=other_pid) == 401
    assert refused(None, query.replace("palToken=", "palToken=x")) == 401
    # revoked like a port link
    assert api.delete(f"/v1/runtime/vms/{vm}/port-links/{link['linkId']}").status_code == 200
    assert refused(None, query) == 401
    with pal_server.client(other) as api2:
        assert api2.post(f"{procs(vm)}/{pid}/attach-url", json={}).status_code == 404
    for p in (pid, other_pid):
        api.delete(f"{procs(vm)}/{p}")


def test_a_link_ends_its_socket_opens_only_from_its_origin_and_may_be_read_only(
    pal_server: PalServer, shared: Any
) -> None:
    """The finding: after ``DELETE .../port-links/{id}`` answered 200, stdin sent through the
    socket the link had opened still reached ``cat``. Now the socket ends with the link; a
    link from another origin's page is 403; a read-only link watches and types nothing."""
    api, vm = shared
    pid = start(api, vm, "cat", stdin=True)

    def link(**body: Any) -> tuple[str, str]:
        r = api.post(f"{procs(vm)}/{pid}/attach-url", json={"expiresInSecs": 300, **body})
        assert r.status_code == 200, r.text
        return r.json()["url"].partition("?")[2], r.json()["linkId"]

    query, link_id = link()
    with pytest.raises(InvalidStatus) as foreign:
        connect(ws_url(pal_server, vm, pid, query), origin="http://evil.example", open_timeout=RECV_S)  # type: ignore[arg-type]
    assert foreign.value.response.status_code == 403
    with attach(pal_server, vm, pid, None, query) as ws:
        screen = Screen(ws)
        ws.send(b"before\n")
        screen.until(b"before\n")
        assert api.delete(f"/v1/runtime/vms/{vm}/port-links/{link_id}").status_code == 200
        with pytest.raises(ConnectionClosed):
            while True:
                notice = screen.pump()
                if notice is not None:
                    assert notice["type"] == "error" and notice["status"] == 401, notice
        assert ws.close_code == 1008
    watch, _ = link(readOnly=True)
    with attach(pal_server, vm, pid, None, watch) as ws:
        ws.send(b"typed\n")
        notice = Screen(ws).pump()
        while notice is None:
            notice = Screen(ws).pump()
        assert notice["type"] == "error" and notice["status"] == 403, notice
    with attach(pal_server, vm, pid, api.headers["Authorization"].split()[1]) as ws:
        screen = Screen(ws)
        ws.send(b"after\n")
        out = screen.until(b"after\n")
        assert b"typed" not in out, "the read-only link's input reached the process"
    api.delete(f"{procs(vm)}/{pid}")


def test_a_pause_ends_the_socket_with_detached_and_a_reattach_goes_on(
    pal_server: PalServer, tenant_key: str, api: httpx.Client, vm: str
) -> None:
    pid = start(api, vm, "read x; echo after-$x", stdin=True)
    with attach(pal_server, vm, pid, tenant_key) as ws:
        s = Screen(ws)
        r = api.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": "snapshot"})
        assert r.status_code == 200, r.text
        end = s.end()
    assert end["type"] == "detached" and end["reason"], end
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    with attach(pal_server, vm, pid, tenant_key, f"from={end['offset']}") as ws:
        s = Screen(ws)
        ws.send(b"resumed\n")
        end = s.end()
    assert end["type"] == "exit" and end["exitCode"] == 0, end
    assert s.out == b"after-resumed\n"
    assert wait(api, vm, pid)["exitCode"] == 0
