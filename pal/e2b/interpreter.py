"""The code interpreter's HTTP API (port 49999 of E2B's code-interpreter template) over
:class:`ops.InterpreterOps`: ``POST /execute`` streams a cell's events as JSON lines,
``/contexts`` creates, lists, removes and restarts kernels' contexts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pal.errors import InvalidRequest, PalError

from . import ops
from .errors import json_error, message_of
from .rest_models import rfc3339
from .streams import aclose, current_target

MAX_CODE_BYTES = 1024 * 1024
MAX_BODY_BYTES = 2 * MAX_CODE_BYTES

# A result's MIME types as the SDKs' `Result` names them; others go to `extra`.
MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
_E2B_KEYS = {*MIME_KEYS.values(), "data", "chart"}


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str = Field(max_length=MAX_CODE_BYTES)
    context_id: str | None = Field(None, max_length=128)
    language: str | None = Field(None, max_length=64)
    env_vars: dict[str, str] | None = Field(None, max_length=1024)


class ContextRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    language: str | None = Field(None, max_length=64)
    cwd: str | None = Field(None, max_length=4096)


def result_line(result: ops.CellResult) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": result.is_main_result}
    extra: dict[str, Any] = {}
    for key, value in result.data.items():
        if key in MIME_KEYS:
            out[MIME_KEYS[key]] = value
        elif key in _E2B_KEYS:
            out[key] = value
        else:
            extra[key] = value
    if extra:
        out["extra"] = extra
    return out


def event_line(event: ops.CellEvent) -> dict[str, Any]:
    match event:
        case ops.CellOutput():
            return {"type": event.stream, "text": event.text, "timestamp": rfc3339(event.timestamp)}
        case ops.CellResult():
            return result_line(event)
        case ops.CellError():
            return {"type": "error", "name": event.name, "value": event.value, "traceback": event.traceback}
        case ops.CellDone():
            return {"type": "number_of_executions", "execution_count": event.execution_count}
    raise AssertionError(f"not a cell event: {event!r}")


def _line(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode() + b"\n"


def context_json(c: ops.CodeContext) -> dict[str, str]:
    return {"id": c.context_id, "language": c.language, "cwd": c.cwd}


async def _on_pal_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PalError)
    return json_error(exc.status, message_of(exc))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path} is not served by the code interpreter"
    return json_error(exc.status_code, message)


async def _parsed(request: Request, model: type[BaseModel]) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise InvalidRequest(f"body of {length} bytes: at most {MAX_BODY_BYTES}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise InvalidRequest(f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"{where}: {first.get('msg')}" if where else "invalid JSON body") from None


def _caller() -> ops.Caller:
    target = current_target.get()
    return ops.Caller(tenant=target.tenant, sandbox_id=target.sandbox_id)


def create_interpreter_app(interpreter: ops.InterpreterOps) -> Starlette:
    async def execute(request: Request) -> Response:
        req: ExecuteRequest = await _parsed(request, ExecuteRequest)
        if req.language and req.context_id:
            raise InvalidRequest("give a context or a language, not both")
        events = interpreter.execute(
            _caller(), req.code, language=req.language, context_id=req.context_id, envs=req.env_vars or {}
        )
        # The first event (or the operation's error: an unknown context is a 404) comes
        # before the answer's status is chosen.
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None

        async def lines() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield _line(event_line(first))
                async for event in events:
                    yield _line(event_line(event))
            except PalError as exc:  # after the answer started: an error line ends it
                yield _line({"type": "error", "name": exc.code, "value": message_of(exc), "traceback": ""})
            finally:
                await aclose(events)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def create_context(request: Request) -> Response:
        req: ContextRequest = await _parsed(request, ContextRequest)
        made = await interpreter.create_context(_caller(), req.language, req.cwd)
        return JSONResponse(context_json(made))

    async def list_contexts(_request: Request) -> Response:
        return JSONResponse([context_json(c) for c in await interpreter.list_contexts(_caller())])

    async def remove_context(request: Request) -> Response:
        await interpreter.remove_context(_caller(), request.path_params["context_id"])
        return Response(status_code=204)

    async def restart_context(request: Request) -> Response:
        await interpreter.restart_context(_caller(), request.path_params["context_id"])
        return Response(status_code=204)

    return Starlette(
        routes=[
            Route("/execute", execute, methods=["POST"]),
            Route("/contexts", create_context, methods=["POST"]),
            Route("/contexts", list_contexts, methods=["GET"]),
            Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
            Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
        ],
        exception_handlers={PalError: _on_pal_error, HTTPException: _on_http_error},
    )
