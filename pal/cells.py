"""What a caller asks of a VM's code interpreter (issue 26; docs/agents.md "Code
interpreter"): a cell to run, a context to create. Public request models, as pal/spec.py's
are; read as the node first read them (``LAX``: not strict), and wrapped by the node RPC's
verbs with the VM they are for (pal/wire/code.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pal.guest import protocol as P
from pal.ids import CONTEXT_ID_PATTERN
from pal.limits import LAX

Language = Literal["python", "bash"]
MAX_CODE_TIMEOUT_SECS, MAX_CODE_ENV_VARS = 24 * 3600, 256


class CodeRequest(BaseModel):
    model_config = LAX
    code: str = Field(..., max_length=P.MAX_CODE_CHARS, description="the cell's source")
    language: Language = Field("python", description="`python` (Jupyter's ipykernel) or `bash`")
    context_id: str | None = Field(
        None,
        pattern=CONTEXT_ID_PATTERN,
        description="the context to run in (default: the language's default context, started on first use)",
    )
    timeout_secs: float | None = Field(
        None,
        gt=0,
        le=MAX_CODE_TIMEOUT_SECS,
        description="interrupt the cell after this long (the context stays); default 300",
    )


class ContextCreate(BaseModel):
    model_config = LAX
    language: Language = "python"
    cwd: str | None = Field(None, max_length=4096, description="working directory (relative: in /workspace)")
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_CODE_ENV_VARS)
