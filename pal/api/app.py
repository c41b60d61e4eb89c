"""The FastAPI application: error mapping, auth, the runtime routes and /healthz.

`pal.server` builds Settings -> Store -> manager -> Scheduler, then calls :func:`create_app`
and serves it; nothing here starts or stops anything.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

import pal
from pal.config import Settings

from .auth import make_tenant_dependency
from .errors import install_error_handlers
from .routes import runtime_router

log = logging.getLogger("pal.api")

HealthCheck = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]


def create_app(scheduler: Any, store: Any, settings: Settings, health: HealthCheck | None = None) -> FastAPI:
    """The REST API over ``scheduler``; ``store`` resolves API keys to tenants.

    ``health()`` returns a dict with at least ``ok: bool`` (scheduler started, manager
    reachable, image present); /healthz answers 200 when ok, else 503. Without one,
    /healthz only says the process is up.
    """
    app = FastAPI(
        title="Pal",
        version=getattr(pal, "__version__", "0.1.0"),
        description="Self-hostable microVM sandboxes for AI agents.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.scheduler = scheduler
    app.state.store = store
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(runtime_router(scheduler, make_tenant_dependency(store)))

    @app.get("/healthz", tags=["health"], summary="200 when this server can schedule VMs, else 503")
    async def healthz() -> JSONResponse:
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
        return JSONResponse(report, status_code=200 if ok else 503, headers={"Cache-Control": "no-store"})

    return app
