"""The WebSocket routes and the MCP server, fuzzed as test_schemathesis.py fuzzes REST: their
inputs are described as OpenAPI operations (a WebSocket handshake's path, query and
headers; each MCP tool's input schema as a tool call's body) and schemathesis generates
what fits them and what does not, hypothesis drives it, and whatever a client sends:

- a WebSocket handshake is refused with a 4xx (never a 5xx, never an exception in the
  app: the finding was ``?from=%C2%B2`` answering 500), or it opens; then any frames (text,
  binary, JSON nested deeper than the parser goes, oversized) end in a clean close or an
  answer on the socket, never an exception;
- a ``tools/call`` answers a result (a tool error is a result) or a JSON-RPC error, with
  an HTTP status below 500, and an id that fails the id pattern reaches no route.

The app is the real API with the real Scheduler and store, the runtime manager the fake
of tests/fakes.py (one VM whose process 1 exists, a loopback echo server on its port).
"""

from __future__ import annotations

import base64
import json
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from pal.api.auth import key_check
from pal.mcp.catalog import SCHEMAS
from pal.mcp.http import install_mcp
from pal.wire.processes import JournalBounds, ProcessEvent, ProcessInfo, StdinWritten
from tests.apienv import make_api

_tmp = tempfile.TemporaryDirectory(prefix="pal-fuzz-ws-")
API = make_api(Path(_tmp.name), max_vms=100, hosts=("testserver",))
install_mcp(API.app, lambda key: key_check(API.sched.store, key))
KEY = API.key_a
PID, PORT = 1, 8000
EXAMPLES = 40

# The inputs of each WebSocket route (and of a tool call), as OpenAPI operations: what
# schemathesis generates cases from.
_STR = {"type": "string"}
_PARAMS = {
    "vm_id": {"name": "vm_id", "in": "path", "required": True, "schema": _STR},
    "pid": {"name": "pid", "in": "path", "required": True, "schema": _STR},
    "port": {"name": "port", "in": "path", "required": True, "schema": _STR},
    "path": {"name": "path", "in": "path", "required": True, "schema": _STR},
    "from": {"name": "from", "in": "query", "required": False, "schema": _STR},
    "palToken": {"name": "palToken", "in": "query", "required": False, "schema": _STR},
    "Origin": {"name": "Origin", "in": "header", "required": False, "schema": _STR},
}
WS_ROUTES = {
    "/v1/runtime/vms/{vm_id}/processes/{pid}/attach": ["vm_id", "pid", "from", "palToken", "Origin"],
    "/v1/runtime/vms/{vm_id}/tunnel/{port}": ["vm_id", "port", "palToken", "Origin"],
    "/v1/runtime/vms/{vm_id}/ports/{port}/{path}": ["vm_id", "port", "path", "palToken", "Origin"],
}
_OK = {"200": {"description": "-"}}
DOC: dict[str, Any] = {
    "openapi": "3.1.0",  # its JSON Schema is the tools' own (2020-12)
    "info": {"title": "Pal's WebSockets and MCP tools", "version": "1"},
    "paths": {
        **{
            route: {"get": {"parameters": [_PARAMS[p] for p in params], "responses": _OK}}
            for route, params in WS_ROUTES.items()
        },
        **{
            f"/mcp-tool/{name}": {
                "post": {
                    "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                    "responses": _OK,
                }
            }
            for name, schema in SCHEMAS.items()
        },
    },
}
OPERATIONS = {
    op.label: op for op in (r.ok() for r in schemathesis.openapi.from_dict(DOC).get_all_operations())
}
WS_LABELS = [label for label in OPERATIONS if not label.startswith("POST /mcp-tool/")]
TOOL_LABELS = [label for label in OPERATIONS if label.startswith("POST /mcp-tool/")]

# Frames a client may send on an open socket: any bytes, any text, JSON of every shape,
# nesting past the parser, and one over the server's message bound.
FRAMES = st.one_of(
    st.binary(max_size=4096),
    st.text(max_size=2048),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(1, 3000)),
    st.builds(
        lambda t, v: json.dumps({"type": t, "cols": v, "rows": v, "signal": v}),
        st.text(max_size=8),
        st.integers(),
    ),
    st.just(json.dumps({"type": "eof"})),
    st.just(b"x" * (2 << 20)),
)


def cases(label: str) -> st.SearchStrategy[schemathesis.Case]:
    op = OPERATIONS[label]
    return st.one_of(
        op.as_strategy(schemathesis.GenerationMode.POSITIVE),
        op.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(API.app) as c:  # its lifespan runs the MCP session manager
        yield c


@pytest.fixture(scope="module")
def live_vm(client: TestClient) -> Iterator[str]:
    """A VM of the caller's whose process PID exists (it prints, then waits for the end of
    the test) and whose port PORT echoes what it gets."""
    r = client.post("/v1/runtime/schedule", json={}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    vm = str(r.json()["vmId"])
    m = API.manager
    info = ProcessInfo(
        process_id=PID, os_pid=10, argv=["sh"], tag="", user="pal", cwd="/workspace", stdin=True,
        keep_awake=False, started_ms=1, running=True, timed_out=False,
        journal=JournalBounds(start=0, end=3, capacity=1 << 20),
    )  # fmt: skip

    async def get_process(vm_id: str, pid: int) -> ProcessInfo:
        return info if pid == PID else m._process_missing(pid)  # type: ignore[attr-defined]

    async def attach_process(vm_id: str, pid: int, start: int) -> AsyncIterator[ProcessEvent]:
        data = base64.b64encode(b"hi\n").decode()
        yield ProcessEvent(type="output", stream="stdout", offset=3, data=data)
        yield ProcessEvent(type="detached", reason="detached", offset=3)

    async def write_stdin(vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten:
        return StdinWritten(written=len(data), closed=eof)

    async def anything(*_: Any) -> None:
        return None

    from pal.errors import NotFound

    def missing(pid: int) -> ProcessInfo:
        raise NotFound(f"no process {pid}", code="PROCESS_NOT_FOUND")

    m._process_missing = missing  # type: ignore[attr-defined]
    m.get_process, m.attach_process, m.write_stdin = get_process, attach_process, write_stdin  # type: ignore[method-assign]
    m.signal_process = m.resize_process = anything  # type: ignore[method-assign,assignment]
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def echo() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=_echo_one, args=(conn,), daemon=True).start()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    m.port_servers[PORT] = srv.getsockname()[1]
    yield vm
    stop.set()
    t.join()
    srv.close()


def _echo_one(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            return


def _path(case: schemathesis.Case, vm: str | None) -> str:
    params = dict(case.path_parameters or {})
    if vm is not None:
        params["vm_id"] = vm
        params.setdefault("pid", str(PID))
        params.setdefault("port", str(PORT))
    path = case.path
    for name, value in params.items():
        path = path.replace("{" + name + "}", quote(str(value), safe=""))
    query = "&".join(
        f"{quote(str(k), safe='')}={quote(str(v), safe='')}" for k, v in (case.query or {}).items()
    )
    return path + ("?" + query if query else "")


def _handshake(client: TestClient, path: str, headers: dict[str, str], frames: list[Any]) -> str:
    """Open ``path`` as a WebSocket and send ``frames``: a refusal must be a 4xx, an open
    socket must take whatever it is sent and end cleanly; an app exception propagates.
    What happened: ``refused``, ``opened`` or ``closed``."""
    try:
        with client.websocket_connect(path, headers=headers) as ws:
            for frame in frames:
                if isinstance(frame, bytes):
                    ws.send_bytes(frame)
                else:
                    ws.send_text(frame)
        return "opened"
    except WebSocketDenialResponse as refused:
        assert 400 <= refused.status_code < 500, (path, refused.status_code, refused.text)
        return "refused"
    except WebSocketDisconnect as closed:
        assert closed.code != 1011 or "internal" not in (closed.reason or "").lower(), (path, closed)
        return "closed"


@pytest.mark.parametrize("label", WS_LABELS)
def test_a_websocket_route_refuses_or_takes_anything_without_a_5xx(
    label: str, client: TestClient, live_vm: str
) -> None:
    seen: set[str] = set()

    @given(case=cases(label), frames=st.lists(FRAMES, max_size=4), real=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case: schemathesis.Case, frames: list[Any], real: bool) -> None:
        headers = {"Authorization": f"Bearer {KEY}"} if real or not (case.query or {}).get("palToken") else {}
        headers.update({k: str(v) for k, v in (case.headers or {}).items() if k.lower() == "origin"})
        seen.add(_handshake(client, _path(case, live_vm if real else None), headers, frames))

    fuzz()
    # The fuzz reached both sides of the handshake: refusals and sockets that took frames.
    assert "refused" in seen and seen & {"opened", "closed"}, seen


def test_the_finding_from_superscript_two_is_400(client: TestClient, live_vm: str) -> None:
    path = f"/v1/runtime/vms/{live_vm}/processes/{PID}/attach?from=%C2%B2"
    with pytest.raises(WebSocketDenialResponse) as refused:
        with client.websocket_connect(path, headers={"Authorization": f"Bearer {KEY}"}):
            pass
    assert refused.value.status_code == 400


def _rpc(client: TestClient, method: str, params: Any) -> Any:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    headers = {"Authorization": f"Bearer {KEY}", "Accept": "application/json, text/event-stream"}
    r = client.post("/mcp", json=body, headers=headers)
    assert r.status_code < 500, (method, params, r.status_code, r.text[:300])
    return r


@pytest.mark.parametrize("label", TOOL_LABELS)
def test_an_mcp_tool_answers_anything_with_a_result_or_an_error(
    label: str, client: TestClient, live_vm: str
) -> None:
    tool = label.removeprefix("POST /mcp-tool/")

    @given(case=cases(label), real=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case: schemathesis.Case, real: bool) -> None:
        args = case.body
        if isinstance(args, bytes):  # a body that is no JSON: the closest a JSON-RPC client can send
            args = args.decode("latin-1")
        if real and isinstance(args, dict) and "vmId" in args:
            args = {**args, "vmId": live_vm}
        r = _rpc(client, "tools/call", {"name": tool, "arguments": args})
        if r.status_code == 200:
            answer = r.json()
            assert "result" in answer or "error" in answer, answer

    fuzz()


def test_an_mcp_request_that_is_no_json_rpc_is_refused_below_500(client: TestClient) -> None:
    for params in ("[" * 5000 + "]" * 5000, {"name": ["x"]}, None, 7):
        _rpc(client, "tools/call", params)
    headers = {"Authorization": f"Bearer {KEY}", "Accept": "application/json, text/event-stream"}
    for raw in (b"[" * 100_000, b"\xff\xfe", b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"'):
        r = client.post("/mcp", content=raw, headers={**headers, "Content-Type": "application/json"})
        assert r.status_code < 500, (raw[:40], r.status_code, r.text[:300])
