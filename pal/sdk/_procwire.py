"""What the sync and async process clients share: request bodies, the output events, and
the rule of when an output iterator reattaches (docs/processes.md)."""

from __future__ import annotations

import base64
import json
from typing import Any

from .errors import ConflictError, PalApiError, PalConnectionError, ServerError
from .models import OutputEvent

REATTACH_TIMEOUT_S = 300.0  # how long an output iterator keeps trying to reattach
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0
WAIT_POLL_SECS = 60  # the server's longest wait; longer waits are several polls


def start_body(command: str, argv: list[str] | None, **opts: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "argv": list(argv or [])}
    names = {
        "env": "env",
        "cwd": "cwd",
        "timeout_secs": "timeoutSecs",
        "user": "user",
        "stdin": "stdin",
        "tag": "tag",
        "keep_awake": "keepAwake",
        "journal_bytes": "journalBytes",
    }
    for key, wire in names.items():
        if opts.get(key) is not None:
            body[wire] = opts[key]
    pty = opts.get("pty")
    if pty is not None:
        cols, rows = (pty["cols"], pty["rows"]) if isinstance(pty, dict) else pty
        body["pty"] = {"cols": cols, "rows": rows}
    return body


def output_event(name: str, eid: str | None, data: str) -> OutputEvent | None:
    """One SSE event of ``/output?encoding=base64`` (None: one this SDK does not know)."""
    try:
        body = json.loads(data) if data else {}
    except ValueError:
        return None
    if name in ("stdout", "stderr"):
        return OutputEvent(name, base64.b64decode(body.get("data", "")), int(eid or 0))
    if name == "gap":
        return OutputEvent("gap", b"", int(eid or 0), lost=int(body.get("lost", 0)))
    if name == "exit":
        code = body.get("exitCode")
        return OutputEvent("exit", b"", 0, exit_code=code, timed_out=bool(body.get("timedOut")))
    if name == "detached":
        return OutputEvent("detached", b"", 0, reason=str(body.get("reason", "")))
    if name == "error":
        return OutputEvent("error", b"", 0, reason=f"{body.get('code')}: {body.get('message')}")
    return None


def may_reattach(exc: PalApiError) -> bool:
    """A stream that could not be (re)opened for a while: the VM is paused (409, until it
    is resumed), the server or its node is away (a connection error, 503)."""
    return isinstance(exc, ConflictError | PalConnectionError) or (
        isinstance(exc, ServerError) and exc.status in (502, 503, 504)
    )


class SseLines:
    """(event, id, data) of text/event-stream lines."""

    def __init__(self) -> None:
        self.event: str = "message"
        self.eid: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str | None, str] | None:
        if line == "":
            out = (self.event, self.eid, "\n".join(self.data)) if self.data else None
            self.event, self.eid, self.data = "message", None, []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "id":
            self.eid = value
        elif name == "data":
            self.data.append(value)
        return None
