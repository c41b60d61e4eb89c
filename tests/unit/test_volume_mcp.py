"""The MCP tools of volumes (pal/mcp/volume_tools.py) over the HTTP endpoint on the real API
(the node's real volume code under tests/fakes.py), with the official ``mcp`` client: a
tenant makes a volume and moves files in and out; another tenant sees none of it."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from pal.api.auth import key_check
from pal.mcp.http import install_mcp
from pal.store import volumes as rows
from tests.apienv import make_api, serve


def _connect(url: str, key: str) -> Any:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return http, Client(streamable_http_client(f"{url}/mcp", http_client=http))


async def test_volumes_as_tools(tmp_path: Path) -> None:
    env = make_api(tmp_path)
    install_mcp(env.app, lambda key: key_check(env.sched.store, key))
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            names = {t.name for t in (await c.list_tools()).tools}
            assert {"list_volumes", "create_volume", "list_volume_files", "read_volume_file"} <= names
            made = await c.call_tool("create_volume", {"name": "notes", "sizeMib": 8})
            assert not made.is_error, made.content
            assert made.structured_content["state"] == "ready"
            listed = await c.call_tool("list_volumes", {})
            assert [v["name"] for v in listed.structured_content["volumes"]] == ["notes"]
            wrote = await c.call_tool(
                "write_volume_file", {"volume": "notes", "path": "a/b.txt", "content": "hi"}
            )
            assert not wrote.is_error and "2 bytes" in wrote.content[0].text
            raw = base64.b64encode(b"\xff\x00").decode()
            wrote = await c.call_tool(
                "write_volume_file", {"volume": "notes", "path": "bin", "content": raw, "encoding": "base64"}
            )
            assert not wrote.is_error
            read = await c.call_tool("read_volume_file", {"volume": "notes", "path": "a/b.txt"})
            assert read.structured_content["content"] == "hi"
            read = await c.call_tool("read_volume_file", {"volume": "notes", "path": "bin"})
            assert read.structured_content["encoding"] == "base64"
            assert read.structured_content["content"] == raw
            files = await c.call_tool("list_volume_files", {"volume": "notes", "depth": 2})
            paths = [e["path"] for e in files.structured_content["entries"]]
            assert paths == ["a", "bin", "a/b.txt"]  # breadth first
            escape = await c.call_tool("read_volume_file", {"volume": "notes", "path": "../../etc/passwd"})
            assert escape.is_error and "PATH_ESCAPE" in escape.content[0].text
            bad = await c.call_tool("create_volume", {"name": "bad name"})
            assert bad.is_error and "name" in bad.content[0].text
        http, client = _connect(url, env.key_b)
        async with http, client as other:
            assert (await other.call_tool("list_volumes", {})).structured_content == {"volumes": []}
            theirs = await other.call_tool("read_volume_file", {"volume": "notes", "path": "a/b.txt"})
            assert theirs.is_error and "404" in theirs.content[0].text
            theirs = await other.call_tool(
                "write_volume_file", {"volume": "notes", "path": "x", "content": "x"}
            )
            assert theirs.is_error and "404" in theirs.content[0].text


async def test_create_sandbox_mounts_the_tenants_volumes(tmp_path: Path) -> None:
    env = make_api(tmp_path)
    install_mcp(env.app, lambda key: key_check(env.sched.store, key))
    mounts = [{"name": "work", "path": "/mnt/work", "readOnly": True}]
    with serve(env.app) as url:
        http, client = _connect(url, env.key_a)
        async with http, client as c:
            assert not (await c.call_tool("create_volume", {"name": "work"})).is_error
            made = await c.call_tool("create_sandbox", {"volumes": mounts})
            assert not made.is_error, made.content
            vm = made.structured_content["vmId"]
            vol = rows.by_name(env.sched.store, env.sched.store.tenant_by_name("acme").id, "work")  # type: ignore[union-attr]
            assert vol is not None and rows.mounts_of(env.sched.store, vm)[0][:3] == (
                vol.volume_id,
                "/mnt/work",
                True,
            )
            bad = await c.call_tool("create_sandbox", {"volumes": [{"name": "work", "path": "/etc"}]})
            assert bad.is_error and "/etc" in bad.content[0].text
            bad = await c.call_tool("create_sandbox", {"volumes": [{"name": "work"}]})
            assert bad.is_error and "'path' is a required property" in bad.content[0].text
        http, client = _connect(url, env.key_b)
        async with http, client as other:
            theirs = await other.call_tool("create_sandbox", {"volumes": mounts})
            assert theirs.is_error and "404" in theirs.content[0].text
            assert (await other.call_tool("list_sandboxes", {})).structured_content == {"sandboxes": []}
