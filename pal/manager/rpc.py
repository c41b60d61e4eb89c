"""The runtime manager's RPC server: HTTP+JSON over a unix socket (docs/internals.md).

A thin skin over :class:`NodeRuntime`; errors travel as ``{"error": {code, message}}``
with the status the API should answer, and ``client.ManagerClient`` rebuilds them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pal.errors import PalError
from pal.manager.models import RetentionRequest, SnapshotRequest, SpawnRequest
from pal.manager.runtime import NodeRuntime
from pal.scheduler.spec import ExecRequest


def create_rpc_app(runtime: NodeRuntime) -> FastAPI:
    app = FastAPI(title="Pal runtime manager", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(PalError)
    async def _pal_error(_: Request, exc: PalError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status)

    def dump(model: object) -> JSONResponse:
        return JSONResponse(model.model_dump(by_alias=True, mode="json"))  # type: ignore[attr-defined]

    @app.post("/vms")
    async def spawn(req: SpawnRequest) -> JSONResponse:
        return dump(await runtime.spawn(req))

    @app.delete("/vms/{vm_id}")
    async def stop(vm_id: str) -> JSONResponse:
        await runtime.stop(vm_id)
        return JSONResponse({"vmId": vm_id, "stopped": True})

    @app.post("/vms/{vm_id}/snapshot")
    async def snapshot(vm_id: str, req: SnapshotRequest) -> JSONResponse:
        return dump(await runtime.snapshot(vm_id, req))

    @app.post("/vms/{vm_id}/exec")
    async def exec_(vm_id: str, req: ExecRequest) -> StreamingResponse:
        runtime._live(vm_id)  # fail with a status before the stream starts

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for ev in runtime.exec_stream(vm_id, req):
                    yield (ev.model_dump_json(by_alias=True, exclude_none=True) + "\n").encode()
            except PalError as exc:
                body = {"type": "error", "code": exc.code, "message": exc.message}
                yield (json.dumps(body) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/vms/{vm_id}/files")
    async def list_files(vm_id: str, path: str = "") -> JSONResponse:
        return dump(await runtime.list_files(vm_id, path))

    @app.get("/vms/{vm_id}/files/content")
    async def read_file(vm_id: str, path: str) -> Response:
        data, truncated = await runtime.read_file(vm_id, path)
        headers = {"X-Pal-Truncated": "true"} if truncated else {}
        return Response(data, media_type="application/octet-stream", headers=headers)

    @app.put("/vms/{vm_id}/files/content")
    async def write_file(vm_id: str, path: str, request: Request) -> JSONResponse:
        return dump(await runtime.write_file(vm_id, path, await request.body()))

    @app.get("/heartbeat")
    async def heartbeat() -> JSONResponse:
        return dump(await runtime.heartbeat())

    @app.get("/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
    async def snapshot_status(agent_version_id: str, vm_id: str, snapshot_id: str) -> JSONResponse:
        return dump(await runtime.snapshot_status(agent_version_id, vm_id, snapshot_id))

    @app.delete("/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
    async def delete_snapshot(agent_version_id: str, vm_id: str, snapshot_id: str) -> JSONResponse:
        await runtime.delete_snapshot(agent_version_id, vm_id, snapshot_id)
        return JSONResponse({"deleted": True})

    @app.post("/snapshots/retention")
    async def retention(req: RetentionRequest) -> JSONResponse:
        deleted = await runtime.apply_retention(req.agent_version_id, req.vm_id, req.protected)
        return JSONResponse({"deleted": deleted})

    return app
