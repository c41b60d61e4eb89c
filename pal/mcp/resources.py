"""A sandbox's ``/workspace`` as MCP resources: ``pal://sandboxes/{vmId}/workspace/{path}``
reads a file (text, or base64 for other bytes), a path ending in ``/`` (or none) lists a
directory. A template only: the sandboxes and their files change under the model, so the
server lists no fixed resources. Each read is audited as ``read_resource``, as a tool call."""

from __future__ import annotations

import base64
import json
import re

import mcp_types as types
from mcp.shared.exceptions import MCPError

from pal.sdk import AsyncClient, PalApiError

from .dispatch import Transport, audit

URI_TEMPLATE = "pal://sandboxes/{vmId}/workspace/{+path}"
_URI = re.compile(r"^pal://sandboxes/([A-Za-z0-9_-]{1,64})/workspace(?:/(.*))?$")

TEMPLATES = [
    types.ResourceTemplate(
        uri_template=URI_TEMPLATE,
        name="workspace",
        title="A sandbox's /workspace",
        description="A file under a sandbox's /workspace (text, or base64 for other bytes, up to 1 MiB); "
        "a path ending in / lists that directory as JSON.",
    )
]


async def read_resource(client: AsyncClient, uri: str, transport: Transport) -> types.ReadResourceResult:
    m = _URI.match(uri)
    if m is None:
        raise MCPError(types.INVALID_PARAMS, f"not a Pal resource: {uri!r} (expected {URI_TEMPLATE})")
    vm, path = m.group(1), m.group(2) or ""
    try:
        contents = await _contents(client, uri, vm, path)
    except PalApiError as exc:
        await audit(
            client, "read_resource", (vm,) if exc.status not in (0, 401, 404) else (), transport, False, exc
        )
        raise MCPError(types.INVALID_PARAMS, f"Pal answered {exc.status} {exc.code}: {exc.message}") from None
    await audit(client, "read_resource", (vm,), transport, True, None)
    return types.ReadResourceResult(contents=[contents])


async def _contents(
    client: AsyncClient, uri: str, vm: str, path: str
) -> types.TextResourceContents | types.BlobResourceContents:
    if path == "" or path.endswith("/"):
        listing = await client.runtime.list_files(vm, path.rstrip("/"))
        return types.TextResourceContents(uri=uri, mime_type="application/json", text=json.dumps(listing))
    data = await client.runtime.read_file_bytes(vm, path)
    try:
        return types.TextResourceContents(uri=uri, mime_type="text/plain", text=data.decode("utf-8"))
    except UnicodeDecodeError:
        blob = base64.b64encode(data).decode("ascii")
        return types.BlobResourceContents(uri=uri, mime_type="application/octet-stream", blob=blob)
