"""The code interpreter's answers as the REST API gives them (docs/agents.md "Code
interpreter"): the API's own shapes, read from the node's (pal/wire/code.py) by field name.
The requests are public models of pal/spec.py."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pal.cells import Language

from .shapes import Shape as _Model


class CodeContext(_Model):
    context_id: str = Field(..., description="`default-python`, `default-bash`, or a created context's id")
    language: Language
    cwd: str
    created_ms: int
    executions: int = Field(..., description="cells run in it")
    running: bool = Field(..., description="a cell is running in it now")


class ContextList(_Model):
    contexts: list[CodeContext]


class ContextDeleted(_Model):
    context_id: str
    deleted: bool = True


class ContextInterrupted(_Model):
    context_id: str
    interrupted: bool = Field(..., description="false: no cell was running")


class CodeError(_Model):
    name: str
    value: str
    traceback: list[str]


class CodeResult(_Model):
    """A cell's buffered answer."""

    context_id: str
    execution_count: int | None = Field(..., description="the kernel's count for this cell")
    stdout: str
    stderr: str
    results: list[dict[str, Any]] = Field(
        ...,
        description="display results in order: MIME bundles (text/plain, text/html, image/png as base64, "
        "image/svg+xml, application/json) with `isMainResult` (true: the last expression's value)",
    )
    text: str | None = Field(..., description="the last expression's text/plain, or null")
    error: CodeError | None = Field(..., description="the cell's exception (name, value, traceback), or null")
    timed_out: bool = Field(False, description="the timeout interrupted the cell; the context stays usable")
    truncated: bool | None = Field(
        default=None,
        description="true: the tenant's budget of buffered output on this server (PAL_EXEC_BUFFER_MIB)"
        " ran out during the cell, and what came past it was not kept (stream the cell with SSE for all);"
        " absent otherwise",
    )
