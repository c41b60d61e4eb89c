"""``ManagerClient``'s code-context calls (the node side: pal/manager/rpc_code.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pal.errors import Unavailable, from_wire
from pal.manager.code_models import CodeContext, CodeEvent, CodeRequest, ContextCreate, ContextList

UNREACHABLE = "NODE_UNREACHABLE"  # client.py's code for a node that cannot be reached


class CodeCalls:
    _http: httpx.AsyncClient

    async def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:  # client.py
        raise NotImplementedError

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:  # client.py
        raise NotImplementedError

    async def run_code(self, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        """A cell's events; a node error (before or during it) is raised as its PalError,
        a node that went away as 503 NODE_UNREACHABLE."""
        body = req.model_dump(by_alias=True, mode="json")
        try:
            async with self._http.stream(
                "POST", f"/vms/{vm_id}/code", json=body, timeout=httpx.Timeout(None, connect=5.0)
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    raw = json.loads(line)
                    if raw.get("type") == "error" and "status" in raw:
                        raise from_wire(raw["status"], raw.get("code") or "", raw.get("message") or "")
                    yield CodeEvent.model_validate(raw)
        except httpx.TransportError as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}", code=UNREACHABLE) from exc

    async def create_context(self, vm_id: str, req: ContextCreate) -> CodeContext:
        body = req.model_dump(by_alias=True, mode="json")
        resp = await self._call("POST", f"/vms/{vm_id}/code/contexts", json=body)
        return CodeContext.model_validate(resp.json())

    async def list_contexts(self, vm_id: str) -> list[CodeContext]:
        resp = await self._call("GET", f"/vms/{vm_id}/code/contexts")
        return ContextList.model_validate(resp.json()).contexts

    async def delete_context(self, vm_id: str, ctx: str) -> None:
        await self._call("DELETE", f"/vms/{vm_id}/code/contexts/{ctx}")

    async def interrupt_context(self, vm_id: str, ctx: str) -> bool:
        resp = await self._call("POST", f"/vms/{vm_id}/code/contexts/{ctx}/interrupt")
        return bool(resp.json().get("interrupted"))
