"""Mount the dashboard on the control plane's FastAPI app: pages, fragments, static files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from pal.config import Settings
from pal.scheduler.scheduler import Scheduler

from . import code_panel, routes, vm_routes, volume_routes
from .context import Dashboard, Refused, SignInRequired, refused, sign_in_required

STATIC = Path(__file__).parent / "static"


def install_dashboard(
    app: FastAPI, scheduler: Scheduler, store: Any, settings: Settings, secret: bytes | None = None
) -> None:
    """``secret`` signs the session cookies (default: session.load_secret). Replicas pass the
    one they share, so a session opened on one works on all. On a follower every dashboard
    request but its static files goes to the leader (pal/api/forward.py, installed by
    create_app), so its actions run where the VM state is mutated."""
    app.mount("/runtime/static", StaticFiles(directory=STATIC), name="dashboard-static")
    app.state.dashboard = dash = Dashboard(scheduler, store, settings, secret)
    app.include_router(routes.router)  # first: its fixed paths before /runtime/{vm_id}
    app.include_router(volume_routes.router)  # /runtime/volumes..., before /runtime/{vm_id}
    app.include_router(vm_routes.router)
    app.include_router(code_panel.router)
    callers = getattr(app.state, "callers", None)
    if callers is not None:  # a follower holds a large form body of a signed-in user only
        callers.add(lambda conn: dash.sessions.read(conn) is not None)  # type: ignore[arg-type]
    app.add_exception_handler(SignInRequired, sign_in_required)
    app.add_exception_handler(Refused, refused)

    @app.get("/", include_in_schema=False)
    async def root() -> Any:
        from fastapi.responses import RedirectResponse

        return RedirectResponse("/runtime", status_code=307)
