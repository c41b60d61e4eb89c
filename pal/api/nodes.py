"""Cluster routes: nodes' heartbeats (node token) and the operator's node commands
(the operator token: pal/api/operator.py).

- ``POST /v1/nodes/heartbeat``: a `pal node` registers and heartbeats (body: the node
  RPC's ``NodeHeartbeat``); ``Authorization: Bearer <its node token>``.
- ``GET /v1/nodes``: nodes, capacity, health (`pal node ls`).
- ``POST /v1/nodes/{id}/drain`` (``{"migrate": bool}``) and ``POST /v1/nodes/{id}/activate``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request

from pal.config import Settings
from pal.errors import Forbidden, Unauthorized
from pal.wire.auth import bearer_matches, node_token
from pal.wire.models import NodeHeartbeat

from .body import require_json
from .deps import scheduler_of
from .errors import error_responses
from .json_response import JSONResponse
from .operator import require_operator


def nodes_router(settings: Settings) -> APIRouter:
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
        ack = await scheduler_of(request.app.state).reconciler.node_heartbeat(hb)
        return JSONResponse(ack.model_dump(by_alias=True, mode="json"))

    @r.get("", summary="Nodes, their capacity and health (operator)")
    async def list_nodes(request: Request) -> JSONResponse:
        require_operator(request, settings)
        return JSONResponse({"nodes": scheduler_of(request.app.state).reads.node_views()})

    @r.post(
        "/{node_id}/drain",
        summary="Pause a node's VMs so they resume elsewhere (operator)",
        dependencies=[Depends(require_json)],
        responses=error_responses(404, 415, 503),
    )
    async def drain(node_id: str, request: Request, body: dict[str, Any] | None = Body(None)) -> JSONResponse:
        require_operator(request, settings)
        migrate = bool((body or {}).get("migrate", False))
        return JSONResponse(
            await scheduler_of(request.app.state).draining.drain_node(node_id, migrate=migrate)
        )

    @r.post(
        "/{node_id}/activate",
        summary="Let a drained node take new VMs again (operator)",
        responses=error_responses(404, 503),
    )
    async def activate(node_id: str, request: Request) -> JSONResponse:
        require_operator(request, settings)
        return JSONResponse(await scheduler_of(request.app.state).draining.set_node_active(node_id))

    return r
