"""/healthz and /readyz: whether this server can schedule, and at full speed; the details
only for the operator. ``create_app`` puts its ``health`` and ``ready`` probes on app.state."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from .json_response import JSONResponse
from .models import HealthOut, ReadyOut
from .operator import is_operator

log = logging.getLogger("pal.api")
READY_POLL_S = 0.5  # how often a starting server checks whether it is ready yet

HealthCheck = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]

health_router = APIRouter(tags=["health"])


@health_router.get(
    "/healthz",
    summary="200 when this server can schedule VMs, else 503; details for the operator only",
    responses={200: {"model": HealthOut}, 503: {"model": HealthOut, "description": "not healthy"}},
)
async def healthz(request: Request) -> JSONResponse:
    """``{"ok": bool}`` for anyone. The details (accelerator, VM count, what failed) only
    with ``Authorization: Bearer <operator token or PAL_METRICS_TOKEN>``: without a
    key the server shows no internals (they are in its log under the request id)."""
    health: HealthCheck | None = request.app.state.health
    if health is None:
        return JSONResponse({"ok": True})
    try:
        result = health()
        report = await result if inspect.isawaitable(result) else result
        report = dict(report)
    except Exception as exc:  # a failing probe is an unhealthy server, not a 500
        log.warning("health check failed: %s", exc)
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ok = bool(report.get("ok"))
    report["ok"] = ok
    shown = report if is_operator(request, request.app.state.settings) else {"ok": ok}
    return JSONResponse(shown, status_code=200 if ok else 503, headers={"Cache-Control": "no-store"})


@health_router.get(
    "/readyz",
    summary="200 when this server schedules at full speed (default template warm), else 503",
    responses={200: {"model": ReadyOut}, 503: {"model": ReadyOut, "description": "not ready yet"}},
)
async def readyz(request: Request) -> JSONResponse:
    """``{"ready": bool}`` for anyone; with the operator's token also ``waitingFor``
    (what readiness still waits for). Healthy first: an unhealthy server is not ready."""
    report = await readiness(request.app.state.health, request.app.state.ready)
    is_ready = bool(report.get("ready"))
    report["ready"] = is_ready
    shown = report if is_operator(request, request.app.state.settings) else {"ready": is_ready}
    return JSONResponse(shown, status_code=200 if is_ready else 503, headers={"Cache-Control": "no-store"})


async def readiness(health: HealthCheck | None, ready: HealthCheck | None) -> dict[str, Any]:
    """``{"ready": bool, "waitingFor"?: str}``: healthy first, then ``ready()``."""
    report: dict[str, Any] = {"ready": True}
    try:
        for probe in (health, ready):
            if probe is None:
                continue
            result = probe()
            got = dict(await result if inspect.isawaitable(result) else result)
            if probe is health and not got.get("ok"):
                return {"ready": False, "waitingFor": got.get("error") or "a healthy server (see /healthz)"}
            if probe is ready:
                report = got
    except Exception as exc:  # a failing probe is a server not ready, not a 500
        log.warning("readiness check failed: %s", exc)
        return {"ready": False, "waitingFor": f"{type(exc).__name__}: {exc}"}
    report["ready"] = bool(report.get("ready"))
    return report


async def announce_ready(health: HealthCheck | None, ready: HealthCheck | None) -> None:
    """Log once when the server schedules at full speed (what /readyz reports), so whoever
    runs `pal up` sees when to start sending work. Polls until then, not after."""
    started = time.monotonic()
    while not (await readiness(health, ready))["ready"]:
        await asyncio.sleep(READY_POLL_S)
    log.info(
        "Pal is ready: the default template is warm, schedules run at full speed (%.1f s after start)",
        time.monotonic() - started,
    )
