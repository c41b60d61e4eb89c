"""Fair shares of the control plane's path to a node (docs/security.md, "Fair shares"):
long-lived calls are capped per tenant and per VM (pal/scheduler/streams.py) and per node
(pal/scheduler/node_client.py), each past its cap a 429 at once, never a wait; and control
calls keep connections of their own that no stream takes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from pal.errors import TooManyRequests
from pal.manager.rpc import create_rpc_app
from pal.scheduler.node_client import HttpNode
from pal.spec import AgentSpec, ExecRequest
from pal.wire import verbs
from pal.wire.handlers import Handlers
from pal.wire.models import Empty, ExecCall, ExecEvent, FilesAt, ImageList, PortOpen, on_vm
from tests.fakes import SchedEnv, make_env

SLOW = ExecRequest(command="slow", argv=[])
ECHO = ExecRequest(command="echo", argv=["hi"])


async def _vm(env: SchedEnv, tenant: str) -> str:
    return (await env.sched.scheduling.schedule(tenant, AgentSpec()))[0].vm_id


async def _open(env: SchedEnv, tenant: str, vm: str) -> AsyncIterator[ExecEvent]:
    """A streaming exec, started (its first event read): it holds its slot until closed."""
    it = env.sched.guest.exec_stream(tenant, on_vm(ExecCall, vm, SLOW))
    first = await it.__anext__()
    assert first.data == "first\n"
    return it


async def test_long_lived_calls_are_capped_per_vm_and_per_tenant_and_not_across_tenants(
    tmp_path: Path,
) -> None:
    env = make_env(tmp_path, tenant_max_streams=3, vm_max_streams=2)
    bob, _ = env.store.create_tenant("bob", 10)
    a1, a2, b1 = await _vm(env, env.tenant_id), await _vm(env, env.tenant_id), await _vm(env, bob.id)
    held = [await _open(env, env.tenant_id, a1), await _open(env, env.tenant_id, a1)]
    try:
        with pytest.raises(TooManyRequests, match="PAL_VM_MAX_STREAMS=2"):
            await _open(env, env.tenant_id, a1)
        held.append(await _open(env, env.tenant_id, a2))
        with pytest.raises(TooManyRequests, match="PAL_TENANT_MAX_STREAMS=3"):
            await _open(env, env.tenant_id, a2)
        # Refused before anything ran: the node saw only the calls that were let through.
        assert [c for c in env.manager.calls if c[0] == "exec"] == [("exec", a1), ("exec", a1), ("exec", a2)]
        # Another tenant is not held back, and short calls of the same tenant are not capped.
        got = [ev.type async for ev in env.sched.guest.exec_stream(bob.id, on_vm(ExecCall, b1, ECHO))]
        assert got == ["stdout", "exit"]
        await env.sched.guest.call(env.tenant_id, verbs.LIST_FILES, FilesAt(vm_id=a1, path=""))
        # A call that ends gives its slot back.
        closing = held.pop()
        await closing.aclose()  # type: ignore[attr-defined]
        held.append(await _open(env, env.tenant_id, a2))
        # Another tenant's VM is 404 before it is 429.
        with pytest.raises(Exception, match="not found"):
            await _open(env, env.tenant_id, b1)
    finally:
        env.manager.gate.set()
        for it in held:
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]
    assert env.sched.guest.waker.streams.by_tenant == {} and env.sched.guest.waker.streams.by_vm == {}


async def test_a_port_tunnel_holds_its_slot_until_it_closes(tmp_path: Path) -> None:
    env = make_env(tmp_path, tenant_max_streams=1)
    vm = await _vm(env, env.tenant_id)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    env.manager.port_servers[8000] = server.sockets[0].getsockname()[1]
    try:
        stream = await env.sched.guest.open_port(env.tenant_id, PortOpen(vm_id=vm, port=8000))
        with pytest.raises(TooManyRequests):
            await env.sched.guest.open_port(env.tenant_id, PortOpen(vm_id=vm, port=8000))
        await stream.aclose()
        await (await env.sched.guest.open_port(env.tenant_id, PortOpen(vm_id=vm, port=8000))).aclose()
    finally:
        server.close()


class _Node:
    """A node whose exec streams last until ``release`` is set, and whose control calls
    answer at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.open = 0

    async def exec_stream(self, req: ExecCall) -> AsyncIterator[ExecEvent]:
        self.open += 1
        yield ExecEvent(type="stdout", data="first")
        await self.release.wait()
        yield ExecEvent(type="exit", exit_code=0)

    async def images(self, _: Empty) -> ImageList:
        return ImageList(images=[])

    def handlers(self) -> Handlers:
        h = Handlers()
        h.on_stream(verbs.EXEC, self.exec_stream)
        h.on(verbs.IMAGES, self.images)
        return h


async def test_streams_never_take_the_control_calls_connections(tmp_path: Path) -> None:
    """A real node RPC server on a unix socket: more streams open than the control pool has
    connections (the finding: 105 readers froze every tenant's heartbeat and spawns); the
    node's budget past them is 429 at once; control calls still answer."""
    sock = tmp_path / "manager.sock"
    node = _Node()
    server = uvicorn.Server(
        uvicorn.Config(create_rpc_app(node.handlers()), uds=str(sock), log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    client = HttpNode(sock, max_streams=110)
    echo = on_vm(ExecCall, "vm-1", ECHO)
    streams: list[AsyncIterator[ExecEvent]] = []
    try:
        for _ in range(110):
            it = client.stream(verbs.EXEC, echo)
            assert (await it.__anext__()).data == "first"
            streams.append(it)
        assert node.open == 110 and client.slots.held == 110
        with pytest.raises(TooManyRequests, match="PAL_NODE_MAX_STREAMS=110"):
            await client.stream(verbs.EXEC, echo).__anext__()
        images = await client.call(verbs.IMAGES, Empty())
        assert images.images == [], "a control call answers beside 110 streams"
        node.release.set()
        for it in streams:
            assert [ev.type async for ev in it] == ["exit"]
        assert client.slots.held == 0
    finally:
        node.release.set()
        for it in streams:
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]
        await client.aclose()
        server.should_exit = True
        await serving
