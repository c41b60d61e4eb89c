"""Pal's MCP server (docs/agents.md): sandbox tools for AI agents, over stdio (``pal mcp``)
and Streamable HTTP (``/mcp`` on the control plane). The tools use only the Python SDK, so
they work the same against any Pal server."""
