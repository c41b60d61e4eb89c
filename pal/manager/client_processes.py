"""``ManagerClient``'s process calls (the node side: pal/manager/rpc_processes.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pal.errors import Unavailable, from_wire
from pal.manager.process_models import ProcessDeleted, ProcessEvent, ProcessInfo, ProcessOutput, StdinWritten
from pal.spec import ProcessStartRequest, SignalRequest, Terminal

UNREACHABLE = "NODE_UNREACHABLE"  # client.py's code for a node that cannot be reached
LONG_POLL_SLACK_S = 35.0  # beyond a long poll's own wait: the node's guest request bound (30 s)


class ProcessCalls:
    _http: httpx.AsyncClient

    async def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:  # client.py
        raise NotImplementedError

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:  # client.py
        raise NotImplementedError

    async def start_process(self, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        body = req.model_dump(by_alias=True, mode="json")
        resp = await self._call("POST", f"/vms/{vm_id}/processes", json=body)
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
        resp = await self._call(
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
        resp = await self._call(
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
        try:
            async with self._http.stream(
                "GET", url, params={"from": start}, timeout=httpx.Timeout(None, connect=5.0)
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        ev = ProcessEvent.model_validate(json.loads(line))
                        if ev.type == "error":
                            raise from_wire(ev.status or 503, ev.code or "", ev.message or "")
                        yield ev
        except httpx.TransportError as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}", code=UNREACHABLE) from exc
