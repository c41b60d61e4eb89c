"""The ``run_code`` tool: a cell in the sandbox's stateful kernel (the code interpreter,
docs/agents.md), its results shaped for a model: text cut with a marker, images as MCP
image content, an exception as name, value and traceback."""

from __future__ import annotations

import base64
from typing import Any

import mcp_types as types

from pal.ids import CONTEXT_ID_PATTERN
from pal.sdk import AsyncClient
from pal.sdk.code import CodeResult

from .shaping import DEFAULT_OUTPUT_BYTES, utf8_prefix

MAX_IMAGES = 4  # images per answer: each costs a model many tokens
MAX_CELL_SECS = 600  # a tool call should not hold the model longer

SCHEMA_PROPS: dict[str, Any] = {
    "code": {"type": "string", "minLength": 1, "description": "the cell's source"},
    "language": {"type": "string", "enum": ["python", "bash"], "description": 'default "python"'},
    "contextId": {
        "type": "string",
        "pattern": CONTEXT_ID_PATTERN,
        "description": "a context (kernel) of the sandbox; default: its default context of that language",
    },
    "timeoutSecs": {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": MAX_CELL_SECS,
        "description": "interrupt the cell after this long (default 300); the context stays usable",
    },
}
DESCRIPTION = (
    "Run a cell of Python (Jupyter kernel) or bash in the sandbox's stateful kernel: variables, "
    "imports and loaded data stay for the next cell, across pause and resume too. Returns stdout, "
    "stderr, the last expression's value, rich results (tables as text/HTML, charts as PNG images) "
    "and an exception with its traceback. Python needs a sandbox of the code-interpreter image "
    '(create_sandbox with image "code-interpreter").'
)


def _cut(label: str, text: str) -> str:
    data = text.encode()
    if len(data) <= DEFAULT_OUTPUT_BYTES:
        return f"{label}:\n{text}"
    kept = utf8_prefix(data, DEFAULT_OUTPUT_BYTES).decode()
    more = "[cut: print less, or write it to a file and read it with read_file]"
    return f"{label} (first {len(kept.encode())} of {len(data)} bytes):\n{kept}\n{more}"


def shape(res: CodeResult) -> types.CallToolResult:
    parts = [
        f"context {res.context_id}, cell {res.execution_count}" + (" (timed out)" if res.timed_out else "")
    ]
    parts += [_cut(k, v) for k, v in (("stdout", res.stdout), ("stderr", res.stderr)) if v]
    for r in res.results:
        body = r.text if r.text is not None else (r.html or "")
        if body and not r.png:
            parts.append(_cut("result" if r.is_main_result else "display", body))
    if res.error is not None:
        tb = "\n".join(res.error.traceback)
        parts.append(_cut(f"error {res.error.name}: {res.error.value}", tb))
    content: list[Any] = [types.TextContent(type="text", text="\n".join(parts))]
    pngs = res.pngs
    content += [
        types.ImageContent(type="image", data=base64.b64encode(p).decode(), mime_type="image/png")
        for p in pngs[:MAX_IMAGES]
    ]
    if len(pngs) > MAX_IMAGES:
        content.append(
            types.TextContent(type="text", text=f"[{len(pngs) - MAX_IMAGES} more images left out]")
        )
    structured = {
        "contextId": res.context_id,
        "executionCount": res.execution_count,
        "text": res.text,
        "timedOut": res.timed_out,
        "error": None if res.error is None else {"name": res.error.name, "value": res.error.value},
        "images": len(pngs),
    }
    # An exception in the cell is the cell's answer (in the text), not a failed tool call.
    return types.CallToolResult(content=content, structured_content=structured)


async def run_code(c: AsyncClient, a: dict[str, Any]) -> types.CallToolResult:
    res = await c.runtime.code.run(
        a["vmId"],
        a["code"],
        language=a.get("language", "python"),
        context=a.get("contextId"),
        timeout_secs=a.get("timeoutSecs"),
    )
    return shape(res)
