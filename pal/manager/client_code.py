"""``ManagerClient``'s code-context calls (the node side: pal/manager/rpc_code.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pal.errors import from_wire
from pal.manager.client_http import NodeHttp
from pal.manager.code_models import CodeContext, CodeEvent, CodeRequest, ContextCreate, ContextList


class CodeCalls(NodeHttp):
    async def run_code(self, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        """A cell's events; a node error (before or during it) is raised as its PalError,
        a node that went away as 503 NODE_UNREACHABLE."""
        async with contextlib.aclosing(
            self._ndjson("POST", f"/vms/{vm_id}/code", json=self._body(req))
        ) as lines:
            async for raw in lines:
                if raw.get("type") == "error" and "status" in raw:
                    raise from_wire(raw["status"], raw.get("code") or "", raw.get("message") or "")
                yield CodeEvent.model_validate(raw)

    async def create_context(self, vm_id: str, req: ContextCreate) -> CodeContext:
        # A kernel's start may take minutes under TCG: long-lived.
        resp = await self._long("POST", f"/vms/{vm_id}/code/contexts", json=self._body(req))
        return CodeContext.model_validate(resp.json())

    async def list_contexts(self, vm_id: str) -> list[CodeContext]:
        resp = await self._call("GET", f"/vms/{vm_id}/code/contexts")
        return ContextList.model_validate(resp.json()).contexts

    async def delete_context(self, vm_id: str, ctx: str) -> None:
        await self._call("DELETE", f"/vms/{vm_id}/code/contexts/{ctx}")

    async def interrupt_context(self, vm_id: str, ctx: str) -> bool:
        resp = await self._call("POST", f"/vms/{vm_id}/code/contexts/{ctx}/interrupt")
        return bool(resp.json().get("interrupted"))
