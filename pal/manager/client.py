"""The one client of the runtime manager RPC (implements ``api.RuntimeManager``).

The embedded default (`pal up`) talks to its in-process manager through this same client
over the manager's unix socket, so there is one code path, not two.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from pal.errors import Unavailable, from_wire
from pal.manager.client_code import CodeCalls
from pal.manager.client_http import (
    CONTROL_CONNECTIONS,
    CONTROL_POOL_WAIT_S,
    DEFAULT_MAX_STREAMS,
    UNREACHABLE,
    NodeHttp,
    StreamSlots,
)
from pal.manager.client_processes import ProcessCalls
from pal.manager.models import (
    BrokeredSet,
    EgressEvents,
    EgressSet,
    EgressSetResult,
    ExecEvent,
    FileDeleted,
    FileList,
    FileWritten,
    ImageInfo,
    LivePauseRequest,
    LivePauseResult,
    LiveResumeResult,
    LiveState,
    NodeHeartbeat,
    NodeStats,
    Notices,
    SnapshotInfo,
    SnapshotOwners,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
    VmMetrics,
    WarmRequest,
    WarmResult,
)
from pal.manager.tunnel import MAX_FRAME, TunnelStream, open_tunnel
from pal.spec import ExecRequest

TUNNEL_OPEN_TIMEOUT_S = 30.0  # the node's connect to the guest has its own 10 s bound

# Spawns include a cold boot under TCG; snapshots include checksumming. No call waits for
# a free connection longer than CONTROL_POOL_WAIT_S (client_http.py).
LONG_TIMEOUT = httpx.Timeout(300.0, connect=5.0, pool=CONTROL_POOL_WAIT_S)
SPAWN_TIMEOUT = httpx.Timeout(None, connect=5.0, pool=CONTROL_POOL_WAIT_S)
# A heartbeat is a read of the node's books: a node that takes longer is as good as silent
# (reconciliation must not hang on it).
HEARTBEAT_TIMEOUT = httpx.Timeout(15.0, connect=5.0, pool=CONTROL_POOL_WAIT_S)


class ManagerClient(ProcessCalls, CodeCalls, NodeHttp):
    """``ManagerClient(socket)``: the embedded node's root-only unix socket.
    ``ManagerClient(url=..., token=...)``: a remote node over HTTP, every request carrying
    the node's token (``Authorization: Bearer``; pal/manager/auth.py). ``max_streams``: the
    node's budget of long-lived calls (client_http.py)."""

    def __init__(
        self,
        socket_path: Path | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if (socket_path is None) == (url is None):
            raise ValueError("ManagerClient needs exactly one of a unix socket path or a URL")
        self.socket_path = socket_path
        self.url = url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._auth_headers = dict(headers)
        self.slots = StreamSlots(max_streams)
        self._http = self._client(headers, httpx.Limits(max_connections=CONTROL_CONNECTIONS))
        # Grows with the streams open, up to their budget (one connection each).
        self._streams = self._client(
            headers, httpx.Limits(max_connections=max_streams, max_keepalive_connections=32)
        )

    def _client(self, headers: dict[str, str], limits: httpx.Limits) -> httpx.AsyncClient:
        uds = str(self.socket_path) if self.socket_path is not None else None
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits),
            base_url=self.url or "http://manager",
            timeout=LONG_TIMEOUT,
            headers=headers,
        )

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._streams.aclose()

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        # No read timeout: a spawn waits its turn for free CPU on the node, as long as the
        # restores ahead of it take (restore_gate.py), and then ends by the node's own
        # deadlines (identify in CPU time, QMP, migration); a node that dies closes it.
        resp = await self._call("POST", "/vms", json=self._body(req), timeout=SPAWN_TIMEOUT)
        return SpawnResult.model_validate(resp.json())

    async def stop(self, vm_id: str, incarnation: int | None = None) -> None:
        params = {"incarnation": incarnation} if incarnation is not None else None
        await self._call("DELETE", f"/vms/{vm_id}", params=params)

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        resp = await self._call("POST", f"/vms/{vm_id}/snapshot", json=self._body(req))
        return SnapshotResult.model_validate(resp.json())

    async def live_pause(self, vm_id: str, req: LivePauseRequest) -> LivePauseResult:
        resp = await self._call("POST", f"/vms/{vm_id}/live-pause", json=self._body(req))
        return LivePauseResult.model_validate(resp.json())

    async def live_resume(self, vm_id: str) -> LiveResumeResult:
        resp = await self._call("POST", f"/vms/{vm_id}/live-resume")
        return LiveResumeResult.model_validate(resp.json())

    async def live_status(self, vm_id: str) -> LiveState | None:
        resp = await self._call("GET", f"/vms/{vm_id}/live", timeout=10.0)
        raw = resp.json().get("live")
        return None if raw is None else LiveState.model_validate(raw)

    async def notices(self, after: int, epoch: str, wait_s: float) -> Notices:
        # The control plane's own long poll (one per node, bounded by wait_s): a control call.
        resp = await self._call(
            "GET",
            "/notices",
            params={"after": after, "epoch": epoch, "wait_s": wait_s},
            timeout=httpx.Timeout(wait_s + 30.0, connect=5.0),
        )
        return Notices.model_validate(resp.json())

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        async with contextlib.aclosing(
            self._ndjson("POST", f"/vms/{vm_id}/exec", json=self._body(req))
        ) as lines:
            async for raw in lines:
                ev = ExecEvent.model_validate(raw)
                if ev.type == "error" and ev.status is not None:
                    # The node's own error, as if it came before the stream.
                    raise from_wire(ev.status, ev.code or "", ev.message or "")
                yield ev

    async def open_port(self, vm_id: str, port: int) -> TunnelStream:
        path = f"/vms/{vm_id}/ports/{port}"
        self.slots.take()  # a tunnel is long-lived: given back when it closes
        try:
            stream = await self._open_tunnel(path)
        except BaseException:
            self.slots.give()
            raise
        stream.on_close(self.slots.give)
        return stream

    async def _open_tunnel(self, path: str) -> TunnelStream:
        from websockets.asyncio.client import connect, unix_connect

        opts: dict[str, Any] = {
            "max_size": MAX_FRAME,
            "compression": None,
            "open_timeout": TUNNEL_OPEN_TIMEOUT_S,
            "additional_headers": self._auth_headers,
        }
        try:
            if self.socket_path is not None:
                # A local socket: no dead peer to detect with pings.
                ws = await unix_connect(
                    str(self.socket_path), "ws://manager" + path, ping_interval=None, **opts
                )
            else:
                assert self.url is not None
                base = self.url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
                ws = await connect(base + path, **opts)
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"runtime manager unreachable: {exc}", code=UNREACHABLE) from exc
        except Exception as exc:  # a refused handshake (websockets.InvalidStatus...)
            raise Unavailable(f"runtime manager refused the port stream: {exc}") from exc
        return await open_tunnel(ws)

    async def list_files(self, vm_id: str, path: str) -> FileList:
        resp = await self._call("GET", f"/vms/{vm_id}/files", params={"path": path})
        return FileList.model_validate(resp.json())

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        resp = await self._call("GET", f"/vms/{vm_id}/files/content", params={"path": path})
        return resp.content, resp.headers.get("X-Pal-Truncated") == "true"

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        resp = await self._call("PUT", f"/vms/{vm_id}/files/content", params={"path": path}, content=data)
        return FileWritten.model_validate(resp.json())

    async def set_egress(self, vm_id: str, req: EgressSet) -> EgressSetResult:
        resp = await self._call("PUT", f"/vms/{vm_id}/egress", json=self._body(req))
        return EgressSetResult.model_validate(resp.json())

    async def set_brokered(self, vm_id: str, req: BrokeredSet) -> None:
        await self._call("PUT", f"/vms/{vm_id}/brokered", json=self._body(req))

    async def egress_counters(self, vm_id: str) -> dict[str, int] | None:
        resp = await self._call("GET", f"/vms/{vm_id}/egress", timeout=5.0)
        c = resp.json().get("counters")
        return dict(c) if isinstance(c, dict) else None

    async def egress_events(self, after: int, epoch: str) -> EgressEvents:
        resp = await self._call("GET", "/egress/events", params={"after": after, "epoch": epoch})
        return EgressEvents.model_validate(resp.json())

    async def warm(self, req: WarmRequest) -> WarmResult:
        # A template build is a cold boot (a minute or more under TCG on a busy host).
        resp = await self._call("POST", "/templates", json=self._body(req), timeout=httpx.Timeout(900.0))
        return WarmResult.model_validate(resp.json())

    async def delete_file(self, vm_id: str, path: str) -> FileDeleted:
        resp = await self._call("DELETE", f"/vms/{vm_id}/files/content", params={"path": path})
        return FileDeleted.model_validate(resp.json())

    async def heartbeat(self) -> NodeHeartbeat:
        resp = await self._call("GET", "/heartbeat", timeout=HEARTBEAT_TIMEOUT)
        return NodeHeartbeat.model_validate(resp.json())

    async def images(self) -> list[ImageInfo]:
        resp = await self._call("GET", "/images")
        return [ImageInfo.model_validate(x) for x in resp.json()["images"]]

    async def vm_metrics(self, vm_id: str) -> VmMetrics:
        resp = await self._call("GET", f"/vms/{vm_id}/metrics")
        return VmMetrics.model_validate(resp.json())

    async def stats(self) -> NodeStats:
        resp = await self._call("GET", "/stats")
        return NodeStats.model_validate(resp.json())

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[SnapshotInfo]:
        resp = await self._call("GET", f"/snapshots/{agent_version_id}/{vm_id}")
        return [SnapshotInfo.model_validate(x) for x in resp.json()["snapshots"]]

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        resp = await self._call("GET", f"/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")
        return SnapshotStatus.model_validate(resp.json())

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await self._call("POST", f"/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}/upload")

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await self._call("DELETE", f"/snapshots/{agent_version_id}/{vm_id}/{snapshot_id}")

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        resp = await self._call(
            "DELETE", f"/snapshots/{agent_version_id}/{vm_id}", params={"keep": ",".join(keep)}
        )
        return list(resp.json()["deleted"])

    async def snapshot_owners(self) -> SnapshotOwners:
        resp = await self._call("GET", "/snapshots")
        return SnapshotOwners.model_validate(resp.json())
