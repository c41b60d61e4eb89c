"""Issue 24: an exec error keeps its status across the manager RPC. A node-side error that
comes after the exec stream started (a live pause that won the race for the VM's lock, a
guest channel that broke) travels as an ``error`` event with its status, and the client
raises it as the same error as one that came before the stream; a guest's error code
travels without a status, for pal/manager/guest_errors.py to map."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from pal.errors import BackendError, LivePaused, PalError
from pal.manager.rpc import create_rpc_app
from pal.scheduler.node_client import HttpNode
from pal.spec import ExecRequest
from pal.wire import verbs
from pal.wire.handlers import Handlers
from pal.wire.models import ExecCall, ExecEvent, on_vm

REQ = on_vm(ExecCall, "vm-1", ExecRequest(command="/bin/true", argv=[], cwd=None, timeout_secs=5, user=None))


class _Node:
    """A node whose exec streams fail after they started, in the given way."""

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    async def exec_stream(self, req: ExecCall) -> AsyncIterator[ExecEvent]:
        yield ExecEvent(type="stdout", data="started\n")
        if self.fail is not None:
            raise self.fail
        yield ExecEvent(type="error", code="ENOENT", message="no such file")


def _client(node: _Node) -> HttpNode:
    client = HttpNode(url="http://node")
    h = Handlers()
    h.on_stream(verbs.EXEC, node.exec_stream)
    app = create_rpc_app(h)
    for pool in ("_control", "_streams"):  # control calls and streams alike
        setattr(
            client, pool, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")
        )
    return client


@pytest.mark.parametrize(
    "fail",
    [
        LivePaused("VM vm-1 is live-paused (by idle): resume it first"),
        BackendError("VM vm-1: guest channel closed during exec"),
    ],
)
async def test_a_node_error_after_the_stream_started_keeps_its_status(fail: PalError) -> None:
    client = _client(_Node(fail))
    got: list[ExecEvent] = []
    with pytest.raises(PalError) as err:
        async for ev in client.stream(verbs.EXEC, REQ):
            got.append(ev)
    await client.aclose()
    assert [e.data for e in got] == ["started\n"]
    assert (err.value.status, err.value.code, err.value.message) == (fail.status, fail.code, fail.message)


async def test_a_guest_error_code_travels_as_an_event_without_status() -> None:
    client = _client(_Node(None))
    events = [ev async for ev in client.stream(verbs.EXEC, REQ)]
    await client.aclose()
    assert events[-1] == ExecEvent(type="error", code="ENOENT", message="no such file")
    assert events[-1].status is None
