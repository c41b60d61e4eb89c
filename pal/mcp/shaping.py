"""Tool results a model can use: text cut to fit its context with a marker that says how to
read on, and errors that say what happened and what to do (docs/agents.md)."""

from __future__ import annotations

import base64
import json
from typing import Any

import mcp_types as types

from pal.sdk import PalApiError

# What one tool result holds of a command's output or a file by default, and at most when a
# model asks for more (``maxBytes``): a few thousand tokens, so a chatty build cannot fill
# the model's context in one call.
DEFAULT_OUTPUT_BYTES = 16 * 1024
MAX_OUTPUT_BYTES = 256 * 1024

# What a model should do about each status (the error's own message says what happened).
_NEXT_STEP = {
    400: "fix the arguments as the message says and call again",
    401: "the API key is missing or invalid: the user must configure PAL_API_KEY (or the bearer token)",
    402: "the tenant's quota is used up: delete sandboxes you no longer need (list_sandboxes), then retry",
    403: "this key may not do that",
    404: "check the id: list_sandboxes shows your sandboxes; a process id comes from run_command",
    409: "the sandbox or process is not in a state for this (get_sandbox shows its state; resume a "
    "paused sandbox first)",
    413: "the content is too large: send it in smaller parts",
    429: "too many processes or requests at once: wait for some to finish (or kill them) and retry",
}
# Codes whose next step is not their status's.
_NEXT_STEP_BY_CODE = {
    "KERNEL_UNAVAILABLE": "this sandbox's image has no kernel for that language: run the code with "
    "run_command (e.g. `python3 -c ...`), or create a sandbox of an image with one (code-interpreter)",
    "CONTEXT_BUSY": "a cell still runs in that context: wait for it, interrupt it, or use another context",
    "LIVE_PAUSED": "the sandbox is paused: resume it, then call again",
}


def utf8_prefix(data: bytes, limit: int) -> bytes:
    """The longest prefix of ``data`` of at most ``limit`` bytes that does not end inside a
    UTF-8 character (so the next read, from where this one stopped, starts on one)."""
    if len(data) <= limit:
        return data
    end = limit
    # Step back over continuation bytes (10xxxxxx) to the start of the cut character.
    while end > 0 and limit - end < 4 and (data[end] & 0xC0) == 0x80:
        end -= 1
    return data[:end] if end > 0 else data[:limit]


def text_result(text: str, structured: dict[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structured_content=structured
    )


def json_result(summary: str, value: dict[str, Any]) -> types.CallToolResult:
    """A one-line summary for the model, then the JSON (also as structured content)."""
    return text_result(f"{summary}\n{json.dumps(value, indent=1, sort_keys=True)}", value)


def error_result(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], is_error=True)


def api_error(exc: PalApiError) -> types.CallToolResult:
    """A Pal API error as a tool error: status, code, the server's message, what to do."""
    if exc.status == 0:
        what = "check that the Pal server is running and PAL_URL points at it, then retry"
    else:
        what = (
            _NEXT_STEP_BY_CODE.get(exc.code)
            or _NEXT_STEP.get(exc.status)
            or "the server could not do it now: retry in a moment"
        )
    return error_result(f"Pal answered {exc.status} {exc.code}: {exc.message}\nWhat to do: {what}.")


def render_output(items: list[dict[str, Any]]) -> str:
    """A read's output items (``data`` bytes) as one text, in journal order, each switch of
    stream marked (``[stderr]``/``[stdout]``) so the model tells them apart."""
    parts: list[str] = []
    current = "stdout"
    for item in items:
        if item["stream"] != current:
            current = item["stream"]
            parts.append(f"\n[{current}]\n")
        parts.append(item["data"].decode("utf-8", "replace"))
    return "".join(parts)


def cut_items(items: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], int]:
    """The output items cut to ``limit`` bytes in all (on a character boundary) and how
    many bytes were kept."""
    kept: list[dict[str, Any]] = []
    taken = 0
    for item in items:
        data = utf8_prefix(item["data"], limit - taken)
        if data:
            kept.append({"stream": item["stream"], "data": data})
        taken += len(data)
        if len(data) < len(item["data"]):
            break
    return kept, taken


def file_slice(data: bytes, offset: int, limit: int) -> tuple[str, str, int]:
    """(text or base64, encoding, bytes given) of ``data[offset:]`` cut to ``limit``."""
    part = data[offset:]
    try:
        text = utf8_prefix(part, limit).decode("utf-8")
        return text, "utf-8", len(text.encode("utf-8"))
    except UnicodeDecodeError:
        raw = part[:limit]
        return base64.b64encode(raw).decode("ascii"), "base64", len(raw)
