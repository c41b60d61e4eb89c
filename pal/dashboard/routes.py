"""The dashboard under /runtime: server-rendered pages (Jinja2) with htmx fragments.

Every action calls the same Scheduler methods the REST API calls, in this process (no
second code path, no HTTP to itself); errors are the same PalErrors, shown in words with
their status. Pages need a session (session.py); state-changing requests need its CSRF
token. Nothing here runs a command or touches a file unless the signed-in tenant asked for
it: in particular, opening a VM's page does not wake an idle-suspended VM (the file browser
and the console act only on a click).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError

from pal.api.auth import tenant_for_key
from pal.errors import InvalidRequest
from pal.spec import AgentSpec
from pal.store.store import hash_api_key

from .context import CSRF_FIELD, STATES, Dash, safe_next

router = APIRouter(prefix="/runtime", include_in_schema=False)


def _filtered(vms: list[Any], state: str, q: str) -> list[Any]:
    if state == "active":
        vms = [v for v in vms if str(v.state) != "terminated"]
    elif state in STATES:
        vms = [v for v in vms if str(v.state) == state]
    q = q.strip().lower()
    if q:
        vms = [
            v
            for v in vms
            if q in v.vm_id.lower() or q in v.image.lower() or q in (v.parent_vm_id or "").lower()
        ]
    return sorted(vms, key=lambda v: v.created_at, reverse=True)


# -- sign in / out -----------------------------------------------------------------------


@router.get("/login")
async def login_page(request: Request, dash: Dash, next: str = "/runtime") -> Response:
    if dash.sessions.read(request) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return dash.login_page_with(request, next)


@router.post("/login")
async def login(request: Request, dash: Dash) -> Response:
    form = await dash.form_of(request)
    next_url = safe_next(str(form.get("next") or "/runtime"))
    if not dash.sessions.check_login_token(request, str(form.get(CSRF_FIELD) or "")):
        return dash.login_page_with(request, next_url, 403, "The sign-in form expired; try again.")
    key = str(form.get("api_key") or "").strip()
    tenant = await tenant_for_key(dash.store, key) if key else None
    if tenant is None:
        return dash.login_page_with(request, next_url, 401, "That API key is not valid.")
    resp = RedirectResponse(next_url, status_code=303)
    dash.sessions.start(resp, request, str(tenant.id), str(tenant.name), hash_api_key(key))
    return resp


@router.post("/logout")
async def logout(request: Request, dash: Dash) -> Response:
    await dash.mutating(request, "page")
    resp = RedirectResponse("/runtime/login", status_code=303)
    dash.sessions.end(resp)
    return resp


# -- the list ------------------------------------------------------------------------------


@router.get("")
async def list_page(request: Request, dash: Dash, state: str = "active", q: str = "") -> Response:
    s = await dash.session_for(request, "page")
    vms = _filtered(await dash.scheduler.reads.list_vms(s.tenant_id), state, q)
    return dash.render(request, "list.html", vms=vms, state=state, q=q)


@router.get("/_rows")
async def list_rows(request: Request, dash: Dash, state: str = "active", q: str = "") -> Response:
    s = await dash.session_for(request, "fragment")
    vms = _filtered(await dash.scheduler.reads.list_vms(s.tenant_id), state, q)
    return dash.render(request, "_rows.html", vms=vms)


@router.post("/schedule")
async def schedule(request: Request, dash: Dash) -> Response:
    s, form = await dash.mutating(request)

    async def act() -> str:
        try:
            # A field left empty takes the AgentSpec's default.
            limits = {k: int(form[k]) for k in ("vcpus", "memoryMib") if form.get(k)}
            body: dict[str, Any] = {"limits": limits}
            if form.get("idleTimeoutSecs"):
                body["idleTimeoutSecs"] = int(form["idleTimeoutSecs"])
            spec = AgentSpec.model_validate(body)
        except (ValueError, ValidationError) as exc:
            raise InvalidRequest(f"check the numbers: {exc}") from None
        vm, how = await dash.scheduler.scheduling.schedule(s.tenant_id, spec)
        return f"Scheduled {vm.vm_id} ({vm.state}, {how} boot)."

    return await dash.attempt(request, act, trigger="vmsChanged")
