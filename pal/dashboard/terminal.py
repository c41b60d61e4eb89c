"""The VM page's terminal (templates/_terminal.html, static/terminal.js): a shell on a
terminal in the VM, shown by xterm.js and attached over the processes' WebSocket attach.

``POST /runtime/{vm}/terminal`` (a session and its CSRF token, like every action) answers
``{processId, url}``: the shell this dashboard left running in the VM, or a new one, and a
short-lived signed attach link for it (pal/api/process_attach.py), since a browser cannot
put the API key on a WebSocket and the session cookie never leaves /runtime. With
``{processId}`` it is a new link for that process (a reattach after a pause).

The page's CSP admits ``<style>`` elements only with the response's nonce: xterm.js writes
its layout into such elements, and terminal.js stamps the nonce on them.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pal.api.body import json_value
from pal.api.process_attach import attach_link
from pal.errors import InvalidRequest, PalError
from pal.scheduler.guest import GuestCalls
from pal.spec import Terminal
from pal.wire import verbs
from pal.wire.models import VmRef
from pal.wire.processes import ProcessRef, ProcessStart

from .session import Session

TAG = "dashboard terminal"
LINK_SECS = 60  # the page opens the socket at once; a reattach asks for a new link
SHELLS = (("/bin/bash", ["-l"]), ("/bin/sh", ["-l"]))  # the first the image has


def with_style_nonce(headers: dict[str, str], nonce: str) -> dict[str, str]:
    """The page's headers with ``nonce`` admitted for ``<style>`` elements."""
    csp = headers["Content-Security-Policy"].replace("style-src 'self'", f"style-src 'self' 'nonce-{nonce}'")
    return {**headers, "Content-Security-Policy": csp}


async def _shell(guest: GuestCalls, tenant: str, vm_id: str, size: Terminal) -> int:
    """The running shell this dashboard started in the VM, else a new one."""
    for proc in reversed((await guest.call(tenant, verbs.LIST_PROCESSES, VmRef(vm_id=vm_id))).processes):
        if proc.running and proc.tag == TAG and proc.pty is not None:
            return int(proc.process_id)
    for i, (exe, args) in enumerate(SHELLS):
        req = ProcessStart.model_validate(
            {"vm_id": vm_id, "command": exe, "argv": args, "pty": size, "tag": TAG}
        )
        try:
            return int((await guest.call(tenant, verbs.START_PROCESS, req)).process_id)
        except PalError as exc:
            if exc.code != "EXECUTABLE_NOT_FOUND" or i == len(SHELLS) - 1:
                raise
    raise AssertionError("unreachable")


async def open_terminal(request: Request, guest: GuestCalls, session: Session, vm_id: str) -> JSONResponse:
    try:
        body = json_value(await request.body() or b"{}")
        if not isinstance(body, dict):
            raise ValueError
        pid = body.get("processId")
        size = None if pid is not None else Terminal(cols=body.get("cols", 80), rows=body.get("rows", 24))
    except (ValueError, ValidationError, InvalidRequest):
        raise InvalidRequest('send {"cols": C, "rows": R} or {"processId": N}') from None
    tenant = session.tenant_id
    if size is not None:
        pid = await _shell(guest, tenant, vm_id, size)
    elif not isinstance(pid, int) or isinstance(pid, bool):
        raise InvalidRequest("processId must be a number")
    else:
        await guest.call(tenant, verbs.GET_PROCESS, ProcessRef(vm_id=vm_id, pid=pid))  # 404 for unknown ones
    link = attach_link(request.app.state.attach_links, tenant, session.key_hash, vm_id, pid, LINK_SECS)
    return JSONResponse({"processId": pid, "url": link.url}, headers={"Cache-Control": "no-store"})
