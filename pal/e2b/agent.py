"""The agent listener's app (``PAL_E2B_PORT``, default 49983): every sandbox's envd and
code interpreter behind one address, as ``E2B_SANDBOX_URL`` expects (docs/e2b.md).

Which sandbox and which of its services a request is for:

1. the ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers the SDKs always send (port
   49983: envd, the default; 49999: the code interpreter); else
2. the ``Host`` ``{port}-{sandboxId}.{domain}`` (``E2B_DOMAIN``'s form), when a domain
   is configured.

Then: a sandbox that is gone answers 502 (the SDKs' "sandbox timeout":
``TimeoutException``, and ``is_running()`` is False); a secure sandbox's calls need its
access token in ``X-Access-Token``, except ``/files`` with a signed URL (checked there)
and the code interpreter's ``/contexts`` calls, which no SDK sends a token with (E2B's
interpreter port is reachable by the sandbox id alone; running code needs the token).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pal.errors import PalError

from . import ops
from .access import token_matches
from .codecs import agent_codecs
from .envd_http import FilesConfig, create_envd_http_app
from .errors import json_error, message_of
from .filesystem_service import FilesystemService
from .gen.filesystem_connect import FilesystemASGIApplication
from .gen.process_connect import ProcessASGIApplication
from .interpreter import create_interpreter_app
from .process_service import ProcessService
from .streams import Target, current_target
from .versions import ACCESS_TOKEN_HEADER, ENVD_PORT, INTERPRETER_PORT, SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER

# A sandbox id as it may appear in a header or a DNS label (Pal's are "vm-" + 24 hex).
_SANDBOX_ID = re.compile(r"\A[a-z0-9][a-z0-9-]{0,62}\Z")
_HOST_LABEL = re.compile(r"\A([1-9][0-9]{0,4})-([a-z0-9][a-z0-9-]{0,62})\Z")
# Bound on one Connect message (SendInput's stdin: Pal takes 1 MiB a write, base64 in JSON).
READ_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class AgentConfig:
    """``domain``: the ``{port}-{id}.{domain}`` host form's domain (None: headers only)."""

    domain: str | None = None
    files: FilesConfig = field(default_factory=FilesConfig)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def route_of(scope: Scope, domain: str | None) -> tuple[str, int] | None:
    """(sandbox id, port) of a request, from its headers or its host; None when it names
    none. ValueError for a malformed name."""
    sandbox_id = _header(scope, SANDBOX_ID_HEADER.encode())
    if sandbox_id is not None:
        port_text = _header(scope, SANDBOX_PORT_HEADER.encode()) or str(ENVD_PORT)
        if not _SANDBOX_ID.match(sandbox_id) or not port_text.isdigit():
            raise ValueError("malformed E2b-Sandbox-Id or E2b-Sandbox-Port")
        return sandbox_id, int(port_text)
    host = _header(scope, b"host")
    if domain is None or not host:
        return None
    name = host.strip().lower().rsplit(":", 1)[0] if not host.startswith("[") else ""
    suffix = "." + domain.lower().rstrip(".")
    if not name.rstrip(".").endswith(suffix):
        return None
    label = _HOST_LABEL.match(name.rstrip(".")[: -len(suffix)])
    if label is None:
        raise ValueError(f"host {host!r} is not {{port}}-{{sandboxId}}{suffix}")
    return label.group(2), int(label.group(1))


async def _answer(
    scope: Scope, receive: Receive, send: Send, status: int, message: str, **extra: str
) -> None:
    await json_error(status, message, **extra)(scope, receive, send)


def _token_free(port: int, path: str) -> bool:
    """Requests a secure sandbox takes without its token (their own check, or none)."""
    if port == ENVD_PORT:
        return path == "/files"  # a signed URL: envd_http checks the signature
    return path == "/contexts" or path.startswith("/contexts/")


def create_agent_app(backend: ops.AgentBackend, config: AgentConfig) -> ASGIApp:
    process = ProcessASGIApplication(
        ProcessService(backend.processes), read_max_bytes=READ_MAX_BYTES, codecs=agent_codecs()
    )
    filesystem = FilesystemASGIApplication(
        FilesystemService(backend.files), read_max_bytes=READ_MAX_BYTES, codecs=agent_codecs()
    )
    envd_http = create_envd_http_app(backend.files, backend.info, config.files)
    interpreter = create_interpreter_app(backend.interpreter)

    def envd(path: str) -> ASGIApp:
        if path.startswith("/process.Process/"):
            return process
        if path.startswith("/filesystem.Filesystem/"):
            return filesystem
        return envd_http

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 4404, "reason": "not served here"})
            return
        try:
            route = route_of(scope, config.domain)
        except ValueError as exc:
            await _answer(scope, receive, send, 400, str(exc))
            return
        if route is None:
            why = "name the sandbox: E2b-Sandbox-Id header (E2B_SANDBOX_URL)"
            await _answer(scope, receive, send, 400, why)
            return
        sandbox_id, port = route
        if port not in (ENVD_PORT, INTERPRETER_PORT):
            await _answer(scope, receive, send, 404, f"port {port} is not served by the agent listener")
            return
        try:
            access = await backend.access(sandbox_id)
        except PalError as exc:
            await _answer(scope, receive, send, exc.status, message_of(exc))
            return
        if access is None or not access.running:
            why = "not found" if access is None else "not running"
            await _answer(scope, receive, send, 502, f"sandbox {sandbox_id} {why}", sandboxId=sandbox_id)
            return
        path = scope.get("path", "")
        authorised = access.access_token is None or token_matches(
            _header(scope, ACCESS_TOKEN_HEADER.encode()), access.access_token
        )
        if not authorised and not _token_free(port, path):
            await _answer(scope, receive, send, 401, "this sandbox is secure: send its X-Access-Token")
            return
        gone = asyncio.Event()

        async def watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            return message

        target = Target(access.tenant, sandbox_id, authorised, access.access_token, gone)
        reset = current_target.set(target)
        try:
            await (envd(path) if port == ENVD_PORT else interpreter)(scope, watched, send)
        finally:
            current_target.reset(reset)

    return app
