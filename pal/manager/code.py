"""Code contexts on the node (issue 26; docs/agents.md "Code interpreter"): the calls on
the harness's kernels (pal/guest/kernels.py), under the rules of exec and processes
(exec_files.py, processes.py):

- the VM must be running (409, or 409 LIVE_PAUSED, which the scheduler turns into a wake),
  the request enters the channel under the VM's ``op_lock``;
- a running cell counts as an exec in flight (``active_execs``): the VM stays awake;
- whatever the guest sends is hostile: each event is checked and the cell's totals are
  bounded here again (the guest's own bounds, protocol.py), so a guest cannot make the
  API hold more than MAX_CELL_STREAM_CHARS of text and MAX_CELL_RESULT_BYTES of results.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from pal.errors import PalError, Unavailable
from pal.guest import protocol as p
from pal.manager import guest_input as gi
from pal.manager.channel import GuestError
from pal.manager.vm import VmRegistry
from pal.wire.code import (
    CONTEXT_ID_PATTERN,
    DEFAULT_TIMEOUT_SECS,
    CodeContext,
    CodeError,
    CodeEvent,
    CodeRequest,
    CodeRun,
    ContextCreate,
)
from pal.wire.guest_errors import to_pal_error

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 240.0  # a context start may import ipykernel under TCG (guest: 180 s)
NO_KERNEL_HINT = (
    "; run Python cells in a VM of the code-interpreter image "
    "(`pal image build code-interpreter --warm`, then schedule with image code-interpreter)"
)
_ID = re.compile(CONTEXT_ID_PATTERN)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # IPython colours its tracebacks


def _plain(value: object, limit: int) -> str:
    """Guest text for a JSON answer: a string, valid Unicode, at most ``limit`` characters
    (newlines and tabs kept: it is output, not a log line)."""
    if not isinstance(value, str):
        return ""
    return value[:limit].encode("utf-8", "replace").decode("utf-8")


def _error(exc: GuestError) -> PalError:
    msg = exc.message + (NO_KERNEL_HINT if exc.guest_code == p.ERR_NOKERNEL else "")
    return to_pal_error(exc.guest_code, msg, "code")


def context(raw: object) -> CodeContext:
    if not isinstance(raw, dict):
        raise gi.BadReply("context is not an object")
    cid, lang = raw.get("id"), raw.get("language")
    if not isinstance(cid, str) or not _ID.match(cid) or lang not in ("python", "bash"):
        raise gi.BadReply("context has no valid id or language")
    return CodeContext(
        context_id=cid,
        language=lang,
        cwd=gi.text(raw.get("cwd"), 4096),
        created_ms=gi.integer(raw.get("created_ms"), 0, gi.MAX_JSON_INT) or 0,
        executions=gi.integer(raw.get("executions"), 0, gi.MAX_JSON_INT) or 0,
        running=raw.get("running") is True,
    )


class CellBound:
    """The host's bound on one cell's events: the guest's (pal/guest/kernels.py), counted
    the same way and checked again. Stream text and error events share
    MAX_CELL_STREAM_CHARS (+ the notes' reserve), each event with its overhead
    (protocol.cell_event_chars); results MAX_CELL_RESULTS and MAX_CELL_RESULT_BYTES; an
    ``application/json`` result must parse within MAX_RESULT_JSON_DEPTH. Past a bound an
    event is dropped (a guest that honours the bound never gets there)."""

    TEXT_LIMIT = p.MAX_CELL_STREAM_CHARS + p.CELL_NOTE_RESERVE

    def __init__(self) -> None:
        self.chars = self.result_bytes = self.results = 0
        self.dropped = 0

    def _fits(self, cost: int) -> bool:
        if self.chars + cost > self.TEXT_LIMIT:
            self.dropped += 1
            return False
        self.chars += cost
        return True

    def event(self, ev: dict[str, Any]) -> CodeEvent | None:
        t = ev.get("t")
        if t == "stream" and ev.get("name") in ("stdout", "stderr") and isinstance(ev.get("text"), str):
            text = _plain(ev["text"], p.STREAM_EVENT_CHARS)
            if not text or not self._fits(p.cell_event_chars(text)):
                return None
            return CodeEvent(type=ev["name"], text=text)
        if t == "result" and isinstance(ev.get("mime"), dict):
            return self._result(ev["mime"], ev.get("main") is True)
        if t == "error":
            raw = ev.get("traceback")
            lines = raw[:200] if isinstance(raw, list) else []
            tb = [_ANSI.sub("", _plain(x, 10_000)) for x in lines]
            name, value = _plain(ev.get("name"), 200), _plain(ev.get("value"), 10_000)
            if not self._fits(p.cell_event_chars(name, value, *tb)):
                return None
            return CodeEvent(type="error", error=CodeError(name=name, value=value, traceback=tb))
        return None

    def _result(self, raw: dict[str, Any], main: bool) -> CodeEvent | None:
        data: dict[str, Any] = {}
        size = 0
        for mime in p.CODE_MIMES:
            value = raw.get(mime)
            if isinstance(value, str):
                size += len(value)
                data[mime] = value
        self.results += 1
        self.result_bytes += size
        if not data or self.results > p.MAX_CELL_RESULTS or self.result_bytes > p.MAX_CELL_RESULT_BYTES:
            self.dropped += 1
            return None
        if "application/json" in data:
            parsed = gi.nested_json(data["application/json"], p.MAX_RESULT_JSON_DEPTH)
            if parsed is None:
                del data["application/json"]  # not JSON, or nested too deep to carry
                if not data:
                    return None
            else:
                data["application/json"] = parsed
        return CodeEvent(type="result", data=data, is_main_result=main)


SLOW_READER_CODE = "SLOW_READER"


def _detached(reply: p.Message) -> bool:
    res = reply.get("result")
    return isinstance(res, dict) and res.get("detached") is True


def _end(res: object) -> CodeEvent:
    if not isinstance(res, dict):
        raise gi.BadReply("crun ended without a result")
    cid = res.get("context_id")
    if not isinstance(cid, str) or not _ID.match(cid):
        raise gi.BadReply("crun ended without a valid context id")
    return CodeEvent(
        type="end",
        context_id=cid,
        execution_count=gi.integer(res.get("execution_count"), 0, gi.MAX_JSON_INT),
        timed_out=res.get("timed_out") is True,
    )


class GuestCode:
    def __init__(self, registry: VmRegistry) -> None:
        self.registry = registry

    async def run(self, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        """A cell's events, ending with ``end``; a guest error is raised before any event."""
        lv = self.registry.running(vm_id)
        msg: p.Message = {
            "k": p.K_CRUN,
            "tok": lv.token,
            "ctx": req.context_id,
            "language": req.language,
            "code": req.code,
            "timeout": req.timeout_secs or DEFAULT_TIMEOUT_SECS,
        }
        if isinstance(req, CodeRun) and req.env:
            msg["env"] = req.env
        bound = CellBound()
        # A reader that stops taking the cell's events interrupts it (channel.py).
        async with lv.exec_in_flight(msg, on_slow=p.K_CANCEL) as replies:
            async for reply in replies:
                kind = reply["k"]
                if kind == p.K_CEV:
                    ev = bound.event(reply)
                    if ev is not None:
                        yield ev
                elif kind == p.K_ERR:
                    code, message = gi.error(reply)
                    raise _error(GuestError(code, message))
                elif kind == p.K_OK and _detached(reply):
                    raise Unavailable(
                        f"VM {vm_id}: the cell's reader took none of its events for too long: the cell"
                        " was interrupted (read a streamed cell as it comes)",
                        code=SLOW_READER_CODE,
                    )
                elif kind == p.K_OK:
                    try:
                        yield _end(reply.get("result"))
                    except gi.BadReply as exc:
                        raise _bad_reply(vm_id, exc) from None
                    return

    async def _call(self, vm_id: str, msg: p.Message) -> dict[str, Any]:
        try:
            reply, _ = await self.registry.running(vm_id).request_in_flight(msg, timeout=REQUEST_TIMEOUT_S)
        except GuestError as exc:
            raise _error(exc) from None
        res = reply.get("result")
        if not isinstance(res, dict):
            raise _bad_reply(vm_id, gi.BadReply(f"{msg['k']} reply has no result"))
        return res

    async def create_context(self, vm_id: str, req: ContextCreate) -> CodeContext:
        msg = {"k": p.K_CNEW, "language": req.language, "cwd": req.cwd, "env": req.env}
        res = await self._call(vm_id, msg)
        try:
            return context(res.get("context"))
        except gi.BadReply as exc:
            raise _bad_reply(vm_id, exc) from None

    async def list_contexts(self, vm_id: str) -> list[CodeContext]:
        res = await self._call(vm_id, {"k": p.K_CLIST})
        raw = res.get("contexts")
        try:
            if not isinstance(raw, list) or len(raw) > p.MAX_CODE_CONTEXTS * 2:
                raise gi.BadReply("clist reply has no valid list")
            return [context(x) for x in raw]
        except gi.BadReply as exc:
            raise _bad_reply(vm_id, exc) from None

    async def delete_context(self, vm_id: str, ctx: str) -> None:
        await self._call(vm_id, {"k": p.K_CDELETE, "ctx": ctx})

    async def restart_context(self, vm_id: str, ctx: str) -> None:
        await self._call(vm_id, {"k": p.K_CRESTART, "ctx": ctx})

    async def interrupt_context(self, vm_id: str, ctx: str) -> bool:
        res = await self._call(vm_id, {"k": p.K_CINTERRUPT, "ctx": ctx})
        return res.get("interrupted") is True


def _bad_reply(vm_id: str, exc: Exception) -> PalError:
    log.warning("VM %s: invalid code reply from the guest: %s", vm_id, gi.text(str(exc)))
    return Unavailable(f"VM {vm_id}: the guest sent an invalid reply to a code request", code="GUEST_ERROR")
