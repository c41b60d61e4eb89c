"""What every dashboard route shares: the :class:`Dashboard` (the scheduler and store it
acts on, the sessions, the templates) with its request helpers, found on app.state through
the ``Dash`` dependency; the page headers, the words for statuses, the template filters."""

from __future__ import annotations

import html
import json
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from pal import sizes
from pal.api.auth import tenant_for_key_hash
from pal.api.body import MAX_FILE_BYTES, MAX_FILE_WORDS
from pal.config import Settings
from pal.errors import PalError, TooLarge
from pal.scheduler import states
from pal.scheduler.scheduler import Scheduler
from pal.scheduler.states import Action, VmState

from .session import CSRF_FIELD, CSRF_HEADER, Session, Sessions, csrf_ok, load_secret
from .terminal import with_style_nonce

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


def buttons_for(vm: Any) -> dict[str, bool]:
    """Which of a VM's buttons its state allows: the scheduler's transition table decides
    (states.py), so a button is enabled exactly when its action would not be a 409."""
    st, marker = VmState(vm.state), vm.marker
    return {
        "pause": states.allowed(st, Action.PAUSE, marker),
        "resume": states.allowed(st, Action.RESUME, marker) or states.allowed(st, Action.LIVE_RESUME, marker),
        "delete": states.allowed(st, Action.DELETE, marker),
    }


def error_words(exc: PalError) -> tuple[int, str]:
    words = STATUS_WORDS.get(exc.status, "Error")
    return exc.status, f"{words} ({exc.status}): {exc.message}"


class Dashboard:
    """One app's dashboard: built by install_dashboard, kept on ``app.state.dashboard``."""

    def __init__(
        self, scheduler: Scheduler, store: Any, settings: Settings, secret: bytes | None = None
    ) -> None:
        self.scheduler = scheduler
        self.store = store
        self.settings = settings
        self.sessions = Sessions(secret if secret is not None else load_secret(settings))
        self.templates = templates = Jinja2Templates(directory=str(TEMPLATES))
        templates.env.filters["age"] = _age
        templates.env.filters["bytes"] = _bytes
        templates.env.filters["egress"] = _egress
        templates.env.globals["states"] = STATES
        templates.env.globals["sizes"] = sizes
        templates.env.globals["max_file"] = MAX_FILE_WORDS
        templates.env.globals["max_fork"] = settings.max_fork_count

    async def session_for(self, request: Request, kind: str) -> Session:
        """The request's session, if its API key still opens its tenant (a key rotated past
        its grace, expired or removed ends every session opened with it)."""
        s = self.sessions.read(request)
        if s is None or not s.key_hash:
            raise SignInRequired(kind)
        tenant = await tenant_for_key_hash(self.store, s.key_hash)
        if tenant is None or str(tenant.id) != s.tenant_id:
            raise SignInRequired(kind)
        return s

    async def form_of(self, request: Request) -> dict[str, Any]:
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

    async def mutating(self, request: Request, kind: str = "fragment") -> tuple[Session, dict[str, Any]]:
        """The session of a state-changing request whose CSRF token checks out."""
        s = await self.session_for(request, kind)
        form = await self.form_of(request)
        given = request.headers.get(CSRF_HEADER) or form.get(CSRF_FIELD)
        if not csrf_ok(s, given if isinstance(given, str) else None):
            forged = "the form is stale or forged (CSRF token); reload the page"
            raise Refused(PalError(forged, status=403, code="CSRF"))
        return s, form

    def render(self, request: Request, name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        s = self.sessions.read(request)
        ctx.setdefault("session", s)
        nonce = ctx.setdefault("style_nonce", secrets.token_urlsafe(16))  # terminal.py
        headers = with_style_nonce(PAGE_HEADERS, nonce)
        return self.templates.TemplateResponse(request, name, ctx, status_code=status, headers=headers)

    def message(
        self, request: Request, text: str, status: int = 200, *, trigger: str | None = None
    ) -> HTMLResponse:
        resp = self.render(request, "_message.html", status=status, text=text, ok=status < 400)
        if trigger:
            resp.headers["HX-Trigger"] = trigger
        return resp

    async def attempt(
        self, request: Request, action: Callable[[], Awaitable[str]], trigger: str | None = None
    ) -> HTMLResponse:
        """Run an action; its PalError becomes words with the status (402, 409...)."""
        try:
            text = await action()
        except PalError as exc:
            status, words = error_words(exc)
            return self.message(request, words, status, trigger=trigger)
        return self.message(request, text, trigger=trigger)

    def login_page_with(
        self, request: Request, next_url: str, status: int = 200, error: str | None = None
    ) -> Response:
        probe = Response()  # collects the sign-in form's CSRF cookie
        token = self.sessions.login_token(request, probe)
        page = self.render(
            request, "login.html", status=status, csrf=token, next=safe_next(next_url), error=error
        )
        for key, value in probe.headers.items():
            if key.lower() == "set-cookie":
                page.headers.append("set-cookie", value)
        return page


def _dashboard(request: Request) -> Dashboard:
    dash: Dashboard = request.app.state.dashboard
    return dash


Dash = Annotated[Dashboard, Depends(_dashboard)]


def safe_next(url: str) -> str:
    """Only same-site dashboard paths: never an open redirect."""
    if url.startswith("/runtime") and not url.startswith("//") and "\\" not in url:
        return url
    return "/runtime"


async def refused(request: Request, exc: Exception) -> Response:
    err = exc.error if isinstance(exc, Refused) else PalError(str(exc))
    status, words = error_words(err)
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
