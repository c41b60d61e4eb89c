"""The node RPC's code-context verbs (issue 26; docs/agents.md "Code interpreter"): what
they name (the public requests of pal/spec.py and the VM) and answer (contexts, a cell's
events). The API answers with shapes of its own (pal/api/code_models.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pal.cells import CodeRequest, ContextCreate, Language
from pal.ids import CONTEXT_ID_PATTERN as CONTEXT_ID_PATTERN
from pal.ids import SafeId
from pal.wire.models import WireModel as _Model

DEFAULT_TIMEOUT_SECS = 300.0  # a cell without timeoutSecs


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


# ---------------------------------------------------------------------- what a request names


class CodeRun(CodeRequest):
    vm_id: SafeId


class ContextNew(ContextCreate):
    vm_id: SafeId


class ContextRef(_Model):
    vm_id: SafeId
    context_id: str = Field(pattern=CONTEXT_ID_PATTERN)
