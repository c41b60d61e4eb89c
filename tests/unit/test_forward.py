"""A follower replica forwards to the leader (pal/api/forward.py), as two real servers on
loopback: the leader's app on the real Scheduler with a fake node, and a follower sharing
its store whose leadership says "not me, the leader is there". What the follower answers
itself, what reaches the leader (each request the leader sees is recorded), WebSockets,
the dashboard's actions, and the seconds of a failover when the lease still names a dead
leader."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, WebSocket
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from pal.api.callers import NODE_HEADER, Callers
from pal.api.forward import ForwardToLeader, forwarded_ok, forwarding_key, sign_forwarded
from pal.config import Settings
from pal.scheduler.scheduler import Scheduler
from pal.server import control_plane_app
from pal.store import Store
from pal.wire.auth import node_token
from tests.apienv import serve
from tests.conftest import free_port
from tests.fakes import SchedEnv, make_env

SECRET = b"replicas-share-this-secret"


class Recorder:
    """ASGI wrapper: what reached this app (method or WS, path, forwarded by a replica?)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str, bool]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            fwd = any(k.lower() == b"x-pal-forwarded" for k, _ in scope["headers"])
            self.seen.append((scope.get("method", "WS"), scope["path"], fwd))
        await self.app(scope, receive, send)


@dataclass
class FakeLeadership:
    """A follower's view of the lease: ``urls`` are the leader URLs the lease names, one per
    read (the last one stays); ``lead_after`` reads, this replica leads itself."""

    urls: list[str | None]
    lead_after: int | None = None
    reads: int = 0
    token: int | None = None
    renew_interval_s: float = 1.0
    leading: bool = False
    log: list[str | None] = field(default_factory=list)

    async def is_leader(self) -> bool:
        return self.leading

    async def leader_url(self) -> str | None:
        self.reads += 1
        if self.lead_after is not None and self.reads >= self.lead_after:
            self.leading = True
        url = self.urls[min(self.reads, len(self.urls)) - 1]
        self.log.append(url)
        return url

    async def acquire(self) -> bool:
        return self.leading

    async def release(self) -> None:
        return None


@dataclass
class Replicas:
    env: SchedEnv  # the leader's scheduler, store and fake node
    leader: Recorder
    leader_url: str
    follower_url: str
    lease: FakeLeadership


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    env = make_env(tmp_path / "leader", max_vms=4)
    leader = Recorder(control_plane_app(env.sched, env.store, env.settings, None, SECRET))
    with serve(leader) as leader_url:  # type: ignore[arg-type]
        settings = Settings(data_dir=tmp_path / "follower", leader_lease_s=1.0)
        store = Store(f"sqlite:///{env.settings.db_path}")
        lease = FakeLeadership([leader_url])
        follower = Scheduler(settings, store, leader=lease)  # no node of its own, as `pal server`
        with serve(control_plane_app(follower, store, settings, None, SECRET)) as follower_url:
            yield Replicas(env, leader, leader_url, follower_url, lease)
        store.close()
    env.store.close()


def _api(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_a_follower_answers_reads_itself_and_forwards_the_rest(replicas: Replicas) -> None:
    with _api(replicas.follower_url, replicas.env.api_key) as c:
        r = c.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm = r.json()["vmId"]
        assert vm in replicas.env.manager.alive  # it runs where the leader placed it
        got = c.get(f"/v1/runtime/vms/{vm}")
        assert got.status_code == 200 and got.json()["state"] == "running"
        assert c.get("/v1/runtime/vms").json()["vms"][0]["vmId"] == vm
        with c.stream(
            "POST",
            f"/v1/runtime/vms/{vm}/exec",
            json={"command": "echo", "argv": ["hi"]},
            headers={"Accept": "text/event-stream"},
        ) as sse:
            assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
            text = "".join(sse.iter_text())
        assert "event: stdout" in text and "hi" in text and "event: exit" in text
        assert c.post("/v1/runtime/vms/vm-nope/pause").status_code == 404  # the leader's answer
    seen = replicas.leader.seen
    assert ("POST", "/v1/runtime/schedule", True) in seen
    assert ("POST", f"/v1/runtime/vms/{vm}/exec", True) in seen
    assert ("POST", "/v1/runtime/vms/vm-nope/pause", True) in seen
    assert not [s for s in seen if s[0] == "GET"]  # reads were the follower's own


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html
    return m.group(1)


def test_the_dashboard_on_a_follower_acts_on_the_leader(replicas: Replicas) -> None:
    """`pal server` serves the dashboard; a follower's dashboard pages and actions run on
    the leader, signed in with a session any replica accepts."""
    with _api(replicas.leader_url, replicas.env.api_key) as c:
        vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
    with httpx.Client(base_url=replicas.follower_url, timeout=60) as browser:
        page = browser.get("/runtime", follow_redirects=True)
        assert page.status_code == 200 and 'name="api_key"' in page.text  # the sign-in page
        signed = browser.post(
            "/runtime/login",
            data={"api_key": replicas.env.api_key, "csrf": _csrf(page.text), "next": "/runtime"},
        )
        assert signed.status_code == 303, signed.text
        listing = browser.get("/runtime")
        assert listing.status_code == 200 and vm in listing.text
        css = re.search(r'href="(/runtime/static/[^"]+\.css)"', listing.text)
        assert css and browser.get(css.group(1)).status_code == 200
        paused = browser.post(f"/runtime/{vm}/pause", headers={"X-CSRF-Token": _csrf(listing.text)})
        assert paused.status_code == 200, paused.text
    assert ("snapshot", vm) in replicas.env.manager.calls  # done by the leader's scheduler
    assert replicas.env.store.get_vm(vm).state == "paused"  # type: ignore[union-attr]
    assert ("POST", f"/runtime/{vm}/pause", True) in replicas.leader.seen
    assert not [s for s in replicas.leader.seen if s[1].startswith("/runtime/static/")]


def test_a_follower_retries_while_the_lease_still_names_a_dead_leader(replicas: Replicas) -> None:
    """The leader was killed: its lease names it until it expires, then none, then the new
    leader. A request in those seconds waits for the new leader instead of failing."""
    dead = f"http://127.0.0.1:{free_port()}"
    replicas.lease.urls = [dead, dead, dead, None, None, replicas.leader_url]
    with _api(replicas.follower_url, replicas.env.api_key) as c:
        r = c.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    assert replicas.lease.log[-1] == replicas.leader_url and dead in replicas.lease.log
    assert [s for s in replicas.leader.seen if s[1] == "/v1/runtime/schedule"] == [
        ("POST", "/v1/runtime/schedule", True)
    ]  # sent once to the leader that answered


# -- the middleware alone, around small apps -------------------------------------------------


def _local_app() -> FastAPI:
    app = FastAPI()

    @app.post("/act")
    async def act() -> dict[str, str]:
        return {"by": "follower"}

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("follower")
        await socket.close()

    return app


def _leader_app() -> FastAPI:
    app = FastAPI()

    @app.post("/act")
    async def act() -> dict[str, str]:
        return {"by": "leader"}

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        if socket.query_params.get("deny"):
            from fastapi.responses import JSONResponse

            await socket.send_denial_response(
                JSONResponse({"error": {"code": "NOT_FOUND", "message": "no such VM"}}, status_code=404)
            )
            return
        offered = socket.headers.get("sec-websocket-protocol", "")
        await socket.accept(subprotocol="pal.v1" if "pal.v1" in offered else None)
        who = {
            "auth": socket.headers.get("authorization"),
            "forwarded": socket.headers.get("x-pal-forwarded"),
            "q": socket.query_params.get("q"),
        }
        await socket.send_text(json.dumps(who))
        while True:
            msg = await socket.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("text") == "bye":
                await socket.close(code=4321, reason="done")
                return
            if msg.get("bytes") is not None:
                await socket.send_bytes(msg["bytes"][::-1])
            else:
                await socket.send_text(str(msg.get("text")).upper())

    return app


@pytest.fixture
def leader_url() -> Iterator[str]:
    with serve(_leader_app()) as url:
        yield url


KEY = forwarding_key(SECRET)


def _follower(lease: FakeLeadership, failover_s: float = 5.0) -> Any:
    return ForwardToLeader(_local_app(), lease.is_leader, lease.leader_url, failover_s=failover_s, key=KEY)


def _signed(value: str | None) -> bool:
    return value is not None and forwarded_ok(KEY, value, "WEBSOCKET", "/ws")


def test_websockets_reach_the_leader_both_ways(leader_url: str) -> None:
    lease = FakeLeadership([leader_url])
    with serve(_follower(lease)) as url:  # type: ignore[arg-type]
        ws_url = url.replace("http", "ws") + "/ws?q=42"
        with ws_connect(
            ws_url, subprotocols=["pal.v1"], additional_headers={"Authorization": "Bearer k"}
        ) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "pal.v1"
            who = json.loads(ws.recv())
            assert who["auth"] == "Bearer k" and who["q"] == "42" and _signed(who["forwarded"])
            ws.send("hello")
            assert ws.recv() == "HELLO"
            ws.send(b"\x00\x01\xff")
            assert ws.recv() == b"\xff\x01\x00"
            ws.send("bye")
            with pytest.raises(ConnectionClosed):
                ws.recv()
            assert ws.close_code == 4321 and ws.close_reason == "done"  # the leader's close
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(url.replace("http", "ws") + "/ws?deny=1")
        assert refused.value.response.status_code == 404  # the leader's refusal, as it is
        assert json.loads(refused.value.response.body or b"")["error"]["message"] == "no such VM"


def test_a_websocket_waits_for_the_new_leader_too(leader_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    lease = FakeLeadership([dead, dead, None, leader_url])
    with serve(_follower(lease)) as url, ws_connect(url.replace("http", "ws") + "/ws") as ws:  # type: ignore[arg-type]
        assert _signed(json.loads(ws.recv())["forwarded"])
    assert lease.log[-1] == leader_url


def test_without_a_leader_in_time_the_answer_is_not_leader(leader_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for urls, words in (([None], "no control-plane replica leads"), ([dead], f"the leader ({dead}) did not")):
        lease = FakeLeadership(list(urls))
        with serve(_follower(lease, failover_s=0.5)) as url:  # type: ignore[arg-type]
            r = httpx.post(url + "/act", timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "NOT_LEADER", r.text
            assert words in r.json()["error"]["message"]
            with pytest.raises(InvalidStatus) as refused:
                ws_connect(url.replace("http", "ws") + "/ws")
            assert refused.value.response.status_code == 503
        assert lease.reads > 1  # it looked again before giving up


def test_a_follower_that_becomes_leader_meanwhile_answers_itself() -> None:
    lease = FakeLeadership([None], lead_after=3)
    with serve(_follower(lease)) as url:  # type: ignore[arg-type]
        r = httpx.post(url + "/act", timeout=30)
        assert r.status_code == 200 and r.json() == {"by": "follower"}
        with ws_connect(url.replace("http", "ws") + "/ws") as ws:
            assert ws.recv() == "follower"


# -- who may send X-Pal-Forwarded, and whose body a follower holds -------------------------------


def test_a_forged_forwarded_header_is_refused_by_a_follower(replicas: Replicas) -> None:
    """Only a replica signs X-Pal-Forwarded: without the shared secret, a caller cannot make a
    follower act on a request itself (or skip forwarding it)."""
    now = time.time()
    path = "/v1/runtime/schedule"
    forged = [
        "1",  # what a replica used to send
        sign_forwarded(forwarding_key(b"another secret"), "POST", path),
        sign_forwarded(KEY, "POST", "/v1/runtime/vms"),  # another path's
        sign_forwarded(KEY, "GET", path),  # another method's
        sign_forwarded(KEY, "POST", path, now=now - 3600),  # an old one
    ]
    with _api(replicas.follower_url, replicas.env.api_key) as c:
        for value in forged:
            r = c.post(path, json={}, headers={"X-Pal-Forwarded": value})
            assert r.status_code == 403, (value, r.text)
            assert "X-Pal-Forwarded" in r.json()["error"]["message"]
        assert c.get("/v1/runtime/vms").json()["vms"] == []  # nothing was scheduled
        ok = c.post(path, json={}, headers={"X-Pal-Forwarded": sign_forwarded(KEY, "POST", path)})
        # A replica's signature is taken: the follower answers it itself (it has no node here).
        assert ok.status_code != 403 and "X-Pal-Forwarded" not in ok.text, ok.text
    assert [s for s in replicas.leader.seen if s[1] == path] == []


def _raw(url: str, head: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``head`` and only ``body`` (less than it declares); the status and JSON answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        headers, _, rest = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", headers).group(1))  # type: ignore[union-attr]
        while len(rest) < length:
            rest += sock.recv(65536)
    return int(headers.split()[1]), json.loads(rest)


def test_an_anonymous_large_body_is_refused_before_the_follower_reads_it(replicas: Replicas) -> None:
    """Declared larger than the anonymous bound: 401 while most of it is still unsent (the
    follower holds none of it), and nothing reaches the leader. With an API key the same
    upload is forwarded."""
    with _api(replicas.leader_url, replicas.env.api_key) as c:
        vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
    size = 1 << 20
    port = replicas.follower_url.rsplit(":", 1)[1]
    for path, extra in (
        (f"/v1/runtime/vms/{vm}/files/content?path=big.bin", "Content-Type: application/octet-stream\r\n"),
        ("/runtime/login", "Content-Type: application/x-www-form-urlencoded\r\n"),
        (f"/v1/runtime/vms/{vm}/files/content?path=big.bin", "Authorization: Bearer not-a-key\r\n"),
    ):
        method = "POST" if path == "/runtime/login" else "PUT"
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}Content-Length: {size}\r\n\r\n"
        status, body = _raw(replicas.follower_url, head, b"x" * 4096)  # 4 KiB of the 1 MiB sent
        assert status == 401, body
        assert body["error"]["code"] == "UNAUTHENTICATED" and "credentials" in body["error"]["message"]
    assert not [s for s in replicas.leader.seen if s[0] in ("PUT", "POST") and s[2]]  # nothing forwarded
    with _api(replicas.follower_url, replicas.env.api_key) as c:
        r = c.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "big.bin"}, content=b"y" * size)
        assert r.status_code == 200, r.text
    assert ("PUT", f"/v1/runtime/vms/{vm}/files/content", True) in replicas.leader.seen


async def test_a_follower_knows_operators_tenants_and_nodes_by_their_credentials(tmp_path: Path) -> None:
    env = make_env(tmp_path, cluster_secret="s3cret", admin_token="op-token")
    callers = Callers(env.store, env.settings)

    def scope(*headers: tuple[str, str]) -> dict[str, Any]:
        return {"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}

    auth = "Authorization"
    assert await callers.known(scope((auth, "Bearer op-token")))
    assert await callers.known(scope((auth, f"Bearer {env.api_key}")))
    assert await callers.known(scope((auth, f"Bearer {node_token('s3cret', 'n1')}"), (NODE_HEADER, "n1")))
    assert not await callers.known(scope((auth, f"Bearer {node_token('s3cret', 'n1')}"), (NODE_HEADER, "n2")))
    assert not await callers.known(scope((auth, "Bearer guess")))
    assert not await callers.known(scope())
    env.store.close()


def test_a_follower_forwards_a_ports_origin_with_its_host(replicas: Replicas) -> None:
    """A VM port's origin is named by the Host: the follower forwards its requests and
    WebSockets to the leader with that Host, and the leader answers them from the port."""
    from websockets.sync.server import ServerConnection
    from websockets.sync.server import serve as ws_serve

    def echo(conn: ServerConnection) -> None:
        for msg in conn:
            conn.send(msg)

    with ws_serve(echo, "127.0.0.1", 0) as guest:
        threading.Thread(target=guest.serve_forever, daemon=True).start()
        replicas.env.manager.port_servers[8000] = guest.socket.getsockname()[1]
        with _api(replicas.follower_url, replicas.env.api_key) as c:
            vm = c.post("/v1/runtime/schedule", json={}).json()["vmId"]
            host = f"8000-{vm}.localhost:8082"
            # The guest's WebSocket server answers plain HTTP with 426: the port answered.
            r = c.get("/runtime/login", headers={"Host": host})
            assert r.status_code == 426, r.text
            port = int(replicas.follower_url.rsplit(":", 1)[1])
            auth = {"Authorization": f"Bearer {replicas.env.api_key}"}
            with ws_connect(f"ws://{host}/ws", address=("127.0.0.1", port), additional_headers=auth) as ws:
                ws.send("hi")
                assert ws.recv(timeout=30) == "hi"
        guest.shutdown()
    seen = replicas.leader.seen
    assert ("GET", "/runtime/login", True) in seen  # the leader's ports app, not its dashboard
    assert ("WS", "/ws", True) in seen
