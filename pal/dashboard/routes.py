"""The dashboard under /runtime: server-rendered pages (Jinja2) with htmx fragments.

Every action calls the same Scheduler methods the REST API calls, in this process (no
second code path, no HTTP to itself); errors are the same PalErrors, shown in words with
their status. Pages need a session (session.py); state-changing requests need its CSRF
token. Nothing here runs a command or touches a file unless the signed-in tenant asked for
it: in particular, opening a VM's page does not wake an idle-suspended VM (the file browser
and the console act only on a click).
"""

from __future__ import annotations

import html
import json
import posixpath
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from pal import sizes
from pal.api.auth import tenant_for_key, tenant_for_key_hash
from pal.api.body import MAX_FILE_BYTES, MAX_FILE_WORDS
from pal.api.exec_stream import sse_exec
from pal.api.paths import check_workspace_path
from pal.api.ports import port_link
from pal.config import Settings
from pal.errors import InvalidRequest, PalError, TooLarge
from pal.scheduler import states
from pal.scheduler.states import Action, VmState
from pal.spec import AgentSpec, ExecRequest
from pal.store.store import hash_api_key

from .code_panel import add_code_routes
from .session import CSRF_FIELD, CSRF_HEADER, Session, Sessions, csrf_ok, load_secret

TEMPLATES = Path(__file__).parent / "templates"
MAX_FORM_BYTES = MAX_FILE_BYTES + 64 * 1024  # one uploaded file plus the form's other fields
PORT_LINK_SECS = 3600  # a port link made on a VM's page works this long (as `pal vm port-url`)
STATES = tuple(s.value for s in VmState)
# Words for the statuses a person meets on this page.
STATUS_WORDS = {
    400: "Invalid request",
    401: "Not signed in",
    402: "Quota exhausted",
    403: "Not allowed",
    404: "Not found",
    409: "Not possible in this state",
    413: "Too large",
    500: "Server error",
    503: "Unavailable",
}


# Scripts and styles only from this server (the vendored libraries included): no inline
# script can run even if some text slipped through escaping. uPlot sizes its canvas through
# element.style, which CSP allows.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class Refused(Exception):
    """A dashboard request refused before any action (CSRF, form too large): answered with
    the error in words and its status, as a fragment (see install)."""

    def __init__(self, error: PalError) -> None:
        super().__init__(error.message)
        self.error = error


class SignInRequired(Exception):
    """Raised by routes that need a session; answered by a redirect (see install)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "page" | "fragment" | "json"


def _age(then: datetime) -> str:
    secs = max(0, int((datetime.now(UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _egress(policy: Any) -> str:
    """The egress policy in a few words: none, open, or the allow/deny lists."""
    if isinstance(policy, str):
        return policy
    if isinstance(policy, dict):
        parts = [f"{k} {', '.join(map(str, v))}" for k, v in policy.items() if isinstance(v, list) and v]
        return "; ".join(parts) or json.dumps(policy)
    return str(policy)


def _buttons(vm: Any) -> dict[str, bool]:
    """Which of a VM's buttons its state allows: the scheduler's transition table decides
    (states.py), so a button is enabled exactly when its action would not be a 409."""
    st, marker = VmState(vm.state), vm.marker
    return {
        "pause": states.allowed(st, Action.PAUSE, marker),
        "resume": states.allowed(st, Action.RESUME, marker) or states.allowed(st, Action.LIVE_RESUME, marker),
        "delete": states.allowed(st, Action.DELETE, marker),
    }


def _error_words(exc: PalError) -> tuple[int, str]:
    words = STATUS_WORDS.get(exc.status, "Error")
    return exc.status, f"{words} ({exc.status}): {exc.message}"


def dashboard_router(
    scheduler: Any, store: Any, settings: Settings, secret: bytes | None = None
) -> APIRouter:
    r = APIRouter(prefix="/runtime", include_in_schema=False)
    sessions = Sessions(secret if secret is not None else load_secret(settings))
    templates = Jinja2Templates(directory=str(TEMPLATES))
    templates.env.filters["age"] = _age
    templates.env.filters["bytes"] = _bytes
    templates.env.filters["egress"] = _egress
    templates.env.globals["states"] = STATES
    templates.env.globals["sizes"] = sizes
    templates.env.globals["max_file"] = MAX_FILE_WORDS
    templates.env.globals["max_fork"] = settings.max_fork_count

    async def session_for(request: Request, kind: str) -> Session:
        """The request's session, if its API key still opens its tenant (a key rotated past
        its grace, expired or removed ends every session opened with it)."""
        s = sessions.read(request)
        if s is None or not s.key_hash:
            raise SignInRequired(kind)
        tenant = await tenant_for_key_hash(store, s.key_hash)
        if tenant is None or str(tenant.id) != s.tenant_id:
            raise SignInRequired(kind)
        return s

    async def form_of(request: Request) -> dict[str, Any]:
        if not request.headers.get("content-type", "").startswith(("multipart/", "application/x-www-form")):
            return {}
        # Refused before parsing: the multipart parser would spool a large file to disk first.
        try:
            length = int(request.headers.get("content-length", ""))
        except ValueError:
            no_length = PalError("send forms with a Content-Length", status=411, code="LENGTH_REQUIRED")
            raise Refused(no_length) from None
        if length > MAX_FORM_BYTES:
            raise Refused(TooLarge(f"the form is {length} bytes; an upload may be at most {MAX_FILE_WORDS}"))
        return dict(await request.form(max_files=1, max_fields=10))

    async def mutating(request: Request, kind: str = "fragment") -> tuple[Session, dict[str, Any]]:
        """The session of a state-changing request whose CSRF token checks out."""
        s = await session_for(request, kind)
        form = await form_of(request)
        given = request.headers.get(CSRF_HEADER) or form.get(CSRF_FIELD)
        if not csrf_ok(s, given if isinstance(given, str) else None):
            forged = "the form is stale or forged (CSRF token); reload the page"
            raise Refused(PalError(forged, status=403, code="CSRF"))
        return s, form

    def render(request: Request, name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        s = sessions.read(request)
        ctx.setdefault("session", s)
        return templates.TemplateResponse(request, name, ctx, status_code=status, headers=PAGE_HEADERS)

    def message(
        request: Request, text: str, status: int = 200, *, trigger: str | None = None
    ) -> HTMLResponse:
        resp = render(request, "_message.html", status=status, text=text, ok=status < 400)
        if trigger:
            resp.headers["HX-Trigger"] = trigger
        return resp

    async def attempt(
        request: Request, action: Callable[[], Awaitable[str]], trigger: str | None = None
    ) -> HTMLResponse:
        """Run an action; its PalError becomes words with the status (402, 409...)."""
        try:
            text = await action()
        except PalError as exc:
            status, words = _error_words(exc)
            return message(request, words, status, trigger=trigger)
        return message(request, text, trigger=trigger)

    # -- sign in / out -----------------------------------------------------------------------

    def login_page_with(
        request: Request, next_url: str, status: int = 200, error: str | None = None
    ) -> Response:
        probe = Response()  # collects the sign-in form's CSRF cookie
        token = sessions.login_token(request, probe)
        page = render(
            request, "login.html", status=status, csrf=token, next=_safe_next(next_url), error=error
        )
        for key, value in probe.headers.items():
            if key.lower() == "set-cookie":
                page.headers.append("set-cookie", value)
        return page

    @r.get("/login")
    async def login_page(request: Request, next: str = "/runtime") -> Response:
        if sessions.read(request) is not None:
            return RedirectResponse(_safe_next(next), status_code=303)
        return login_page_with(request, next)

    @r.post("/login")
    async def login(request: Request) -> Response:
        form = await form_of(request)
        next_url = _safe_next(str(form.get("next") or "/runtime"))
        if not sessions.check_login_token(request, str(form.get(CSRF_FIELD) or "")):
            return login_page_with(request, next_url, 403, "The sign-in form expired; try again.")
        key = str(form.get("api_key") or "").strip()
        tenant = await tenant_for_key(store, key) if key else None
        if tenant is None:
            return login_page_with(request, next_url, 401, "That API key is not valid.")
        resp = RedirectResponse(next_url, status_code=303)
        sessions.start(resp, request, str(tenant.id), str(tenant.name), hash_api_key(key))
        return resp

    @r.post("/logout")
    async def logout(request: Request) -> Response:
        await mutating(request, "page")
        resp = RedirectResponse("/runtime/login", status_code=303)
        sessions.end(resp)
        return resp

    # -- the list ------------------------------------------------------------------------------

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

    @r.get("")
    async def list_page(request: Request, state: str = "active", q: str = "") -> Response:
        s = await session_for(request, "page")
        vms = _filtered(await scheduler.list(s.tenant_id), state, q)
        return render(request, "list.html", vms=vms, state=state, q=q)

    @r.get("/_rows")
    async def list_rows(request: Request, state: str = "active", q: str = "") -> Response:
        s = await session_for(request, "fragment")
        vms = _filtered(await scheduler.list(s.tenant_id), state, q)
        return render(request, "_rows.html", vms=vms)

    @r.post("/schedule")
    async def schedule(request: Request) -> Response:
        s, form = await mutating(request)

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
            vm, how = await scheduler.schedule(s.tenant_id, spec)
            return f"Scheduled {vm.vm_id} ({vm.state}, {how} boot)."

        return await attempt(request, act, trigger="vmsChanged")

    # -- one VM --------------------------------------------------------------------------------

    @r.get("/{vm_id}")
    async def detail_page(request: Request, vm_id: str) -> Response:
        s = await session_for(request, "page")
        try:
            vm = await scheduler.get(s.tenant_id, vm_id)
        except PalError as exc:
            status, words = _error_words(exc)
            return render(request, "error.html", status=status, text=words)
        network = await scheduler.network(vm)
        return render(request, "detail.html", vm=vm, network=network, buttons=_buttons(vm))

    @r.get("/{vm_id}/_state")
    async def state_fragment(request: Request, vm_id: str) -> Response:
        s = await session_for(request, "fragment")
        vm = await scheduler.get(s.tenant_id, vm_id)
        children = [v for v in await scheduler.list(s.tenant_id) if v.parent_vm_id == vm_id]
        network = await scheduler.network(vm)
        return render(request, "_state.html", vm=vm, children=children, network=network, buttons=_buttons(vm))

    @r.get("/{vm_id}/_timeline")
    async def timeline(request: Request, vm_id: str) -> Response:
        s = await session_for(request, "fragment")
        events = await scheduler.events(s.tenant_id, vm_id)
        return render(request, "_timeline.html", events=list(reversed(events)))

    @r.get("/{vm_id}/_snapshots")
    async def snapshots(request: Request, vm_id: str) -> Response:
        s = await session_for(request, "fragment")
        try:
            snaps = await scheduler.snapshots(s.tenant_id, vm_id)
        except PalError as exc:
            return message(request, _error_words(exc)[1], 200)
        return render(request, "_snapshots.html", snapshots=list(reversed(snaps)))

    @r.get("/{vm_id}/metrics.json")
    async def metrics(request: Request, vm_id: str) -> Response:
        s = await session_for(request, "json")
        m = await scheduler.metrics(s.tenant_id, vm_id)
        return JSONResponse(m.model_dump(by_alias=True, mode="json"), headers={"Cache-Control": "no-store"})

    @r.post("/{vm_id}/fork")
    async def fork(request: Request, vm_id: str) -> Response:
        s, form = await mutating(request)

        async def act() -> str:
            try:
                count = int(form.get("count") or 1)
            except ValueError:
                raise InvalidRequest("the fork count must be a whole number") from None
            res = await scheduler.fork(s.tenant_id, vm_id, count)
            parts = [f"{c.vm_id} {c.state}" + (f" ({c.error})" if c.error else "") for c in res.forks]
            return f"Forked {len(res.forks)}: " + ", ".join(parts) + "."

        return await attempt(request, act, trigger="vmChanged")

    # Pause, Resume, Delete: a button each, the scheduler's call of that name, and what to
    # say after it.
    def simple_action(name: str, done: Callable[[Any], str]) -> Callable[..., Awaitable[Response]]:
        async def route(request: Request, vm_id: str) -> Response:
            s, _ = await mutating(request)

            async def act() -> str:
                return done(await getattr(scheduler, name)(s.tenant_id, vm_id))

            return await attempt(request, act, trigger="vmChanged")

        return route

    for name, done in (
        ("pause", lambda v: f"Paused: snapshot {v.snapshot_id}."),
        ("resume", lambda v: f"Resumed ({v.state})."),
        ("delete", lambda v: f"Deleted ({v.state})."),
    ):
        r.add_api_route(f"/{{vm_id}}/{name}", simple_action(name, done), methods=["POST"], name=name)

    @r.post("/{vm_id}/port-link")
    async def open_port(request: Request, vm_id: str) -> Response:
        s, form = await mutating(request)
        try:
            port = int(str(form.get("port") or ""))
            if not 1 <= port <= 65535:
                raise ValueError
        except ValueError:
            return message(request, _error_words(InvalidRequest("give a port from 1 to 65535"))[1], 400)
        try:
            await scheduler.get(s.tenant_id, vm_id)  # 404 for unknown and other tenants' VMs
        except PalError as exc:
            status, words = _error_words(exc)
            return message(request, words, status)
        state = request.app.state
        link = port_link(
            state.links, state.port_origins, s.tenant_id, s.key_hash, vm_id, port, PORT_LINK_SECS
        )
        expires = datetime.fromtimestamp(link.expires_at, UTC).strftime("%H:%M UTC")
        return render(request, "_port_link.html", port=port, url=link.url, expires=expires)

    # -- files ---------------------------------------------------------------------------------

    @r.get("/{vm_id}/_files")
    async def files(request: Request, vm_id: str, path: str = "") -> Response:
        s = await session_for(request, "fragment")
        try:
            checked = check_workspace_path(path, required=False)
            listing = await scheduler.list_files(s.tenant_id, vm_id, checked)
        except PalError as exc:
            status, words = _error_words(exc)
            return message(request, words, status)
        entries = sorted(listing.entries, key=lambda e: (e.get("type") != "dir", str(e.get("name"))))
        parent = posixpath.dirname(path.rstrip("/")) if path.strip("/") else None
        return render(
            request,
            "_files.html",
            vm_id=vm_id,
            path=path.strip("/"),
            parent=parent,
            entries=entries,
            truncated=listing.truncated,
            join=lambda name: posixpath.join(path.strip("/"), str(name)) if path.strip("/") else str(name),
        )

    @r.get("/{vm_id}/files/view")
    async def view_file(request: Request, vm_id: str, path: str) -> Response:
        s = await session_for(request, "fragment")
        try:
            data, truncated = await scheduler.read_file(
                s.tenant_id, vm_id, check_workspace_path(path, required=True)
            )
        except PalError as exc:
            status, words = _error_words(exc)
            return message(request, words, status)
        text: str | None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        return render(
            request, "_file_view.html", vm_id=vm_id, path=path, text=text, size=len(data), truncated=truncated
        )

    @r.get("/{vm_id}/files/download")
    async def download(request: Request, vm_id: str, path: str) -> Response:
        s = await session_for(request, "page")
        data, truncated = await scheduler.read_file(
            s.tenant_id, vm_id, check_workspace_path(path, required=True)
        )
        name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(path)) or "file"
        headers = {
            "Content-Disposition": f"attachment; filename=\"{name}\"; filename*=UTF-8''{quote(name)}",
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-store",
        }
        if truncated:
            headers["X-Pal-Truncated"] = "true"
        return Response(data, media_type="application/octet-stream", headers=headers)

    @r.post("/{vm_id}/files/upload")
    async def upload(request: Request, vm_id: str) -> Response:
        s, form = await mutating(request)
        upload = form.get("file")

        async def act() -> str:
            if not isinstance(upload, UploadFile) or not upload.filename:
                raise InvalidRequest("choose a file to upload")
            data = await upload.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise TooLarge(
                    f"{upload.filename} is over {MAX_FILE_WORDS}; the limit is {MAX_FILE_BYTES} bytes"
                )
            folder = str(form.get("dir") or "").strip("/")
            name = posixpath.basename(upload.filename.replace("\\", "/"))
            target = check_workspace_path(posixpath.join(folder, name) if folder else name, required=True)
            res = await scheduler.write_file(s.tenant_id, vm_id, target, data)
            return f"Uploaded {res.path} ({res.bytes_written} bytes)."

        try:
            return await attempt(request, act, trigger="filesChanged")
        finally:
            if isinstance(upload, UploadFile):
                await upload.close()

    # -- exec console --------------------------------------------------------------------------

    @r.post("/{vm_id}/exec")
    async def exec_(request: Request, vm_id: str) -> Response:
        s, _ = await mutating(request, "json")
        try:
            body = json.loads(await request.body() or b"{}")
            line = str(body.get("line", "")).strip()
            if not line:
                raise InvalidRequest("type a command")
            req = ExecRequest.model_validate({"command": "/bin/sh", "argv": ["-c", line]})
        except (ValueError, AttributeError, ValidationError):
            raise InvalidRequest('send {"line": "<shell command>"}') from None
        # The REST API's SSE path: same events, same errors, same cancel-on-disconnect.
        return await sse_exec(lambda: scheduler.exec_stream(s.tenant_id, vm_id, req))

    add_code_routes(r, scheduler, mutating, render, message, _error_words)  # code_panel.py
    return r


def _safe_next(url: str) -> str:
    """Only same-site dashboard paths: never an open redirect."""
    if url.startswith("/runtime") and not url.startswith("//") and "\\" not in url:
        return url
    return "/runtime"


async def refused(request: Request, exc: Exception) -> Response:
    err = exc.error if isinstance(exc, Refused) else PalError(str(exc))
    status, words = _error_words(err)
    body = f'<p class="msg err" role="alert">{html.escape(words)}</p>'
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


async def sign_in_required(request: Request, exc: Exception) -> Response:
    kind = exc.kind if isinstance(exc, SignInRequired) else "page"
    login = "/runtime/login"
    if kind == "page":
        nxt = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"{login}?next={quote(nxt)}", status_code=303)
    body = {"error": {"code": "UNAUTHENTICATED", "message": "sign in again"}}
    resp = JSONResponse(body, status_code=401, headers={"Cache-Control": "no-store"})
    if kind == "fragment":
        resp.headers["HX-Redirect"] = login  # htmx sends the whole page to the sign-in form
    return resp
