"""GET /v1/operator/host (the operator's token): what the running server uses, its
effective settings (secrets only say whether they are set) and, where it runs VMs itself
(`pal up`), each host capability as `pal doctor` shows it, probed by the server with its
own settings. `pal doctor` reads it when a server is up, so it says what the server uses,
not what the shell it runs in would (pal/ops/doctor.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from pal.config_env import effective

from .errors import error_responses
from .json_response import JSONResponse
from .models import HostOut
from .operator import require_operator

# The server's host checks as doctor's rows ({check, ok, detail}); None: it runs no VMs.
HostChecks = Callable[[], list[dict[str, Any]]]

host_router = APIRouter(tags=["nodes"])


@host_router.get(
    "/v1/operator/host",
    summary="The server's effective settings and host capabilities (operator)",
    response_model=HostOut,
    responses=error_responses(401, 403),
)
async def operator_host(request: Request) -> JSONResponse:
    settings = request.app.state.settings
    require_operator(request, settings)
    checks: HostChecks | None = request.app.state.host_checks
    rows = await asyncio.to_thread(checks) if checks is not None else None
    body = {"settings": effective(settings), "checks": rows}
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
