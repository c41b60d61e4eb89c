"""REST API behaviour as a client sees it: shapes, status codes, auth, errors, files."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.unit.test_api_helpers import Env, make_env

MiB = 1024 * 1024


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


@pytest.fixture
def client(env: Env) -> TestClient:
    return TestClient(env.app, headers={"Authorization": f"Bearer {env.key_a}"})


def _err(resp: object) -> dict[str, str]:
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}, body
    return body["error"]


def _vm(client: TestClient) -> str:
    resp = client.post("/v1/runtime/schedule", json={})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["vmId"])


# -- auth --------------------------------------------------------------------------------


def test_v1_routes_need_a_valid_key(env: Env) -> None:
    anon = TestClient(env.app)
    resp = anon.get("/v1/runtime/vms")
    assert resp.status_code == 401 and _err(resp)["code"] == "UNAUTHENTICATED"
    assert resp.headers["www-authenticate"] == "Bearer"
    resp = anon.get("/v1/runtime/vms", headers={"Authorization": "Bearer pal_wrong"})
    assert resp.status_code == 401
    resp = anon.post("/v1/runtime/schedule", json={}, headers={"Authorization": f"Basic {env.key_a}"})
    assert resp.status_code == 401


def test_healthz_and_openapi_need_no_key(env: Env) -> None:
    anon = TestClient(env.app)
    assert anon.get("/healthz").json()["ok"] is True
    spec = anon.get("/openapi.json").json()
    assert "/v1/runtime/vms/{vm_id}/fork" in spec["paths"]
    assert "vmId" in spec["components"]["schemas"]["VmOut"]["properties"]


def test_other_tenants_vm_is_404(env: Env, client: TestClient) -> None:
    vm = _vm(client)
    bob = TestClient(env.app, headers={"Authorization": f"Bearer {env.key_b}"})
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/pause"), ("GET", "/events")]:
        resp = bob.request(method, f"/v1/runtime/vms/{vm}{path}")
        assert resp.status_code == 404, (method, path)
        assert _err(resp)["code"] == "NOT_FOUND"
    assert bob.get("/v1/runtime/vms").json() == {"vms": []}
    assert client.get(f"/v1/runtime/vms/{vm}").status_code == 200


# -- schedule and request validation -------------------------------------------------------


def test_schedule_empty_body_gives_defaults(client: TestClient) -> None:
    for kwargs in ({"json": {}}, {}):
        resp = client.post("/v1/runtime/schedule", **kwargs)  # type: ignore[arg-type]
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["state"] == "running" and body["vmId"].startswith("vm-")
        assert body["limits"] == {"vcpus": 1, "memoryMib": 256, "diskMib": 2048}
        assert body["image"] == "default" and body["idleTimeoutSecs"] == 0


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
def test_schedule_validation_is_400_naming_the_field(client: TestClient, body: dict, needle: str) -> None:
    resp = client.post("/v1/runtime/schedule", json=body)
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "INVALID_ARGUMENT"
    assert needle in err["message"]


def test_bad_json_is_400(client: TestClient) -> None:
    resp = client.post(
        "/v1/runtime/schedule", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 400
    assert "invalid JSON" in _err(resp)["message"]


def test_unknown_image_is_400(client: TestClient) -> None:
    resp = client.post("/v1/runtime/schedule", json={"image": "nope"})
    assert resp.status_code == 400 and "nope" in _err(resp)["message"]


def test_quota_is_402(client: TestClient) -> None:
    _vm(client)
    _vm(client)
    resp = client.post("/v1/runtime/schedule", json={})
    assert resp.status_code == 402 and _err(resp)["code"] == "QUOTA_EXCEEDED"


def test_unknown_route_is_json_404(client: TestClient) -> None:
    resp = client.get("/v1/nothing-here")
    assert resp.status_code == 404 and _err(resp)["code"] == "NOT_FOUND"
    resp = client.put("/v1/runtime/schedule", json={})
    assert resp.status_code == 405 and _err(resp)["code"] == "METHOD_NOT_ALLOWED"


# -- lifecycle ---------------------------------------------------------------------------


def test_pause_resume_and_wrong_state_409(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/pause")
    assert resp.json() == {"vmId": vm, "snapshotId": "snap-1", "state": "paused"}
    again = client.post(f"/v1/runtime/vms/{vm}/pause")  # IllegalTransition from the state table
    assert again.status_code == 409 and _err(again)["code"] == "FAILED_PRECONDITION"
    ex = client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "echo"})
    assert ex.status_code == 409
    view = client.get(f"/v1/runtime/vms/{vm}").json()
    assert view["state"] == "paused" and view["pausedBy"] == "operator"
    resp = client.post(f"/v1/runtime/vms/{vm}/resume")
    assert resp.json() == {"vmId": vm, "snapshotId": "snap-1", "state": "running"}
    assert client.post(f"/v1/runtime/vms/{vm}/resume").status_code == 409
    assert client.delete(f"/v1/runtime/vms/{vm}").json()["state"] == "terminated"


def test_fork_omits_null_errors(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 2})
    assert resp.status_code == 200
    body = resp.json()
    assert body["sourceVmId"] == vm and body["snapshotId"] == "snap-f"
    assert body["forks"][0] == {"vmId": f"{vm}-f0", "state": "running"}
    assert body["forks"][1] == {"vmId": f"{vm}-bad", "state": "failed", "error": "restore failed"}
    assert client.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 0}).status_code == 400
    assert client.post(f"/v1/runtime/vms/{vm}/fork", json={}).status_code == 400


def test_events_include_audit(client: TestClient) -> None:
    vm = _vm(client)
    events = client.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
    assert [e["kind"] for e in events] == ["status", "auto_resume"]
    assert events[1]["fromState"] == "paused" and events[1]["toState"] == "running"


# -- exec (buffered) -------------------------------------------------------------------------


def test_exec_buffered(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "echo", "argv": ["hi", "fail"]})
    assert resp.status_code == 200
    assert resp.json() == {"exitCode": 3, "stdout": "hi fail\n", "stderr": "warn\n"}


def test_exec_missing_executable_is_400(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/no/such"})
    assert resp.status_code == 400
    assert _err(resp) == {"code": "EXECUTABLE_NOT_FOUND", "message": "/no/such: not found"}


def test_exec_timeout_is_exit_124_with_partial_output(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "sleepy", "timeoutSecs": 1})
    assert resp.status_code == 200
    assert resp.json() == {"exitCode": 124, "stdout": "partial", "stderr": "", "timedOut": True}


def test_exec_request_validation(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.post(f"/v1/runtime/vms/{vm}/exec", json={"argv": ["x"]})
    assert resp.status_code == 400 and "command" in _err(resp)["message"]
    resp = client.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "x", "timeoutSecs": -1})
    assert resp.status_code == 400 and "timeoutSecs" in _err(resp)["message"]


# -- files -------------------------------------------------------------------------------------


def test_write_read_list_files(env: Env, client: TestClient) -> None:
    vm = _vm(client)
    url = f"/v1/runtime/vms/{vm}/files/content"
    resp = client.put(url, params={"path": "job.py"}, content="print('hé')".encode())
    assert resp.json() == {"path": "job.py", "bytesWritten": 12}
    got = client.get(url, params={"path": "job.py"})
    assert got.text == "print('hé')"
    assert got.headers["content-type"] == "text/plain; charset=utf-8"
    assert "x-pal-truncated" not in got.headers
    listing = client.get(f"/v1/runtime/vms/{vm}/files").json()
    assert listing == {
        "path": "",
        "entries": [{"name": "job.py", "type": "file", "size": 12}],
        "truncated": False,
    }
    assert client.get(url, params={"path": "missing.txt"}).status_code == 404


def test_read_cut_at_1mib_is_flagged(env: Env, client: TestClient) -> None:
    vm = _vm(client)
    env.scheduler.files[(vm, "big.txt")] = b"x" * (MiB + 10)
    got = client.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "big.txt"})
    assert got.status_code == 200 and len(got.content) == MiB
    assert got.headers["x-pal-truncated"] == "true"


def test_write_limit_is_1mib(env: Env, client: TestClient) -> None:
    vm = _vm(client)
    url = f"/v1/runtime/vms/{vm}/files/content"
    assert client.put(url, params={"path": "ok.bin"}, content=b"a" * MiB).json()["bytesWritten"] == MiB
    resp = client.put(url, params={"path": "big.bin"}, content=b"a" * (MiB + 1))
    assert resp.status_code == 413 and _err(resp)["code"] == "PAYLOAD_TOO_LARGE"

    def chunks():  # no Content-Length: the server must count while reading
        for _ in range(20):
            yield b"b" * (128 * 1024)

    resp = client.put(url, params={"path": "chunked.bin"}, content=chunks())
    assert resp.status_code == 413
    assert env.scheduler.written == [("ok.bin", MiB)]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../b", "a\x00b", ".."])
def test_path_escapes_are_400_without_touching_the_vm(env: Env, client: TestClient, bad: str) -> None:
    vm = _vm(client)
    for resp in (
        client.get(f"/v1/runtime/vms/{vm}/files", params={"path": bad}),
        client.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": bad}),
        client.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": bad}, content=b"x"),
    ):
        assert resp.status_code == 400 and _err(resp)["code"] == "PATH_ESCAPE"
    assert env.scheduler.written == []


def test_content_requires_a_path(client: TestClient) -> None:
    vm = _vm(client)
    resp = client.get(f"/v1/runtime/vms/{vm}/files/content")
    assert resp.status_code == 400 and "path" in _err(resp)["message"]


# -- health ---------------------------------------------------------------------------------


def test_healthz_reports_503_when_it_cannot_schedule(tmp_path: Path) -> None:
    async def unhealthy() -> dict[str, object]:
        return {"ok": False, "image": "missing: run `pal image build default`"}

    resp = TestClient(make_env(tmp_path, health=unhealthy).app).get("/healthz")
    assert resp.status_code == 503 and resp.json()["image"].startswith("missing")


def test_healthz_probe_crash_is_503(tmp_path: Path) -> None:
    def broken() -> dict[str, object]:
        raise ConnectionError("manager socket refused")

    resp = TestClient(make_env(tmp_path, health=broken).app).get("/healthz")
    assert resp.status_code == 503 and "manager socket refused" in resp.json()["error"]
