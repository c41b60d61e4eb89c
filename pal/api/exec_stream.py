"""Exec over HTTP: buffered JSON, or Server-Sent Events flushed as the guest produces output.

Guest error codes (pal.guest.protocol ERR_*) are mapped to API errors here:

| guest code | buffered answer | SSE |
|---|---|---|
| ENOENT | 400 EXECUTABLE_NOT_FOUND | `error` event, same code |
| EPERM | 400 NOT_EXECUTABLE | `error` |
| EESCAPE | 400 PATH_ESCAPE | `error` |
| EINVAL, ENOTDIR, EISDIR | 400 INVALID_ARGUMENT (bad cwd, argv...) | `error` |
| ETIMEDOUT | **200** `{exitCode: 124, timedOut: true}` + output so far | `exit`, same fields |
| EAUTH, EIO, anything else | 503 (the guest could not run it; never 500) | `error` |

A timeout is answered like `timeout(1)` does (exit status 124) rather than 408, because the
command did run and its partial output is what the caller needs to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from pal.errors import PalError
from pal.manager.models import ExecEvent

from .errors import error_response
from .models import ExecOut

TIMEOUT_EXIT_CODE = 124
# How long an SSE request waits for its first event before sending headers. Errors that
# come before it (404, 409, 402, missing executable) get their real HTTP status; after it
# they arrive as an `error` event on a 200 stream.
FIRST_EVENT_GRACE_S = 1.0
KEEPALIVE_S = 15.0

BUFFERED_OUTPUT_MAX = 8 * 1024 * 1024  # characters kept per stream in a buffered exec

_GUEST_ERRORS: dict[str, tuple[int, str]] = {
    "ENOENT": (400, "EXECUTABLE_NOT_FOUND"),
    "EPERM": (400, "NOT_EXECUTABLE"),
    "EESCAPE": (400, "PATH_ESCAPE"),
    "EINVAL": (400, "INVALID_ARGUMENT"),
    "ENOTDIR": (400, "INVALID_ARGUMENT"),
    "EISDIR": (400, "INVALID_ARGUMENT"),
    "ETOOBIG": (413, "PAYLOAD_TOO_LARGE"),
}


def guest_error(code: str | None, message: str | None) -> PalError:
    """The API error for an exec that ended with a guest `error` event."""
    status, api_code = _GUEST_ERRORS.get(code or "", (503, code or "GUEST_ERROR"))
    return PalError(message or f"guest error {code}", code=api_code, status=status)


def _is_timeout(ev: ExecEvent) -> bool:
    return ev.type == "error" and ev.code == "ETIMEDOUT"


class _Capped:
    """One output stream of a buffered exec, kept up to BUFFERED_OUTPUT_MAX characters: a
    command printing without end must not grow the server's memory without end (stream
    it with SSE to get everything)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.cut = False

    def add(self, data: str) -> None:
        room = BUFFERED_OUTPUT_MAX - self.size
        if len(data) > room:
            data, self.cut = data[: max(room, 0)], True
        self.parts.append(data)
        self.size += len(data)

    def text(self) -> str:
        return "".join(self.parts)


def _out(code: int, out: _Capped, err: _Capped, timed_out: bool | None = None) -> ExecOut:
    cut = (out.cut or err.cut) or None
    return ExecOut(exit_code=code, stdout=out.text(), stderr=err.text(), timed_out=timed_out, truncated=cut)


async def buffered_exec(events: AsyncIterator[ExecEvent]) -> ExecOut:
    stdout, stderr = _Capped(), _Capped()
    try:
        async for ev in events:
            if ev.type == "stdout":
                stdout.add(ev.data or "")
            elif ev.type == "stderr":
                stderr.add(ev.data or "")
            elif ev.type == "exit":
                return _out(ev.exit_code if ev.exit_code is not None else -1, stdout, stderr)
            elif _is_timeout(ev):
                return _out(TIMEOUT_EXIT_CODE, stdout, stderr, timed_out=True)
            else:
                raise guest_error(ev.code, ev.message)
    finally:
        await _aclose(events)
    raise PalError("exec stream ended without an exit status", code="GUEST_ERROR", status=503)


def sse_frame(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def event_frame(ev: ExecEvent) -> bytes:
    if ev.type in ("stdout", "stderr"):
        return sse_frame(ev.type, {"data": ev.data or ""})
    if ev.type == "exit":
        return sse_frame("exit", {"exitCode": ev.exit_code if ev.exit_code is not None else -1})
    if _is_timeout(ev):
        return sse_frame("exit", {"exitCode": TIMEOUT_EXIT_CODE, "timedOut": True})
    err = guest_error(ev.code, ev.message)
    return sse_frame("error", {"code": err.code, "message": err.message})


_DONE = object()


async def _aclose(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def sse_exec(
    open_events: Callable[[], AsyncIterator[ExecEvent]], grace_s: float = FIRST_EVENT_GRACE_S
) -> StreamingResponse | JSONResponse:
    """Stream exec events as SSE.

    One pump task drives the scheduler's iterator (so it lives in a single task) into a
    small queue; the response drains the queue. When the client goes away the response
    generator is cancelled, which cancels the pump, which closes the iterator and so
    cancels the command in the guest.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        events = open_events()
        try:
            async for ev in events:
                await queue.put(ev)
        except PalError as exc:
            await queue.put(exc)
        except Exception as exc:
            await queue.put(PalError(f"exec failed: {type(exc).__name__}: {exc}", status=503))
        finally:
            await _aclose(events)
            await queue.put(_DONE)

    task = asyncio.create_task(pump())
    first: Any = None
    try:
        first = await asyncio.wait_for(queue.get(), timeout=grace_s)
    except TimeoutError:
        first = None
    if isinstance(first, PalError):
        await _stop(task)
        return error_response(first.status, first.code, first.message)
    # A guest-side failure (e.g. executable not found) is part of the exec's outcome and
    # arrives as an `error` event; only control-plane refusals (404/409/402...) keep their
    # HTTP status, since for those no exec ever started.

    async def body() -> AsyncIterator[bytes]:
        try:
            item = first
            while True:
                if item is None:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                if item is _DONE:
                    msg = "exec ended without an exit status"
                    yield sse_frame("error", {"code": "GUEST_ERROR", "message": msg})
                    return
                if isinstance(item, PalError):
                    yield sse_frame("error", {"code": item.code, "message": item.message})
                    return
                yield event_frame(item)
                if item.type in ("exit", "error"):
                    return
                item = None
        finally:
            await _stop(task)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
