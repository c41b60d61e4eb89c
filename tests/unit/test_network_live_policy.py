"""A live egress change in the gateway, without VMs: real loopback sockets stand in for
the guest's connections and for two upstreams, and each connection goes through the
gateway's own decision (`VmGateway._open`). An open connection the new policy refuses is
reset with a denied event; one still being decided when the policy changes is judged by
the new policy before a byte reaches its upstream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pal.network.gateway import Gateway
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide
from pal.network.vm_gateway import VmGateway
from pal.spec import EgressAllow

HANG_GUARD_S = 30  # a hang guard, not a speed bound


@dataclass
class Upstream:
    """An echo server on its own loopback address; ``got``: the bytes it received."""

    server: asyncio.Server
    port: int
    got: list[bytes] = field(default_factory=list)


async def _upstream(host: str) -> Upstream:
    up: Upstream

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(4096):
                up.got.append(data)
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        finally:
            w.close()

    server = await asyncio.start_server(echo, host, 0)
    up = Upstream(server, server.sockets[0].getsockname()[1])
    return up


@dataclass
class Net:
    gw: Gateway
    vm: VmGateway
    api: Upstream  # api.test at 127.0.0.2
    other: Upstream  # other.test at 127.0.0.3
    guests: asyncio.Server
    made: asyncio.Queue[Connection]
    next_dst: tuple[str, int] = ("", 0)

    async def connect(
        self, dst: tuple[str, int]
    ) -> tuple[Connection, asyncio.StreamReader, asyncio.StreamWriter]:
        """A guest connection to ``dst`` (what SO_ORIGINAL_DST would say), decided by the
        gateway as an accepted one is."""
        port = self.guests.sockets[0].getsockname()[1]
        self.next_dst = dst
        r, w = await asyncio.open_connection("127.0.0.1", port)
        conn = await asyncio.wait_for(self.made.get(), HANG_GUARD_S)
        return conn, r, w


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    api, other = await _upstream("127.0.0.2"), await _upstream("127.0.0.3")
    gw = Gateway()
    gw.configure("api.test=127.0.0.2,other.test=127.0.0.3", ["127.0.0.2", "127.0.0.3"])
    both = Policy(EgressAllow(allow=[f"api.test:{api.port}", f"other.test:{other.port}"]))
    vm = VmGateway(gw, "vm-1", both, {}, NameTable())
    gw.vms["vm-1"] = vm
    made: asyncio.Queue[Connection] = asyncio.Queue()
    holder: dict[str, Net] = {}

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        # what VmGateway.accepted does, but with the destination given by the test
        conn = Connection(
            gw.next_id(), transport, holder["net"].next_dst, on_bytes=vm._count, on_close=vm._closed
        )
        side.conn = conn
        vm.conns[conn.id] = conn
        asyncio.get_running_loop().create_task(vm._open(conn))
        made.put_nowait(conn)

    guests = await asyncio.get_running_loop().create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    n = Net(gw, vm, api, other, guests, made)
    holder["net"] = n
    try:
        yield n
    finally:
        vm.close()
        for s in (guests, api.server, other.server):
            s.close()


def _synthetic(vm: VmGateway, name: str, port: int) -> tuple[str, int]:
    """The address the guest got from the gateway's DNS for ``name``."""
    return str(vm.table.address(name)), port


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter, data: bytes) -> bytes:
    w.write(data)
    await w.drain()
    return await asyncio.wait_for(r.readexactly(len(data)), HANG_GUARD_S)


async def _is_cut(r: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(r.read(1), HANG_GUARD_S) == b""
    except ConnectionError:
        return True


def _denied(gw: Gateway) -> list[dict[str, Any]]:
    return [e for e in gw.events.since(0) if e["kind"] == "egress_denied"]


async def test_a_refusing_policy_resets_the_open_connections_it_refuses_only(net: Net) -> None:
    conn_api, r_api, w_api = await net.connect(_synthetic(net.vm, "api.test", net.api.port))
    conn_other, r_other, w_other = await net.connect(_synthetic(net.vm, "other.test", net.other.port))
    assert await _echo(r_api, w_api, b"one") == b"one"
    assert await _echo(r_other, w_other, b"two") == b"two"
    assert (conn_api.state, conn_other.state) == ("open", "open")
    assert net.vm.counters["refused"] == 0 and _denied(net.gw) == []

    closed = net.vm.apply_policy(Policy(EgressAllow(allow=[f"api.test:{net.api.port}"])))
    assert closed == 1
    assert await _is_cut(r_other), "the refused connection is reset"
    assert await _echo(r_api, w_api, b"still") == b"still", "the allowed one carries on"
    (ev,) = _denied(net.gw)
    assert (ev["vmId"], ev["name"], ev["address"], ev["port"]) == (
        "vm-1",
        "other.test",
        "127.0.0.3",
        net.other.port,
    )
    assert ev["rule"] == "not in the allow list" and net.vm.counters["refused"] == 1
    # and the next connection to it is refused too
    _, r_again, _ = await net.connect(_synthetic(net.vm, "other.test", net.other.port))
    assert await _is_cut(r_again)
    assert net.other.got == [b"two"], "nothing reached other.test after the change"
    for w in (w_api, w_other):
        w.close()


async def test_a_connection_connecting_when_the_policy_changes_is_judged_by_the_new_one(net: Net) -> None:
    # The change lands while the gateway looks the name up, after it read the old policy:
    # apply_policy sees no open connection to reset, and the connection must not slip through.
    refusing = Policy(EgressAllow(allow=[f"api.test:{net.api.port}"]))
    resolve = net.gw.resolver.resolve
    changed: list[int] = []

    async def resolve_then_change(name: str, slots: Any = None) -> Any:
        found = await resolve(name, slots)
        changed.append(net.vm.apply_policy(refusing))
        return found

    net.gw.resolver.resolve = resolve_then_change  # type: ignore[method-assign]
    _, r, w = await net.connect(_synthetic(net.vm, "other.test", net.other.port))
    w.write(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")
    await w.drain()
    assert await _is_cut(r), "refused by the policy in force when it would start relaying"
    assert changed == [0], "the change found it not yet open"
    assert net.other.got == [], "not a byte reached the upstream the new policy refuses"
    (ev,) = _denied(net.gw)
    assert (ev["name"], ev["port"], ev["rule"]) == ("other.test", net.other.port, "not in the allow list")
    w.close()


@pytest.mark.parametrize("stricter", [True, False])
async def test_a_connection_waiting_for_its_name_follows_the_policy_changed_meanwhile(
    net: Net, stricter: bool
) -> None:
    # A bare-IP connection under a policy with names: the gateway waits (up to seconds) for
    # the guest's first bytes to learn the name (HTTP Host here); the policy changes then.
    net.vm.policy = Policy(EgressAllow(allow=[f"{'other' if stricter else 'api'}.test:{net.other.port}"]))
    peeking = asyncio.Event()
    peek = net.vm._peek_name

    async def watched_peek(conn: Connection) -> str | None:
        peeking.set()
        return await peek(conn)

    net.vm._peek_name = watched_peek  # type: ignore[method-assign]
    _, r, w = await net.connect(("127.0.0.3", net.other.port))
    await asyncio.wait_for(peeking.wait(), HANG_GUARD_S)
    new = "api.test" if stricter else "other.test"
    assert net.vm.apply_policy(Policy(EgressAllow(allow=[f"{new}:{net.other.port}"]))) == 0
    request = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n"
    w.write(request)
    await w.drain()
    if stricter:
        assert await _is_cut(r) and net.other.got == []
        assert [e["name"] for e in _denied(net.gw)] == ["other.test"]
    else:
        assert await asyncio.wait_for(r.readexactly(len(request)), HANG_GUARD_S) == request
        assert _denied(net.gw) == []
    w.close()
