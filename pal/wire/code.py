"""The code interpreter's shapes (issue 26; docs/agents.md "Code interpreter"): requests,
contexts, a cell's events and its buffered result. The node's RPC, the REST API and the
SDKs use the same camelCase JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pal.guest import protocol as p
from pal.ids import CONTEXT_ID_PATTERN as CONTEXT_ID_PATTERN
from pal.ids import SafeId
from pal.wire.models import WireModel as _Model

Language = Literal["python", "bash"]
MAX_TIMEOUT_SECS = 24 * 3600
MAX_ENV_VARS = 256
DEFAULT_TIMEOUT_SECS = 300.0  # a cell without timeoutSecs


class CodeRequest(_Model):
    code: str = Field(..., max_length=p.MAX_CODE_CHARS, description="the cell's source")
    language: Language = Field("python", description="`python` (Jupyter's ipykernel) or `bash`")
    context_id: str | None = Field(
        None,
        pattern=CONTEXT_ID_PATTERN,
        description="the context to run in (default: the language's default context, started on first use)",
    )
    timeout_secs: float | None = Field(
        None,
        gt=0,
        le=MAX_TIMEOUT_SECS,
        description="interrupt the cell after this long (the context stays); default 300",
    )


class ContextCreate(_Model):
    language: Language = "python"
    cwd: str | None = Field(None, max_length=4096, description="working directory (relative: in /workspace)")
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV_VARS)


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


class CodeEvent(_Model):
    """One event of a cell: ``stdout``/``stderr`` (``text``), ``result`` (``data``, a MIME
    bundle, and ``isMainResult``), ``error`` (``error``), then ``end``."""

    type: Literal["stdout", "stderr", "result", "error", "end"]
    text: str | None = None
    data: dict[str, Any] | None = None
    is_main_result: bool | None = None
    error: CodeError | None = None
    context_id: str | None = None
    execution_count: int | None = None
    timed_out: bool | None = None


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


# ---------------------------------------------------------------------- what a request names


class CodeRun(CodeRequest):
    vm_id: SafeId


class ContextNew(ContextCreate):
    vm_id: SafeId


class ContextRef(_Model):
    vm_id: SafeId
    context_id: str = Field(pattern=CONTEXT_ID_PATTERN)
