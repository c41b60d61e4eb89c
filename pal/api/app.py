"""The FastAPI application: error mapping, auth, the runtime routes and /healthz.

`pal.server` builds Settings -> Store -> manager -> Scheduler, then calls :func:`create_app`
and serves it; nothing here starts or stops anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

import pal
from pal.config import Settings
from pal.scheduler.scheduler import Scheduler

from .audit import audit_router
from .callers import Callers
from .code import code_router
from .errors import document_errors, install_error_handlers
from .exec_budget import MIB, ExecBudget
from .forward import forward_to_leader, forwarding_key
from .health import HealthCheck, announce_ready, health_router
from .host_report import HostChecks, host_router
from .hosts import AllowedHosts, HostCheckMiddleware
from .json_response import JSONResponse
from .kept_snapshots import kept_router
from .middleware import BodyLimitMiddleware, IdPathMiddleware, RequestIdMiddleware
from .nodes import nodes_router
from .port_host import create_ports_app
from .port_links import Links, OpenLinks
from .port_origins import PortsHostDispatch, PortsOrigins
from .ports import ports_router
from .ports_openapi import document_port_proxy
from .process_attach import attach_links, attach_router
from .processes import processes_router
from .prometheus import metrics_router
from .routes import images_router, runtime_router
from .volume_files import volume_files_router
from .volumes import volumes_router

log = logging.getLogger("pal.api")
DOCS_ASSETS = "/docs-assets"


def create_app(
    scheduler: Scheduler | None,
    store: Any,
    settings: Settings,
    health: HealthCheck | None = None,
    link_secret: bytes | None = None,
    ready: HealthCheck | None = None,
    hosts: AllowedHosts | None = None,
    host_checks: HostChecks | None = None,
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
    ``host_checks()``: its host's capabilities as `pal doctor` rows (GET /v1/operator/host;
    None: a control plane that runs no VMs).
    """
    if ready is None and scheduler is not None:
        ready = _nodes_ready(scheduler, settings)
    # /docs (Swagger UI) and /redoc with their assets served from the fastapi-offline
    # package: no CDN, so they work on machines without Internet access.
    app = FastAPIOffline(
        title="Pal",
        version=getattr(pal, "__version__", "0.1.0"),
        description="Self-hostable microVM sandboxes for AI agents.",
        static_url=DOCS_ASSETS,
        lifespan=_lifespan,
        default_response_class=JSONResponse,
    )
    app.state.scheduler = scheduler
    app.state.store = store
    app.state.settings = settings
    install_error_handlers(app)
    # Credentials a follower checks before it holds a large body (the dashboard adds its own).
    app.state.callers = Callers(store, settings)
    app.state.exec_budget = ExecBudget(settings.exec_buffer_mib * MIB)  # buffered exec output
    # Their handlers find the above on app.state. audit: clients' audit events (the MCP
    # server's tool calls); volumes: docs/volumes.md (and a volume's files, without a
    # sandbox); kept: kept snapshots (docs/lifecycle.md).
    routers = (runtime_router, processes_router, audit_router, code_router, volumes_router, kept_router)
    for router in (*routers, volume_files_router):
        app.include_router(router)
    # Port links are signed with the server's secret (pal.server passes the one dashboard
    # sessions use, which replicas share); without one they last as long as this process.
    shared = link_secret or secrets.token_bytes(32)
    opened = OpenLinks()  # the sockets links opened, closed when their link ends
    app.state.links = Links(shared, store, opened=opened)  # the dashboard's port form too
    app.state.attach_links = attach_links(shared, store, opened)  # processes' WebSocket attach
    app.include_router(attach_router)
    origins = PortsOrigins.from_settings(settings)
    app.state.port_origins = origins
    app.include_router(ports_router)  # its handlers find links and origins on app.state
    app.include_router(images_router)
    app.include_router(metrics_router(settings))
    app.include_router(nodes_router(settings))
    # Followers forward what they cannot answer from the store (pal/api/forward.py).
    # X-Pal-Forwarded is signed with the secret the replicas share (port links' too).
    forward_to_leader(
        app,
        scheduler,
        failover_s=settings.leader_lease_s + 2.0,
        key=forwarding_key(shared),
        known_caller=app.state.callers.known,
    )

    _add_middleware(app, settings, hosts, shared, scheduler, store)
    app.state.health, app.state.ready = health, ready  # for /healthz, /readyz and the lifespan
    app.include_router(health_router)
    app.state.host_checks = host_checks
    app.include_router(host_router)
    document_errors(app)
    document_port_proxy(app)
    return app


def _add_middleware(
    app: FastAPI,
    settings: Settings,
    hosts: AllowedHosts | None,
    shared: bytes,
    scheduler: Scheduler | None,
    store: Any,
) -> None:
    """The middleware stack, innermost first (Starlette runs the last added outermost)."""
    links, origins = app.state.links, app.state.port_origins
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
    # Before routing or forwarding: an id in the path that is none is 400 (middleware.py).
    app.add_middleware(IdPathMiddleware)
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


def _nodes_ready(scheduler: Scheduler, settings: Settings) -> HealthCheck:
    """The default readiness: pal/scheduler/readiness.py on ``scheduler``'s nodes."""

    async def ready() -> dict[str, Any]:
        from pal.scheduler.readiness import readiness

        return await readiness(scheduler, templates=settings.templates)

    return ready


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Served with a lifespan (uvicorn), the app logs once when it becomes ready."""
    task = asyncio.create_task(announce_ready(app.state.health, app.state.ready), name="announce-ready")
    try:
        yield
    finally:
        task.cancel()
