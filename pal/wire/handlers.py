"""The two sides of a verb (verbs.py) as code sees them.

- :class:`NodeCalls`: what the control plane holds for each node. ``call``, ``stream`` and
  ``open`` take any declared verb and its request, and answer its answer type: mypy checks
  both against the declaration. The one HTTP client (pal/scheduler/node_client.py)
  implements it for the embedded node and remote ones alike.
- :class:`Handlers`: what a node serves: each verb bound to the function that answers it,
  checked against the declaration as it is bound. The node agent fills one
  (pal/manager/runtime.py), and so does every test double of a node; pal/manager/rpc.py
  serves a table over HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from pal.errors import Unavailable
from pal.wire.tunnel import Opened, TunnelStream
from pal.wire.verbs import VERBS, Call, Stream, Tunnel, Verb

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)
Ev = TypeVar("Ev", bound=BaseModel)


class NodeCalls(Protocol):
    async def call(self, verb: Call[Req, Ans], req: Req) -> Ans: ...

    def stream(self, verb: Stream[Req, Ev], req: Req) -> AsyncGenerator[Ev, None]:
        """The stream's events; an error before or during it is raised as its PalError (a
        node that went away: 503 NODE_UNREACHABLE), on the first ``__anext__`` if before."""
        ...

    async def open(self, verb: Tunnel[Req], req: Req) -> TunnelStream: ...

    async def aclose(self) -> None: ...


CallFn = Callable[[Any], Awaitable[BaseModel]]
StreamFn = Callable[[Any], AsyncIterator[BaseModel]]
TunnelFn = Callable[[Any], Awaitable[Opened]]


class Handlers:
    """Each verb's handler on one node. A verb without one answers 503 (``unserved``)."""

    def __init__(self) -> None:
        self.calls: dict[str, CallFn] = {}
        self.streams: dict[str, StreamFn] = {}
        self.tunnels: dict[str, TunnelFn] = {}

    def on(self, verb: Call[Req, Ans], fn: Callable[[Req], Awaitable[Ans]]) -> None:
        self.calls[verb.name] = fn

    def on_stream(self, verb: Stream[Req, Ev], fn: Callable[[Req], AsyncIterator[Ev]]) -> None:
        self.streams[verb.name] = fn

    def on_tunnel(self, verb: Tunnel[Req], fn: Callable[[Req], Awaitable[Opened]]) -> None:
        self.tunnels[verb.name] = fn

    def bound(self, verb: Verb) -> bool:
        return verb.name in {**self.calls, **self.streams, **self.tunnels}

    def unbound(self) -> list[str]:
        """Declared verbs this table serves none of."""
        return [v.name for v in VERBS if not self.bound(v)]

    def call_fn(self, verb: Call[Any, Any]) -> CallFn:
        return self.calls.get(verb.name) or _unserved(verb.name)

    def stream_fn(self, verb: Stream[Any, Any]) -> StreamFn:
        fn = self.streams.get(verb.name)
        if fn is None:
            raise unserved(verb.name)
        return fn

    def tunnel_fn(self, verb: Tunnel[Any]) -> TunnelFn:
        return self.tunnels.get(verb.name) or _unserved(verb.name)


def unserved(name: str) -> Unavailable:
    return Unavailable(f"this node does not serve {name}", code="NOT_SERVED")


def _unserved(name: str) -> Callable[[Any], Awaitable[Any]]:
    async def refuse(_: Any) -> Any:
        raise unserved(name)

    return refuse
