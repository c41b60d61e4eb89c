"""Issue 9 items 5 and 6 at the API: request ids, errors without internals, body and
argument limits, /healthz without internals (real Scheduler and store, fake manager)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.api.middleware import MAX_BODY_BYTES
from pal.errors import BackendError
from pal.spec import MAX_ARG_BYTES, MAX_ARGS, MAX_SECRETS_JSON_BYTES
from tests.apienv import ApiEnv, make_api


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    return make_api(tmp_path, health=lambda: {"ok": True, "accel": "tcg", "vms": 3})


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {env.key_a}"},
    ) as c:
        yield c


async def _vm(client: httpx.AsyncClient, **spec: object) -> str:
    resp = await client.post("/v1/runtime/schedule", json=spec)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["vmId"])


async def test_every_response_has_a_request_id_and_errors_carry_it(client: httpx.AsyncClient) -> None:
    ok = await client.get("/v1/runtime/vms")
    assert ok.status_code == 200 and ok.headers["x-request-id"].startswith("req-")
    missing = await client.get("/v1/runtime/vms/vm-nope")
    err = missing.json()["error"]
    assert missing.status_code == 404 and err["requestId"] == missing.headers["x-request-id"]
    assert ok.headers["x-request-id"] != missing.headers["x-request-id"]
    # A caller's own id is kept (tracing through proxies) when it is a short safe token...
    mine = await client.get("/v1/runtime/vms/vm-nope", headers={"X-Request-Id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42" and mine.json()["error"]["requestId"] == "trace-42"
    # ...and replaced when it is not.
    bad = await client.get("/v1/runtime/vms", headers={"X-Request-Id": "x" * 200})
    assert bad.headers["x-request-id"].startswith("req-")


async def test_backend_errors_show_no_host_paths_or_qemu_output(
    env: ApiEnv, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    secret_path = "/var/lib/pal/vms/vm-1/qemu.log"
    env.manager.fail(
        "spawn",
        BackendError(
            f"QEMU exited with 1 (log {secret_path}):\n"
            "qemu-system-x86_64: -drive file=/dev/fdset/3: Permission denied"
        ),
    )
    with caplog.at_level(logging.WARNING, logger="pal.api"):
        resp = await client.post("/v1/runtime/schedule", json={})
    err = resp.json()["error"]
    assert resp.status_code == 500, resp.text
    shown = err["message"]
    assert "/var/lib" not in shown and "qemu-system" not in shown and "\n" not in shown
    assert "QEMU exited with 1" in err["message"]
    # The full text is in the server log, findable by the request id.
    assert any(secret_path in r.getMessage() and "qemu-system" in r.getMessage() for r in caplog.records)
    # The failed VM's reason, shown to the tenant, is cleaned the same way.
    (vm,) = (await client.get("/v1/runtime/vms")).json()["vms"]
    assert vm["state"] == "failed" and "/var/lib" not in vm["reason"] and "\n" not in vm["reason"]


async def test_a_body_over_the_limit_is_refused_before_it_is_read(client: httpx.AsyncClient) -> None:
    declared = await client.post(
        "/v1/runtime/schedule",
        content=b"{}",
        headers={"Content-Length": str(MAX_BODY_BYTES + 1), "Content-Type": "application/json"},
    )
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"secrets": {"A": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'"}}'

    streamed = await client.post(
        "/v1/runtime/schedule", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert streamed.status_code == 413, streamed.text
    assert (await client.get("/v1/runtime/vms")).json()["vms"] == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"command": "echo", "argv": ["x"] * (MAX_ARGS + 1)}, "argv"),
        ({"command": "echo", "argv": ["y" * (MAX_ARG_BYTES + 1)]}, "argv"),
        ({"command": "echo", "argv": ["a\x00b"]}, "argv"),
        ({"command": "echo", "env": {"A": "z" * (MAX_ARG_BYTES + 1)}}, "env"),
        ({"command": "echo", "env": {"A" * 300: "1"}}, "env"),
        ({"command": "echo", "cwd": "/" + "d" * 5000}, "cwd"),
        ({"command": "ec\x00ho"}, "command"),
        ({"command": "echo", "argv": ["q" * 100_000] * 11}, "argv and env take"),
    ],
)
async def test_exec_arguments_have_limits(client: httpx.AsyncClient, body: dict, field: str) -> None:
    vm = await _vm(client)
    resp = await client.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == "INVALID_ARGUMENT" and field in err["message"], err


async def test_oversized_secrets_are_a_400_not_a_failed_spawn(env: ApiEnv, client: httpx.AsyncClient) -> None:
    many = {f"S{i}": "v" * 1000 for i in range(40)}  # each fine, 40 KB together
    assert len(json.dumps(many)) > MAX_SECRETS_JSON_BYTES
    resp = await client.post("/v1/runtime/schedule", json={"secrets": many})
    assert resp.status_code == 400 and "secrets" in resp.json()["error"]["message"]
    for bad in ({"A": "x" * (17 * 1024)}, {"A": "nul\x00"}, {"bad-name": "1"}):
        resp = await client.post("/v1/runtime/schedule", json={"secrets": bad})
        assert resp.status_code == 400, resp.text
    assert (await client.get("/v1/runtime/vms")).json()["vms"] == []
    assert not any(c[0] == "spawn" for c in env.manager.calls)


async def test_healthz_shows_internals_only_to_the_operator(env: ApiEnv) -> None:
    env.sched.settings.admin_token = "adm-token"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app), base_url="http://localhost"
    ) as c:
        anon = await c.get("/healthz")
        assert anon.status_code == 200 and anon.json() == {"ok": True}
        tenant = await c.get("/healthz", headers={"Authorization": f"Bearer {env.key_a}"})
        assert tenant.json() == {"ok": True}
        op = await c.get("/healthz", headers={"Authorization": "Bearer adm-token"})
        assert op.json() == {"ok": True, "accel": "tcg", "vms": 3}


async def test_a_failing_health_probe_shows_nothing_without_a_key(tmp_path: Path) -> None:
    def broken() -> dict:
        raise RuntimeError("cannot open /var/lib/pal/images/default/meta.json")

    env = make_api(tmp_path, health=broken)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app), base_url="http://localhost"
    ) as c:
        resp = await c.get("/healthz")
    assert resp.status_code == 503 and resp.json() == {"ok": False}


async def test_cors_only_for_the_operators_origins(tmp_path: Path) -> None:
    """A browser page on an origin in PAL_CORS_ORIGINS may call the API with its key (the
    TypeScript SDK in a page); any other origin gets no CORS grant; none is the default."""

    from pal.api.app import create_app
    from tests.fakes import make_env

    env = make_env(tmp_path)
    for origins, origin, granted in (
        ([], "https://app.example", False),
        (["https://app.example"], "https://app.example", True),
        (["https://app.example"], "https://evil.example", False),
    ):
        settings = env.settings.model_copy(update={"cors_origins": origins})
        app = create_app(env.sched, env.store, settings)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost"
        ) as c:
            pre = await c.options(
                "/v1/runtime/vms",
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "GET",
                    "Access-Control-Request-Headers": "authorization",
                },
            )
            got = await c.get(
                "/v1/runtime/vms", headers={"Origin": origin, "Authorization": f"Bearer {env.api_key}"}
            )
        assert got.status_code == 200
        allow = got.headers.get("access-control-allow-origin")
        assert (allow == origin) is granted, (origins, origin, allow)
        assert (pre.headers.get("access-control-allow-origin") == origin) is granted
        assert "access-control-allow-credentials" not in got.headers


async def test_an_id_in_a_path_that_is_none_is_400_before_routing(client: httpx.AsyncClient) -> None:
    """An id pasted into a URL (``%2F`` is a ``/`` once decoded, which would make it another
    route) is refused as an id before any route runs, whatever the route; real ids are not."""
    vm = await _vm(client)
    await client.post(f"/v1/runtime/vms/{vm}/pause")
    for path in (
        f"/v1/runtime/vms/{vm}%2Fresume",
        f"/v1/runtime/vms/{vm}%2Fresume%3Fx%3D/audit",
        "/v1/runtime/vms/..%2F..%2Fetc",
        "/v1/runtime/vms/.hidden",
        "/v1/runtime/vms/vm%00x/events",
        f"/v1/runtime/vms/{vm}/code/contexts/a%2Fb/interrupt",
        "/runtime/vm%2F..%2Flogout",
    ):
        resp = await client.post(path, json={})
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert (await client.get(f"/v1/runtime/vms/{vm}")).json()["state"] == "paused"
    assert (await client.get(f"/v1/runtime/vms/{vm}/events")).status_code == 200
    # A guest path through the ports proxy may hold anything: it is the guest's, not an id.
    assert (await client.get(f"/v1/runtime/vms/{vm}/ports/8000/a%2Fb")).status_code != 400


def test_a_websocket_naming_an_id_that_is_none_is_refused(env: ApiEnv) -> None:
    from starlette.testclient import TestClient, WebSocketDenialResponse

    with TestClient(env.app, base_url="http://localhost") as tc:
        headers = {"Authorization": f"Bearer {env.key_a}", "Host": "localhost"}
        with pytest.raises(WebSocketDenialResponse) as info:
            with tc.websocket_connect("/v1/runtime/vms/vm%2F1/processes/1/attach", headers=headers):
                pass
        assert info.value.status_code == 400 and "invalid VM id" in info.value.text
