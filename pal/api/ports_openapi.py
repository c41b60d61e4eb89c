"""The ports proxy in ``/openapi.json``.

The proxy route (pal/api/ports.py) is kept out of FastAPI's generated document: it serves
methods OpenAPI cannot name (QUERY, WebDAV's PROPFIND...), and its path parameter spans
slashes. So it is described here by hand, for the methods OpenAPI has: its parameters,
that any body passes through, and that the answer is the guest server's own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .errors import _DESCRIPTIONS

PROXY_PATH = "/v1/runtime/vms/{vm_id}/ports/{port}/{path}"
OPENAPI_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

_PARAMETERS = [
    {"name": "vm_id", "in": "path", "required": True, "schema": {"type": "string"}, "description": "VM id"},
    {
        "name": "port",
        "in": "path",
        "required": True,
        "schema": {"type": "integer", "minimum": 1, "maximum": 65535},
        "description": "port of a server listening in the VM (on 0.0.0.0 or 127.0.0.1)",
    },
    {
        "name": "path",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "the path on the guest's server: the rest of the URL, slashes included "
        "(may be empty), with the query string minus `palToken`",
    },
]


def _operation(method: str) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorOut"}
    errors = {
        str(code): {"description": _DESCRIPTIONS[code], "content": {"application/json": {"schema": ref}}}
        for code in (400, 401, 404, 409)
    }
    errors["502"] = {
        "description": "nothing listens on the port (`PORT_NOT_LISTENING`, after waiting up to 5 s "
        "for a server still starting), or the guest's server closed or answered broken HTTP",
        "content": {"application/json": {"schema": ref}},
    }
    op: dict[str, Any] = {
        "tags": ["ports"],
        "operationId": f"port_proxy_{method}",
        "summary": "Reverse proxy to a server in the VM (any method; WebSocket upgrades too)",
        "description": "Forwards the request to the server on `port` in the VM and streams its "
        "answer back. Authorise with the API key (never forwarded to the guest), a signed "
        "link's `?palToken=` (POST .../ports/{port}/url) or the cookie that link sets. Any "
        "method passes, including those OpenAPI cannot list (QUERY, WebDAV's PROPFIND, MKCOL, "
        "...). An idle-suspended VM wakes; an operator-paused one is 409. See docs/ports.md.",
        "parameters": _PARAMETERS,
        "responses": {
            "default": {
                "description": "the guest server's answer: its status, headers (minus hop-by-hop "
                "ones) and body, as it sent them",
                "content": {"*/*": {"schema": {}}},
            },
            **errors,
        },
    }
    if method not in ("get", "head", "options", "trace"):
        op["requestBody"] = {
            "required": False,
            "description": "any body, of any type and size, streamed to the guest's server as sent",
            "content": {"*/*": {"schema": {}}},
        }
    return op


def document_port_proxy(app: FastAPI) -> None:
    """Add the proxy route to ``/openapi.json`` (see the module's docstring)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = build()
        doc.setdefault("paths", {})[PROXY_PATH] = {m: _operation(m) for m in OPENAPI_METHODS}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
