"""What a signed link opened ends with it (pal/api/port_links.py): a socket opened through a
port link closes when the link is revoked, expires or its key is rotated out (the finding:
after the revocation answered 200, stdin through the open socket still reached ``cat``);
a link is taken only from its own origin; an attach link may be read-only. On the real API
and scheduler with the fake runtime manager (a loopback server plays the guest's port); the
attach link on a real VM is tests/integration/test_process_attach.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from pal.api import port_links
from pal.api.port_links import Links, origin_ok
from pal.errors import Unauthorized
from tests.apienv import ApiEnv, make_api, serve

PORT = 7000


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A loopback TCP echo server standing in for the guest's server."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed at the end
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        acceptor.join()
        srv.close()


@pytest.fixture
def env(tmp_path: Path, echo_port: int) -> ApiEnv:
    e = make_api(tmp_path)
    e.manager.port_servers[PORT] = echo_port
    return e


async def _link(url: str, key: str, vm: str | None = None, secs: int = 300) -> tuple[str, str, str]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
        if vm is None:
            vm = (await c.post("/v1/runtime/schedule", json={})).json()["vmId"]
        made = (await c.post(f"/v1/runtime/vms/{vm}/ports/{PORT}/url", json={"expiresInSecs": secs})).json()
    token = made["url"].split("palToken=", 1)[1]
    return vm, token, made["linkId"]


async def _tunnel(url: str, vm: str, token: str, origin: str | None = None) -> object:
    """A port tunnel opened with the link, its first frame said ok, one echo through it; or
    the refusal (the tunnel answers its status in its first frame: manager/tunnel.py)."""
    ws = await connect(
        url.replace("http://", "ws://") + f"/v1/runtime/vms/{vm}/tunnel/{PORT}?palToken={token}",
        origin=origin,  # type: ignore[arg-type]
    )
    first = json.loads(await ws.recv())
    if "error" in first:
        await ws.close()
        raise Refused(first["status"], first["error"]["message"])
    await ws.send(b"ping")
    assert await ws.recv() == b"ping"
    return ws


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


async def _closed(ws: object) -> bool:
    """The socket closes: whatever it had sent is read first (60 s: a hang guard, not a
    speed bound; it closes within a recheck period)."""

    async def drain() -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await ws.recv()  # type: ignore[attr-defined]

    await asyncio.wait_for(drain(), 60)
    return True


async def test_a_revoked_link_closes_the_socket_it_opened(env: ApiEnv) -> None:
    with serve(env.app) as url:
        vm, token, link_id = await _link(url, env.key_a)
        ws = await _tunnel(url, vm, token)
        other = await _tunnel(url, vm, (await _link(url, env.key_a, vm))[1])
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}) as c:
            assert (await c.delete(f"/v1/runtime/vms/{vm}/port-links/{link_id}")).status_code == 200
        assert await _closed(ws)
        await other.send(b"still")  # type: ignore[attr-defined]
        assert await other.recv() == b"still", "another link's socket is not touched"  # type: ignore[attr-defined]
        await other.close()  # type: ignore[attr-defined]
        with pytest.raises(Refused, match="401 this port link was revoked"):
            await _tunnel(url, vm, token)


async def test_a_link_ends_its_socket_at_expiry_and_when_its_key_is_rotated(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(port_links, "LINK_RECHECK_S", 0.2)
    with serve(env.app) as url:
        vm, token, _ = await _link(url, env.key_a, secs=2)
        expiring = await _tunnel(url, vm, token)
        assert await _closed(expiring)
        vm, token, _ = await _link(url, env.key_a)
        ws = await _tunnel(url, vm, token)
        tenant = env.sched.store.tenant_by_api_key(env.key_a)
        assert tenant is not None
        env.sched.store.rotate_api_key(tenant.id)  # `pal tenants rotate-key`, from another process
        assert await _closed(ws)


async def test_a_link_is_taken_only_from_its_own_origin(env: ApiEnv) -> None:
    with serve(env.app) as url:
        vm, token, _ = await _link(url, env.key_a)
        with pytest.raises(Refused) as refused:
            await _tunnel(url, vm, token, origin="http://evil.example")
        assert refused.value.status == 403
        ws = await _tunnel(url, vm, token, origin=url)  # this server's own page
        await ws.close()  # type: ignore[attr-defined]
    assert origin_ok(None, b"h:1") and origin_ok(b"http://h:1", b"h:1")
    assert not origin_ok(b"http://h:2", b"h:1") and not origin_ok(b"null", b"h:1")
    assert origin_ok("https://app.example", "h:1", lambda o: o == "https://app.example")


async def test_a_read_only_link_says_so_in_its_token(tmp_path: Path) -> None:
    class Store:
        def port_link_check(self, tenant: str, link_id: str) -> object:
            raise AssertionError("not read")

    links = Links(b"k" * 32, Store(), salt="pal-attach-link-v1", noun="process attach")
    ro = links.sign("t", "vm-a", 3, int(time.time()) + 60, "h", read_only=True)
    rw = links.sign("t", "vm-a", 3, int(time.time()) + 60, "h")
    assert links.decode(links.token(ro)).read_only and not links.decode(links.token(rw)).read_only
    with pytest.raises(Unauthorized):
        Links(b"k" * 32, Store()).decode(links.token(ro))  # a port link is not an attach link


async def test_while_valid_runs_work_to_its_end_when_the_link_lasts() -> None:
    class Store:
        def port_link_check(self, tenant: str, link_id: str) -> object:
            from types import SimpleNamespace

            from pal.api.port_links import key_fingerprint

            return SimpleNamespace(revoked=False, key_hashes=["h"], fp=key_fingerprint("h"))

    links = Links(b"k" * 32, Store())
    link = links.sign("t", "vm-a", 1, int(time.time()) + 60, "h")
    ended: list[str] = []

    async def work() -> str:
        await asyncio.sleep(0)
        return "done"

    async def on_end(why: str) -> None:
        ended.append(why)

    assert await links.while_valid(link, work(), on_end) == "done" and ended == []
    assert links.opened.waiting == {}, "no watcher is left behind"
