"""Followers forward to the leader: a client may talk to any control-plane replica.

A replica that does not lead serves the reads it can answer from the store itself
(listing and getting VMs, their events, nodes, health, metrics, the OpenAPI document)
and forwards every other request, unchanged, to the leader's advertised URL (from the
lease row), streaming the answer back (exec's SSE included). A forwarded request carries
``X-Pal-Forwarded``; a replica never forwards one again (a replica that lost the lead
meanwhile answers 503 NOT_LEADER through the store's fencing instead of looping).

During a failover there is briefly no leader: the follower waits for one (at most
``PAL_LEADER_LEASE`` + 1 s, the longest a failover takes), and handles the request itself if
it became the leader meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from pal.errors import NotLeader, TooLarge

log = logging.getLogger(__name__)

FORWARDED = "x-pal-forwarded"
# Reads a follower answers from the store (method, path pattern).
LOCAL_READS = [
    re.compile(p)
    for p in (
        r"^/healthz$",
        r"^/readyz$",
        r"^/metrics$",
        r"^/openapi\.json$",
        r"^/v1/runtime/vms$",
        r"^/v1/runtime/vms/[^/]+$",
        r"^/v1/runtime/vms/[^/]+/events$",
        r"^/v1/nodes$",
    )
]
MAX_FORWARDED_BODY = 4 << 20  # above any request the API accepts (files are 1 MiB)
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ForwardToLeader:
    """ASGI middleware; ``is_leader()`` and ``leader_url()`` come from the Leadership."""

    def __init__(
        self,
        app: Any,
        is_leader: Callable[[], Awaitable[bool]],
        leader_url: Callable[[], Awaitable[str | None]],
        failover_s: float,
    ) -> None:
        self.app = app
        self.is_leader = is_leader
        self.leader_url = leader_url
        self.failover_s = failover_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    def _local(self, scope: Scope) -> bool:
        if scope["method"] in ("GET", "HEAD") and any(p.match(scope["path"]) for p in LOCAL_READS):
            return True
        return any(k.decode().lower() == FORWARDED for k, _ in scope.get("headers", []))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._local(scope) or await self.is_leader():
            await self.app(scope, receive, send)
            return
        target = await self._wait_for_leader()
        if target is None:
            if await self.is_leader():
                await self.app(scope, receive, send)
                return
            await _error(send, NotLeader("no control-plane replica leads right now; retry shortly"))
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > MAX_FORWARDED_BODY:
                await _error(send, TooLarge("request body too large"))
                return
            if not msg.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() not in _HOP]
        headers.append((FORWARDED, "1"))
        url = target.rstrip("/") + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        req = self._http.build_request(scope["method"], url, headers=headers, content=bytes(body))
        try:
            resp = await self._http.send(req, stream=True)
        except httpx.TransportError as exc:
            log.warning(
                "forwarding %s %s to the leader %s failed: %s", scope["method"], scope["path"], target, exc
            )
            await _error(send, NotLeader(f"the leader ({target}) did not answer; retry shortly"))
            return
        try:
            out = [(k.encode(), v.encode()) for k, v in resp.headers.items() if k.lower() not in _HOP]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.TransportError:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    async def _wait_for_leader(self) -> str | None:
        deadline = time.monotonic() + self.failover_s
        while True:
            try:
                url = await self.leader_url()
            except Exception as exc:
                log.warning("cannot read the leadership lease: %s", exc)
                url = None
            if url or time.monotonic() >= deadline or await self.is_leader():
                return url
            await asyncio.sleep(0.2)

    async def aclose(self) -> None:
        await self._http.aclose()


async def _error(send: Send, err: Any) -> None:
    body = json.dumps(err.to_body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
