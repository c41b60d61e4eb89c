"""Dashboard sessions: sign in with an API key, get a signed cookie; CSRF tokens for forms.

The cookie (``pal_session``) holds the tenant id and a CSRF token, signed and time-stamped
with itsdangerous (HMAC-SHA1 over a key only the server holds). It is httpOnly (scripts
cannot read it), SameSite=Strict (no other site's page can send it) and scoped to
``/runtime`` (the REST API under /v1 never looks at cookies, only at bearer keys). The API
key itself is never stored in it. A session lasts ``SESSION_MAX_AGE_S``.

CSRF: every state-changing request must echo the session's token, as a ``csrf`` form field
or an ``X-CSRF-Token`` header (htmx and the page's fetch calls send the header). The sign-in
form is protected the same way with a token in a short-lived cookie of its own.

The signing key: ``PAL_DASHBOARD_SECRET`` when set. Else a control-plane replica
(``pal server``, which has no data dir of its own) derives it from the cluster secret all
replicas share, and ``pal up`` keeps a random key in ``<data dir>/dashboard.key`` (0600,
made on first use).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

from pal.config import Settings

SESSION_COOKIE = "pal_session"
LOGIN_CSRF_COOKIE = "pal_login_csrf"
COOKIE_PATH = "/runtime"
SESSION_MAX_AGE_S = 12 * 3600
LOGIN_MAX_AGE_S = 3600
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf"


def load_secret(settings: Settings, replica: bool = False) -> bytes:
    if settings.dashboard_secret:
        return settings.dashboard_secret.encode()
    if replica:
        # Never a file: a replica writing into the default data dir would leave a
        # non-empty /var/lib/pal that `pal up` could then not mount its XFS on.
        if not settings.cluster_secret:
            raise ValueError("pal server needs PAL_DASHBOARD_SECRET or PAL_CLUSTER_SECRET")
        mac = hmac.new(settings.cluster_secret.encode(), b"pal-dashboard-secret", hashlib.sha256)
        return mac.hexdigest().encode()
    path: Path = settings.data_dir / "dashboard.key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another replica of this data dir made it first
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


@dataclass(frozen=True)
class Session:
    tenant_id: str
    tenant_name: str
    csrf: str
    # The hash of the API key it was opened with: a session lasts only while that key
    # still authenticates the tenant (rotated past its grace, expired, tenant removed: out).
    key_hash: str = ""


class Sessions:
    def __init__(self, secret: bytes) -> None:
        self._signer = URLSafeTimedSerializer(secret, salt="pal-dashboard-session")
        self._login_signer = URLSafeTimedSerializer(secret, salt="pal-dashboard-login")

    # -- the session cookie --------------------------------------------------------------

    def read(self, request: Request) -> Session | None:
        raw = request.cookies.get(SESSION_COOKIE)
        if not raw:
            return None
        try:
            data = self._signer.loads(raw, max_age=SESSION_MAX_AGE_S)
            return Session(str(data["t"]), str(data["n"]), str(data["c"]), str(data.get("k") or ""))
        except (BadSignature, KeyError, TypeError):
            return None

    def start(
        self, response: Response, request: Request, tenant_id: str, tenant_name: str, key_hash: str
    ) -> None:
        value = self._signer.dumps(
            {"t": tenant_id, "n": tenant_name, "c": secrets.token_urlsafe(32), "k": key_hash}
        )
        _set_cookie(response, request, SESSION_COOKIE, value, SESSION_MAX_AGE_S)
        response.delete_cookie(LOGIN_CSRF_COOKIE, path=COOKIE_PATH)

    @staticmethod
    def end(response: Response) -> None:
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")

    # -- the sign-in form's CSRF token ---------------------------------------------------

    def login_token(self, request: Request, response: Response) -> str:
        """A token for the sign-in form; the same value goes into a cookie (double submit)."""
        raw = request.cookies.get(LOGIN_CSRF_COOKIE)
        token = None
        if raw:
            try:
                token = str(self._login_signer.loads(raw, max_age=LOGIN_MAX_AGE_S))
            except BadSignature:
                token = None
        if token is None:
            token = secrets.token_urlsafe(32)
            _set_cookie(
                response, request, LOGIN_CSRF_COOKIE, self._login_signer.dumps(token), LOGIN_MAX_AGE_S
            )
        return token

    def check_login_token(self, request: Request, given: str) -> bool:
        raw = request.cookies.get(LOGIN_CSRF_COOKIE)
        if not raw or not given:
            return False
        try:
            token = str(self._login_signer.loads(raw, max_age=LOGIN_MAX_AGE_S))
        except BadSignature:
            return False
        return hmac.compare_digest(token.encode(), given.encode())


def csrf_ok(session: Session, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(session.csrf.encode(), str(given).encode())


def _set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
