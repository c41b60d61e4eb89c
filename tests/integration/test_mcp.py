"""The MCP server, driven by the official ``mcp`` client over both transports against a real
`pal up` and real VMs (docs/agents.md): stdio (`pal mcp` as a subprocess, as a desktop
client starts it) and Streamable HTTP (``/mcp`` with the API key as a bearer token).

One VM per transport: a whole session each (create, a command that yields and is read to
its end, files as tools and as a resource, pause and resume, delete), every call audited on
the VM."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import httpx2
import jsonschema
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from pal.mcp.catalog import TOOLS
from tests.conftest import PalServer

pytestmark = pytest.mark.vm

Connect = Callable[[str], AbstractAsyncContextManager[Client]]
TEXT = "héllo from MCP ✓\n" * 200  # several reads at a small maxBytes, multi-byte characters


def _http(server: PalServer) -> Connect:
    @asynccontextmanager
    async def connect(key: str) -> AsyncIterator[Client]:
        http = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(30, read=300)
        )
        async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
            yield c

    return connect


def _stdio(server: PalServer) -> Connect:
    @asynccontextmanager
    async def connect(key: str) -> AsyncIterator[Client]:
        env = {"PAL_URL": server.url, "PAL_API_KEY": key, "PATH": os.environ.get("PATH", "")}
        params = StdioServerParameters(command=sys.executable, args=["-m", "pal.cli.main", "mcp"], env=env)
        async with Client(params) as c:
            yield c

    return connect


def _text(result: Any) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


async def _call(c: Client, name: str, **args: Any) -> Any:
    result = await c.call_tool(name, args)
    assert not result.is_error, f"{name}: {_text(result)}"
    return result


async def _follow(c: Client, vm: str, pid: int, offset: int) -> tuple[str, int]:
    """read_process_output from ``offset`` until the process exited and all is read."""
    out = []
    for _ in range(200):  # each read waits for output: bounded, not timed
        r = await _call(c, "read_process_output", vmId=vm, processId=pid, offset=offset, waitMs=5000)
        s = r.structured_content
        assert s["offset"] == offset
        out.append(s["output"])
        offset = s["next"]
        if s["complete"]:
            return "".join(out), s["exitCode"]
    raise AssertionError("the process never completed")


async def _session(c: Client, api: httpx.AsyncClient, other: Client) -> str:
    tools = await c.list_tools()
    names = {t.name for t in tools.tools}
    assert names == {t.name for t in TOOLS}
    for t in tools.tools:
        jsonschema.Draft202012Validator.check_schema(t.input_schema)
        assert t.description and t.input_schema["type"] == "object"

    vm = (await _call(c, "create_sandbox", idleTimeoutSecs=0)).structured_content["vmId"]
    # A command that is still running at its yield: it waits for a file the model writes.
    cmd = "echo started; while [ ! -e /workspace/go ]; do sleep 0.05; done; echo finished >&2; exit 3"
    r = await _call(c, "run_command", vmId=vm, command=cmd, yieldAfterMs=300)
    s = r.structured_content
    # (the output so far may be empty: on a loaded host the shell may not have echoed yet)
    assert s["running"] is True and s["exitCode"] is None
    assert f"offset={s['next']}" in _text(r)
    pid = s["processId"]

    await _call(c, "write_file", vmId=vm, path="go", content="")
    rest, code = await _follow(c, vm, pid, s["next"])
    assert code == 3 and s["output"] + rest == "started\n\n[stderr]\nfinished\n"

    # A process that reads its stdin, and one that is killed.
    r = await _call(c, "run_command", vmId=vm, command="tr a-z A-Z", stdin=True, yieldAfterMs=0)
    cat = r.structured_content["processId"]
    await _call(c, "write_process_stdin", vmId=vm, processId=cat, data="hello\n", eof=True)
    assert await _follow(c, vm, cat, 0) == ("HELLO\n", 0)
    r = await _call(c, "run_command", vmId=vm, command="sleep 600", yieldAfterMs=0)
    sleeper = r.structured_content["processId"]
    await _call(c, "kill_process", vmId=vm, processId=sleeper)
    _, code = await _follow(c, vm, sleeper, 0)
    assert code != 0

    # A file written and read back in parts: each cut result names the offset to go on from.
    await _call(c, "write_file", vmId=vm, path="notes/a.txt", content=TEXT)
    got, offset = b"", 0
    for _ in range(20):
        r = await _call(c, "read_file", vmId=vm, path="notes/a.txt", offset=offset, maxBytes=1000)
        s = r.structured_content
        got += s["content"].encode()
        if s["next"] == s["size"]:
            break
        assert f"offset={s['next']}" in _text(r)
        offset = s["next"]
    assert got.decode() == TEXT
    read = await c.read_resource(f"pal://sandboxes/{vm}/workspace/notes/a.txt")
    assert read.contents[0].text == TEXT
    listing = (await _call(c, "list_files", vmId=vm, path="notes")).structured_content
    assert [e["name"] for e in listing["entries"]] == ["a.txt"]

    # Another tenant's client does not see this VM.
    r = await other.call_tool("get_sandbox", {"vmId": vm})
    assert r.is_error and "404" in _text(r)
    r = await c.call_tool("run_command", {"vmId": vm})  # no command: the schema says what is missing
    assert r.is_error and "command" in _text(r)

    # A bash kernel (any image has bash): its state outlives the pause below.
    await _call(c, "run_code", vmId=vm, language="bash", code="x=41")
    paused = (await _call(c, "pause_sandbox", vmId=vm)).structured_content
    assert paused["state"] == "paused"
    assert (await _call(c, "resume_sandbox", vmId=vm)).structured_content["state"] == "running"
    r = await _call(c, "run_code", vmId=vm, language="bash", code="echo $((x + 1))")
    assert "stdout:\n42" in _text(r), _text(r)
    r = await _call(c, "run_command", vmId=vm, command="wc -c < notes/a.txt")
    assert r.structured_content["exitCode"] == 0
    assert r.structured_content["output"].strip() == str(len(TEXT.encode()))

    await _call(c, "delete_sandbox", vmId=vm)
    assert (await api.get(f"/v1/runtime/vms/{vm}")).json()["state"] == "terminated"
    return vm


async def _audited(api: httpx.AsyncClient, vm: str, transport: str) -> list[dict[str, Any]]:
    events = (await api.get(f"/v1/runtime/vms/{vm}/events")).json()["events"]
    return [
        e["details"] for e in events if e["kind"] == "mcp_tool" and e["details"]["transport"] == transport
    ]


@pytest.mark.parametrize("transport", ["http", "stdio"])
async def test_a_whole_session_over_each_transport(
    pal_server: PalServer, tenant_key: str, transport: str
) -> None:
    connect = (_http if transport == "http" else _stdio)(pal_server)
    other_key = pal_server.keys.get("mcp-other") or pal_server.tenant("mcp-other", max_vms=1)
    headers = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=pal_server.url, headers=headers, timeout=300) as api:
        async with connect(tenant_key) as c, connect(other_key) as other:
            vm = await _session(c, api, other)
        audited = await _audited(api, vm, transport)
    tools = [d["tool"] for d in audited]
    for name in (
        "create_sandbox",
        "run_command",
        "read_process_output",
        "write_file",
        "read_file",
        "read_resource",
        "run_code",
    ):
        assert name in tools
    assert tools[-1] == "delete_sandbox" and all(d["ok"] for d in audited)
    # The audit names the tool, never its arguments (a command or a file's content).
    assert not any("héllo" in str(d) or "started" in str(d) for d in audited)


async def test_a_wrong_key_is_refused(pal_server: PalServer, tenant_key: str) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=pal_server.url, timeout=60) as anon:
        for auth in ({}, {"Authorization": "Bearer pal_not-a-key"}):
            r = await anon.post("/mcp", json=body, headers={**headers, **auth})
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "UNAUTHENTICATED"
    # Over stdio the key goes with each call: the tool says the server refused it.
    async with _stdio(pal_server)("pal_not-a-key") as c:
        r = await c.call_tool("list_sandboxes", {})
    assert r.is_error and "401" in _text(r) and "PAL_API_KEY" in _text(r)
