"""The HTTP side of ``ManagerClient`` (client.py) that its call groups share: one request,
one NDJSON stream, and the rule that turns a node's answer or absence into a PalError."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from pal.errors import PalError, Unavailable, from_wire

# The node could not be reached at all (nothing was done there): callers may try another.
UNREACHABLE = "NODE_UNREACHABLE"

# A stream (an exec, a cell, a process's output) runs as long as it runs.
STREAM_TIMEOUT = httpx.Timeout(None, connect=5.0)


def unreachable(exc: httpx.TransportError) -> Unavailable:
    # httpx's errors often have no text (a reset connection reads as ReadError('')).
    return Unavailable(f"runtime manager unreachable: {str(exc) or type(exc).__name__}", code=UNREACHABLE)


class NodeHttp:
    """What every ``ManagerClient`` call group (client_code.py, client_processes.py) calls
    through; client.py makes ``_http``."""

    _http: httpx.AsyncClient

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            err = resp.json()["error"]
            raise from_wire(resp.status_code, err["code"], err["message"])
        except (ValueError, KeyError, TypeError):
            raise PalError(f"runtime manager answered {resp.status_code}: {resp.text[:200]}") from None

    async def _call(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, url, **kw)
        except httpx.TransportError as exc:
            raise unreachable(exc) from exc
        self._raise_for(resp)
        return resp

    @staticmethod
    def _body(model: Any) -> dict[str, Any]:
        return model.model_dump(by_alias=True, mode="json")  # type: ignore[no-any-return]

    async def _ndjson(self, method: str, url: str, **kw: Any) -> AsyncGenerator[dict[str, Any], None]:
        """Each line of an NDJSON stream, decoded; an error answer before it starts raises
        its PalError, a node that went away 503 NODE_UNREACHABLE. The caller decides which
        ``error`` lines are the node's own (rpc.py sends those with their ``status``)."""
        try:
            async with self._http.stream(method, url, timeout=STREAM_TIMEOUT, **kw) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise unreachable(exc) from exc
