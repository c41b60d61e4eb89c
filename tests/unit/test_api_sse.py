"""Streaming exec over a real HTTP server: event order, and chunks that arrive while the
command is still running."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.apienv import ApiEnv, make_api, serve

SSE = {"Accept": "text/event-stream"}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[ApiEnv, httpx.Client, str]]:
    env = make_api(tmp_path)
    with (
        serve(env.app) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {env.key_a}"}, timeout=10) as http,
    ):
        vm = http.post("/v1/runtime/schedule", json={}).json()["vmId"]
        try:
            yield env, http, vm
        finally:
            env.manager.gate.set()  # never leave the fake command waiting


def _events(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            assert name is not None
            yield name, json.loads(line[len("data: ") :])


def test_sse_events_in_order(live: tuple[ApiEnv, httpx.Client, str]) -> None:
    _, http, vm = live
    for body, want in [
        ({"command": "echo", "argv": ["a", "b"]}, [("stdout", {"data": "a b\n"}), ("exit", {"exitCode": 0})]),
        ({"command": "fail", "argv": ["3"]}, [("stderr", {"data": "warn\n"}), ("exit", {"exitCode": 3})]),
    ]:
        with http.stream("POST", f"/v1/runtime/vms/{vm}/exec", json=body, headers=SSE) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert list(_events(resp.iter_lines())) == want


def test_sse_chunk_arrives_before_the_command_ends(live: tuple[ApiEnv, httpx.Client, str]) -> None:
    env, http, vm = live
    with http.stream("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "slow"}, headers=SSE) as resp:
        events = _events(resp.iter_lines())
        # The fake node holds the command until the gate opens, so this only passes if the
        # first chunk was flushed while the command was still running.
        assert next(events) == ("stdout", {"data": "first\n"})
        assert not env.manager.slow_done
        env.manager.gate.set()
        assert list(events) == [("stdout", {"data": "second\n"}), ("exit", {"exitCode": 0})]


def test_sse_refusals_keep_their_status_guest_errors_are_events(
    live: tuple[ApiEnv, httpx.Client, str],
) -> None:
    _, http, vm = live
    resp = http.post("/v1/runtime/vms/vm-unknown/exec", json={"command": "echo"}, headers=SSE)
    assert resp.status_code == 404
    with http.stream("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "nope"}, headers=SSE) as resp:
        assert resp.status_code == 200
        got = list(_events(resp.iter_lines()))
    assert len(got) == 1 and got[0][0] == "error"
    assert got[0][1]["code"] == "EXECUTABLE_NOT_FOUND" and got[0][1]["message"]


def test_sse_timeout_is_an_exit_event(live: tuple[ApiEnv, httpx.Client, str]) -> None:
    _, http, vm = live
    with http.stream("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "sleepy"}, headers=SSE) as resp:
        got = list(_events(resp.iter_lines()))
    assert got == [("stdout", {"data": "partial"}), ("exit", {"exitCode": 124, "timedOut": True})]


def test_client_disconnect_cancels_the_command(live: tuple[ApiEnv, httpx.Client, str]) -> None:
    env, http, vm = live
    with http.stream("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "slow"}, headers=SSE) as resp:
        assert next(_events(resp.iter_lines())) == ("stdout", {"data": "first\n"})
    # leaving the block closed the connection mid-command
    assert env.manager.slow_cancelled.wait(30), "exec iterator was not closed after the client left"
    assert not env.manager.slow_done
