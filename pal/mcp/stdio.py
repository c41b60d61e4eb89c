"""``pal mcp``: the MCP server over stdio, for a desktop client that starts it as a
subprocess with PAL_URL and PAL_API_KEY in its environment. Every tool call goes to that
Pal server with that key, through one SDK client."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from mcp.server.stdio import stdio_server

from pal.sdk import AsyncClient

from .server import build_server


async def serve_stdio(base_url: str | None = None, api_key: str | None = None) -> None:
    """Serve until the client closes stdin. ``base_url``/``api_key``: PAL_URL and
    PAL_API_KEY when None (the SDK's defaults)."""
    async with AsyncClient(base_url, api_key) as client:

        @contextlib.asynccontextmanager
        async def same_client(_ctx: Any) -> AsyncIterator[AsyncClient]:
            yield client

        server = build_server(same_client, "stdio")
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


def run_stdio(base_url: str | None = None, api_key: str | None = None) -> None:
    anyio.run(serve_stdio, base_url, api_key)
