"""The node RPC's code-context verbs (issue 26; docs/agents.md "Code interpreter"): what
they name (the public requests of pal/spec.py and the VM) and answer (contexts, a cell's
events). The API answers with shapes of its own (pal/api/code_models.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from pal.cells import MAX_CODE_ENV_VARS, CodeRequest, ContextCreate, Language
from pal.ids import CONTEXT_ID_PATTERN as CONTEXT_ID_PATTERN
from pal.ids import SafeId
from pal.spec import ENV_NAME
from pal.wire.models import WireModel as _Model

DEFAULT_TIMEOUT_SECS = 300.0  # a cell without timeoutSecs
MAX_CELL_ENV_BYTES = 64 * 1024  # a cell's own variables, names and values


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
    # Set for this cell only, restored after it (E2B's ``env_vars``): in the kernel's
    # process environment (Python's and its subprocesses', bash's exported variables).
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_CODE_ENV_VARS)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        total = 0
        for k, val in v.items():
            if not ENV_NAME.match(k):
                raise ValueError(f"env name {k[:64]!r} is not a valid environment variable name")
            if "\0" in val:
                raise ValueError(f"env {k!r}: no NUL byte")
            total += len(k) + len(val.encode())
        if total > MAX_CELL_ENV_BYTES:
            raise ValueError(f"a cell's env of {total} bytes: at most {MAX_CELL_ENV_BYTES}")
        return v


class ContextNew(ContextCreate):
    vm_id: SafeId


class ContextRef(_Model):
    vm_id: SafeId
    context_id: str = Field(pattern=CONTEXT_ID_PATTERN)


class ContextRestarted(_Model):
    context_id: str
    restarted: bool = True
