"""A process over a WebSocket, for people at terminals (docs/processes.md, "WebSocket attach").

``GET /v1/runtime/vms/{id}/processes/{pid}/attach?from=OFFSET`` upgraded to a WebSocket:

- server -> client: binary frames are the output bytes, exactly (stdout and stderr as the
  journal orders them; a terminal has one stream); text frames are JSON notices:
  ``attached {processId, from, pty}`` first, ``gap {lost, offset}``, then
  ``exit {exitCode, timedOut, offset}`` or ``detached {reason, offset}`` and a close
  (1000), or ``error {status, code, message}``. ``offset`` is the journal offset after
  the last byte sent: a client reattaches with ``?from=<offset>`` and loses nothing.
- client -> server: binary frames are stdin bytes (at most MAX_INPUT_FRAME each); text
  frames are JSON: ``resize {cols, rows}``, ``signal {signal}``, ``eof``.

A client's messages are taken one at a time, each carried to the guest before the next is
read, so a client that sends faster than the process reads is slowed by TCP (backpressure),
never buffered here. A frame over the bound closes the socket (1009).

Authorisation, as the ports': the API key (``Authorization: Bearer``), or a signed attach
link's ``?palToken=`` (``POST .../processes/{pid}/attach-url``: short-lived, bound to one
VM and process, ends with the key it was made with), which a browser can use since it
cannot set headers on a WebSocket. A link is taken only from its own origin (this server's
pages) or from a client that sends no ``Origin``; a socket it opened closes when it ends
(revoked, expired, its key rotated: port_links.py); a ``readOnly`` link opens the output
and refuses every input message (403, said on the socket). A follower replica forwards the
socket to the leader (pal/api/forward.py) like every other WebSocket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from pal.errors import Forbidden, InvalidRequest, PalError, Unauthorized
from pal.scheduler.wake import ResolvedVm
from pal.spec import SignalRequest, Terminal
from pal.wire import verbs
from pal.wire.processes import AttachFrom, ProcessEvent, ProcessRef, ProcessResize, ProcessSignal, StdinWrite
from pal.wire.tunnel import run_until_one_ends

from .body import decimal, json_value, require_json
from .deps import scheduler_of
from .errors import error_responses, public_error
from .exec_stream import FIRST_EVENT_GRACE_S, Pumped, StreamEnd, _stop, start_pump
from .port_links import Link, Links, OpenLinks, origin_ok
from .ports import TOKEN_PARAM, _get, _header_items, _query_without_token, _refuse, key_tenant, signing_key
from .processes import Pid
from .shapes import Shape as _Model

MAX_INPUT_FRAME = 64 * 1024  # one stdin frame from a client (a paste; the SDK splits more)
MAX_CONTROL_FRAME = 4096  # one JSON control message
ATTACH_LINK_MAX_SECS = 3600
ATTACH_LINK_DEFAULT_SECS = 300
ATTACH_PATH = "/v1/runtime/vms/{vm_id}/processes/{pid}/attach"


def attach_links(secret: bytes, store: Any, opened: OpenLinks | None = None) -> Links:
    """Signed attach links: port links' rules (expiry, key rotation, revocation by id),
    their own salt, a process id where a port link has a port."""
    return Links(secret, store, salt="pal-attach-link-v1", noun="process attach", opened=opened)


class AttachUrlRequest(_Model):
    expires_in_secs: int = Field(
        ATTACH_LINK_DEFAULT_SECS, ge=1, le=ATTACH_LINK_MAX_SECS, description="how long the link opens sockets"
    )
    read_only: bool = Field(
        False, description="true: the link opens the output only (no stdin, signals or resizes)"
    )


class AttachUrlOut(_Model):
    url: str = Field(description="the attach path with its token (open it as a WebSocket on this server)")
    expires_at: int = Field(description="unix seconds")
    link_id: str = Field(description="revokes the link: DELETE /v1/runtime/vms/{id}/port-links/{linkId}")


def attach_link(
    links: Links, tenant: str, key_hash: str, vm_id: str, pid: int, secs: int, *, read_only: bool = False
) -> AttachUrlOut:
    """A signed attach link (its path and query, relative to the server)."""
    link = links.sign(tenant, vm_id, pid, int(time.time()) + secs, key_hash, read_only=read_only)
    url = ATTACH_PATH.format(vm_id=vm_id, pid=pid) + f"?{TOKEN_PARAM}={links.token(link)}"
    return AttachUrlOut(url=url, expires_at=link.expires_at, link_id=link.link_id)


attach_router = APIRouter(prefix="/v1/runtime/vms/{vm_id}/processes", tags=["processes"])


@attach_router.post(
    "/{pid}/attach-url",
    response_model=AttachUrlOut,
    summary="A signed, short-lived link that opens the process's WebSocket attach without the API key",
    dependencies=[Depends(require_json)],
    responses=error_responses(400, 401, 404, 409, 415, 429, 503),  # as the processes routes
)
async def attach_url(vm_id: str, pid: Pid, body: AttachUrlRequest, request: Request) -> AttachUrlOut:
    state = request.app.state
    tenant, key_hash = await signing_key(request)
    # 404 for unknown VMs and processes
    await scheduler_of(state).guest.call(tenant, verbs.GET_PROCESS, ProcessRef(vm_id=vm_id, pid=pid))
    return attach_link(
        state.attach_links, tenant, key_hash, vm_id, pid, body.expires_in_secs, read_only=body.read_only
    )


async def _who(state: Any, scope: Any, vm_id: str, pid: int) -> tuple[str, Link | None]:
    """The tenant, and the link that opened the socket (None: the API key)."""
    headers = _header_items(scope)
    by_key = await key_tenant(state.store, headers)
    if by_key is not None:
        return by_key[0], None
    _, token = _query_without_token(scope.get("query_string") or b"")
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <apiKey>' or open a signed link "
            "(POST .../processes/{pid}/attach-url)"
        )
    cors = tuple(getattr(state.settings, "cors_origins", ()) or ())
    if not origin_ok(_get(headers, b"origin"), _get(headers, b"host"), lambda o: o.rstrip("/") in cors):
        raise Forbidden(
            "an attach link opens only from this server's own pages (or a client that sends no Origin)"
        )
    link = await state.attach_links.check(token, vm_id, pid)
    return link.tenant_id, link


def _offset(ws: WebSocket) -> int:
    offset = decimal(ws.query_params.get("from", "0"))
    if offset is None or offset > 2**62:
        raise InvalidRequest("from must be an output offset (a non-negative integer)")
    return offset


@attach_router.websocket("/{pid}/attach")
async def attach(ws: WebSocket, vm_id: str, pid: int) -> None:
    state = ws.app.state
    scheduler = scheduler_of(state)
    guest = scheduler.guest
    try:
        if not 1 <= pid <= 2**53:
            raise InvalidRequest("the process id is out of range")
        tenant, link = await _who(state, ws.scope, vm_id, pid)
        offset = _offset(ws)
        # Asked first, however slow the guest: an unknown VM or process, or a VM paused by
        # an operator, is the handshake's answer (404, 409), never a socket that then fails.
        proc = await guest.call(tenant, verbs.GET_PROCESS, ProcessRef(vm_id=vm_id, pid=pid))
        if offset > proc.journal.end:
            raise InvalidRequest(f"from={offset} is past the output's end ({proc.journal.end})")
    except PalError as exc:
        await _refuse(ws, exc)
        return
    at = AttachFrom(vm_id=vm_id, pid=pid, start=offset)
    queue, task = start_pump(lambda: guest.attach(tenant, at), "attach")
    try:
        first: Pumped[ProcessEvent] | None = await asyncio.wait_for(queue.get(), timeout=FIRST_EVENT_GRACE_S)
    except TimeoutError:
        first = None
    if isinstance(first, PalError):  # before any output: the handshake's status (404, 409, 400)
        await _stop(task)
        await _refuse(ws, first)
        return
    try:
        await ws.accept()
        pty = proc.pty.model_dump() if proc.pty is not None else None
        hello = {"type": "attached", "processId": pid, "from": offset, "pty": pty}
        await ws.send_text(json.dumps(hello))
        # The client's input goes straight to the VM's node, resolved once for the session
        # (not a wake and two store writes per frame); a live pause meanwhile wakes it.
        async with scheduler.waker.resolve(tenant, vm_id) as vm:
            session = _Session(ws, vm, pid, offset, read_only=link is not None and link.read_only)
            await state.attach_links.while_valid(link, session.run(queue, first), session.link_ended)
    except PalError as exc:  # the VM went away between the handshake and the session
        with contextlib.suppress(Exception):
            await ws.send_text(
                json.dumps(
                    {"type": "error", "status": exc.status, **public_error(exc.status, exc.code, exc.message)}
                )
            )
            await ws.close(1011)
    finally:
        await _stop(task)


class _Session:
    """One attached client: output to it, its input to the process."""

    def __init__(self, ws: WebSocket, vm: ResolvedVm, pid: int, offset: int, *, read_only: bool) -> None:
        self.ws, self.vm, self.pid = ws, vm, pid
        self.offset = offset
        self.read_only = read_only

    async def link_ended(self, why: str) -> None:
        """The link that opened this socket ended (revoked, expired, key rotated)."""
        with contextlib.suppress(Exception):
            await self._error(401, "UNAUTHENTICATED", why)
            await self.ws.close(1008, why[:120])

    async def run(
        self, queue: asyncio.Queue[Pumped[ProcessEvent]], first: Pumped[ProcessEvent] | None
    ) -> None:
        await run_until_one_ends(self._output(queue, first), self._input())

    async def _notice(self, kind: str, **fields: Any) -> None:
        await self.ws.send_text(json.dumps({"type": kind, **fields}))

    async def _error(self, status: int, code: str, message: str) -> None:
        await self._notice("error", status=status, **public_error(status, code, message))

    async def _output(
        self, queue: asyncio.Queue[Pumped[ProcessEvent]], first: Pumped[ProcessEvent] | None
    ) -> None:
        item = first
        while True:
            if item is None:
                item = await queue.get()
            if isinstance(item, StreamEnd):  # ended without an exit: never make one up
                await self._end("detached", reason="stream-ended")
                return
            if isinstance(item, PalError):
                await self._error(item.status, item.code, item.message)
                await self.ws.close(1011)
                return
            if await self._event(item):
                return
            item = None

    async def _event(self, ev: ProcessEvent) -> bool:
        """Send one event; True when it ended the stream."""
        if ev.type == "output":
            data = base64.b64decode(ev.data or "")
            if data:
                await self.ws.send_bytes(data)
            self.offset = ev.offset if ev.offset is not None else self.offset + len(data)
            return False
        if ev.type == "gap":
            self.offset = ev.offset if ev.offset is not None else self.offset
            await self._notice("gap", lost=ev.lost or 0, offset=self.offset)
            return False
        if ev.type == "exit":
            await self._end("exit", exitCode=ev.exit_code, timedOut=bool(ev.timed_out))
            return True
        if ev.type == "detached":
            await self._end("detached", reason=ev.reason or "detached")
            return True
        await self._error(ev.status or 503, ev.code or "GUEST_ERROR", ev.message or "")
        await self.ws.close(1011)
        return True

    async def _end(self, kind: str, **fields: Any) -> None:
        await self._notice(kind, **fields, offset=self.offset)
        await self.ws.close(1000)

    async def _input(self) -> None:
        while True:
            try:
                msg = await self.ws.receive()
            except WebSocketDisconnect:
                return
            if msg["type"] == "websocket.disconnect":
                return
            data, text = msg.get("bytes"), msg.get("text")
            limit = MAX_INPUT_FRAME if data is not None else MAX_CONTROL_FRAME
            if len(data if data is not None else text or "") > limit:
                await self.ws.close(1009, f"a message may be at most {limit} bytes")
                return
            try:
                if self.read_only:
                    raise Forbidden(
                        "this attach link is read-only: it opens the output, not stdin or signals"
                    )
                if data is not None:
                    await self._stdin(data, eof=False)
                elif text is not None:
                    await self._control(text)
            except PalError as exc:  # the process exited, has no stdin... : said, not fatal
                await self._error(exc.status, exc.code, exc.message)

    async def _stdin(self, data: bytes, eof: bool) -> None:
        while True:
            req = StdinWrite(vm_id=self.vm.vm_id, pid=self.pid, data=data, eof=eof)
            res = await self.vm.call(verbs.WRITE_STDIN, req)
            data = data[res.written :]
            if not data:
                return

    async def _control(self, text: str) -> None:
        try:
            msg = json_value(text, "a text message")
            kind = msg.get("type") if isinstance(msg, dict) else None
        except InvalidRequest:
            kind = None
        try:
            if kind == "resize":
                size = Terminal.model_validate({"cols": msg.get("cols"), "rows": msg.get("rows")})
                resize = ProcessResize(vm_id=self.vm.vm_id, pid=self.pid, cols=size.cols, rows=size.rows)
                await self.vm.call(verbs.RESIZE_PROCESS, resize)
            elif kind == "signal":
                req = SignalRequest.model_validate({"signal": msg.get("signal")})
                sent = ProcessSignal(vm_id=self.vm.vm_id, pid=self.pid, signal=req.signal)
                await self.vm.call(verbs.SIGNAL_PROCESS, sent)
            elif kind == "eof":
                await self._stdin(b"", eof=True)
            else:
                raise InvalidRequest(
                    'a text message is JSON: {"type": "resize", "cols": C, "rows": R}, '
                    '{"type": "signal", "signal": "INT"} or {"type": "eof"}'
                )
        except ValidationError as exc:
            raise InvalidRequest(f"bad {kind} message: {exc.errors()[0].get('msg')}") from None
