"""The MCP server's pure parts (schemas, result shaping, argument checks) and its HTTP
endpoint on the real API, scheduler and store with the fake runtime manager, driven by the
official ``mcp`` client (tests/integration/test_mcp.py drives both transports on real VMs)."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import Any

import httpx
import httpx2
import jsonschema
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from pal.api.auth import key_check
from pal.mcp.catalog import SCHEMAS, TOOLS
from pal.mcp.code_tool import MAX_IMAGES, shape
from pal.mcp.dispatch import call_tool, check_arguments
from pal.mcp.http import install_mcp
from pal.mcp.resources import URI_TEMPLATE
from pal.mcp.shaping import DEFAULT_OUTPUT_BYTES, api_error, cut_items, render_output, utf8_prefix
from pal.mcp.tools import HANDLERS
from pal.sdk import AsyncClient, NotFoundError, PalApiError
from pal.sdk.code import code_result
from tests.apienv import ApiEnv, make_api, serve


def test_every_tool_has_a_handler_and_a_valid_schema_for_a_model() -> None:
    assert set(HANDLERS) == set(SCHEMAS)
    for tool in TOOLS:
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.input_schema["type"] == "object"
        assert tool.input_schema["additionalProperties"] is False
        assert tool.description and len(tool.description) > 40
        for name, prop in tool.input_schema["properties"].items():
            assert prop.get("description"), f"{tool.name}.{name} has no description"


def test_arguments_are_checked_with_a_message_a_model_can_act_on() -> None:
    assert check_arguments("run_command", {"vmId": "vm-1", "command": "ls"}) is None
    why = check_arguments("run_command", {"vmId": "vm-1"})
    assert why is not None and "'command' is a required property" in why
    why = check_arguments("read_process_output", {"vmId": "vm-1", "processId": 1, "waitMs": 10**6})
    assert why is not None and "waitMs" in why
    why = check_arguments("create_sandbox", {"egress": "sometimes"})
    assert why is not None and "egress" in why


def test_a_cut_never_splits_a_character() -> None:
    data = "aé✓😀".encode()  # 1, 2, 3 and 4 bytes
    for limit in range(len(data) + 1):
        part = utf8_prefix(data, limit)
        assert len(part) <= limit
        part.decode("utf-8")  # whole characters only
        assert data.startswith(part)
    items = [{"stream": "stdout", "data": b"abc"}, {"stream": "stderr", "data": "éé".encode()}]
    kept, taken = cut_items(items, 6)
    assert taken == 5 and render_output(kept) == "abc\n[stderr]\né"


def test_an_api_error_says_what_happened_and_what_to_do() -> None:
    result = api_error(NotFoundError(404, "NOT_FOUND", "VM vm-x not found"))
    text = result.content[0].text  # type: ignore[union-attr]
    assert result.is_error
    assert "404 NOT_FOUND: VM vm-x not found" in text and "list_sandboxes" in text
    # a 409 about the image's kernel is not about the sandbox's state: no "resume" advice
    no_kernel = api_error(PalApiError(409, "KERNEL_UNAVAILABLE", "no python kernel in this image"))
    advice = no_kernel.content[0].text  # type: ignore[union-attr]
    assert "run_command" in advice and "code-interpreter" in advice and "resume" not in advice


async def test_an_unreachable_server_is_a_tool_error_that_names_pal_url() -> None:
    async with AsyncClient("http://127.0.0.1:9", "pal_key") as client:  # port 9: nothing listens
        result = await call_tool(client, "list_sandboxes", {}, "stdio")
        unknown = await call_tool(client, "no_such_tool", {}, "stdio")
    assert result.is_error and "PAL_URL" in result.content[0].text  # type: ignore[union-attr]
    assert unknown.is_error and "run_command" in unknown.content[0].text  # type: ignore[union-attr]


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    env = make_api(tmp_path)
    install_mcp(env.app, lambda key: key_check(env.sched.store, key))
    return env


def _connect(url: str, key: str) -> Any:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return http, Client(streamable_http_client(f"{url}/mcp", http_client=http))


async def test_the_http_endpoint_runs_tools_with_the_callers_key(env: ApiEnv) -> None:
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            assert {t.name for t in (await c.list_tools()).tools} == set(SCHEMAS)
            made = await c.call_tool("create_sandbox", {"memoryMib": 256})
            assert not made.is_error, made.content
            vm = made.structured_content["vmId"]
            got = await c.call_tool("get_sandbox", {"vmId": vm})
            assert got.structured_content["state"] == "running"
            bad = await c.call_tool("get_sandbox", {"vmId": "vm-nope"})
            assert bad.is_error and "404" in bad.content[0].text
        http, client = _connect(url, env.key_b)
        async with http, client as other:
            theirs = await other.call_tool("get_sandbox", {"vmId": vm})
            assert theirs.is_error and "404" in theirs.content[0].text
            assert (await other.call_tool("list_sandboxes", {})).structured_content == {"sandboxes": []}
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=60
        ) as api:
            events = (await api.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    audited = [e["details"] for e in events if e["kind"] == "mcp_tool"]
    # Bob's refused call is on no log of Alice's VM; Alice's two calls are.
    assert audited == [
        {"tool": "create_sandbox", "transport": "http", "ok": True},
        {"tool": "get_sandbox", "transport": "http", "ok": True},
    ]


async def test_files_as_tools_and_as_resources(env: ApiEnv) -> None:
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            vm = (await c.call_tool("create_sandbox", {})).structured_content["vmId"]
            text = "ligne é ✓\n" * 50
            wrote = await c.call_tool("write_file", {"vmId": vm, "path": "a.txt", "content": text})
            assert not wrote.is_error, wrote.content
            blob = base64.b64encode(b"\xff\x00\xfe").decode()
            args = {"vmId": vm, "path": "b.bin", "content": blob, "encoding": "base64"}
            assert not (await c.call_tool("write_file", args)).is_error
            part = await c.call_tool("read_file", {"vmId": vm, "path": "a.txt", "maxBytes": 100})
            s = part.structured_content
            assert s["next"] <= 100 and s["size"] == len(text.encode()) and text.startswith(s["content"])
            assert f"offset={s['next']}" in part.content[0].text
            templates = (await c.list_resource_templates()).resource_templates
            assert [t.uri_template for t in templates] == [URI_TEMPLATE]
            read = await c.read_resource(f"pal://sandboxes/{vm}/workspace/a.txt")
            assert read.contents[0].text == text
            read = await c.read_resource(f"pal://sandboxes/{vm}/workspace/b.bin")
            assert base64.b64decode(read.contents[0].blob) == b"\xff\x00\xfe"
            with pytest.raises(MCPError, match="not a Pal resource"):
                await c.read_resource("file:///etc/passwd")
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=60
        ) as api:
            events = (await api.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    tools = [e["details"]["tool"] for e in events if e["kind"] == "mcp_tool"]
    assert tools == [
        "create_sandbox",
        "write_file",
        "write_file",
        "read_file",
        "read_resource",
        "read_resource",
    ]


async def test_a_fork_is_audited_on_the_parent_and_each_child(env: ApiEnv) -> None:
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            vm = (await c.call_tool("create_sandbox", {})).structured_content["vmId"]
            forked = await c.call_tool("fork_sandbox", {"vmId": vm, "count": 1, "metadata": {"try": "a"}})
            assert not forked.is_error, forked.content
            kids = [f["vmId"] for f in forked.structured_content["forks"]]
            assert len(kids) == 1 and kids[0] in forked.content[0].text
            got = env.sched.store.get_vm(kids[0])
            assert got is not None and dict(got.metadata) == {"try": "a"}
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=60
        ) as api:
            for one in (vm, kids[0]):
                events = (await api.get(f"/v1/runtime/vms/{one}/events")).json()["events"]
                assert "fork_sandbox" in [e["details"]["tool"] for e in events if e["kind"] == "mcp_tool"]


async def test_the_http_endpoint_refuses_a_wrong_key(env: ApiEnv) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    with serve(env.app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as anon:
            for auth in ({}, {"Authorization": "Bearer pal_wrong"}, {"Authorization": f"Basic {env.key_a}"}):
                r = await anon.post("/mcp", json=body, headers={**headers, **auth})
                assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
                assert r.headers["www-authenticate"] == "Bearer"


async def test_the_audit_route_is_the_tenants_own_and_bounded(env: ApiEnv) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {env.key_a}"},
    ) as api:
        vm = (await api.post("/v1/runtime/schedule", json={})).json()["vmId"]
        ok = {"tool": "run_command", "transport": "stdio", "ok": False, "status": 409, "code": "VM_PAUSED"}
        assert (await api.post(f"/v1/runtime/vms/{vm}/audit", json=ok)).status_code == 200
        for bad in ({**ok, "tool": "Run Command"}, {**ok, "args": "ls"}, {**ok, "transport": "ws"}):
            assert (await api.post(f"/v1/runtime/vms/{vm}/audit", json=bad)).status_code == 400
        bob = {"Authorization": f"Bearer {env.key_b}"}
        assert (await api.post(f"/v1/runtime/vms/{vm}/audit", json=ok, headers=bob)).status_code == 404
        events = (await api.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    assert [e["details"] for e in events if e["kind"] == "mcp_tool"] == [ok]


def test_run_code_results_are_shaped_for_a_model() -> None:
    """A cell's answer: text cut with a marker that says what to do, PNGs as image content
    (at most MAX_IMAGES), an exception with its traceback in the text."""
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
    res = code_result(
        {
            "contextId": "default-python",
            "executionCount": 3,
            "stdout": "y" * (DEFAULT_OUTPUT_BYTES + 10),
            "stderr": "",
            "text": "42",
            "results": [{"text/plain": "42", "isMainResult": True}]
            + [{"image/png": base64.b64encode(png).decode(), "text/plain": "<Figure>"}] * (MAX_IMAGES + 1),
            "error": {"name": "ZeroDivisionError", "value": "division by zero", "traceback": ["line 1"]},
        }
    )
    out = shape(res)
    text = out.content[0].text
    assert f"stdout (first {DEFAULT_OUTPUT_BYTES} of {DEFAULT_OUTPUT_BYTES + 10} bytes)" in text
    assert "[cut: print less" in text and "result:\n42" in text
    assert "error ZeroDivisionError: division by zero" in text and "line 1" in text
    images = [c for c in out.content if c.type == "image"]
    assert len(images) == MAX_IMAGES and base64.b64decode(images[0].data) == png
    assert out.content[-1].text == "[1 more images left out]"
    assert out.structured_content["images"] == MAX_IMAGES + 1 and not out.is_error


async def test_an_id_that_is_none_never_reaches_a_route(env: ApiEnv) -> None:
    """The finding: ``get_sandbox {"vmId": "<vm>/resume?x="}`` (a read-only tool) made its
    failure audit POST ``.../vms/<vm>/resume?x=/audit`` and resumed a paused VM. The tool
    schemas carry the id pattern, so such an id runs nothing; a tool that fails on a real
    id calls its own route and that VM's audit route, nothing else."""
    seen: list[str] = []
    app_transport = httpx.ASGITransport(app=env.app)

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            seen.append(f"{request.method} {request.url.raw_path.decode()}")
            return await app_transport.handle_async_request(request)

    http = httpx.AsyncClient(transport=Recording(), base_url="http://localhost")
    async with AsyncClient("http://localhost", env.key_a, 30, http_client=http) as client:
        vm = (await client.runtime.schedule())["vmId"]
        await client.runtime.pause(vm)
        seen.clear()
        for tool in ("get_sandbox", "resume_sandbox", "run_command", "read_file"):
            args: dict[str, Any] = {"vmId": f"{vm}/resume?x=", "command": "true", "path": "f"}
            args = {k: v for k, v in args.items() if k in SCHEMAS[tool]["properties"]}
            res = await call_tool(client, tool, args, "stdio")
            assert res.is_error and "vmId" in res.content[0].text  # type: ignore[union-attr]
        assert seen == [], "an id that fails the pattern reaches no route"
        assert (await client.runtime.get(vm))["state"] == "paused"
        seen.clear()
        res = await call_tool(client, "run_command", {"vmId": vm, "command": "true"}, "stdio")
        assert res.is_error  # 409: paused by its owner
        assert seen == [f"POST /v1/runtime/vms/{vm}/processes", f"POST /v1/runtime/vms/{vm}/audit"]
        # The SDK itself quotes what it puts in a path: the API refuses it as an id (400),
        # before any route, even for a route the pasted text names.
        with pytest.raises(Exception, match="invalid VM id"):
            await client.runtime.get(f"{vm}/resume?x=")
        assert seen[-1] == f"GET /v1/runtime/vms/{vm}%2Fresume%3Fx%3D"
        assert (await client.runtime.get(vm))["state"] == "paused"


async def test_the_http_endpoint_checks_the_origin_and_caps_a_tenants_requests(tmp_path: Path) -> None:
    """MCP asks servers to validate Origin: a page elsewhere is 403, the server's own origin
    is not. A tenant holds at most its budget of requests at once (an idle GET stream
    counts): past it 429, while another tenant is not held back."""
    env = make_api(tmp_path)
    install_mcp(env.app, lambda key: key_check(env.sched.store, key), max_per_tenant=2)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream"}
    with serve(env.app) as url:
        a = {**accept, "Authorization": f"Bearer {env.key_a}"}
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/mcp", json=body, headers={**a, "Origin": "http://evil.example"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "FORBIDDEN"
            own = {**a, "Origin": url}
            assert (await c.post("/mcp", json=body, headers=own)).status_code == 200
            async with contextlib.AsyncExitStack() as held:
                for _ in range(2):
                    idle = await held.enter_async_context(c.stream("GET", "/mcp", headers=a))
                    assert idle.status_code == 200
                r = await c.post("/mcp", json=body, headers=a)
                assert r.status_code == 429 and "PAL_TENANT_MAX_STREAMS=2" in r.json()["error"]["message"]
                b = {**accept, "Authorization": f"Bearer {env.key_b}"}
                assert (await c.post("/mcp", json=body, headers=b)).status_code == 200
            assert (await c.post("/mcp", json=body, headers=a)).status_code == 200, "closing gives it back"


async def test_the_audit_log_is_a_ring_per_vm_and_its_route_is_rate_limited(env: ApiEnv) -> None:
    """The finding: 3,000 audit POSTs in 20 s grew the store tenfold. A tenant writes at most
    PAL_AUDIT_RATE a second (in bursts of 10 s worth): past it 429 with Retry-After, again
    once time has passed; each VM keeps its newest PAL_AUDIT_EVENTS_PER_VM."""
    env.sched.settings.audit_events_per_vm = 10
    limit = env.sched.sched.audit.limit
    limit.rate, limit.burst = 1.0, 30.0
    ok = {"tool": "run_command", "transport": "stdio", "ok": True}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {env.key_a}"},
    ) as api:
        vm = (await api.post("/v1/runtime/schedule", json={})).json()["vmId"]
        codes = [(await api.post(f"/v1/runtime/vms/{vm}/audit", json=ok)).status_code for _ in range(40)]
        assert codes == [200] * 30 + [429] * 10
        refused = await api.post(f"/v1/runtime/vms/{vm}/audit", json=ok)
        assert refused.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        assert int(refused.headers["retry-after"]) >= 1
        bob = {"Authorization": f"Bearer {env.key_b}"}
        theirs = (await api.post("/v1/runtime/schedule", json={}, headers=bob)).json()["vmId"]
        assert (await api.post(f"/v1/runtime/vms/{theirs}/audit", json=ok, headers=bob)).status_code == 200
        env.sched.clock.advance(2.0)
        assert (await api.post(f"/v1/runtime/vms/{vm}/audit", json=ok)).status_code == 200
        events = (await api.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    audit = [e for e in events if e["kind"] == "mcp_tool"]
    assert len(audit) == 10, "the ring keeps the newest 10"
    assert [e for e in events if e["kind"] != "mcp_tool"], "status events are not the ring's"
    assert audit == sorted(audit, key=lambda e: e["at"])


async def test_kept_snapshots_as_tools(env: ApiEnv) -> None:
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            made = await c.call_tool("create_sandbox", {"metadata": {"team": "a"}})
            vm = made.structured_content["vmId"]
            took = await c.call_tool("snapshot_sandbox", {"vmId": vm, "name": "prepared"})
            assert not took.is_error, took.content
            snap = took.structured_content
            assert (
                snap["name"] == "prepared"
                and snap["sourceVmId"] == vm
                and snap["snapshotId"] in took.content[0].text
            )
            bad = await c.call_tool("snapshot_sandbox", {"vmId": vm, "name": "no spaces"})
            assert bad.is_error and "name" in bad.content[0].text
            listed = await c.call_tool("list_snapshots", {"vmId": vm})
            assert listed.structured_content == {"snapshots": [snap]}
            assert (await c.call_tool("delete_sandbox", {"vmId": vm})).is_error is False

            started = await c.call_tool(
                "start_from_snapshot", {"snapshot": "prepared", "metadata": {"run": "2"}}
            )
            assert not started.is_error, started.content
            [kid] = [f["vmId"] for f in started.structured_content["forks"]]
            assert kid in started.content[0].text
            got = await c.call_tool("get_sandbox", {"vmId": kid})
            assert got.structured_content["metadata"] == {"run": "2"}
            assert (await c.call_tool("delete_snapshot", {"snapshot": "prepared"})).structured_content == snap
            gone = await c.call_tool("start_from_snapshot", {"snapshot": "prepared"})
            assert gone.is_error and "not found" in gone.content[0].text
            assert (await c.call_tool("list_snapshots", {})).structured_content == {"snapshots": []}
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=60
        ) as api:
            for one, tool in ((vm, "snapshot_sandbox"), (kid, "start_from_snapshot")):
                events = (await api.get(f"/v1/runtime/vms/{one}/events")).json()["events"]
                assert tool in [e["details"]["tool"] for e in events if e["kind"] == "mcp_tool"]
