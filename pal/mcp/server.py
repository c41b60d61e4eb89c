"""The MCP server (official ``mcp`` SDK, low-level ``Server``): the tool list and the tool
calls, over a Pal client that the transport provides (stdio.py: one client from PAL_URL and
PAL_API_KEY; http.py: one per request, with the caller's key)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

import pal

from .catalog import TOOLS
from .dispatch import Transport, call_tool
from .resources import TEMPLATES, read_resource
from .shaping import error_result

# The Pal client for one request (its HTTP request, when the transport has one).
ClientSource = Callable[[ServerRequestContext[Any, Any]], AbstractAsyncContextManager[Any]]

INSTRUCTIONS = (
    "Pal sandboxes are Linux microVMs for running code. Create one with create_sandbox, run "
    "commands with run_command (long ones keep running: follow them with read_process_output), "
    "move files with read_file/write_file, and delete_sandbox when done. pause_sandbox and "
    "resume_sandbox keep memory and processes; fork_sandbox copies a sandbox's whole state; "
    "snapshot_sandbox keeps that state by a name, and start_from_snapshot starts new sandboxes "
    "from it later."
)


def build_server(clients: ClientSource, transport: Transport) -> Server[Any]:
    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def on_call(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            async with clients(ctx) as client:
                return await call_tool(client, params.name, params.arguments, transport)
        except PermissionError as exc:  # the HTTP transport found no key on the request
            return error_result(str(exc))

    async def list_templates(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=TEMPLATES)

    async def list_resources(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])  # a template only (resources.py)

    async def on_read(
        ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        async with clients(ctx) as client:
            return await read_resource(client, str(params.uri), transport)

    return Server(
        "pal",
        version=getattr(pal, "__version__", "0.1.0"),
        title="Pal sandboxes",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=on_call,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=on_read,
    )
