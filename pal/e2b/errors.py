"""Pal's errors in E2B's three shapes, decided in one place (docs/e2b.md, "Errors").

The operations raise :class:`PalError` with the status Pal's API would answer. The E2B
surface answers it as:

- REST: that status (a few remapped to what E2B answers) and ``{"code": status,
  "message"}``: the SDKs raise ``AuthenticationException`` for 401,
  ``RateLimitException`` for 429, ``SandboxNotFoundException`` for a 404 of a sandbox call;
- envd HTTP (``/files``, ``/health``): the same body; 404 ``FileNotFoundException``, 502
  ``TimeoutException``, 507 ``NotEnoughSpaceException``;
- Connect: the code of the status (``not_found``, ``already_exists``, ``unavailable``...).

Messages of server-side failures (5xx) are shown as :func:`public_message` makes them (no
host paths, no tracebacks).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.responses import Response

from pal.errors import PalError, public_message

log = logging.getLogger(__name__)

# Pal's statuses E2B answers otherwise: a quota is a 429 there ("maximum number of
# concurrent sandboxes"), which the SDKs raise as RateLimitException.
_REST_STATUS = {402: 429}

# What a Conflict means to E2B: MakeDir of an existing directory is ALREADY_EXISTS
# (make_dir() answers False), any other wrong state FAILED_PRECONDITION.
ALREADY_EXISTS = "ALREADY_EXISTS"

_CONNECT_CODE = {
    400: Code.INVALID_ARGUMENT,
    401: Code.UNAUTHENTICATED,
    402: Code.RESOURCE_EXHAUSTED,
    403: Code.PERMISSION_DENIED,
    404: Code.NOT_FOUND,
    409: Code.FAILED_PRECONDITION,
    413: Code.RESOURCE_EXHAUSTED,
    415: Code.INVALID_ARGUMENT,
    429: Code.RESOURCE_EXHAUSTED,
    499: Code.CANCELED,
    501: Code.UNIMPLEMENTED,
    502: Code.UNAVAILABLE,
    503: Code.UNAVAILABLE,
    504: Code.DEADLINE_EXCEEDED,
    507: Code.RESOURCE_EXHAUSTED,
}


def message_of(exc: PalError) -> str:
    if exc.status >= 500:
        return public_message(exc.message)
    return exc.message


def rest_status(exc: PalError) -> int:
    return _REST_STATUS.get(exc.status, exc.status)


def error_body(status: int, message: str, **extra: Any) -> bytes:
    """E2B's ``Error`` (REST and envd HTTP alike): ``{"code": status, "message"}``."""
    return json.dumps({"code": status, "message": message, **extra}).encode() + b"\n"


def json_error(status: int, message: str, **extra: Any) -> Response:
    """An HTTP answer with E2B's ``Error`` body."""
    return Response(error_body(status, message, **extra), status_code=status, media_type="application/json")


def rest_error(exc: PalError) -> tuple[int, bytes]:
    status = rest_status(exc)
    return status, error_body(status, message_of(exc))


def connect_code(exc: PalError) -> Code:
    if exc.status == 409 and exc.code == ALREADY_EXISTS:
        return Code.ALREADY_EXISTS
    return _CONNECT_CODE.get(exc.status, Code.INTERNAL if exc.status >= 500 else Code.UNKNOWN)


def connect_error(exc: BaseException) -> ConnectError:
    """The Connect error a failed operation ends its call with; anything that is not a
    PalError is a bug: logged, and ``internal`` without its text."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, PalError):
        return ConnectError(connect_code(exc), message_of(exc))
    log.exception("E2B agent call failed", exc_info=exc)
    return ConnectError(Code.INTERNAL, "internal error")
