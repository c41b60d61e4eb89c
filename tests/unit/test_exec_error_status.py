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
from pal.manager.client import ManagerClient
from pal.manager.models import ExecEvent
from pal.manager.rpc import create_rpc_app
from pal.spec import ExecRequest

REQ = ExecRequest(command="/bin/true", argv=[], cwd=None, timeout_secs=5, user=None)


class _Node:
    """A node whose exec streams fail after they started, in the given way."""

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    def require_running(self, vm_id: str) -> None:
        return None  # the VM ran when the request came

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        yield ExecEvent(type="stdout", data="started\n")
        if self.fail is not None:
            raise self.fail
        yield ExecEvent(type="error", code="ENOENT", message="no such file")


def _client(node: _Node) -> ManagerClient:
    client = ManagerClient(url="http://node")
    app = create_rpc_app(node)  # type: ignore[arg-type]
    for pool in ("_http", "_streams"):  # control calls and streams alike
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
        async for ev in client.exec_stream("vm-1", REQ):
            got.append(ev)
    await client.aclose()
    assert [e.data for e in got] == ["started\n"]
    assert (err.value.status, err.value.code, err.value.message) == (fail.status, fail.code, fail.message)


async def test_a_guest_error_code_travels_as_an_event_without_status() -> None:
    client = _client(_Node(None))
    events = [ev async for ev in client.exec_stream("vm-1", REQ)]
    await client.aclose()
    assert events[-1] == ExecEvent(type="error", code="ENOENT", message="no such file")
    assert events[-1].status is None
