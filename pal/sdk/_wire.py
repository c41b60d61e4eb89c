"""HTTP details shared by the sync and async clients: settings, errors, SSE parsing."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable
from typing import Any

import httpx

from .errors import PalApiError, error_for
from .models import ExecEvent, FileBytes, FileText

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT = 60.0
TRUNCATED_HEADER = "x-pal-truncated"


def resolve(base_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    url = base_url or os.environ.get("PAL_URL") or DEFAULT_URL
    key = api_key if api_key is not None else os.environ.get("PAL_API_KEY")
    return url.rstrip("/"), key


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def exec_timeout(timeout: float) -> httpx.Timeout:
    # A command may run silently for long; the server bounds it (timeoutSecs) and sends
    # SSE keepalives, so the client does not put its own limit on reading.
    return httpx.Timeout(timeout, read=None)


def exec_body(
    command: str,
    argv: list[str] | None,
    env: dict[str, str] | None,
    cwd: str | None,
    timeout_secs: float | None,
    user: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "argv": list(argv or []), "env": dict(env or {})}
    if cwd is not None:
        body["cwd"] = cwd
    if timeout_secs is not None:
        body["timeoutSecs"] = timeout_secs
    if user is not None:
        body["user"] = user
    return body


def error_from(status: int, body: bytes) -> PalApiError:
    try:
        err = json.loads(body)["error"]
        rid = err.get("requestId")
        return error_for(
            status,
            str(err.get("code", "ERROR")),
            str(err.get("message", "")),
            str(rid) if rid is not None else None,
        )
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()[:500]
        return error_for(status, "HTTP_ERROR", text or f"HTTP {status}")


def check(resp: httpx.Response) -> httpx.Response:
    """Raise the matching PalApiError for a non-2xx answer (body must be read)."""
    if resp.status_code >= 400:
        raise error_from(resp.status_code, resp.content)
    return resp


def file_bytes(resp: httpx.Response) -> FileBytes:
    return FileBytes(resp.content, resp.headers.get(TRUNCATED_HEADER, "").lower() == "true")


def file_text(resp: httpx.Response, path: str) -> FileText:
    """The content as text; a file that is not UTF-8 raises ``UnicodeDecodeError`` (never
    silently replaced: read it with ``read_file_bytes``)."""
    data = file_bytes(resp)
    # A cut at 1 MiB may split the last character: drop that partial one only.
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=not data.truncated)
    except UnicodeDecodeError as exc:
        exc.add_note(f"{path} is not UTF-8 text; read it with read_file_bytes()")
        raise
    return FileText(text, data.truncated)


def to_event(name: str, data: str) -> ExecEvent:
    try:
        payload = json.loads(data) if data else {}
    except ValueError:
        payload = {"data": data}
    if name == "process":
        return ExecEvent(type="process", process_id=int(payload.get("processId", 0)))
    if name in ("stdout", "stderr"):
        return ExecEvent(type=name, data=str(payload.get("data", "")))
    if name == "exit":
        return ExecEvent(
            type="exit", exit_code=int(payload.get("exitCode", -1)), timed_out=bool(payload.get("timedOut"))
        )
    return ExecEvent(type="error", code=payload.get("code"), message=payload.get("message"))


class SseParser:
    """Incremental text/event-stream parser: feed lines, get (event, data) pairs."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, lines: Iterable[str]) -> list[ExecEvent]:
        out = []
        for line in lines:
            if line == "":
                if self._data:
                    out.append(to_event(self._event, "\n".join(self._data)))
                self._event, self._data = "message", []
            elif line.startswith(":"):
                continue  # keepalive comment
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "event":
                    self._event = value
                elif name == "data":
                    self._data.append(value)
        return out


def connection_error(exc: httpx.TransportError, url: str) -> PalApiError:
    from .errors import PalConnectionError

    return PalConnectionError(0, "CONNECTION_ERROR", f"cannot reach Pal at {url}: {exc}")
