"""Audit records that a client writes about its own use of a VM: the MCP server's tool
calls (pal/mcp), so the VM's event log says which agent tool touched it and when."""

from __future__ import annotations

from dataclasses import dataclass

from pal.scheduler.deps import Deps

MCP_TOOL_EVENT = "mcp_tool"


@dataclass(frozen=True)
class ToolAudit:
    d: Deps

    async def record_tool_call(self, tenant_id: str, vm_id: str, details: dict[str, object]) -> None:
        """An ``mcp_tool`` event on the tenant's VM (404 for another tenant's, as for a
        missing one). ``details`` are bounded by the caller (the API's model): the tool's
        name, the transport and the outcome, never the call's arguments."""
        vm = self.d.own(tenant_id, vm_id)
        self.d.store.add_event(vm_id, vm.tenant_id, MCP_TOOL_EVENT, details=dict(details))
