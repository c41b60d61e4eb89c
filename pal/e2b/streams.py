"""What every server stream of the agent API shares: the caller it acts for, its deadline
(``Connect-Timeout-Ms``), its keepalive events (``Keepalive-Ping-Interval``) and the one
translation of Pal's errors into Connect's.

A stream reads its source in a task of its own and hands each event over a one-slot queue,
so waiting for the next event can time out for a keepalive or the deadline without
cancelling the source mid-event, and a slow client holds the source back (the slot is
full) instead of piling events up in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from pal.errors import PalError

from . import ops
from .access import basic_user
from .errors import connect_error
from .versions import KEEPALIVE_HEADER

T = TypeVar("T")
R = TypeVar("R")

MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 300.0


@dataclass(frozen=True)
class Target:
    """The sandbox an agent request is for, decided by the agent app before the services
    run (they read it from :data:`current_target`). ``authorised``: the request carried
    the sandbox's access token, or the sandbox needs none; otherwise only a signed
    ``/files`` URL may go on (``access_token`` checks the signature)."""

    tenant: str
    sandbox_id: str
    authorised: bool = True
    access_token: str | None = None
    # Set when the client goes away: a stream waiting for its next event ends at once
    # (a watch or a command stream must not hold the guest's resources until it next sends).
    gone: asyncio.Event | None = None


current_target: ContextVar[Target] = ContextVar("pal_e2b_target")


def caller(ctx: RequestContext[Any, Any]) -> ops.Caller:
    """The caller of a Connect call: its sandbox, and the user of its Basic header."""
    target = current_target.get()
    try:
        user = basic_user(ctx.request_headers.get("authorization"))
    except PalError as exc:
        raise connect_error(exc) from None
    return ops.Caller(tenant=target.tenant, sandbox_id=target.sandbox_id, user=user)


def keepalive_interval(ctx: RequestContext[Any, Any]) -> float | None:
    """``Keepalive-Ping-Interval`` (seconds; the SDKs send 50), bounded; None: no pings."""
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return min(max(value, MIN_KEEPALIVE_S), MAX_KEEPALIVE_S)


async def unary(call: Callable[[], Any]) -> Any:
    """Run a unary operation, its PalError as the Connect error."""
    try:
        return await call()
    except PalError as exc:
        raise connect_error(exc) from None


_END = object()


async def stream(
    ctx: RequestContext[Any, Any],
    source: AsyncIterator[T],
    convert: Callable[[T], R],
    keepalive: Callable[[], R] | None,
) -> AsyncIterator[R]:
    """``source``'s events converted to messages, with a keepalive message whenever the
    client's interval passes without one, ending with ``deadline_exceeded`` when the
    call's deadline passes and with the Connect error of a failed operation."""
    interval = keepalive_interval(ctx) if keepalive is not None else None
    loop = asyncio.get_running_loop()
    remaining_ms = ctx.timeout_ms
    deadline = loop.time() + remaining_ms / 1000 if remaining_ms is not None else None
    slot: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)

    async def pump() -> None:
        try:
            async for event in source:
                await slot.put(event)
            await slot.put(_END)
        except BaseException as exc:  # handed to the reader, which raises it
            await slot.put(exc)

    task = asyncio.create_task(pump())
    gone = current_target.get().gone or asyncio.Event()
    gone_wait = asyncio.create_task(gone.wait())
    try:
        while True:
            wait = interval
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded")
                wait = left if wait is None else min(wait, left)
            getting = asyncio.create_task(slot.get())
            await asyncio.wait({getting, gone_wait}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not getting.done():
                getting.cancel()
                if gone.is_set():
                    raise ConnectError(Code.CANCELED, "the client went away")
                if keepalive is not None and (deadline is None or loop.time() < deadline):
                    yield keepalive()
                continue
            item = getting.result()
            if item is _END:
                return
            if isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    raise ConnectError(Code.CANCELED, "the call was cancelled")
                raise connect_error(item)
            yield convert(item)
    finally:
        gone_wait.cancel()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(BaseException):
            await aclose(source)


async def aclose(source: AsyncIterator[Any]) -> None:
    """Close an operation's iterator (an async generator's ``finally`` runs now, not at
    garbage collection)."""
    close = getattr(source, "aclose", None)
    if close is not None:
        await close()
