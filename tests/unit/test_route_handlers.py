"""The /v1/runtime, /v1/images and ports handlers are module-level functions (pal/api/routes.py,
pal/api/ports.py): each has a name, and can be called (and tested) without an app."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import Request
from fastapi.routing import APIRoute, APIWebSocketRoute

from pal.api import ports, routes
from pal.api.models import ImageListOut, VmListOut


@pytest.mark.parametrize(
    ("module", "router"),
    [(routes, routes.runtime_router), (routes, routes.images_router), (ports, ports.ports_router)],
)
def test_every_handler_is_a_named_module_function(module: Any, router: Any) -> None:
    handlers = [r.endpoint for r in router.routes if isinstance(r, APIRoute | APIWebSocketRoute)]
    assert len(handlers) >= 1
    for handler in handlers:
        assert "<locals>" not in handler.__qualname__, handler.__qualname__
        assert getattr(module, handler.__name__) is handler


class _Scheduler:
    """Stands in for the two operations the routes call (pal/scheduler/listing.py, reads.py)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def vms(self, tenant: str, **_: Any) -> list[Any]:
        self.asked.append(tenant)
        return []

    async def list_images(self, tenant: str) -> list[Any]:
        self.asked.append(tenant)
        return []


async def test_a_handler_runs_on_its_own() -> None:
    scheduler = _Scheduler()
    request = Request({"type": "http", "query_string": b"", "headers": []})
    assert await routes.list_vms("t-1", scheduler, request) == VmListOut(vms=[])  # type: ignore[arg-type]
    assert await routes.list_images("t-2", scheduler) == ImageListOut(images=[])  # type: ignore[arg-type]
    assert scheduler.asked == ["t-1", "t-2"]
