"""``ManagerClient``'s process calls (the node side: pal/manager/rpc_processes.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from pal.errors import from_wire
from pal.manager.client_http import NodeHttp
from pal.manager.process_models import ProcessDeleted, ProcessEvent, ProcessInfo, ProcessOutput, StdinWritten
from pal.spec import ProcessStartRequest, SignalRequest, Terminal

LONG_POLL_SLACK_S = 35.0  # beyond a long poll's own wait: the node's guest request bound (30 s)


class ProcessCalls(NodeHttp):
    async def start_process(self, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        resp = await self._call("POST", f"/vms/{vm_id}/processes", json=self._body(req))
        return ProcessInfo.model_validate(resp.json())

    async def list_processes(self, vm_id: str) -> list[ProcessInfo]:
        resp = await self._call("GET", f"/vms/{vm_id}/processes")
        return [ProcessInfo.model_validate(x) for x in resp.json()["processes"]]

    async def get_process(self, vm_id: str, pid: int) -> ProcessInfo:
        resp = await self._call("GET", f"/vms/{vm_id}/processes/{pid}")
        return ProcessInfo.model_validate(resp.json())

    async def delete_process(self, vm_id: str, pid: int) -> ProcessDeleted:
        resp = await self._call("DELETE", f"/vms/{vm_id}/processes/{pid}")
        return ProcessDeleted.model_validate(resp.json())

    async def read_output(
        self, vm_id: str, pid: int, start: int, max_bytes: int, wait_ms: int
    ) -> ProcessOutput:
        call = self._long if wait_ms > 0 else self._call  # a long poll is long-lived
        resp = await call(
            "GET",
            f"/vms/{vm_id}/processes/{pid}/output",
            params={"from": start, "maxBytes": max_bytes, "waitMs": wait_ms},
            timeout=httpx.Timeout(wait_ms / 1000 + LONG_POLL_SLACK_S, connect=5.0),
        )
        return ProcessOutput.model_validate(resp.json())

    async def write_stdin(self, vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten:
        resp = await self._call(
            "POST", f"/vms/{vm_id}/processes/{pid}/stdin", params={"eof": eof}, content=data
        )
        return StdinWritten.model_validate(resp.json())

    async def signal_process(self, vm_id: str, pid: int, req: SignalRequest) -> None:
        await self._call("POST", f"/vms/{vm_id}/processes/{pid}/signal", json=req.model_dump())

    async def resize_process(self, vm_id: str, pid: int, size: Terminal) -> None:
        await self._call("POST", f"/vms/{vm_id}/processes/{pid}/resize", json=size.model_dump())

    async def wait_process(self, vm_id: str, pid: int, timeout_ms: int) -> ProcessInfo:
        call = self._long if timeout_ms > 0 else self._call
        resp = await call(
            "POST",
            f"/vms/{vm_id}/processes/{pid}/wait",
            params={"timeoutMs": timeout_ms},
            timeout=httpx.Timeout(timeout_ms / 1000 + LONG_POLL_SLACK_S, connect=5.0),
        )
        return ProcessInfo.model_validate(resp.json())

    async def attach_process(self, vm_id: str, pid: int, start: int) -> AsyncIterator[ProcessEvent]:
        """The output stream; a node error (before or during it) is raised as its PalError,
        a node that went away as 503 NODE_UNREACHABLE."""
        url = f"/vms/{vm_id}/processes/{pid}/attach"
        async with contextlib.aclosing(self._ndjson("GET", url, params={"from": start})) as lines:
            async for raw in lines:
                ev = ProcessEvent.model_validate(raw)
                if ev.type == "error":
                    raise from_wire(ev.status or 503, ev.code or "", ev.message or "")
                yield ev
