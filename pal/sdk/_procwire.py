"""What the sync and async process clients share: request bodies, the output events, and
the rule of when an output iterator reattaches (docs/processes.md)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Unpack, cast

from ._wire import ExecOptions
from .errors import ConflictError, PalApiError, PalConnectionError, ServerError
from .models import OutputEvent

REATTACH_TIMEOUT_S = 300.0  # how long an output iterator keeps trying to reattach
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0
WAIT_POLL_SECS = 60  # the server's longest wait; longer waits are several polls
STDIN_PART_BYTES = 1 << 20  # one stdin write's body at the most


class StartOptions(ExecOptions, total=False):
    """A process start's optional fields besides ``pty`` (docs/processes.md)."""

    stdin: bool | None  # keep its stdin open for writes
    tag: str | None
    keep_awake: bool | None  # the VM is not idle while it runs
    journal_bytes: int | None  # how much output the node keeps for reattaches


class ProcessOptions(StartOptions, total=False):
    pty: tuple[int, int] | dict[str, int] | None  # a terminal of (cols, rows)


class TerminalOptions(StartOptions, total=False):
    cols: int  # 80 when left out
    rows: int  # 24 when left out


def terminal_options(opts: TerminalOptions) -> ProcessOptions:
    """A terminal's start: ``cols`` x ``rows`` (default 80 x 24) as its ``pty``."""
    start = {k: v for k, v in opts.items() if k not in ("cols", "rows")}
    return cast(ProcessOptions, start | {"pty": (opts.get("cols", 80), opts.get("rows", 24))})


# The wire names of the start options that go into the body as they are.
_WIRE_NAMES = {
    "env": "env",
    "cwd": "cwd",
    "timeout_secs": "timeoutSecs",
    "user": "user",
    "stdin": "stdin",
    "tag": "tag",
    "keep_awake": "keepAwake",
    "journal_bytes": "journalBytes",
}


def start_body(command: str, argv: list[str] | None, **opts: Unpack[ProcessOptions]) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "argv": list(argv or [])}
    for key, value in opts.items():
        if value is not None and key in _WIRE_NAMES:
            body[_WIRE_NAMES[key]] = value
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


class Reattach:
    """An output iterator's place (``offset``: after the last event it gave) and its rule of
    when to reattach: after a ``detached`` event, or a stream that could not be (re)opened
    (:func:`may_reattach`) with a growing backoff, until nothing came for ``timeout`` s."""

    def __init__(self, offset: int, timeout: float) -> None:
        self.offset = offset
        self._timeout = timeout
        self._backoff, self._since = BACKOFF_START_S, time.monotonic()

    def passes(self, ev: OutputEvent) -> bool:
        """Whether ``ev`` goes to the caller (False: ``detached``, reattach); an ``error``
        event raises."""
        if ev.type == "detached":
            return False
        if ev.type == "error":
            raise PalApiError(503, "STREAM_ERROR", ev.reason)
        self._backoff, self._since = BACKOFF_START_S, time.monotonic()
        self.offset = ev.offset or self.offset
        return True

    def may_retry(self, exc: PalApiError) -> bool:
        return may_reattach(exc) and time.monotonic() - self._since <= self._timeout

    def next_backoff(self) -> float:
        """How long to sleep before this reattach (the next one waits twice as long)."""
        delay, self._backoff = self._backoff, min(self._backoff * 2, BACKOFF_MAX_S)
        return delay


class WaitPolls:
    """``wait``'s long polls: each at most WAIT_POLL_SECS, until ``timeout_secs`` (None: no
    limit) or the process exited."""

    def __init__(self, timeout_secs: float | None) -> None:
        self._deadline = None if timeout_secs is None else time.monotonic() + timeout_secs

    def next_poll(self) -> float:
        left = WAIT_POLL_SECS if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        return min(left, WAIT_POLL_SECS)

    def done(self, proc: dict[str, Any]) -> bool:
        return not proc["running"] or (self._deadline is not None and time.monotonic() >= self._deadline)


class StdinParts:
    """``send_stdin``'s writes: ``data`` (``str`` as UTF-8) in parts of at most
    STDIN_PART_BYTES, each from what the server has not taken yet; ``eof`` with the last."""

    def __init__(self, data: bytes | str, eof: bool) -> None:
        self._view = memoryview(data.encode() if isinstance(data, str) else data)
        self._eof = eof

    def next_part(self) -> tuple[bytes, dict[str, str]]:
        """The next write's body and query."""
        part = bytes(self._view[:STDIN_PART_BYTES])
        last = len(part) == len(self._view)
        return part, {"eof": "true" if self._eof and last else "false"}

    def taken(self, answer: dict[str, Any]) -> bool:
        """Whether all is written, now that the server answered a write (``written`` bytes)."""
        self._view = self._view[int(answer["written"]) :]
        return not self._view


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
