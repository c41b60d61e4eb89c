"""The agent API and the REST API at the wire, below the SDKs: Connect's framing, errors
and streams as other clients send them (protobuf as well as JSON, a client stream over
HTTP/1.1), the listener's routing, and hostile input."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import pytest
from e2b import Sandbox
from protobuf import Oneof

from pal.e2b.gen import process_connect
from pal.e2b.gen import process_pb as pb
from tests.e2b.conftest import E2bServer


@pytest.fixture
def open_sbx(e2b_env: E2bServer) -> Sandbox:
    return Sandbox.create(secure=False)


def _envelopes(raw: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    while raw:
        flags, size = struct.unpack(">BI", raw[:5])
        yield flags, json.loads(raw[5 : 5 + size])
        raw = raw[5 + size :]


def _frame(message: dict[str, object]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(body)) + body


def _stream_headers(sandbox_id: str, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "Content-Type": "application/connect+json", **extra}


def _start_sleep(sandbox_id: str) -> dict[str, object]:
    return {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "sleep"]}}


async def test_stream_input_over_http1_with_connects_own_client(
    open_sbx: Sandbox, e2b_env: E2bServer
) -> None:
    """No pinned SDK sends a client stream; Connect's own Python client does, over HTTP/1.1
    (plain http), in protobuf binary."""
    handle = open_sbx.commands.run("cat", background=True, stdin=True)
    client = process_connect.ProcessClient(e2b_env.sandbox_url)
    S = pb.StreamInputRequest
    selector = pb.ProcessSelector(selector=Oneof[Literal["pid"], int]("pid", handle.pid))

    async def messages() -> AsyncIterator[pb.StreamInputRequest]:
        yield S(
            event=Oneof[Literal["start"], pb.StreamInputRequest.StartEvent](
                "start", S.StartEvent(process=selector)
            )
        )
        for text in (b"one\n", b"two\n"):
            data = S.DataEvent(input=pb.ProcessInput(input=Oneof[Literal["stdin"], bytes]("stdin", text)))
            yield S(event=Oneof[Literal["data"], pb.StreamInputRequest.DataEvent]("data", data))

    await client.stream_input(messages(), headers={"E2b-Sandbox-Id": open_sbx.sandbox_id})
    open_sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "one\ntwo\n"


def test_keepalives_while_idle_and_the_deadline(open_sbx: Sandbox, e2b_env: E2bServer) -> None:
    headers = _stream_headers(
        open_sbx.sandbox_id, **{"Keepalive-Ping-Interval": "1", "Connect-Timeout-Ms": "2500"}
    )
    answer = httpx.post(
        f"{e2b_env.sandbox_url}/process.Process/Start",
        headers=headers,
        content=_frame(_start_sleep(open_sbx.sandbox_id)),
        timeout=60,
    )
    assert answer.status_code == 200
    frames = list(_envelopes(answer.content))
    events: list[dict[str, Any]] = [body.get("event", {}) for flags, body in frames if flags == 0]
    assert "start" in events[0]
    assert any("keepalive" in e for e in events[1:])
    end_flags, end = frames[-1]
    assert end_flags == 2 and end["error"]["code"] == "deadline_exceeded"  # type: ignore[index]


def test_a_malformed_frame_is_a_clean_error(open_sbx: Sandbox, e2b_env: E2bServer) -> None:
    url = f"{e2b_env.sandbox_url}/process.Process/Start"
    headers = _stream_headers(open_sbx.sandbox_id)
    truncated, not_json = b"\x00\x00\x00\x00\x09{not", b"\x00\x00\x00\x00\x04{not"
    for body in (truncated, not_json, b"\x00\xff\xff\xff\xff", _frame({"process": {"cmd": 5}})):
        answer = httpx.post(url, headers=headers, content=body)
        flags, end = list(_envelopes(answer.content))[-1]
        assert flags == 2 and end["error"]["code"] in ("invalid_argument", "unimplemented")  # type: ignore[index]
    assert open_sbx.commands.run("echo still").stdout == "still\n"


def test_unary_errors_are_connect_json(open_sbx: Sandbox, e2b_env: E2bServer) -> None:
    answer = httpx.post(
        f"{e2b_env.sandbox_url}/process.Process/SendSignal",
        headers={"E2b-Sandbox-Id": open_sbx.sandbox_id, "Content-Type": "application/json"},
        json={"process": {"pid": 424242}, "signal": "SIGNAL_SIGKILL"},
    )
    assert answer.status_code == 404
    assert answer.json() == {"code": "not_found", "message": "process 424242 not found"}


def test_listener_routing(open_sbx: Sandbox, e2b_env: E2bServer) -> None:
    url = f"{e2b_env.sandbox_url}/health"
    assert httpx.get(url, headers={"E2b-Sandbox-Id": open_sbx.sandbox_id}).status_code == 204
    gone = httpx.get(url, headers={"E2b-Sandbox-Id": "vm-" + "f" * 24})
    assert gone.status_code == 502 and gone.json()["sandboxId"] == "vm-" + "f" * 24
    assert httpx.get(url).status_code == 400
    assert httpx.get(url, headers={"E2b-Sandbox-Id": "../etc"}).status_code == 400
    other_port = {"E2b-Sandbox-Id": open_sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
    assert httpx.get(url, headers=other_port).status_code == 404
    envs = httpx.get(f"{e2b_env.sandbox_url}/envs", headers={"E2b-Sandbox-Id": open_sbx.sandbox_id})
    assert envs.json()["E2B_SANDBOX"] == "true"
    metrics = httpx.get(f"{e2b_env.sandbox_url}/metrics", headers={"E2b-Sandbox-Id": open_sbx.sandbox_id})
    assert metrics.json()["cpu_count"] == 2


def test_rest_errors_and_refusals(e2b_env: E2bServer) -> None:
    key = {"X-API-KEY": e2b_env.key}
    bad = httpx.post(f"{e2b_env.api_url}/sandboxes", headers=key, json={"templateID": 7})
    assert bad.status_code == 400 and bad.json()["code"] == 400
    missing = httpx.get(f"{e2b_env.api_url}/sandboxes/vm-nope", headers=key)
    assert missing.status_code == 404 and missing.json() == {
        "code": 404,
        "message": "sandbox vm-nope not found",
    }
    build = httpx.post(f"{e2b_env.api_url}/v3/templates", headers=key, json={})
    assert build.status_code == 501 and "pal image build" in build.json()["message"]
    assert httpx.get(f"{e2b_env.api_url}/v2/sandboxes").status_code == 401
    alias = httpx.get(f"{e2b_env.api_url}/templates/aliases/base", headers=key)
    assert alias.json() == {"templateID": "base", "public": False}
