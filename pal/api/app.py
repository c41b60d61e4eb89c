"""The FastAPI application: error mapping, auth, the runtime routes and /healthz.

`pal.server` builds Settings -> Store -> manager -> Scheduler, then calls :func:`create_app`
and serves it; nothing here starts or stops anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

import pal
from pal.config import Settings

from .callers import Callers
from .code import code_router
from .errors import document_errors, install_error_handlers
from .exec_budget import MIB, ExecBudget
from .forward import forward_to_leader, forwarding_key
from .hosts import AllowedHosts, HostCheckMiddleware
from .middleware import BodyLimitMiddleware, RequestIdMiddleware
from .models import HealthOut, ReadyOut
from .nodes import nodes_router
from .operator import is_operator
from .port_host import create_ports_app
from .port_links import Links
from .port_origins import PortsHostDispatch, PortsOrigins
from .ports import ports_router
from .ports_openapi import document_port_proxy
from .processes import processes_router
from .prometheus import metrics_router
from .routes import images_router, runtime_router

log = logging.getLogger("pal.api")
DOCS_ASSETS = "/docs-assets"
READY_POLL_S = 0.5  # how often a starting server checks whether it is ready yet

HealthCheck = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]


def create_app(
    scheduler: Any,
    store: Any,
    settings: Settings,
    health: HealthCheck | None = None,
    link_secret: bytes | None = None,
    ready: HealthCheck | None = None,
    hosts: AllowedHosts | None = None,
) -> FastAPI:
    """The REST API over ``scheduler``; ``store`` resolves API keys to tenants.

    ``health()`` returns a dict with at least ``ok: bool`` (scheduler started, manager
    reachable, image present); /healthz answers 200 when ok, else 503. Without one,
    /healthz only says the process is up. ``ready()`` returns ``ready: bool`` (and what it
    waits for; default: pal/scheduler/readiness.py on ``scheduler``'s nodes): /readyz
    answers 200 when the server is healthy and ready to schedule at full speed, else 503.
    Served with a lifespan (uvicorn), the app logs once when it becomes ready.

    ``hosts``: the names it answers as (pal/api/hosts.py; default: loopback names and
    ``PAL_HOSTS``). ``settings.admin_token`` is the operator token in effect (pal/operator.py).
    """
    if ready is None and getattr(scheduler, "nodes", None) is not None:

        async def ready() -> dict[str, Any]:
            from pal.scheduler.readiness import readiness

            return await readiness(scheduler, templates=settings.templates)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_announce_ready(health, ready), name="announce-ready")
        try:
            yield
        finally:
            task.cancel()

    # /docs (Swagger UI) and /redoc with their assets served from the fastapi-offline
    # package: no CDN, so they work on machines without Internet access.
    app = FastAPIOffline(
        title="Pal",
        version=getattr(pal, "__version__", "0.1.0"),
        description="Self-hostable microVM sandboxes for AI agents.",
        static_url=DOCS_ASSETS,
        lifespan=lifespan,
    )
    app.state.scheduler = scheduler
    app.state.store = store
    app.state.settings = settings
    install_error_handlers(app)
    # Credentials a follower checks before it holds a large body (the dashboard adds its own).
    app.state.callers = Callers(store, settings)
    app.state.exec_budget = ExecBudget(settings.exec_buffer_mib * MIB)  # buffered exec output
    app.include_router(runtime_router)  # its handlers find the above on app.state
    app.include_router(processes_router)
    app.include_router(code_router)
    # Port links are signed with the server's secret (pal.server passes the one dashboard
    # sessions use, which replicas share); without one they last as long as this process.
    shared = link_secret or secrets.token_bytes(32)
    app.state.links = links = Links(shared, store)  # the dashboard's port form too
    origins = PortsOrigins.from_settings(settings)
    app.state.port_origins = origins
    app.include_router(ports_router)  # its handlers find links and origins on app.state
    app.include_router(images_router)
    app.include_router(metrics_router(scheduler, settings))
    app.include_router(nodes_router(scheduler, settings))
    # Followers forward what they cannot answer from the store (pal/api/forward.py).
    # X-Pal-Forwarded is signed with the secret the replicas share (port links' too).
    forward_to_leader(
        app,
        scheduler,
        failover_s=settings.leader_lease_s + 2.0,
        key=forwarding_key(shared),
        known_caller=app.state.callers.known,
    )

    # Outermost last: every request gets its id first, then the body limit applies.
    app.add_middleware(BodyLimitMiddleware)
    if settings.cors_origins:
        # Browser apps on these origins may call the API with a key (the TypeScript SDK in a
        # page); the dashboard is same-origin and needs none. No cookies cross origins.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Accept"],
            expose_headers=["X-Request-Id", "X-Pal-Truncated"],
            allow_credentials=False,
            max_age=600,
        )
    # Before anything reads the request or forwards it: a name this server is not is a
    # DNS-rebinding page (pal/api/hosts.py).
    app.add_middleware(HostCheckMiddleware, allowed=hosts or AllowedHosts.for_server(settings))
    app.add_middleware(RequestIdMiddleware)
    # Outermost of all: a request whose Host names a VM port gets the ports proxy and
    # nothing else, never the API or the dashboard (pal/api/port_origins.py). pal.server
    # serves the same ports app on the ports listener.
    app.state.ports_app = create_ports_app(
        scheduler,
        store,
        links,
        origins,
        settings.leader_lease_s + 2.0,
        forwarding_key=forwarding_key(shared),
        known_caller=app.state.callers.known,
    )
    app.add_middleware(PortsHostDispatch, ports_app=app.state.ports_app, origins=origins)

    @app.get(
        "/healthz",
        tags=["health"],
        summary="200 when this server can schedule VMs, else 503; details for the operator only",
        responses={200: {"model": HealthOut}, 503: {"model": HealthOut, "description": "not healthy"}},
    )
    async def healthz(request: Request) -> JSONResponse:
        """``{"ok": bool}`` for anyone. The details (accelerator, VM count, what failed) only
        with ``Authorization: Bearer <operator token or PAL_METRICS_TOKEN>``: without a
        key the server shows no internals (they are in its log under the request id)."""
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
        shown = report if is_operator(request, settings) else {"ok": ok}
        return JSONResponse(shown, status_code=200 if ok else 503, headers={"Cache-Control": "no-store"})

    @app.get(
        "/readyz",
        tags=["health"],
        summary="200 when this server schedules at full speed (default template warm), else 503",
        responses={200: {"model": ReadyOut}, 503: {"model": ReadyOut, "description": "not ready yet"}},
    )
    async def readyz(request: Request) -> JSONResponse:
        """``{"ready": bool}`` for anyone; with the operator's token also ``waitingFor``
        (what readiness still waits for). Healthy first: an unhealthy server is not ready."""
        report = await _readiness(health, ready)
        is_ready = bool(report.get("ready"))
        report["ready"] = is_ready
        shown = report if is_operator(request, settings) else {"ready": is_ready}
        return JSONResponse(
            shown, status_code=200 if is_ready else 503, headers={"Cache-Control": "no-store"}
        )

    document_errors(app)
    document_port_proxy(app)
    return app


async def _readiness(health: HealthCheck | None, ready: HealthCheck | None) -> dict[str, Any]:
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


async def _announce_ready(health: HealthCheck | None, ready: HealthCheck | None) -> None:
    """Log once when the server schedules at full speed (what /readyz reports), so whoever
    runs `pal up` sees when to start sending work. Polls until then, not after."""
    started = time.monotonic()
    while not (await _readiness(health, ready))["ready"]:
        await asyncio.sleep(READY_POLL_S)
    log.info(
        "Pal is ready: the default template is warm, schedules run at full speed (%.1f s after start)",
        time.monotonic() - started,
    )
