"""Every failure becomes `{"error": {"code", "message", "requestId"}}` with the right status.

FastAPI's defaults (422 for validation, `{"detail": ...}` bodies, HTML-less 404s) are
replaced here so clients only ever parse one error shape. A server-side failure (5xx) is
logged in full under the request id and answered with ``public_message``: its first line,
no host paths, no QEMU log tail (docs/security.md, "Errors").
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pal.errors import BY_STATUS, InvalidRequest, PalError, public_message

from .json_response import JSONResponse
from .middleware import current_request_id
from .models import ErrorOut

log = logging.getLogger("pal.api")

# The code of an HTTPException (Starlette's own 404, 405...): a status Pal states has its code.
_HTTP_CODES = {
    **{status: cls.code for status, cls in BY_STATUS.items()},
    405: "METHOD_NOT_ALLOWED",
    406: "NOT_ACCEPTABLE",
}
_DESCRIPTIONS = {status: cls.summary for status, cls in BY_STATUS.items()}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, all with the one error shape."""
    return {c: {"model": ErrorOut, "description": _DESCRIPTIONS[c]} for c in codes}


def document_errors(app: FastAPI) -> None:
    """Make ``/openapi.json`` say what the handlers below answer: a request that fails
    validation is a 400 with the error shape, never FastAPI's 422 ``HTTPValidationError``."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = build()
        ref = {"$ref": "#/components/schemas/ErrorOut"}
        for item in doc.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": _DESCRIPTIONS[400],
                        "content": {"application/json": {"schema": ref}},
                    }
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def public_error(status: int, code: str, message: str) -> dict[str, str]:
    """The error body's inner object. A 5xx is logged in full (under the request id, by the
    log filter) and answered without internals."""
    if status == 502:
        # A sandbox's own server not there (yet), or broken: its business, not the server's.
        log.info("request failed: %s %s: %s", status, code, message)
    elif status >= 500:
        log.warning("request failed: %s %s: %s", status, code, message)
        message = public_message(message)
    err = {"code": code, "message": message}
    rid = current_request_id()
    if rid:
        err["requestId"] = rid
    return err


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": public_error(status, code, message)}, status_code=status, headers=headers)


def validation_message(errors: list[Any]) -> str:
    """`limits.memoryMib: Input should be greater than or equal to 128`, one per problem.

    The location's first element (`body`, `query`...) is dropped for the body, so the
    field reads as the client wrote it.
    """
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ())]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"invalid JSON body: {ctx.get('error', err.get('msg', ''))}")
            continue
        if loc and loc[0] == "body":
            loc = loc[1:]
        elif loc and loc[0] in ("query", "path", "header"):
            loc = loc[1:]
        field = ".".join(loc)
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PalError)
    async def _pal(_: Request, exc: PalError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            headers = {"Retry-After": str(max(1, math.ceil(retry)))}
        return error_response(exc.status, exc.code, exc.message, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        bad = InvalidRequest(validation_message(list(exc.errors())))
        return error_response(bad.status, bad.code, bad.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "ERROR")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, code, message, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "INTERNAL", f"internal error ({type(exc).__name__}); see the server log")
