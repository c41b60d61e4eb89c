"""The HTTP side of ``ManagerClient`` (client.py) that its call groups share: one request,
one NDJSON stream, and the rule that turns a node's answer or absence into a PalError.

Two kinds of call, on two pools of connections (docs/security.md, "Fair shares"):

- **control calls** (``_call``: heartbeats, spawns, snapshots, stops, and the short guest
  calls: files, a process's state, stdin, signals) each end by their own deadline, and
  have connections of their own that no long-lived call ever takes;
- **long-lived calls** (``_ndjson`` streams: exec, a process's output, a cell; ``_long``:
  long polls, a kernel's start; a port tunnel) each hold a slot of the node's budget
  (``StreamSlots``) while they last, on a pool that grows with them up to that budget.
  Past it a new one is 429 at once: a call never waits for a connection without end.

Who may hold how many of those slots (per tenant, per VM) is the scheduler's rule
(pal/scheduler/streams.py); this is the node's own ceiling.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx

from pal.errors import PalError, TooManyRequests, Unavailable, from_wire

# The node could not be reached at all (nothing was done there): callers may try another.
UNREACHABLE = "NODE_UNREACHABLE"

# A stream (an exec, a cell, a process's output) runs as long as it runs. Its slot is taken
# before the request, so its pool has a connection for it: the pool wait is a hang guard.
STREAM_TIMEOUT = httpx.Timeout(None, connect=5.0, pool=10.0)
# A control call waits this long at most for a free connection of its own pool.
CONTROL_POOL_WAIT_S = 30.0
CONTROL_CONNECTIONS = 100
DEFAULT_MAX_STREAMS = 1024


class StreamSlots:
    """The long-lived calls open to one node, at most ``limit``; a new one past it is 429
    at once. The embedded node and a remote one keep the same count."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self) -> None:
        if self.held >= self.limit:
            raise TooManyRequests(
                f"this node already carries {self.held} long-lived calls (streams, attaches, "
                f"long polls, cells, port tunnels), its budget (PAL_NODE_MAX_STREAMS={self.limit}): "
                "retry when some have ended"
            )
        self.held += 1

    def give(self) -> None:
        self.held = max(0, self.held - 1)

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        self.take()
        try:
            yield
        finally:
            self.give()


def unreachable(exc: httpx.TransportError) -> Unavailable:
    # httpx's errors often have no text (a reset connection reads as ReadError('')).
    return Unavailable(f"runtime manager unreachable: {str(exc) or type(exc).__name__}", code=UNREACHABLE)


class NodeHttp:
    """What every ``ManagerClient`` call group (client_code.py, client_processes.py) calls
    through; client.py makes ``_http``."""

    _http: httpx.AsyncClient  # control calls
    _streams: httpx.AsyncClient  # long-lived calls, each in a slot of ``slots``
    slots: StreamSlots

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
        """A control call (see the module's doc)."""
        return await self._request(self._http, method, url, **kw)

    async def _long(self, method: str, url: str, **kw: Any) -> httpx.Response:
        """A long-lived call that answers once (a long poll, a kernel's start), in a slot."""
        with self.slots.slot():
            return await self._request(self._streams, method, url, **kw)

    async def _request(self, http: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            resp = await http.request(method, url, **kw)
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
        ``error`` lines are the node's own (rpc.py sends those with their ``status``). It
        holds a slot of the node's budget while it lasts (429 when none is free)."""
        try:
            with self.slots.slot():
                async with self._streams.stream(method, url, timeout=STREAM_TIMEOUT, **kw) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        self._raise_for(resp)
                    async for line in resp.aiter_lines():
                        if line.strip():
                            yield json.loads(line)
        except httpx.TransportError as exc:
            raise unreachable(exc) from exc
