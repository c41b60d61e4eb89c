"""The API on the real Scheduler (with the fake runtime manager): the two sides agree on
views, states and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.api.app import create_app
from tests.fakes import SchedEnv, make_env


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[SchedEnv, httpx.AsyncClient, httpx.AsyncClient]]:
    env = make_env(tmp_path, max_vms=2)
    _, other_key = env.store.create_tenant("other", 2)
    key = _key_for(env)
    app = create_app(env.sched, env.store, env.settings)
    transport = httpx.ASGITransport(app=app)
    try:
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://pal", headers=_auth(key)) as a,
            httpx.AsyncClient(transport=transport, base_url="http://pal", headers=_auth(other_key)) as b,
        ):
            yield env, a, b
    finally:
        await env.sched.close()
        env.store.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key_for(env: SchedEnv) -> str:
    # make_env keeps no key; a second tenant with the same quota stands in for "acme".
    tenant, key = env.store.create_tenant("api-user", 2)
    env.tenant_id = tenant.id
    return key


async def test_lifecycle_through_the_scheduler(
    api: tuple[SchedEnv, httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    _, a, b = api
    resp = await a.post("/v1/runtime/schedule", json={"limits": {"memoryMib": 512}})
    assert resp.status_code == 200, resp.text
    vm = resp.json()
    assert vm["state"] == "running" and vm["limits"]["memoryMib"] == 512
    vm_id = vm["vmId"]
    assert (await b.get(f"/v1/runtime/vms/{vm_id}")).status_code == 404

    out = (await a.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "echo", "argv": ["hi"]})).json()
    assert out["exitCode"] == 0 and out["stdout"] == "echo hi"

    paused = (await a.post(f"/v1/runtime/vms/{vm_id}/pause")).json()
    assert paused["state"] == "paused" and paused["snapshotId"]
    again = await a.post(f"/v1/runtime/vms/{vm_id}/pause")
    assert again.status_code == 409, again.text
    ex = await a.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "echo"})
    assert ex.status_code == 409, ex.text  # operator-paused VMs are not woken

    resumed = (await a.post(f"/v1/runtime/vms/{vm_id}/resume")).json()
    assert resumed == {"vmId": vm_id, "snapshotId": resumed["snapshotId"], "state": "running"}

    fork = await a.post(f"/v1/runtime/vms/{vm_id}/fork", json={"count": 1})
    assert fork.status_code == 200, fork.text
    assert [set(f) for f in fork.json()["forks"]] == [{"vmId", "state"}]
    assert (await a.post(f"/v1/runtime/vms/{vm_id}/fork", json={"count": 0})).status_code == 400

    # two slots used (source + fork): the next schedule is over quota
    assert (await a.post("/v1/runtime/schedule", json={})).status_code == 402

    events = (await a.get(f"/v1/runtime/vms/{vm_id}/events")).json()["events"]
    assert "paused" in [e["toState"] for e in events]
    gone = (await a.delete(f"/v1/runtime/vms/{vm_id}")).json()
    assert gone["state"] == "terminated"
