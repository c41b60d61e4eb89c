"""``POST /v1/runtime/vms/{id}/audit``: a client's audit record of its own use of a VM,
kept as an event in the VM's log. The MCP server (pal/mcp) writes one ``mcp_tool`` event per
tool call: the tool's name, the transport, the outcome; never the call's arguments (a
command line or a file's content may hold secrets).
"""

# No `from __future__ import annotations`: FastAPI must resolve the local `Tenant` alias.

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pal.scheduler.audit import MCP_TOOL_EVENT

from .body import require_json
from .deps import SchedulerOf, Tenant
from .errors import error_responses


class ToolCallAudit(BaseModel):
    """Body of POST .../audit: one MCP tool call."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=True
    )
    tool: str = Field(..., pattern=r"^[a-z][a-z0-9_]{0,63}$", description="the tool's name")
    transport: Literal["stdio", "http"] = Field(..., description="how the MCP client reached Pal")
    ok: bool = Field(..., description="false: the call ended in a tool error")
    status: int | None = Field(None, ge=0, le=599, description="the HTTP status of a failed call")
    code: str | None = Field(
        None, pattern=r"^[A-Z0-9_]{1,64}$", description="the error code of a failed call"
    )


class AuditedOut(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    vm_id: str
    kind: str


audit_router = APIRouter(prefix="/v1/runtime", tags=["runtime"], responses=error_responses(400, 401, 404))


@audit_router.post(
    "/vms/{vm_id}/audit",
    response_model=AuditedOut,
    summary="Record a client's audit event on the VM (the MCP server's `mcp_tool`: one per tool call)",
    dependencies=[Depends(require_json)],
    responses=error_responses(415),
)
async def audit(
    tenant: Tenant,
    scheduler: SchedulerOf,
    vm_id: str,
    body: ToolCallAudit,
) -> AuditedOut:
    details = body.model_dump(by_alias=True, exclude_none=True)
    await scheduler.audit.record_tool_call(tenant, vm_id, details)
    return AuditedOut(vm_id=vm_id, kind=MCP_TOOL_EVENT)
