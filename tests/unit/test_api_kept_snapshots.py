"""The /v1 routes of kept snapshots (pal/api/kept_snapshots.py) as a client sees them, on
the real scheduler and store over the fake node: the shapes, the codes, another tenant's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.apienv import ApiEnv, make_api


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    return make_api(tmp_path)


def _client(env: ApiEnv, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(env, env.key_a) as c:
        yield c


async def test_keep_list_start_and_delete(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = (await client.post("/v1/runtime/schedule", json={})).json()["vmId"]
    made = await client.post(f"/v1/runtime/vms/{vm}/snapshots", json={"name": "golden"})
    assert made.status_code == 200, made.text
    kept = made.json()
    assert set(kept) == {"snapshotId", "name", "sourceVmId", "createdAt"} and kept["sourceVmId"] == vm
    plain = (await client.post(f"/v1/runtime/vms/{vm}/snapshots", json={})).json()
    assert "name" not in plain  # no null name
    assert (await client.post(f"/v1/runtime/vms/{vm}/snapshots", json={"name": "a b"})).status_code == 400
    assert (await client.post(f"/v1/runtime/vms/{vm}/snapshots", json={"name": "default"})).status_code == 409

    first = (await client.get("/v1/runtime/snapshots", params={"vmId": vm, "limit": 1})).json()
    assert [k["snapshotId"] for k in first["snapshots"]] == [kept["snapshotId"]] and first["nextCursor"]
    rest = (await client.get("/v1/runtime/snapshots", params={"cursor": first["nextCursor"]})).json()
    assert [k["snapshotId"] for k in rest["snapshots"]] == [plain["snapshotId"]] and "nextCursor" not in rest
    assert (await client.get("/v1/runtime/snapshots/golden")).json() == kept

    assert (await client.delete(f"/v1/runtime/vms/{vm}")).status_code == 200
    started = await client.post("/v1/runtime/snapshots/golden/start", json={"count": 1})
    assert started.status_code == 200, started.text
    [child] = started.json()["forks"]
    assert child["state"] == "running" and started.json()["snapshotId"] == kept["snapshotId"]
    assert (await client.get(f"/v1/runtime/vms/{child['vmId']}")).json()["parentVmId"] == vm

    async with _client(env, env.key_b) as bob:
        assert (await bob.get("/v1/runtime/snapshots")).json() == {"snapshots": []}
        for call in (
            bob.get("/v1/runtime/snapshots/golden"),
            bob.delete(f"/v1/runtime/snapshots/{kept['snapshotId']}"),
            bob.post("/v1/runtime/snapshots/golden/start", json={"count": 1}),
            bob.post(f"/v1/runtime/vms/{vm}/snapshots", json={}),
        ):
            assert (await call).status_code == 404

    assert (await client.delete("/v1/runtime/snapshots/golden")).json() == kept
    assert (await client.get("/v1/runtime/snapshots/golden")).status_code == 404
    gone = await client.post(f"/v1/runtime/snapshots/{kept['snapshotId']}/start", json={"count": 1})
    assert gone.status_code == 404


async def test_a_start_tags_its_vms_as_a_schedule_would(client: httpx.AsyncClient) -> None:
    vm = (await client.post("/v1/runtime/schedule", json={"metadata": {"team": "a"}})).json()["vmId"]
    await client.post(f"/v1/runtime/vms/{vm}/snapshots", json={"name": "tagged"})
    assert (await client.delete(f"/v1/runtime/vms/{vm}")).status_code == 200  # two VMs at most
    started = await client.post("/v1/runtime/snapshots/tagged/start", json={"metadata": {"run": "9"}})
    assert started.status_code == 200, started.text
    [child] = started.json()["forks"]
    assert (await client.get(f"/v1/runtime/vms/{child['vmId']}")).json()["metadata"] == {"run": "9"}
    plain = (await client.post("/v1/runtime/snapshots/tagged/start", json={})).json()["forks"][0]["vmId"]
    assert (await client.get(f"/v1/runtime/vms/{plain}")).json()["metadata"] == {"team": "a"}
    listed = (await client.get("/v1/runtime/vms", params={"metadata.run": "9"})).json()["vms"]
    assert [v["vmId"] for v in listed] == [child["vmId"]]
    for bad in ({"a b": "1"}, {"k": 1}, ["k"]):
        res = await client.post("/v1/runtime/snapshots/tagged/start", json={"metadata": bad})
        assert res.status_code == 400 and res.json()["error"]["code"] == "INVALID_ARGUMENT", res.text
