"""The runtime manager's RPC server: HTTP+JSON over a unix socket (docs/internals.md).

A thin skin over :class:`NodeRuntime`; errors travel as ``{"error": {code, message}}``
with the status the API should answer, and ``client.ManagerClient`` rebuilds them. An
error in the middle of an exec stream travels as an ``error`` event with its ``status``
(the client raises it again, like any other RPC error); a guest's own error code travels
without one (guest_errors.py maps it). Every id in a path or body is a
:data:`pal.ids.SafeId`: anything else is 400 before any work. Who may connect at all is
rpc_socket.py's business.

The handlers are module-level functions on :data:`router`; each gets the node's runtime
through ``Depends(node_runtime)`` (the app's ``state.runtime``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pal.errors import InvalidRequest, PalError, Unauthorized
from pal.ids import SafeId
from pal.manager import tunnel
from pal.manager.auth import bearer_matches
from pal.manager.models import (
    BrokeredSet,
    EgressSet,
    LivePauseRequest,
    SnapshotRequest,
    SpawnRequest,
    WarmRequest,
)
from pal.manager.rpc_answers import dump, dump_list, ndjson
from pal.manager.rpc_code import router as code_router
from pal.manager.rpc_processes import router as processes_router
from pal.manager.runtime import NodeRuntime
from pal.spec import ExecRequest

router = APIRouter()


def node_runtime(request: Request) -> NodeRuntime:
    return request.app.state.runtime  # type: ignore[no-any-return]


Runtime = Annotated[NodeRuntime, Depends(node_runtime)]


def create_rpc_app(runtime: NodeRuntime, token: str | None = None) -> FastAPI:
    """``token``: required on every request (a node reached over the network); None on the
    embedded node's root-only unix socket."""
    app = FastAPI(title="Pal runtime manager", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    app.state.token = token
    if token is not None:
        app.middleware("http")(require_token)
    app.exception_handler(PalError)(pal_error)
    app.exception_handler(RequestValidationError)(invalid_request)
    # The routes themselves (not an included router): each app lists them (tests/unit/test_rpc_docs.py).
    app.router.routes.extend(router.routes)
    app.router.routes.extend(processes_router.routes)
    app.router.routes.extend(code_router.routes)
    return app


# ---------------------------------------------------------------------- errors and auth
async def require_token(request: Request, call_next: Any) -> Response:
    if not bearer_matches(request.headers.get("authorization"), request.app.state.token):
        err = Unauthorized("node RPC: missing or wrong node token")
        return JSONResponse(err.to_body(), status_code=err.status)
    return await call_next(request)  # type: ignore[no-any-return]


async def pal_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PalError)
    return JSONResponse(exc.to_body(), status_code=exc.status)


async def invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    where = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()[:5]
    )
    err = InvalidRequest(f"invalid manager request: {where}")
    return JSONResponse(err.to_body(), status_code=err.status)


# ---------------------------------------------------------------------- a VM's life
@router.post("/vms")
async def spawn(req: SpawnRequest, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.spawn(req))


@router.delete("/vms/{vm_id}")
async def stop(vm_id: SafeId, runtime: Runtime, incarnation: int | None = None) -> JSONResponse:
    if incarnation is not None and runtime.runs_other_incarnation(vm_id, incarnation):
        return JSONResponse({"vmId": vm_id, "stopped": False})  # a newer one runs: keep it
    await runtime.stop(vm_id)
    return JSONResponse({"vmId": vm_id, "stopped": True})


@router.post("/vms/{vm_id}/snapshot")
async def snapshot(vm_id: SafeId, req: SnapshotRequest, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.snapshot(vm_id, req))


@router.post("/vms/{vm_id}/live-pause")
async def live_pause(vm_id: SafeId, req: LivePauseRequest, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.live_pause(vm_id, req))


@router.post("/vms/{vm_id}/live-resume")
async def live_resume(vm_id: SafeId, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.live_resume(vm_id))


@router.get("/vms/{vm_id}/live")
async def live_status(vm_id: SafeId, runtime: Runtime) -> JSONResponse:
    st = await runtime.live_status(vm_id)
    return JSONResponse({"live": None if st is None else st.model_dump(by_alias=True, mode="json")})


@router.get("/notices")
async def notices(runtime: Runtime, after: int = 0, epoch: str = "", wait_s: float = 0.0) -> JSONResponse:
    return dump(await runtime.notices(after, epoch, wait_s))


# ---------------------------------------------------------------------- in the guest
@router.post("/vms/{vm_id}/exec")
async def exec_(vm_id: SafeId, req: ExecRequest, runtime: Runtime) -> StreamingResponse:
    runtime.require_running(vm_id)  # fail with a status before the stream starts
    return ndjson(runtime.exec_stream(vm_id, req))


@router.websocket("/vms/{vm_id}/ports/{port}")
async def port_stream(ws: WebSocket, vm_id: SafeId, port: int) -> None:
    """A byte stream to a server in the guest, over this WebSocket (tunnel.py)."""
    runtime: NodeRuntime = ws.app.state.runtime
    token: str | None = ws.app.state.token
    # The HTTP middleware does not see WebSockets: the same check, here.
    if token is not None and not bearer_matches(ws.headers.get("authorization"), token):
        await ws.close(code=4401, reason="node RPC: missing or wrong node token")
        return
    await ws.accept()
    try:
        conn = await runtime.open_port(vm_id, port)
    except PalError as exc:
        await ws.send_text(tunnel.error_frame(exc))
        await ws.close()
        return
    await ws.send_text(tunnel.status_frame(conn.route))
    await tunnel.serve_stream(ws, conn.reader, conn.writer, lambda: runtime.port_traffic(vm_id))


@router.get("/vms/{vm_id}/files")
async def list_files(vm_id: SafeId, runtime: Runtime, path: str = "") -> JSONResponse:
    return dump(await runtime.list_files(vm_id, path))


@router.get("/vms/{vm_id}/files/content")
async def read_file(vm_id: SafeId, path: str, runtime: Runtime) -> Response:
    data, truncated = await runtime.read_file(vm_id, path)
    headers = {"X-Pal-Truncated": "true"} if truncated else {}
    return Response(data, media_type="application/octet-stream", headers=headers)


@router.put("/vms/{vm_id}/files/content")
async def write_file(vm_id: SafeId, path: str, request: Request, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.write_file(vm_id, path, await request.body()))


@router.delete("/vms/{vm_id}/files/content")
async def delete_file(vm_id: SafeId, path: str, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.delete_file(vm_id, path))


# ---------------------------------------------------------------------- egress
@router.put("/vms/{vm_id}/egress")
async def set_egress(vm_id: SafeId, req: EgressSet, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.set_egress(vm_id, req))


@router.put("/vms/{vm_id}/brokered")
async def set_brokered(vm_id: SafeId, req: BrokeredSet, runtime: Runtime) -> JSONResponse:
    await runtime.set_brokered(vm_id, req)
    return JSONResponse({"vmId": vm_id, "rules": len(req.brokered)})


@router.get("/vms/{vm_id}/egress")
async def egress_counters(vm_id: SafeId, runtime: Runtime) -> JSONResponse:
    return JSONResponse({"counters": await runtime.egress_counters(vm_id)})


@router.get("/egress/events")
async def egress_events(runtime: Runtime, after: int = 0, epoch: str = "") -> JSONResponse:
    return dump(await runtime.egress_events(after, epoch))


# ---------------------------------------------------------------------- the node
@router.post("/templates")
async def warm(req: WarmRequest, runtime: Runtime) -> JSONResponse:
    return dump(await runtime.warm(req))


@router.get("/heartbeat")
async def heartbeat(runtime: Runtime) -> JSONResponse:
    return dump(await runtime.heartbeat())


@router.get("/images")
async def images(runtime: Runtime) -> JSONResponse:
    return dump_list("images", await runtime.images())


@router.get("/vms/{vm_id}/metrics")
async def vm_metrics(vm_id: SafeId, runtime: Runtime) -> JSONResponse:
    return dump(runtime.vm_metrics(vm_id))


@router.get("/stats")
async def stats(runtime: Runtime) -> JSONResponse:
    return dump(await runtime.stats())


# ---------------------------------------------------------------------- snapshots kept
@router.get("/snapshots")
async def snapshot_owners(runtime: Runtime) -> JSONResponse:
    return dump(await runtime.snapshot_owners())


@router.delete("/snapshots/{agent_version_id}/{vm_id}")
async def delete_vm_snapshots(
    agent_version_id: SafeId, vm_id: SafeId, runtime: Runtime, keep: str = ""
) -> JSONResponse:
    kept = [k for k in keep.split(",") if k]
    return JSONResponse({"deleted": await runtime.delete_vm_snapshots(agent_version_id, vm_id, kept)})


@router.get("/snapshots/{agent_version_id}/{vm_id}")
async def list_snapshots(agent_version_id: SafeId, vm_id: SafeId, runtime: Runtime) -> JSONResponse:
    return dump_list("snapshots", await runtime.list_snapshots(agent_version_id, vm_id))


@router.get("/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
async def snapshot_status(
    agent_version_id: SafeId, vm_id: SafeId, snapshot_id: SafeId, runtime: Runtime
) -> JSONResponse:
    return dump(await runtime.snapshot_status(agent_version_id, vm_id, snapshot_id))


@router.post("/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}/upload")
async def ensure_uploaded(
    agent_version_id: SafeId, vm_id: SafeId, snapshot_id: SafeId, runtime: Runtime
) -> JSONResponse:
    await runtime.ensure_uploaded(agent_version_id, vm_id, snapshot_id)
    return JSONResponse({"uploaded": True})


@router.delete("/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
async def delete_snapshot(
    agent_version_id: SafeId, vm_id: SafeId, snapshot_id: SafeId, runtime: Runtime
) -> JSONResponse:
    await runtime.delete_snapshot(agent_version_id, vm_id, snapshot_id)
    return JSONResponse({"deleted": True})
