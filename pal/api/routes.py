"""The /v1/runtime routes: thin adapters from HTTP to the Scheduler.

Every route is authenticated (the tenant id comes from the API key) and passes that tenant
to the scheduler, which answers 404 for other tenants' VMs.
"""

# No `from __future__ import annotations`: FastAPI must resolve the local `Tenant` alias.

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request, Response

from pal.scheduler.spec import AgentSpec, ExecRequest, ForkRequest

from .body import MAX_FILE_BYTES, read_bounded
from .exec_stream import buffered_exec, sse_exec
from .models import (
    ErrorOut,
    EventListOut,
    EventOut,
    ExecOut,
    FileEntryOut,
    FileListOut,
    FileWrittenOut,
    ForkChildOut,
    ForkOut,
    SnapshotStateOut,
    VmListOut,
    VmOut,
)
from .paths import check_workspace_path

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut, "description": desc}
    for code, desc in {
        400: "invalid request",
        401: "missing or invalid API key",
        402: "tenant quota exhausted",
        404: "unknown VM (or another tenant's)",
        409: "wrong lifecycle state",
        413: "body too large",
        503: "backend cannot do it",
    }.items()
}


def runtime_router(scheduler: Any, require_tenant: Any) -> APIRouter:
    r = APIRouter(prefix="/v1/runtime", tags=["runtime"], responses=_ERRORS)
    Tenant = Annotated[str, Depends(require_tenant)]

    @r.post("/schedule", response_model=VmOut, summary="Schedule a sandbox microVM")
    async def schedule(tenant: Tenant, spec: Annotated[AgentSpec | None, Body()] = None) -> VmOut:
        view = await scheduler.schedule(tenant, spec or AgentSpec.model_validate({}))
        return VmOut.from_view(view)

    @r.get("/vms", response_model=VmListOut, summary="List the tenant's VMs")
    async def list_vms(tenant: Tenant) -> VmListOut:
        return VmListOut(vms=[VmOut.from_view(v) for v in await scheduler.list(tenant)])

    @r.get("/vms/{vm_id}", response_model=VmOut)
    async def get_vm(tenant: Tenant, vm_id: str) -> VmOut:
        return VmOut.from_view(await scheduler.get(tenant, vm_id))

    @r.delete("/vms/{vm_id}", response_model=VmOut, summary="Stop the VM (terminated)")
    async def delete_vm(tenant: Tenant, vm_id: str) -> VmOut:
        return VmOut.from_view(await scheduler.delete(tenant, vm_id))

    @r.post("/vms/{vm_id}/pause", response_model=SnapshotStateOut)
    async def pause(tenant: Tenant, vm_id: str) -> SnapshotStateOut:
        v = await scheduler.pause(tenant, vm_id)
        return SnapshotStateOut(vm_id=v.vm_id, snapshot_id=v.snapshot_id, state=str(v.state))

    @r.post("/vms/{vm_id}/resume", response_model=SnapshotStateOut)
    async def resume(tenant: Tenant, vm_id: str) -> SnapshotStateOut:
        v = await scheduler.resume(tenant, vm_id)
        return SnapshotStateOut(vm_id=v.vm_id, snapshot_id=v.snapshot_id, state=str(v.state))

    @r.post("/vms/{vm_id}/fork", response_model=ForkOut, response_model_exclude_none=True)
    async def fork(tenant: Tenant, vm_id: str, req: ForkRequest) -> ForkOut:
        res = await scheduler.fork(tenant, vm_id, req.count)
        forks = [ForkChildOut(vm_id=c.vm_id, state=str(c.state), error=c.error) for c in res.forks]
        return ForkOut(source_vm_id=res.source_vm_id, snapshot_id=res.snapshot_id, forks=forks)

    @r.post(
        "/vms/{vm_id}/exec",
        response_model=ExecOut,
        response_model_exclude_none=True,
        summary="Run a command (execve-style); `Accept: text/event-stream` streams it",
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def exec_(tenant: Tenant, vm_id: str, req: ExecRequest, request: Request) -> Any:
        if "text/event-stream" in request.headers.get("accept", ""):
            return await sse_exec(lambda: scheduler.exec_stream(tenant, vm_id, req))
        return await buffered_exec(scheduler.exec_stream(tenant, vm_id, req))

    @r.get("/vms/{vm_id}/files", response_model=FileListOut)
    async def list_files(tenant: Tenant, vm_id: str, path: str = "") -> FileListOut:
        res = await scheduler.list_files(tenant, vm_id, check_workspace_path(path, required=False))
        entries = [FileEntryOut.model_validate(e) for e in res.entries]
        return FileListOut(path=res.path, entries=entries, truncated=res.truncated)

    @r.get(
        "/vms/{vm_id}/files/content",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "file text, cut at 1 MiB"}},
    )
    async def read_file(tenant: Tenant, vm_id: str, path: Annotated[str, Query()]) -> Response:
        data, truncated = await scheduler.read_file(tenant, vm_id, check_workspace_path(path, required=True))
        if len(data) > MAX_FILE_BYTES:
            data, truncated = data[:MAX_FILE_BYTES], True
        headers = {"X-Pal-Truncated": "true"} if truncated else {}
        return Response(data, media_type="text/plain; charset=utf-8", headers=headers)

    @r.put(
        "/vms/{vm_id}/files/content",
        response_model=FileWrittenOut,
        openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
    )
    async def write_file(
        tenant: Tenant, vm_id: str, path: Annotated[str, Query()], request: Request
    ) -> FileWrittenOut:
        checked = check_workspace_path(path, required=True)
        data = await read_bounded(request)
        res = await scheduler.write_file(tenant, vm_id, checked, data)
        return FileWrittenOut(path=res.path, bytes_written=res.bytes_written)

    @r.get("/vms/{vm_id}/events", response_model=EventListOut, summary="Status and audit events")
    async def events(tenant: Tenant, vm_id: str) -> EventListOut:
        evs = await scheduler.events(tenant, vm_id)
        return EventListOut(
            events=[
                EventOut(at=e.at, kind=e.kind, from_state=e.from_state, to_state=e.to_state, reason=e.reason)
                for e in evs
            ]
        )

    return r
