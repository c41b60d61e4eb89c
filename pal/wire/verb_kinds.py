"""The kinds of verb of the node RPC (pal/wire/verbs.py declares every verb): a request
answered once (:class:`Call`), a stream of events (:class:`Stream`), a byte stream both ways
(:class:`Tunnel`), and how a guest verb reaches the harness (:class:`GuestOp`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from pal.wire.guest_errors import Op

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)
Ev = TypeVar("Ev", bound=BaseModel)

Method = Literal["GET", "POST", "PUT", "DELETE"]
# A call's read timeout, seconds (None: none; the node's own deadlines end it).
DEFAULT_TIMEOUT_S = 300.0
GUEST_REQUEST_TIMEOUT_S = 30.0  # a guest that answers a request later has lost it
LONG_POLL_SLACK_S = 35.0  # beyond a long poll's own wait: the guest request's bound


@dataclass(frozen=True)
class GuestOp:
    """How a guest verb reaches the guest's harness (pal/guest/protocol.py)."""

    kind: str  # the harness's request kind
    errors: Op  # the column of guest_errors.py's table its error codes map through
    # A request in flight, which an operator's live pause waits for (a long poll is not).
    counted: bool = True


@dataclass(frozen=True)
class Call(Generic[Req, Ans]):
    """A request answered once."""

    name: str
    method: Method
    path: str  # its fields in braces, by their wire names: "/vms/{vmId}/processes/{pid}"
    request: type[Req]
    answer: type[Ans]
    doc: str
    # long-lived (a stream slot while it lasts) rather than a control call
    long: bool | Callable[[Req], bool] = False
    timeout_s: float | Callable[[Req], float | None] | None = DEFAULT_TIMEOUT_S
    guest: GuestOp | None = None

    def is_long(self, req: Req) -> bool:
        return self.long(req) if callable(self.long) else self.long

    def timeout(self, req: Req) -> float | None:
        return self.timeout_s(req) if callable(self.timeout_s) else self.timeout_s


@dataclass(frozen=True)
class Stream(Generic[Req, Ev]):
    """A request answered by events as they come (NDJSON), always long-lived. An error of
    the node after the stream started is an ``error`` event with its ``status``, raised
    again by the caller as that error; an ``error`` event without one is the guest's."""

    name: str
    method: Method
    path: str
    request: type[Req]
    event: type[Ev]
    doc: str

    def is_long(self, req: Req) -> bool:
        return True


@dataclass(frozen=True)
class Tunnel(Generic[Req]):
    """A byte stream both ways (a WebSocket, pal/wire/tunnel.py), long-lived."""

    name: str
    path: str
    request: type[Req]
    doc: str


Verb = Call[Any, Any] | Stream[Any, Any] | Tunnel[Any]


def guest_doc(op: Op) -> str:
    """A guest verb's prerequisites and failure, for its doc."""
    return (
        "Prerequisites: the VM runs here (409, or 409 LIVE_PAUSED while a live pause stopped its "
        f"vCPUs, which the scheduler turns into a wake). Failure: the guest's error, mapped as "
        f"{op} requests' (guest_errors.py)."
    )
