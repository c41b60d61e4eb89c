"""The /v1/runtime routes: thin adapters from HTTP to the scheduler's operations
(deps.py: each route takes the ones it calls), answering with the API's own shapes
(models.py).

Every route is authenticated (the tenant id comes from the API key) and passes that tenant
to the operation, which answers 404 for other tenants' VMs.
"""

# No `from __future__ import annotations`: FastAPI must resolve the local `Tenant` alias.

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request, Response

from pal.spec import (
    AgentSpec,
    EgressUpdate,
    ExecRequest,
    ForkRequest,
    LifetimeUpdate,
    PauseRequest,
    SecretUpdate,
)
from pal.wire import verbs
from pal.wire.models import ExecCall, FileRef, FilesAt, FileWrite, on_vm

from . import pagination as pages
from .body import MAX_FILE_BYTES, MAX_FILE_WORDS, content_type, read_bounded, require_json
from .deps import (
    Deletes,
    EgressSecrets,
    Forks,
    Guest,
    LifetimesOf,
    Lists,
    Live,
    Pauses,
    ReadsOf,
    Schedule,
    Tenant,
)
from .errors import error_responses
from .exec_stream import budgeted_exec, sse_exec
from .models import (
    EventListOut,
    EventOut,
    ExecOut,
    FileDeletedOut,
    FileEntryOut,
    FileListOut,
    FileWrittenOut,
    ForkOut,
    ImageListOut,
    ImageOut,
    PauseOut,
    SecretRotatedOut,
    SnapshotListOut,
    SnapshotOut,
    SnapshotStateOut,
    VmListOut,
    VmMetricsOut,
    VmOut,
)
from .paths import check_workspace_path
from .processes import yield_exec

_ERRORS = error_responses(400, 401, 402, 404, 409, 413, 503)


runtime_router = APIRouter(prefix="/v1/runtime", tags=["runtime"], responses=_ERRORS)
json_body = [Depends(require_json)]
json_errors = error_responses(415)


@runtime_router.post(
    "/schedule",
    response_model=VmOut,
    summary="Schedule a sandbox microVM",
    dependencies=json_body,
    responses=json_errors,
)
async def schedule(
    tenant: Tenant, scheduling: Schedule, spec: Annotated[AgentSpec | None, Body()] = None
) -> VmOut:
    vm, boot_method = await scheduling.schedule(tenant, spec or AgentSpec.model_validate({}))
    return VmOut.of(vm, boot_method)


@runtime_router.get(
    "/vms",
    response_model=VmListOut,
    summary="List the tenant's VMs, a page at a time; `?metadata.k=v` (repeatable, all must match) filters",
)
async def list_vms(
    tenant: Tenant,
    listing: Lists,
    request: Request,
    limit: pages.Limit = None,
    cursor: pages.Cursor = None,
) -> VmListOut:
    size, after, wanted = (
        pages.page_size(limit),
        pages.dated_after("vms", cursor),
        pages.metadata_filter(request),
    )
    rows = await listing.vms(tenant, after=after, limit=size + 1, metadata=wanted)
    page, nxt = pages.next_cursor("vms", rows, size, lambda v: (v.created_at.isoformat(), v.vm_id))
    return VmListOut(vms=[VmOut.of(v) for v in page], next_cursor=nxt)


@runtime_router.get("/vms/{vm_id}", response_model=VmOut)
async def get_vm(tenant: Tenant, reads: ReadsOf, live: Live, vm_id: str) -> VmOut:
    vm = await reads.get(tenant, vm_id)
    return VmOut.of(vm, network=await reads.network(vm), pause=await live.view(vm))


@runtime_router.delete("/vms/{vm_id}", response_model=VmOut, summary="Stop the VM (terminated)")
async def delete_vm(tenant: Tenant, deleting: Deletes, vm_id: str) -> VmOut:
    return VmOut.of(await deleting.delete(tenant, vm_id))


@runtime_router.put(
    "/vms/{vm_id}/egress",
    response_model=VmOut,
    summary="Change the egress policy (running VMs: new connections at once, refused open ones reset)",
    dependencies=json_body,
    responses=json_errors,
)
async def set_egress(
    tenant: Tenant, egress: EgressSecrets, reads: ReadsOf, vm_id: str, update: EgressUpdate
) -> VmOut:
    vm = await egress.set_egress(tenant, vm_id, update)
    return VmOut.of(vm, network=await reads.network(vm))


@runtime_router.put(
    "/vms/{vm_id}/lifetime",
    response_model=VmOut,
    summary="Set (`lifetimeSecs`, from the schedule; 0: none) or extend (`extendSecs`) the VM's lifetime",
    dependencies=json_body,
    responses=json_errors,
)
async def set_lifetime(tenant: Tenant, lifetimes: LifetimesOf, vm_id: str, update: LifetimeUpdate) -> VmOut:
    return VmOut.of(await lifetimes.set_lifetime(tenant, vm_id, update))


@runtime_router.put(
    "/vms/{vm_id}/secrets/{name}",
    response_model=SecretRotatedOut,
    summary="Rotate a brokered secret's value (the guest holds only its placeholder: untouched)",
    dependencies=json_body,
    responses=json_errors,
)
async def rotate_secret(
    tenant: Tenant, egress: EgressSecrets, vm_id: str, name: str, update: SecretUpdate
) -> SecretRotatedOut:
    live = await egress.rotate_secret(tenant, vm_id, name, update)
    return SecretRotatedOut(name=name, applied="now" if live else "next start")


@runtime_router.post(
    "/vms/{vm_id}/pause",
    response_model=SnapshotStateOut,
    summary='Pause: a snapshot (default; frees the slot) or live (`{"mode": "live", "offload": true}`)',
    dependencies=json_body,
    responses=json_errors,
)
async def pause(
    tenant: Tenant,
    pauses: Pauses,
    live: Live,
    vm_id: str,
    req: Annotated[PauseRequest | None, Body()] = None,
) -> SnapshotStateOut:
    paused = await pauses.pause(tenant, vm_id, req)
    out = SnapshotStateOut.model_validate(paused.vm)
    if req is not None and req.mode == "live":
        # A live pause takes no snapshot: the VM's snapshotId is an older pause's.
        out.snapshot_id = None
    view = await live.view(paused.vm, paused.live)
    out.pause = PauseOut.model_validate(view) if view is not None else None
    return out


@runtime_router.post(
    "/vms/{vm_id}/resume",
    response_model=SnapshotStateOut,
    summary="Resume: a live-paused VM continues in place; a snapshot-paused one is restored",
)
async def resume(tenant: Tenant, pauses: Pauses, vm_id: str) -> SnapshotStateOut:
    v = await pauses.resume(tenant, vm_id)
    return SnapshotStateOut.model_validate(v)


@runtime_router.post(
    "/vms/{vm_id}/fork",
    response_model=ForkOut,
    response_model_exclude_none=True,
    dependencies=json_body,
    responses=json_errors,
)
async def fork(tenant: Tenant, forking: Forks, vm_id: str, req: ForkRequest) -> ForkOut:
    return ForkOut.model_validate(await forking.fork(tenant, vm_id, req.count, req.metadata, req.secrets))


@runtime_router.post(
    "/vms/{vm_id}/exec",
    response_model=ExecOut,
    response_model_exclude_none=True,
    summary="Run a command (execve-style); `Accept: text/event-stream` streams it",
    responses={200: {"content": {"text/event-stream": {}}}, **json_errors, **error_responses(429)},
    dependencies=json_body,
)
async def exec_(tenant: Tenant, guest: Guest, vm_id: str, req: ExecRequest, request: Request) -> Any:
    if req.yield_after_ms is not None:  # a process waited for a while (processes.py)
        return await yield_exec(guest, tenant, vm_id, req)
    if "text/event-stream" in request.headers.get("accept", ""):
        # A dropped SSE exec runs on; its first event names the process to read on from.
        detached = on_vm(ExecCall, vm_id, req.model_copy(update={"detach_on_close": True}))
        return await sse_exec(lambda: guest.exec_stream(tenant, detached))
    # the tenants' buffered exec output on this server (exec_budget.py), and the timeout of
    # a buffered exec that names none (PAL_EXEC_DEFAULT_TIMEOUT; None: no default)
    state = request.app.state
    default_timeout = state.settings.exec_default_timeout_s
    if req.timeout_secs is None and default_timeout:
        req = req.model_copy(update={"timeout_secs": default_timeout})
    call = on_vm(ExecCall, vm_id, req)
    return await budgeted_exec(state.exec_budget, tenant, lambda: guest.exec_stream(tenant, call))


@runtime_router.get("/vms/{vm_id}/files", response_model=FileListOut)
async def list_files(tenant: Tenant, guest: Guest, vm_id: str, path: str = "") -> FileListOut:
    at = FilesAt(vm_id=vm_id, path=check_workspace_path(path, required=False))
    res = await guest.call(tenant, verbs.LIST_FILES, at)
    entries = [FileEntryOut.model_validate(e) for e in res.entries]
    return FileListOut(path=res.path, entries=entries, truncated=res.truncated)


@runtime_router.get(
    "/vms/{vm_id}/files/content",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {}, "application/octet-stream": {}},
            "description": f"the file's bytes, cut at {MAX_FILE_WORDS} (`X-Pal-Truncated: true`); "
            "`text/plain; charset=utf-8` when they are UTF-8, else `application/octet-stream`",
        }
    },
)
async def read_file(tenant: Tenant, guest: Guest, vm_id: str, path: Annotated[str, Query()]) -> Response:
    at = FileRef(vm_id=vm_id, path=check_workspace_path(path, required=True))
    got = await guest.call(tenant, verbs.READ_FILE, at)
    data, truncated = got.data, got.truncated
    if len(data) > MAX_FILE_BYTES:
        data, truncated = data[:MAX_FILE_BYTES], True
    headers = {"X-Pal-Truncated": "true"} if truncated else {}
    return Response(data, media_type=content_type(data, truncated), headers=headers)


@runtime_router.put(
    "/vms/{vm_id}/files/content",
    response_model=FileWrittenOut,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def write_file(
    tenant: Tenant, guest: Guest, vm_id: str, path: Annotated[str, Query()], request: Request
) -> FileWrittenOut:
    checked = check_workspace_path(path, required=True)
    data = await read_bounded(request)
    res = await guest.call(tenant, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path=checked, data=data))
    return FileWrittenOut(path=res.path, bytes_written=res.bytes_written)


@runtime_router.delete(
    "/vms/{vm_id}/files/content", response_model=FileDeletedOut, summary="Remove a file or symlink"
)
async def delete_file(
    tenant: Tenant, guest: Guest, vm_id: str, path: Annotated[str, Query()]
) -> FileDeletedOut:
    at = FileRef(vm_id=vm_id, path=check_workspace_path(path, required=True))
    res = await guest.call(tenant, verbs.DELETE_FILE, at)
    return FileDeletedOut.model_validate(res)


@runtime_router.get("/vms/{vm_id}/events", response_model=EventListOut, summary="Status and audit events")
async def events(
    tenant: Tenant, listing: Lists, vm_id: str, limit: pages.Limit = None, cursor: pages.Cursor = None
) -> EventListOut:
    size, after = pages.page_size(limit), pages.event_after(cursor)
    rows = await listing.events(tenant, vm_id, after=after, limit=size + 1)
    page, nxt = pages.next_cursor("events", rows, size, lambda e: e.id)
    return EventListOut(events=[EventOut.model_validate(e) for e in page], next_cursor=nxt)


@runtime_router.get(
    "/vms/{vm_id}/metrics",
    response_model=VmMetricsOut,
    summary="CPU, memory, disk and network samples of the last 15 minutes (every 5 s)",
)
async def metrics(tenant: Tenant, reads: ReadsOf, vm_id: str) -> VmMetricsOut:
    m = await reads.metrics(tenant, vm_id)
    return VmMetricsOut.model_validate(m.model_dump())


@runtime_router.get(
    "/vms/{vm_id}/snapshots", response_model=SnapshotListOut, summary="The VM's snapshots, with sizes"
)
async def snapshots(
    tenant: Tenant, reads: ReadsOf, vm_id: str, limit: pages.Limit = None, cursor: pages.Cursor = None
) -> SnapshotListOut:
    snaps = await reads.snapshots(tenant, vm_id)
    page, nxt = pages.in_memory(
        "snapshots", snaps, lambda x: (x.created_at or "", x.snapshot_id), limit, cursor
    )
    return SnapshotListOut(
        snapshots=[SnapshotOut.model_validate(x.model_dump()) for x in page], next_cursor=nxt
    )


images_router = APIRouter(prefix="/v1", tags=["images"], responses=error_responses(400, 401))


@images_router.get("/images", response_model=ImageListOut, summary="Images this tenant may schedule")
async def list_images(
    tenant: Tenant, reads: ReadsOf, limit: pages.Limit = None, cursor: pages.Cursor = None
) -> ImageListOut:
    images = await reads.list_images(tenant)
    page, nxt = pages.in_memory("images", images, lambda i: i.name, limit, cursor)
    return ImageListOut(images=[ImageOut.from_info(i) for i in page], next_cursor=nxt)
