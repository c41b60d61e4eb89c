"""How the node RPC's handlers (rpc.py, rpc_processes.py, rpc_code.py) answer: a model as
JSON, a list of models under its key, or a stream of events as NDJSON.

An error in the middle of a stream cannot change the status any more: it travels as an
``error`` line with its ``status``, which ``ManagerClient`` raises again as that error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from pal.errors import PalError


def dump(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(by_alias=True, mode="json"))


def dump_list(key: str, models: Iterable[BaseModel]) -> JSONResponse:
    return JSONResponse({key: [m.model_dump(by_alias=True, mode="json") for m in models]})


def event_line(ev: BaseModel) -> bytes:
    return (ev.model_dump_json(by_alias=True, exclude_none=True) + "\n").encode()


def error_line(exc: PalError) -> bytes:
    """A node-side error after the stream started: an ``error`` event with its status."""
    body: dict[str, Any] = {"type": "error", "code": exc.code, "message": exc.message, "status": exc.status}
    return (json.dumps(body) + "\n").encode()


def ndjson(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """``events`` as NDJSON, ending with an ``error`` line if they end in a PalError. The
    caller checks what it can before (the VM runs) so that those fail with a status."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                yield event_line(ev)
        except PalError as exc:
            yield error_line(exc)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
