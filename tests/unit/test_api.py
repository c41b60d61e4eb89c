"""REST API behaviour as a client sees it, on the real Scheduler and store (fake runtime
manager): shapes, status codes, auth, errors, lifecycle, exec and files."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.errors import BackendError
from tests.apienv import ApiEnv, make_api

MiB = 1024 * 1024


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    return make_api(tmp_path)


def _client(env: ApiEnv, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app), base_url="http://localhost", headers=headers
    )


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(env, env.key_a) as c:
        yield c


def _err(resp: httpx.Response) -> dict[str, str]:
    """The error's code and message (its requestId, always there, is checked and dropped)."""
    body = resp.json()
    assert set(body) == {"error"}, body
    err = dict(body["error"])
    assert err.pop("requestId") == resp.headers["x-request-id"]
    return err


async def _vm(client: httpx.AsyncClient, **spec: object) -> str:
    resp = await client.post("/v1/runtime/schedule", json=spec)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["vmId"])


# -- auth --------------------------------------------------------------------------------


async def test_v1_routes_need_a_valid_key(env: ApiEnv) -> None:
    async with _client(env, None) as anon:
        resp = await anon.get("/v1/runtime/vms")
        assert resp.status_code == 401 and _err(resp)["code"] == "UNAUTHENTICATED"
        assert resp.headers["www-authenticate"] == "Bearer"
        resp = await anon.get("/v1/runtime/vms", headers={"Authorization": "Bearer pal_wrong"})
        assert resp.status_code == 401
        resp = await anon.post(
            "/v1/runtime/schedule", json={}, headers={"Authorization": f"Basic {env.key_a}"}
        )
        assert resp.status_code == 401
    assert env.sched.store.list_vms() == []


async def test_healthz_and_openapi_need_no_key(env: ApiEnv) -> None:
    async with _client(env, None) as anon:
        assert (await anon.get("/healthz")).json()["ok"] is True
        spec = (await anon.get("/openapi.json")).json()
    assert "/v1/runtime/vms/{vm_id}/fork" in spec["paths"]
    assert "vmId" in spec["components"]["schemas"]["VmOut"]["properties"]


async def test_other_tenants_vm_is_404(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    async with _client(env, env.key_b) as bob:
        for method, path in [
            ("GET", ""),
            ("DELETE", ""),
            ("POST", "/pause"),
            ("POST", "/resume"),
            ("GET", "/events"),
        ]:
            resp = await bob.request(method, f"/v1/runtime/vms/{vm}{path}")
            assert resp.status_code == 404, (method, path)
            assert _err(resp)["code"] == "NOT_FOUND"
        assert (await bob.get("/v1/runtime/vms")).json() == {"vms": []}
    assert (await client.get(f"/v1/runtime/vms/{vm}")).json()["state"] == "running"


# -- schedule and request validation -------------------------------------------------------


async def test_schedule_without_a_body_gives_defaults(client: httpx.AsyncClient) -> None:
    for kwargs in ({"json": {}}, {}):
        resp = await client.post("/v1/runtime/schedule", **kwargs)  # type: ignore[arg-type]
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["state"] == "running" and body["vmId"].startswith("vm-")
        assert body["limits"] == {
            "vcpus": 1,
            "memoryMib": 256,
            "diskMib": 2048,
            "egressMbps": None,
            "maxConnections": 256,
            # the server's disk defaults (PAL_DISK_*), resolved at schedule
            "diskReadMibps": 200,
            "diskWriteMibps": 100,
            "diskIops": 4000,
        }
        assert body["image"] == "default" and body["idleTimeoutSecs"] == 0
        assert body["bootMethod"] == "cold"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"limits": {"memoryMib": -5}}, "limits.memoryMib: Input should be greater than or equal to 128"),
        ({"limits": {"vcpus": 10_000}}, "limits.vcpus"),
        ({"imag": "default"}, "imag: unknown field"),
        ({"idleTimeoutSecs": "soon"}, "idleTimeoutSecs"),
        ({"image": "Bad Name"}, "image"),
    ],
)
async def test_schedule_validation_is_400_naming_the_field(
    env: ApiEnv, client: httpx.AsyncClient, body: dict, needle: str
) -> None:
    resp = await client.post("/v1/runtime/schedule", json=body)
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "INVALID_ARGUMENT"
    assert needle in err["message"]
    assert env.sched.store.list_vms() == []


async def test_bad_json_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/runtime/schedule", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400
    assert "invalid JSON" in _err(resp)["message"]


async def test_unknown_image_is_400_before_quota_and_leaves_no_row(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    await _vm(client)
    await _vm(client)  # the quota (2) is full: still 400, not 402
    resp = await client.post("/v1/runtime/schedule", json={"image": "nope"})
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "IMAGE_NOT_FOUND" and "GET /v1/images" in err["message"]
    assert len(env.sched.store.list_vms()) == 2


async def test_quota_is_402(env: ApiEnv, client: httpx.AsyncClient) -> None:
    await _vm(client)
    await _vm(client)
    resp = await client.post("/v1/runtime/schedule", json={})
    assert resp.status_code == 402 and _err(resp)["code"] == "QUOTA_EXCEEDED"
    assert len(env.sched.store.list_vms()) == 2


async def test_unknown_route_is_json_404(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/nothing-here")
    assert resp.status_code == 404 and _err(resp)["code"] == "NOT_FOUND"
    resp = await client.put("/v1/runtime/schedule", json={})
    assert resp.status_code == 405 and _err(resp)["code"] == "METHOD_NOT_ALLOWED"


# -- lifecycle ---------------------------------------------------------------------------


async def test_pause_resume_and_wrong_state_409(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/pause")
    paused = resp.json()
    assert paused["vmId"] == vm and paused["state"] == "paused" and paused["snapshotId"].startswith("snap-")
    again = await client.post(f"/v1/runtime/vms/{vm}/pause")  # refused by the state table
    assert again.status_code == 409
    assert _err(again) == {
        "code": "FAILED_PRECONDITION",
        "message": f"VM {vm} is paused: cannot pause (allowed when live-paused, running)",
    }
    ex = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "echo"})
    assert ex.status_code == 409 and "resume it first" in _err(ex)["message"]
    view = (await client.get(f"/v1/runtime/vms/{vm}")).json()
    assert view["state"] == "paused" and view["pausedBy"] == "operator"
    assert view["snapshotId"] == paused["snapshotId"]
    # the tier, without the live-only fields
    assert {k: v for k, v in view["pause"].items() if k != "since"} == {"kind": "snapshot", "by": "operator"}
    resumed = (await client.post(f"/v1/runtime/vms/{vm}/resume")).json()
    # resumed from the snapshot the pause made, under the same id
    assert resumed == {"vmId": vm, "snapshotId": paused["snapshotId"], "state": "running"}
    assert (await client.post(f"/v1/runtime/vms/{vm}/resume")).status_code == 409
    assert "pause" not in (await client.get(f"/v1/runtime/vms/{vm}")).json()
    assert (await client.delete(f"/v1/runtime/vms/{vm}")).json()["state"] == "terminated"
    assert (await client.delete(f"/v1/runtime/vms/{vm}")).json()["state"] == "terminated"


async def test_offload_without_a_live_pause_is_a_400_and_changes_nothing(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    vm = await _vm(client)
    for body in ({"offload": True}, {"mode": "snapshot", "offload": True}):
        resp = await client.post(f"/v1/runtime/vms/{vm}/pause", json=body)
        assert resp.status_code == 400, resp.text
        err = _err(resp)
        assert err["code"] == "INVALID_ARGUMENT" and "offload needs mode 'live'" in err["message"]
    assert (await client.get(f"/v1/runtime/vms/{vm}")).json()["state"] == "running"
    assert not env.manager.snapshot_requests and not env.manager.live_requests
    live = await client.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": "live", "offload": True})
    assert live.status_code == 200 and live.json()["pause"]["offloaded"] is True


async def test_fork_children_and_a_failed_one(env: ApiEnv, client: httpx.AsyncClient) -> None:
    env.sched.store.set_tenant_limits(env.sched.tenant_id, max_vms=4)
    vm = await _vm(client)
    env.manager.fail("spawn", BackendError("restore failed"))  # the first child's spawn
    resp = await client.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["sourceVmId"] == vm and body["snapshotId"].startswith("snap-")
    forks = sorted(body["forks"], key=lambda f: f["state"])
    assert forks[0] == {"vmId": forks[0]["vmId"], "state": "failed", "error": "restore failed"}
    assert forks[1] == {"vmId": forks[1]["vmId"], "state": "running"}  # no null error
    child = (await client.get(f"/v1/runtime/vms/{forks[1]['vmId']}")).json()
    assert child["parentVmId"] == vm and child["state"] == "running"
    assert (await client.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 0})).status_code == 400
    assert (await client.post(f"/v1/runtime/vms/{vm}/fork", json={})).status_code == 400
    over = await client.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 3})  # 2 slots held, 4 max
    assert over.status_code == 402
    assert len(env.sched.store.list_vms()) == 3


async def test_events_include_the_wake_audit(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client, idleTimeoutSecs=30)
    assert await env.sched.sched.pauses.idle_pause(vm, still_idle=lambda _vm: True) is not None
    woke = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "echo", "argv": ["hi"]})
    assert woke.json() == {"exitCode": 0, "stdout": "hi\n", "stderr": ""}
    events = (await client.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    assert [(e["kind"], e["toState"]) for e in events] == [
        ("status", "pending"),
        ("status", "spawning"),
        ("status", "running"),
        ("status", "draining"),
        ("status", "paused"),
        ("status", "spawning"),
        ("status", "running"),
        ("auto_resume", None),
    ]
    assert events[4]["reason"] == "auto-suspended (idle timeout)"


# -- exec (buffered) -------------------------------------------------------------------------


async def test_exec_buffered(client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "fail", "argv": ["3"]})
    assert resp.status_code == 200
    assert resp.json() == {"exitCode": 3, "stdout": "", "stderr": "warn\n"}


async def test_exec_missing_executable_is_400(client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/no/such"})
    assert resp.status_code == 400
    assert _err(resp) == {"code": "EXECUTABLE_NOT_FOUND", "message": "/no/such: not found"}


async def test_exec_timeout_is_exit_124_with_partial_output(client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "sleepy", "timeoutSecs": 1})
    assert resp.status_code == 200
    assert resp.json() == {"exitCode": 124, "stdout": "partial", "stderr": "", "timedOut": True}


async def test_exec_request_validation(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"argv": ["x"]})
    assert resp.status_code == 400 and "command" in _err(resp)["message"]
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "x", "timeoutSecs": -1})
    assert resp.status_code == 400 and "timeoutSecs" in _err(resp)["message"]
    # Which user names exist is the guest's to say (an image's USER); a non-name is 400 here.
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "x", "user": "no body"})
    assert resp.status_code == 400 and "user" in _err(resp)["message"]
    assert env.manager.exec_requests == []


async def test_exec_as_root_reaches_the_node(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "true", "user": "root"})
    assert resp.json()["exitCode"] == 0
    assert [r.user for r in env.manager.exec_requests] == ["root"]


# -- files -------------------------------------------------------------------------------------


async def test_write_read_list_files(client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    url = f"/v1/runtime/vms/{vm}/files/content"
    resp = await client.put(url, params={"path": "job.py"}, content="print('hé')".encode())
    assert resp.json() == {"path": "job.py", "bytesWritten": 12}
    got = await client.get(url, params={"path": "job.py"})
    assert got.text == "print('hé')"
    assert got.headers["content-type"] == "text/plain; charset=utf-8"
    assert "x-pal-truncated" not in got.headers
    listing = (await client.get(f"/v1/runtime/vms/{vm}/files")).json()
    assert listing == {
        "path": "",
        "entries": [{"name": "job.py", "type": "file", "size": 12}],
        "truncated": False,
    }
    missing = await client.get(url, params={"path": "missing.txt"})
    assert missing.status_code == 404 and _err(missing)["code"] == "FILE_NOT_FOUND"


async def test_read_cut_at_1mib_is_flagged(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    env.manager.alive[vm].files["big.txt"] = b"x" * (MiB + 10)
    got = await client.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "big.txt"})
    assert got.status_code == 200 and len(got.content) == MiB
    assert got.headers["x-pal-truncated"] == "true"


async def test_write_limit_is_1mib(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    url = f"/v1/runtime/vms/{vm}/files/content"
    ok = await client.put(url, params={"path": "ok.bin"}, content=b"a" * MiB)
    assert ok.json()["bytesWritten"] == MiB
    resp = await client.put(url, params={"path": "big.bin"}, content=b"a" * (MiB + 1))
    assert resp.status_code == 413 and _err(resp)["code"] == "PAYLOAD_TOO_LARGE"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the server must count
        for _ in range(20):
            yield b"b" * (128 * 1024)

    resp = await client.put(url, params={"path": "chunked.bin"}, content=chunks())
    assert resp.status_code == 413
    assert sorted(env.manager.alive[vm].files) == ["ok.bin"]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../b", "a\x00b", ".."])
async def test_path_escapes_are_400_without_touching_the_vm(
    env: ApiEnv, client: httpx.AsyncClient, bad: str
) -> None:
    vm = await _vm(client)
    calls = len(env.manager.calls)
    for resp in (
        await client.get(f"/v1/runtime/vms/{vm}/files", params={"path": bad}),
        await client.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": bad}),
        await client.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": bad}, content=b"x"),
        await client.delete(f"/v1/runtime/vms/{vm}/files/content", params={"path": bad}),
    ):
        assert resp.status_code == 400 and _err(resp)["code"] == "PATH_ESCAPE"
    assert env.manager.calls[calls:] == []


async def test_content_requires_a_path(client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    resp = await client.get(f"/v1/runtime/vms/{vm}/files/content")
    assert resp.status_code == 400 and "path" in _err(resp)["message"]


# -- health ---------------------------------------------------------------------------------


async def test_healthz_reports_503_when_it_cannot_schedule(tmp_path: Path) -> None:
    async def unhealthy() -> dict[str, object]:
        return {"ok": False, "image": "missing: run `pal image build default`"}

    env = make_api(tmp_path, health=unhealthy)
    env.sched.settings.admin_token = "op"
    async with _client(env, "op") as operator:  # the details are the operator's only
        resp = await operator.get("/healthz")
    assert resp.status_code == 503 and resp.json()["image"].startswith("missing")


async def test_healthz_probe_crash_is_503(tmp_path: Path) -> None:
    def broken() -> dict[str, object]:
        raise ConnectionError("manager socket refused")

    env = make_api(tmp_path, health=broken)
    env.sched.settings.admin_token = "op"
    async with _client(env, "op") as operator:
        resp = await operator.get("/healthz")
    assert resp.status_code == 503 and "manager socket refused" in resp.json()["error"]


# -- images ------------------------------------------------------------------------------------


async def test_images_list_only_what_the_tenant_may_use(env: ApiEnv, client: httpx.AsyncClient) -> None:
    from pal.wire.models import ImageInfo

    acme = env.sched.tenant_id
    env.manager.image_infos.append(
        ImageInfo(
            name="node20",
            agent_version_id="sha256-" + "a" * 64,
            kind="import",
            source="/srv/node20.tar",  # the operator's path: not shown to tenants
            source_digest="sha256:" + "b" * 64,
            tenants=[acme],
            config={"user": "node", "workdir": "/app", "env": {"NODE_ENV": "production"}, "cmd": ["node"]},
            templates=["256m-1c-2048d"],
        )
    )
    resp = await client.get("/v1/images")
    assert resp.status_code == 200
    images = {i["name"]: i for i in resp.json()["images"]}
    assert images["node20"] == {
        "name": "node20",
        "digest": "sha256-" + "a" * 64,
        "kind": "import",
        "sourceDigest": "sha256:" + "b" * 64,
        "createdAt": None,
        "sizeBytes": 0,
        "user": "node",
        "workdir": "/app",
        "env": {"NODE_ENV": "production"},
        "cmd": ["node"],
        "warmSizes": ["256m-1c-2048d"],
    }
    async with _client(env, env.key_b) as bob:
        assert [i["name"] for i in (await bob.get("/v1/images")).json()["images"]] == ["default"]
        resp = await bob.post("/v1/runtime/schedule", json={"image": "node20"})
        assert resp.status_code == 400 and _err(resp)["code"] == "IMAGE_NOT_FOUND"
    assert (await _client(env, None).get("/v1/images")).status_code == 401


# -- content types and docs ----------------------------------------------------------------


async def test_a_json_body_sent_as_a_form_is_415_saying_what_to_send(
    env: ApiEnv, client: httpx.AsyncClient
) -> None:
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    resp = await client.post("/v1/runtime/schedule", content=b"{}", headers=form)
    assert resp.status_code == 415
    err = _err(resp)
    assert err["code"] == "UNSUPPORTED_MEDIA_TYPE"
    assert "Content-Type: application/json" in err["message"] and "x-www-form-urlencoded" in err["message"]
    vm = await _vm(client)
    body = b'{"command": "true"}'
    for path in (f"/v1/runtime/vms/{vm}/exec", f"/v1/runtime/vms/{vm}/fork"):
        assert (await client.post(path, content=body, headers=form)).status_code == 415
        assert (await client.post(path, content=body)).status_code == 415  # no Content-Type
    assert env.manager.exec_requests == [] and len(env.sched.store.list_vms()) == 1
    charset = {"Content-Type": "application/json; charset=utf-8"}
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", content=body, headers=charset)
    assert resp.json()["exitCode"] == 0
    assert (await client.post(f"/v1/runtime/vms/{vm}/pause")).status_code == 200  # no body: fine


async def test_api_docs_are_served_without_a_cdn(env: ApiEnv) -> None:
    async with _client(env, None) as anon:
        for page in ("/docs", "/redoc"):
            html = await anon.get(page)
            assert html.status_code == 200 and "/openapi.json" in html.text
            assets = [u for u in _urls(html.text) if u.endswith((".js", ".css"))]
            assert assets and all(u.startswith("/docs-assets/") for u in assets), assets
            for url in assets:
                got = await anon.get(url)
                assert got.status_code == 200 and len(got.content) > 1000, url


def _urls(html: str) -> list[str]:
    import re

    return re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", html)


async def test_files_are_binary_safe_and_can_be_removed(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vm = await _vm(client)
    url = f"/v1/runtime/vms/{vm}/files/content"
    blob = bytes(range(256))
    assert (await client.put(url, params={"path": "blob.bin"}, content=blob)).json()["bytesWritten"] == 256
    got = await client.get(url, params={"path": "blob.bin"})
    assert got.content == blob and got.headers["content-type"] == "application/octet-stream"
    # a cut at 1 MiB that splits a character is still text
    env.manager.alive[vm].files["big.txt"] = "é".encode() * MiB
    got = await client.get(url, params={"path": "big.txt"})
    assert got.headers["x-pal-truncated"] == "true" and got.headers["content-type"].startswith("text/plain")
    gone = await client.delete(url, params={"path": "blob.bin"})
    assert gone.json() == {"path": "blob.bin", "deleted": True}
    again = await client.delete(url, params={"path": "blob.bin"})
    assert again.status_code == 404 and _err(again)["code"] == "FILE_NOT_FOUND"
    assert (await client.delete(url, params={"path": "../x"})).status_code == 400
    listing = (await client.get(f"/v1/runtime/vms/{vm}/files")).json()
    assert [e["name"] for e in listing["entries"]] == ["big.txt"]
