"""Cluster routes: nodes' heartbeats (node token) and the operator's node commands
(``PAL_ADMIN_TOKEN``, or loopback clients when it is unset).

- ``POST /v1/nodes/heartbeat``: a `pal node` registers and heartbeats (body: the node
  RPC's ``NodeHeartbeat``); ``Authorization: Bearer <its node token>``.
- ``GET /v1/nodes``: nodes, capacity, health (`pal node ls`).
- ``POST /v1/nodes/{id}/drain`` (``{"migrate": bool}``) and ``POST /v1/nodes/{id}/activate``.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse

from pal.config import Settings
from pal.errors import Forbidden, Unauthorized
from pal.manager.auth import bearer_matches, node_token
from pal.manager.models import NodeHeartbeat

from .body import require_json
from .errors import error_responses


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else None
    try:
        return bool(host) and ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def check_admin(request: Request, settings: Settings) -> None:
    """401/403 unless the caller is the operator: ``PAL_ADMIN_TOKEN`` when set (needed in a
    cluster: a follower forwards requests, so the leader sees the follower's address),
    else a loopback client."""
    token = settings.admin_token
    if token:
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized("send 'Authorization: Bearer <PAL_ADMIN_TOKEN>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Forbidden("this token does not open the operator's routes")
        return
    if not _loopback(request):
        raise Forbidden("operator routes answer loopback clients only; set PAL_ADMIN_TOKEN")


def nodes_router(scheduler: Any, settings: Settings) -> APIRouter:
    r = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=error_responses(400, 401, 403, 413))

    @r.post(
        "/heartbeat",
        summary="A node registers and reports (node token)",
        dependencies=[Depends(require_json)],
        responses=error_responses(415),
    )
    async def heartbeat(hb: NodeHeartbeat, request: Request) -> JSONResponse:
        if not settings.cluster_secret:
            raise Forbidden("this control plane takes no remote nodes: PAL_CLUSTER_SECRET is not set")
        if not bearer_matches(
            request.headers.get("authorization"), node_token(settings.cluster_secret, hb.node_id)
        ):
            raise Unauthorized(f"wrong or missing node token for node {hb.node_id}")
        ack = await scheduler.node_heartbeat(hb)
        return JSONResponse(ack.model_dump(by_alias=True, mode="json"))

    @r.get("", summary="Nodes, their capacity and health (operator)")
    async def list_nodes(request: Request) -> JSONResponse:
        check_admin(request, settings)
        return JSONResponse({"nodes": scheduler.node_views()})

    @r.post(
        "/{node_id}/drain",
        summary="Pause a node's VMs so they resume elsewhere (operator)",
        dependencies=[Depends(require_json)],
        responses=error_responses(404, 415, 503),
    )
    async def drain(node_id: str, request: Request, body: dict[str, Any] | None = Body(None)) -> JSONResponse:
        check_admin(request, settings)
        migrate = bool((body or {}).get("migrate", False))
        return JSONResponse(await scheduler.drain_node(node_id, migrate=migrate))

    @r.post(
        "/{node_id}/activate",
        summary="Let a drained node take new VMs again (operator)",
        responses=error_responses(404, 503),
    )
    async def activate(node_id: str, request: Request) -> JSONResponse:
        check_admin(request, settings)
        return JSONResponse(await scheduler.set_node_active(node_id))

    return r
