"""Who is the operator: the caller whose bearer token is the operator token.

No caller is the operator by its address (pal/operator.py says why and where the token
comes from). The server puts the token in effect into ``settings.admin_token`` before it
builds the app; without one, the operator's routes open for no one. ``PAL_METRICS_TOKEN``
opens ``/metrics`` (and the health details) alone, for a scraper that must not drain nodes.
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection

from pal.config import Settings
from pal.errors import Forbidden, Unauthorized

HOW = "send 'Authorization: Bearer <operator token>' (PAL_ADMIN_TOKEN, else <data dir>/keys/operator.token)"


def _bearer(request: HTTPConnection) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip()
    return given if scheme.lower() == "bearer" and given else None


def _one_of(given: str, *tokens: str | None) -> bool:
    return any(tok and hmac.compare_digest(given.encode(), tok.encode()) for tok in tokens)


def require_operator(request: HTTPConnection, settings: Settings) -> None:
    """401 without a bearer token, 403 with one that is not the operator token."""
    given = _bearer(request)
    if given is None:
        raise Unauthorized(f"this is an operator route: {HOW}")
    if not _one_of(given, settings.admin_token):
        raise Forbidden("this token does not open the operator's routes")


def require_metrics_reader(request: HTTPConnection, settings: Settings) -> None:
    """As :func:`require_operator`, and ``PAL_METRICS_TOKEN`` opens it too."""
    given = _bearer(request)
    if given is None:
        raise Unauthorized(f"/metrics is the operator's endpoint: {HOW}, or PAL_METRICS_TOKEN")
    if not _one_of(given, settings.admin_token, settings.metrics_token):
        raise Forbidden("/metrics is the operator's endpoint; this token does not open it")


def is_operator(request: HTTPConnection, settings: Settings) -> bool:
    """The request carries the operator token or ``PAL_METRICS_TOKEN`` (health details)."""
    given = _bearer(request)
    return given is not None and _one_of(given, settings.admin_token, settings.metrics_token)
