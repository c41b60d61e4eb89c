"""Buffered exec keeps at most 8 MiB per stream and says it cut; a tenant's buffered execs
together hold at most its budget (PAL_EXEC_BUFFER_MIB) on the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from pal.api.app import create_app
from pal.api.exec_budget import MIB
from pal.api.exec_stream import BUFFERED_OUTPUT_MAX, buffered_exec
from pal.wire.models import ExecEvent
from tests.apienv import make_api


async def _events(chunks: int, size: int) -> AsyncIterator[ExecEvent]:
    for _ in range(chunks):
        yield ExecEvent(type="stdout", data="x" * size)
    yield ExecEvent(type="stderr", data="small")
    yield ExecEvent(type="exit", exit_code=0)


async def test_buffered_exec_output_is_capped_and_flagged() -> None:
    out = await buffered_exec(_events(chunks=20, size=1024 * 1024))
    assert len(out.stdout) == BUFFERED_OUTPUT_MAX
    assert out.stderr == "small" and out.exit_code == 0
    assert out.truncated is True


async def test_small_output_is_whole_and_not_flagged() -> None:
    out = await buffered_exec(_events(chunks=2, size=10))
    assert out.stdout == "x" * 20 and out.truncated is None


# -- the tenant's budget, through the API ----------------------------------------------------


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_a_tenants_buffered_execs_share_one_budget(tmp_path: Path) -> None:
    """Concurrent buffered execs of one tenant hold at most PAL_EXEC_BUFFER_MIB together: a
    running one is cut there, a new one is refused (429) before it runs; other tenants and
    streamed execs are not affected, and the budget comes back when the answer is sent."""
    env = make_api(tmp_path)
    env.sched.settings.exec_buffer_mib = 1
    app = create_app(env.sched.sched, env.sched.store, env.sched.settings)
    budget = app.state.exec_budget
    transport = httpx.ASGITransport(app=app)
    a = httpx.AsyncClient(
        transport=transport, base_url="http://localhost", headers=_auth(env.key_a), timeout=60
    )
    b = httpx.AsyncClient(
        transport=transport, base_url="http://localhost", headers=_auth(env.key_b), timeout=60
    )
    async with a, b:
        vm_a = (await a.post("/v1/runtime/schedule", json={})).json()["vmId"]
        vm_b = (await b.post("/v1/runtime/schedule", json={})).json()["vmId"]

        def run(c: httpx.AsyncClient, vm: str, *argv: str, **kw: Any) -> Any:
            return c.post(
                f"/v1/runtime/vms/{vm}/exec", json={"command": argv[0], "argv": list(argv[1:])}, **kw
            )

        flood = asyncio.create_task(run(a, vm_a, "flood", str(3 * MIB // 2), "hold"))
        await _until(lambda: sum(budget.held.values()) == MIB)  # it holds the whole budget
        refused = await run(a, vm_a, "echo", "hi")
        assert refused.status_code == 429, refused.text
        err = refused.json()["error"]
        assert err["code"] == "RESOURCE_EXHAUSTED" and "PAL_EXEC_BUFFER_MIB" in err["message"]
        assert [r for r in env.manager.exec_requests if r.command == "echo"] == []  # nothing ran
        other = await run(b, vm_b, "flood", "1000")  # another tenant's budget is its own
        assert other.status_code == 200 and other.json()["stdout"] == "x" * 1000
        streamed = await run(a, vm_a, "echo", "sse", headers={"Accept": "text/event-stream"})
        assert streamed.status_code == 200 and "sse" in streamed.text  # SSE holds nothing
        env.manager.gate.set()
        cut = await flood
        assert cut.status_code == 200 and cut.json()["truncated"] is True
        assert len(cut.json()["stdout"]) == MIB and cut.json()["exitCode"] == 0
        assert budget.held == {}  # given back once the answer was sent
        again = await run(a, vm_a, "echo", "hi")
        assert again.status_code == 200 and again.json()["stdout"] == "hi\n"
        assert "truncated" not in again.json()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
