"""Volumes below and through the API (docs/volumes.md): shapes, errors, quotas, paging and
the metadata filter, on the real Scheduler and store with the node's real volume code
(tests/fakes.py binds pal/manager/volumes.py over a temporary dir); the store's part on
both databases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, QuotaExceeded
from pal.manager.volumes import VolumeFiles
from pal.store import Store, VolumeRecord, utcnow
from pal.store import volumes as rows
from pal.wire.volumes import VolumeCreate, VolumeRef, VolumeResize
from tests.apienv import ApiEnv, make_api

GIB = 1 << 30


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


def _code(resp: httpx.Response) -> str:
    return str(resp.json()["error"]["code"])


def _tenant(env: ApiEnv, name: str = "acme") -> str:
    t = env.sched.store.tenant_by_name(name)
    assert t is not None
    return t.id


async def _create(client: httpx.AsyncClient, name: str, **body: object) -> dict[str, object]:
    resp = await client.post("/v1/volumes", json={"name": name, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


# -- the resource --------------------------------------------------------------------------


async def test_create_get_list_resize_delete(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vol = await _create(client, "cache", sizeMib=2048, metadata={"team": "ml"})
    assert set(vol) == {"volumeId", "name", "sizeMib", "state", "metadata", "createdAt", "updatedAt"}
    assert vol["name"] == "cache" and vol["sizeMib"] == 2048 and vol["state"] == "ready"
    assert str(vol["volumeId"]).startswith("vol-") and vol["metadata"] == {"team": "ml"}
    # The node made its directory, with its size and owner recorded.
    files = env.manager.volume_files
    meta = json.loads((files.path(str(vol["volumeId"])) / "volume.json").read_text())
    assert isinstance(meta.pop("exportId"), int)  # its NFS Export_Id (volume_ids.py)
    assert meta == {"volumeId": vol["volumeId"], "tenantId": _tenant(env), "sizeMib": 2048}
    assert files.data_dir(str(vol["volumeId"])).is_dir()

    for ref in (vol["volumeId"], "cache"):  # by id or by name
        got = (await client.get(f"/v1/volumes/{ref}")).json()
        assert got == {**vol, "mountedBy": []}
    listed = (await client.get("/v1/volumes")).json()
    assert listed == {"volumes": [vol]}

    grown = (await client.post("/v1/volumes/cache/resize", json={"sizeMib": 4096})).json()
    assert grown["sizeMib"] == 4096 and grown["volumeId"] == vol["volumeId"]
    assert json.loads((files.path(str(vol["volumeId"])) / "volume.json").read_text())["sizeMib"] == 4096
    t = env.sched.store.get_tenant(_tenant(env))
    assert t is not None and (t.volumes_used, t.volume_bytes_used) == (1, 4096 << 20)

    gone = (await client.delete("/v1/volumes/cache")).json()
    assert gone["state"] == "deleted" and gone["volumeId"] == vol["volumeId"]
    assert not files.path(str(vol["volumeId"])).exists()
    assert (await client.get("/v1/volumes/cache")).status_code == 404
    assert (await client.delete(f"/v1/volumes/{vol['volumeId']}")).status_code == 404
    t = env.sched.store.get_tenant(_tenant(env))
    assert t is not None and (t.volumes_used, t.volume_bytes_used) == (0, 0)


async def test_the_default_size_and_the_bad_requests(client: httpx.AsyncClient) -> None:
    assert (await _create(client, "plain"))["sizeMib"] == 1024
    for body in (
        {"name": "bad name"},
        {"name": ".hidden"},
        {"name": "x" * 64},
        {"name": "ok", "sizeMib": 0},
        {"name": "ok", "sizeMib": (1 << 20) + 1},
        {"name": "ok", "sizeMib": "10"},
        {"name": "ok", "metadata": {"bad key": "v"}},
        {"name": "ok", "extra": 1},
        {},
    ):
        resp = await client.post("/v1/volumes", json=body)
        assert resp.status_code == 400, (body, resp.text)
    resp = await client.post("/v1/volumes", content=b"{}", headers={"Content-Type": "text/plain"})
    assert resp.status_code == 415


async def test_a_name_is_the_tenants_once_and_other_tenants_see_nothing(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    vol = await _create(client, "data")
    resp = await client.post("/v1/volumes", json={"name": "data"})
    assert resp.status_code == 409 and _code(resp) == "FAILED_PRECONDITION"
    async with _client(env, env.key_b) as bob:
        for ref in (vol["volumeId"], "data"):
            assert (await bob.get(f"/v1/volumes/{ref}")).status_code == 404
            assert (await bob.delete(f"/v1/volumes/{ref}")).status_code == 404
            assert (await bob.post(f"/v1/volumes/{ref}/resize", json={"sizeMib": 4096})).status_code == 404
        assert (await bob.get("/v1/volumes")).json() == {"volumes": []}
        # Bob may have a volume of the same name: names are per tenant.
        theirs = await _create(bob, "data")
        assert theirs["volumeId"] != vol["volumeId"]
    assert (await client.get("/v1/volumes/data")).json()["volumeId"] == vol["volumeId"]


async def test_resize_only_grows(client: httpx.AsyncClient) -> None:
    await _create(client, "v", sizeMib=2048)
    resp = await client.post("/v1/volumes/v/resize", json={"sizeMib": 1024})
    assert resp.status_code == 400 and _code(resp) == "INVALID_ARGUMENT"
    assert "only grows" in resp.json()["error"]["message"]
    same = await client.post("/v1/volumes/v/resize", json={"sizeMib": 2048})
    assert same.status_code == 200 and same.json()["sizeMib"] == 2048
    assert (await client.get("/v1/volumes/v")).json()["sizeMib"] == 2048


async def test_a_mounted_volume_is_deleted_only_with_force(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vol = await _create(client, "shared")
    rows.add_mount(env.sched.store, str(vol["volumeId"]), "vm-one", "/data", read_only=False)
    assert (await client.get("/v1/volumes/shared")).json()["mountedBy"] == ["vm-one"]
    resp = await client.delete("/v1/volumes/shared")
    assert resp.status_code == 409 and _code(resp) == "VOLUME_MOUNTED"
    assert "vm-one" in resp.json()["error"]["message"]
    assert (await client.get("/v1/volumes/shared")).json()["state"] == "ready"
    forced = await client.delete("/v1/volumes/shared", params={"force": "true"})
    assert forced.status_code == 200 and forced.json()["state"] == "deleted"
    assert rows.mounted_by(env.sched.store, str(vol["volumeId"])) == []


# -- quotas ----------------------------------------------------------------------------------


async def test_the_volume_quotas_count_and_bytes(env: ApiEnv, client: httpx.AsyncClient) -> None:
    store = env.sched.store
    store.set_tenant_limits(_tenant(env), max_volumes=2, max_volume_bytes=3 * GIB)
    await _create(client, "a", sizeMib=1024)
    resp = await client.post("/v1/volumes", json={"name": "b", "sizeMib": 3072})
    assert resp.status_code == 402 and _code(resp) == "QUOTA_EXCEEDED"
    assert "GiB of volumes" in resp.json()["error"]["message"]
    await _create(client, "b", sizeMib=2048)
    resp = await client.post("/v1/volumes", json={"name": "c", "sizeMib": 1})
    assert resp.status_code == 402 and "max_volumes=2" in resp.json()["error"]["message"]
    # A resize counts its difference against the bytes; a refused one changes nothing.
    resp = await client.post("/v1/volumes/a/resize", json={"sizeMib": 2048})
    assert resp.status_code == 402
    assert (await client.get("/v1/volumes/a")).json()["sizeMib"] == 1024
    await client.delete("/v1/volumes/b")
    assert (await client.post("/v1/volumes/a/resize", json={"sizeMib": 3072})).status_code == 200
    t = store.get_tenant(_tenant(env))
    assert t is not None and (t.volumes_used, t.volume_bytes_used) == (1, 3 * GIB)
    # Another tenant's volumes count for it alone.
    async with _client(env, env.key_b) as bob:
        await _create(bob, "a", sizeMib=8192)


async def test_a_failed_node_leaves_nothing_behind(env: ApiEnv, client: httpx.AsyncClient) -> None:
    env.manager.fail("create_volume", BackendError("disk full"))
    resp = await client.post("/v1/volumes", json={"name": "v", "sizeMib": 2048})
    assert resp.status_code == 500
    assert (await client.get("/v1/volumes")).json() == {"volumes": []}
    t = env.sched.store.get_tenant(_tenant(env))
    assert t is not None and (t.volumes_used, t.volume_bytes_used) == (0, 0)
    assert ("delete_volume", env.manager.calls[-1][1]) == env.manager.calls[-1], "what it made goes"
    assert env.manager.volume_files.ids() == []
    # A resize the node refuses keeps the old size and count.
    await _create(client, "v", sizeMib=1024)
    env.manager.fail("resize_volume", BackendError("no"))
    assert (await client.post("/v1/volumes/v/resize", json={"sizeMib": 2048})).status_code == 500
    assert (await client.get("/v1/volumes/v")).json()["sizeMib"] == 1024
    t = env.sched.store.get_tenant(_tenant(env))
    assert t is not None and t.volume_bytes_used == 1024 << 20
    # A delete the node fails stays `deleting`, and a second delete finishes it.
    env.manager.fail("delete_volume", BackendError("busy"))
    resp = await client.delete("/v1/volumes/v")
    assert resp.status_code == 503 and "delete it again" in resp.json()["error"]["message"]
    assert (await client.get("/v1/volumes/v")).json()["state"] == "deleting"
    assert (await client.delete("/v1/volumes/v")).json()["state"] == "deleted"


async def test_the_tenants_removal_deletes_its_volumes(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vol = await _create(client, "v")
    store, tid = env.sched.store, _tenant(env)
    store.mark_tenant_deleting(tid)
    assert tid in await env.sched.sched.deleting.purge_deleted_tenants()
    assert store.get_tenant(tid) is None
    assert not env.manager.volume_files.path(str(vol["volumeId"])).exists()


# -- paging and the metadata filter ------------------------------------------------------------


async def test_pages_and_the_metadata_filter(client: httpx.AsyncClient) -> None:
    made = [
        await _create(client, f"v{i}", metadata={"team": "a" if i % 2 else "b", "run": "1"}) for i in range(5)
    ]
    seen, cursor = [], None
    while True:
        params: dict[str, str | int] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/volumes", params=params)).json()
        seen += [v["name"] for v in page["volumes"]]
        cursor = page.get("nextCursor")
        if cursor is None:
            break
    assert seen == [v["name"] for v in made]
    team_a = (await client.get("/v1/volumes", params={"metadata.team": "a", "metadata.run": "1"})).json()
    assert [v["name"] for v in team_a["volumes"]] == ["v1", "v3"]
    assert (await client.get("/v1/volumes", params={"metadata.team": "c"})).json() == {"volumes": []}
    resp = await client.get("/v1/volumes", params={"cursor": "bogus"})
    assert resp.status_code == 400


# -- the store, on both databases ---------------------------------------------------------------


def _record(volume_id: str, tenant_id: str, name: str, size_mib: int = 1024) -> VolumeRecord:
    now = utcnow()
    return VolumeRecord(
        volume_id=volume_id, tenant_id=tenant_id, name=name, size_mib=size_mib, state="ready",
        created_at=now, updated_at=now,
    )  # fmt: skip


def test_the_store_counts_volumes_with_their_rows(db_url: str) -> None:
    store = Store(db_url)
    t, _ = store.create_tenant("acme", 5, max_volumes=3, max_volume_bytes=4 * GIB)
    assert (t.max_volumes, t.max_volume_bytes) == (3, 4 * GIB)
    rows.create(store, _record("vol-1", t.id, "one", 1024))
    rows.create(store, _record("vol-2", t.id, "two", 2048))
    with pytest.raises(Conflict):
        rows.create(store, _record("vol-3", t.id, "one"))
    with pytest.raises(QuotaExceeded):
        rows.create(store, _record("vol-3", t.id, "three", 2048))
    rows.resize(store, "vol-1", 2048)
    with pytest.raises(QuotaExceeded):
        rows.resize(store, "vol-2", 3072)
    got = store.get_tenant(t.id)
    assert got is not None and (got.volumes_used, got.volume_bytes_used) == (2, 4 * GIB)
    # Recounting from the rows gives the same books.
    with store.write() as tx:
        rows.recount(tx._conn)
    again = store.get_tenant(t.id)
    assert again is not None and (again.volumes_used, again.volume_bytes_used) == (2, 4 * GIB)
    assert rows.remove(store, "vol-1") and not rows.remove(store, "vol-1")
    got = store.get_tenant(t.id)
    assert got is not None and (got.volumes_used, got.volume_bytes_used) == (1, 2 * GIB)
    with pytest.raises(NotFound):
        rows.set_state(store, "vol-1", "ready")
    with pytest.raises(InvalidRequest):
        store.set_tenant_limits(t.id, max_volumes=-1)
    # A tenant with volumes is removed only once they are gone.
    store.mark_tenant_deleting(t.id)
    assert store.delete_tenant(t.id) is False
    rows.remove(store, "vol-2")
    assert store.delete_tenant(t.id) is True


# -- the node's side --------------------------------------------------------------------------


async def test_the_nodes_volume_files(tmp_path: Path) -> None:
    files = VolumeFiles(tmp_path / "volumes")
    made = await files.create(VolumeCreate(volume_id="vol-a", tenant_id="t-1", size_mib=10))
    assert made.size_mib == 10 and files.ids() == ["vol-a"]
    (files.data_dir("vol-a") / "f.txt").write_text("kept")
    # Idempotent for its tenant; another tenant's id is a conflict.
    again = await files.create(VolumeCreate(volume_id="vol-a", tenant_id="t-1", size_mib=99))
    assert again.size_mib == 10 and (files.data_dir("vol-a") / "f.txt").read_text() == "kept"
    with pytest.raises(Conflict):
        await files.create(VolumeCreate(volume_id="vol-a", tenant_id="t-2", size_mib=10))
    with pytest.raises(InvalidRequest):
        await files.resize(VolumeResize(volume_id="vol-a", size_mib=5))
    assert (await files.resize(VolumeResize(volume_id="vol-a", size_mib=20))).size_mib == 20
    with pytest.raises(NotFound):
        await files.resize(VolumeResize(volume_id="vol-b", size_mib=20))
    assert (await files.delete(VolumeRef(volume_id="vol-a"))).deleted is True
    assert (await files.delete(VolumeRef(volume_id="vol-a"))).deleted is False
    assert files.ids() == []
    # A delete a crash interrupted is finished by the sweep at the node's start.
    await files.create(VolumeCreate(volume_id="vol-c", tenant_id="t-1", size_mib=10))
    (files.root / ".deleting-vol-x").mkdir()
    (files.root / ".deleting-vol-x" / "left").write_text("x")
    assert files.sweep() == 1 and files.ids() == ["vol-c"]
    with pytest.raises(InvalidRequest):
        files.path("../etc")


async def test_a_volumes_export_id_is_its_own_on_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ganesha puts the Export_Id in every file handle: one volume, one id, whichever node of
    a shared PAL_VOLUMES_DIR exports it, and for as long as it lives (volume_ids.py)."""
    from pal.manager import volume_ids

    monkeypatch.setattr(volume_ids, "_start", lambda _vid: 0)  # every volume wants the same slot
    a, b = VolumeFiles(tmp_path / "shared"), VolumeFiles(tmp_path / "shared")  # two nodes
    await a.create(VolumeCreate(volume_id="vol-a", tenant_id="t-1", size_mib=10))
    await b.create(VolumeCreate(volume_id="vol-b", tenant_id="t-1", size_mib=10))
    assert await a.export_id("vol-a") == await b.export_id("vol-a") == 1
    assert await a.export_id("vol-b") == await b.export_id("vol-b") == 2
    # A volume made before ids were kept gets one at its first export, the same from any
    # node asking at once (the second finds the first's claim).
    b.root.joinpath("vol-c").mkdir()
    b.root.joinpath("vol-c", "volume.json").write_text(
        '{"volumeId": "vol-c", "tenantId": "t-1", "sizeMib": 1}'
    )
    got = await asyncio.gather(a.export_id("vol-c"), b.export_id("vol-c"))
    assert got == [3, 3]
    # A delete frees its id; the others keep theirs (recorded, not searched for again).
    await a.delete(VolumeRef(volume_id="vol-a"))
    assert not (a.root / ".export-ids" / "1").exists()
    assert await b.export_id("vol-b") == 2 and await b.export_id("vol-c") == 3
    await b.create(VolumeCreate(volume_id="vol-d", tenant_id="t-1", size_mib=10))
    assert await a.export_id("vol-d") == 1
    with pytest.raises(NotFound):
        await a.export_id("vol-a")


# -- the SDK and the CLI, over loopback HTTP ----------------------------------------------------


def test_the_python_sdk_and_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pal.cli.main import app
    from pal.sdk import AsyncClient, BadRequestError, Client, ConflictError, NotFoundError
    from tests.apienv import serve

    env = make_api(tmp_path / "api")
    with serve(env.app) as url, Client(url, env.key_a, timeout=10) as c:
        vol = c.volumes.create("data", 2048, {"team": "ml"})
        assert vol["sizeMib"] == 2048 and vol["state"] == "ready"
        c.volumes.create("other")
        assert [v["name"] for v in c.volumes.list(page_size=1)] == ["data", "other"]
        assert [v["name"] for v in c.volumes.list({"team": "ml"})] == ["data"]
        assert c.volumes.get(vol["volumeId"])["mountedBy"] == []
        assert c.volumes.resize("data", 4096)["sizeMib"] == 4096
        with pytest.raises(BadRequestError):
            c.volumes.resize("data", 1)
        with pytest.raises(ConflictError):
            c.volumes.create("data")
        rows.add_mount(env.sched.store, vol["volumeId"], "vm-x", "/data", read_only=True)
        with pytest.raises(ConflictError) as exc:
            c.volumes.delete("data")
        assert exc.value.code == "VOLUME_MOUNTED"
        assert c.volumes.delete("data", force=True)["state"] == "deleted"
        with pytest.raises(NotFoundError):
            c.volumes.get("data")

        async def async_calls() -> None:
            async with AsyncClient(url, env.key_a, timeout=10) as ac:
                made = await ac.volumes.create("async", 8)
                assert [v["name"] for v in await ac.volumes.list()] == ["other", "async"]
                assert (await ac.volumes.get("async"))["volumeId"] == made["volumeId"]
                assert (await ac.volumes.resize("async", 16))["sizeMib"] == 16
                assert (await ac.volumes.delete("async"))["state"] == "deleted"

        import asyncio

        asyncio.run(async_calls())

        runner, envs = CliRunner(), {"PAL_URL": url, "PAL_API_KEY": env.key_a}
        res = runner.invoke(
            app, ["volumes", "create", "cli", "--size-mib", "64", "--meta", "a=b", "-q"], env=envs
        )
        assert res.exit_code == 0, res.output
        vol_id = res.stdout.strip()
        assert vol_id.startswith("vol-")
        res = runner.invoke(app, ["volumes", "ls", "--table", "--meta", "a=b"], env=envs)
        assert res.exit_code == 0 and vol_id in res.stdout and "sizeMib" in res.stdout
        res = runner.invoke(app, ["volumes", "resize", "cli", "32"], env=envs)
        assert res.exit_code == 1 and "only grows" in res.stderr
        assert (
            json.loads(runner.invoke(app, ["volumes", "resize", "cli", "128"], env=envs).stdout)["sizeMib"]
            == 128
        )
        assert json.loads(runner.invoke(app, ["volumes", "get", vol_id], env=envs).stdout)["name"] == "cli"
        assert json.loads(runner.invoke(app, ["volumes", "rm", "cli"], env=envs).stdout)["state"] == "deleted"


def test_tenants_show_and_set_the_volume_limits(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pal.cli.main import app
    from pal.config import Settings

    data = str(tmp_path / "data")
    Store.open(Settings(data_dir=Path(data))).close()  # as the first `pal up` does
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["tenants", "create", "acme", "--max-volumes", "4", "--max-volume-gib", "2.5", "--data-dir", data],
    )
    assert res.exit_code == 0, res.output
    made = json.loads(res.stdout)
    assert (made["maxVolumes"], made["maxVolumeGib"], made["volumes"], made["volumeGib"]) == (4, 2.5, 0, 0)
    res = runner.invoke(app, ["tenants", "set", "acme", "--max-volumes", "none", "--data-dir", data])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["maxVolumes"] is None and json.loads(res.stdout)["maxVolumeGib"] == 2.5
    res = runner.invoke(app, ["tenants", "ls", "--table", "--data-dir", data])
    assert "maxVolumeGib" in res.stdout


# -- mounts (the scheduler's side; the mount itself: tests/integration/test_volumes.py) ----


async def test_a_schedule_records_its_mounts_and_a_delete_ends_them(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    vol = await _create(client, "work")
    spec = {"volumes": [{"name": "work", "path": "/mnt/work"}]}
    resp = await client.post("/v1/runtime/schedule", json=spec)
    assert resp.status_code == 200, resp.text
    vm = resp.json()["vmId"]
    assert (await client.get("/v1/volumes/work")).json()["mountedBy"] == [vm]
    assert rows.mounts_of(env.sched.store, vm)[0][:3] == (vol["volumeId"], "/mnt/work", False)
    resp = await client.delete("/v1/volumes/work")
    assert resp.status_code == 409 and _code(resp) == "VOLUME_MOUNTED"
    assert (await client.delete(f"/v1/runtime/vms/{vm}")).status_code == 200
    assert (await client.get("/v1/volumes/work")).json()["mountedBy"] == []
    assert (await client.delete("/v1/volumes/work")).status_code == 200


async def test_another_tenants_volume_is_a_404_at_schedule_like_a_missing_one(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    vol = await _create(client, "mine")
    async with _client(env, env.key_b) as bob:
        for ref in ("mine", str(vol["volumeId"]), "none-such"):
            resp = await bob.post("/v1/runtime/schedule", json={"volumes": [{"name": ref, "path": "/v"}]})
            assert resp.status_code == 404, resp.text
            assert "not found" in resp.json()["error"]["message"]
    resp = await client.post("/v1/runtime/schedule", json={"volumes": [{"name": "mine", "path": "/etc"}]})
    assert resp.status_code == 400
    assert (await client.get("/v1/volumes/mine")).json()["mountedBy"] == []
