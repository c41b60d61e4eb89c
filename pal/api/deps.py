"""What the route handlers get from the app (create_app puts the scheduler and the store on
``app.state``): the calling tenant's id and the scheduler, as FastAPI dependencies."""

# No `from __future__ import annotations`: FastAPI resolves these aliases where they are used.

from typing import Annotated, Any

from fastapi import Depends, Request

from .auth import require_tenant


def app_scheduler(request: Request) -> Any:
    return request.app.state.scheduler


Tenant = Annotated[str, Depends(require_tenant)]
Scheduler = Annotated[Any, Depends(app_scheduler)]
