"""Readiness (/readyz) apart from liveness (/healthz): ready only once the default image's
warm template exists, so the first schedules do not race its build (issue 17 item 2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from pal.scheduler.readiness import cluster_readiness, default_template_size, node_readiness
from tests.apienv import make_api

WARM = [{"name": "default", "templates": [default_template_size()]}]
OTHER_SIZE = [{"name": "default", "templates": ["512m-1c-2048d"]}, {"name": "py", "templates": []}]


def test_a_node_is_ready_only_with_the_default_template_at_the_default_size() -> None:
    assert node_readiness(WARM, templates=True) == {"ready": True}
    waiting = node_readiness(OTHER_SIZE, templates=True)
    assert waiting["ready"] is False and default_template_size() in waiting["waitingFor"]
    assert node_readiness([], templates=True)["ready"] is False
    # Templates off: every schedule boots cold, nothing to wait for.
    assert node_readiness([], templates=False) == {"ready": True}


def test_a_control_plane_is_ready_when_an_active_healthy_node_has_the_template() -> None:
    def node(state: str, healthy: bool, images: list[dict[str, Any]]) -> Any:
        return SimpleNamespace(state=state, healthy=healthy, images=images)

    assert cluster_readiness([])["ready"] is False
    assert cluster_readiness([node("draining", True, WARM), node("active", False, WARM)])["ready"] is False
    assert cluster_readiness([node("active", True, OTHER_SIZE)])["ready"] is False
    assert cluster_readiness([node("active", True, OTHER_SIZE), node("active", True, WARM)])["ready"] is True


async def test_readyz_is_503_until_ready_and_shows_why_to_the_operator_only(tmp_path: Path) -> None:
    state: dict[str, Any] = {"images": OTHER_SIZE}

    async def healthy() -> dict[str, Any]:
        return {"ok": True}

    async def ready() -> dict[str, Any]:
        return node_readiness(state["images"], templates=True)

    env = make_api(tmp_path, health=healthy, ready=ready)
    env.sched.settings.admin_token = "op"
    transport = httpx.ASGITransport(app=env.app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as anon,
        httpx.AsyncClient(
            transport=transport, base_url="http://localhost", headers={"Authorization": "Bearer op"}
        ) as op,
    ):
        assert (await anon.get("/healthz")).status_code == 200  # alive all along
        r = await anon.get("/readyz")
        assert r.status_code == 503 and r.json() == {"ready": False}
        r = await op.get("/readyz")
        assert r.status_code == 503 and "warm template" in r.json()["waitingFor"]
        state["images"] = WARM
        r = await anon.get("/readyz")
        assert r.status_code == 200 and r.json() == {"ready": True}


async def test_an_unhealthy_server_is_not_ready(tmp_path: Path) -> None:
    async def unhealthy() -> dict[str, Any]:
        return {"ok": False, "error": "manager socket refused"}

    async def ready() -> dict[str, Any]:
        return {"ready": True}

    def broken() -> dict[str, Any]:
        raise ConnectionError("manager gone")

    for health, probe, why in ((unhealthy, ready, "manager socket refused"), (None, broken, "manager gone")):
        env = make_api(tmp_path / why.replace(" ", "-"), health=health, ready=probe)
        env.sched.settings.admin_token = "op"
        transport = httpx.ASGITransport(app=env.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://localhost", headers={"Authorization": "Bearer op"}
        ) as op:
            r = await op.get("/readyz")
        assert r.status_code == 503 and why in r.json()["waitingFor"]


async def test_pal_ups_readiness_asks_its_embedded_node(tmp_path: Path) -> None:
    """Without a probe of its own, the API asks the embedded node's live heartbeat: ready
    the moment the default image lists the default size among its warm templates."""
    env = make_api(tmp_path)
    transport = httpx.ASGITransport(app=env.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as anon:
        assert (await anon.get("/readyz")).status_code == 503
        env.manager.image_infos[0].templates = ["512m-1c-2048d"]
        assert (await anon.get("/readyz")).status_code == 503
        env.manager.image_infos[0].templates.append(default_template_size())
        r = await anon.get("/readyz")
        assert r.status_code == 200 and r.json() == {"ready": True}
        env.sched.settings.templates = False  # PAL_TEMPLATES=0: nothing to wait for
        env.manager.image_infos[0].templates = []
        assert (await anon.get("/readyz")).status_code == 200
