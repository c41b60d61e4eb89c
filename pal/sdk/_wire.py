"""HTTP details shared by the sync and async clients: settings, errors, SSE parsing."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, TypedDict, Unpack
from urllib.parse import quote

import httpx

from .errors import PalApiError, error_for
from .models import ExecEvent, ExecResult, FileBytes, FileText

DEFAULT_URL = "http://127.0.0.1:8080"
DEFAULT_TIMEOUT = 60.0
TRUNCATED_HEADER = "x-pal-truncated"
SSE_HEADERS = {"Accept": "text/event-stream"}


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


def given(**fields: Any) -> dict[str, Any]:
    """The optional fields of a request body that the caller set (None: left out)."""
    return {name: value for name, value in fields.items() if value is not None}


class ExecOptions(TypedDict, total=False):
    """An exec's optional fields (``exec`` and ``exec_stream``): the guest's defaults when
    left out."""

    env: dict[str, str] | None
    cwd: str | None
    timeout_secs: float | None
    user: str | None


def exec_body(command: str, argv: list[str] | None, **opts: Unpack[ExecOptions]) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command, "argv": list(argv or []), "env": dict(opts.get("env") or {})}
    return body | given(cwd=opts.get("cwd"), timeoutSecs=opts.get("timeout_secs"), user=opts.get("user"))


def exec_result(out: dict[str, Any]) -> ExecResult:
    return ExecResult(
        out["exitCode"], out["stdout"], out["stderr"], bool(out.get("timedOut")), out.get("processId")
    )


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
    if name == "detached":  # the stream ended before the command (a slow reader): it runs on
        why = str(payload.get("reason") or "detached")
        msg = f"the output stream was detached ({why}); the command runs on: read its process's output"
        return ExecEvent(type="detached", code="DETACHED", message=msg)
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


def seg(value: object) -> str:
    """``value`` as one path segment, quoted whole: an id holding ``/``, ``?`` or ``#`` stays
    one segment of the route it was meant for (the server then refuses it as an id)."""
    return quote(str(value), safe="")


def connection_error(exc: httpx.TransportError, url: str) -> PalApiError:
    from .errors import PalConnectionError

    return PalConnectionError(0, "CONNECTION_ERROR", f"cannot reach Pal at {url}: {exc}")


class RuntimeCalls:
    """A group of /v1/runtime calls over a :class:`~pal.sdk.client.Client` (``Runtime``,
    ``Processes``, ``Code``)."""

    def __init__(self, client: Any) -> None:  # a Client (client.py imports this module)
        self._c = client

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._c.request(method, f"/v1/runtime{path}", **kw).json()

    def _sse(self, method: str, path: str, **kw: Any) -> contextlib.AbstractContextManager[Iterator[str]]:
        return sse_lines(self._c, method, f"/v1/runtime{path}", **kw)


class AsyncRuntimeCalls:
    """:class:`RuntimeCalls` over an :class:`~pal.sdk.async_client.AsyncClient`."""

    def __init__(self, client: Any) -> None:  # an AsyncClient
        self._c = client

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._c.request(method, f"/v1/runtime{path}", **kw)).json()

    def _sse(
        self, method: str, path: str, **kw: Any
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[str]]:
        return asse_lines(self._c, method, f"/v1/runtime{path}", **kw)


# A stream (exec, process output) runs as long as it runs: the server bounds it and sends
# keepalives, so its read has no timeout (exec_timeout).
@contextlib.contextmanager
def sse_lines(client: Any, method: str, path: str, **kw: Any) -> Iterator[Iterator[str]]:
    """The lines of an SSE answer of ``client`` (a Client); an error status raises its
    PalApiError, a connection that fails PalConnectionError (also while reading)."""
    try:
        timeout = exec_timeout(client.timeout)
        with client._http.stream(method, path, headers=SSE_HEADERS, timeout=timeout, **kw) as resp:
            if resp.status_code >= 400:
                resp.read()
                check(resp)
            yield resp.iter_lines()
    except httpx.TransportError as exc:
        raise connection_error(exc, client.base_url) from exc


@contextlib.asynccontextmanager
async def asse_lines(client: Any, method: str, path: str, **kw: Any) -> AsyncIterator[AsyncIterator[str]]:
    """:func:`sse_lines` of an AsyncClient."""
    try:
        timeout = exec_timeout(client.timeout)
        async with client._http.stream(method, path, headers=SSE_HEADERS, timeout=timeout, **kw) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                check(resp)
            yield resp.aiter_lines()
    except httpx.TransportError as exc:
        raise connection_error(exc, client.base_url) from exc
