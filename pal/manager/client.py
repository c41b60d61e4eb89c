"""The one client of the runtime manager RPC (implements ``api.RuntimeManager``).

The embedded default (`pal up`) talks to its in-process manager through this same client
over the manager's unix socket, so there is one code path, not two.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from pal.errors import PalError, Unavailable, from_wire
from pal.manager.models import (
    ExecEvent,
    FileList,
    FileWritten,
    NodeHeartbeat,
    RetentionRequest,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
)
from pal.scheduler.spec import ExecRequest

# Spawns include a cold boot under TCG; snapshots include checksumming.
LONG_TIMEOUT = httpx.Timeout(300.0, connect=5.0)


class ManagerClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            base_url="http://manager",
            timeout=LONG_TIMEOUT,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            err = resp.json()["error"]
            raise from_wire(resp.status_code, err["code"], err["message"])
        except (ValueError, KeyError, TypeError):
            raise PalError(f"runtime manager answered {resp.status_code}: {resp.text[:200]}") from None

    async def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}") from exc
        self._raise_for(resp)
        return resp

    @staticmethod
    def _body(model: Any) -> dict[str, Any]:
        return model.model_dump(by_alias=True, mode="json")  # type: ignore[no-any-return]

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        resp = await self._call("POST", "/vms", json=self._body(req))
        return SpawnResult.model_validate(resp.json())

    async def stop(self, vm_id: str) -> None:
        await self._call("DELETE", f"/vms/{vm_id}")

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        resp = await self._call("POST", f"/vms/{vm_id}/snapshot", json=self._body(req))
        return SnapshotResult.model_validate(resp.json())

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        body = req.model_dump(by_alias=True, mode="json")
        try:
            async with self._http.stream(
                "POST", f"/vms/{vm_id}/exec", json=body, timeout=httpx.Timeout(None, connect=5.0)
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield ExecEvent.model_validate(json.loads(line))
        except httpx.TransportError as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}") from exc

    async def list_files(self, vm_id: str, path: str) -> FileList:
        resp = await self._call("GET", f"/vms/{vm_id}/files", params={"path": path})
        return FileList.model_validate(resp.json())

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        resp = await self._call("GET", f"/vms/{vm_id}/files/content", params={"path": path})
        return resp.content, resp.headers.get("X-Pal-Truncated") == "true"

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        resp = await self._call("PUT", f"/vms/{vm_id}/files/content", params={"path": path}, content=data)
        return FileWritten.model_validate(resp.json())

    async def heartbeat(self) -> NodeHeartbeat:
        resp = await self._call("GET", "/heartbeat")
        return NodeHeartbeat.model_validate(resp.json())

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        resp = await self._call("GET", f"/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
        return SnapshotStatus.model_validate(resp.json())

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await self._call("DELETE", f"/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")

    async def apply_retention(self, agent_version_id: str, vm_id: str, protected: list[str]) -> list[str]:
        req = RetentionRequest(agent_version_id=agent_version_id, vm_id=vm_id, protected=protected)
        resp = await self._call("POST", "/snapshots/retention", json=self._body(req))
        return list(resp.json()["deleted"])
