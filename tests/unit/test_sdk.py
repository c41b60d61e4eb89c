"""The SDK against the real app over loopback HTTP: results, streaming and typed errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pal.sdk import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    NotFoundError,
    PalConnectionError,
    PayloadTooLargeError,
    QuotaExceededError,
)
from tests.apienv import ApiEnv, make_api, serve


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[ApiEnv, str]]:
    env = make_api(tmp_path)
    with serve(env.app) as url:
        yield env, url


def test_sync_client_round_trip(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with Client(url, env.key_a, timeout=10) as c:
        vm = c.runtime.schedule(limits={"memoryMib": 512}, idleTimeoutSecs=30)
        vm_id = vm["vmId"]
        assert vm["limits"]["memoryMib"] == 512 and vm["idleTimeoutSecs"] == 30
        assert [v["vmId"] for v in c.runtime.list()] == [vm_id]
        res = c.runtime.exec(vm_id, "echo", ["hello"])
        assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (0, "hello\n", "", False)
        res = c.runtime.exec(vm_id, "fail", ["3"])
        assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, "", "warn\n", False)
        assert c.runtime.exec(vm_id, "sleepy", timeout_secs=1).timed_out is True
        assert c.runtime.write_file(vm_id, "a.txt", "héllo") == {"path": "a.txt", "bytesWritten": 6}
        text = c.runtime.read_file(vm_id, "a.txt")
        assert text == "héllo" and text.truncated is False
        assert c.runtime.list_files(vm_id)["entries"][0]["name"] == "a.txt"
        assert c.runtime.pause(vm_id)["state"] == "paused"
        with pytest.raises(ConflictError) as exc:
            c.runtime.exec(vm_id, "echo")
        assert exc.value.status == 409 and exc.value.code == "FAILED_PRECONDITION"
        resumed = c.runtime.resume(vm_id)
        assert resumed["state"] == "running" and resumed["snapshotId"].startswith("snap-")
        (child,) = c.runtime.fork(vm_id, count=1)["forks"]
        assert child["state"] == "running" and "error" not in child
        assert ["paused", "running"] == [
            e["toState"] for e in c.runtime.events(vm_id) if e["toState"] in ("paused", "running")
        ][1:]
        assert c.runtime.delete(vm_id)["state"] == "terminated"


def test_sync_exec_stream(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with Client(url, env.key_a, timeout=10) as c:
        vm_id = c.runtime.schedule()["vmId"]
        events = list(c.runtime.exec_stream(vm_id, "echo", ["x"]))
        assert [(e.type, e.data, e.exit_code) for e in events] == [("stdout", "x\n", None), ("exit", None, 0)]
        events = list(c.runtime.exec_stream(vm_id, "fail", ["2"]))
        assert [(e.type, e.data, e.exit_code) for e in events] == [
            ("stderr", "warn\n", None),
            ("exit", None, 2),
        ]
        # A guest-side failure is the stream's last event, not an HTTP error.
        (err,) = list(c.runtime.exec_stream(vm_id, "missing"))
        assert err.type == "error" and err.code == "EXECUTABLE_NOT_FOUND" and err.message


def test_typed_errors(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with pytest.raises(AuthenticationError):
        Client(url, "pal_bogus").runtime.list()
    c = Client(url, env.key_a)
    with pytest.raises(NotFoundError):
        c.runtime.get("vm-nope")
    with pytest.raises(BadRequestError, match=r"limits\.vcpus"):
        c.runtime.schedule(limits={"vcpus": 0})
    vm_id = c.runtime.schedule()["vmId"]
    c.runtime.schedule()
    with pytest.raises(QuotaExceededError):
        c.runtime.schedule()
    with pytest.raises(PayloadTooLargeError):
        c.runtime.write_file(vm_id, "big", b"x" * (1024 * 1024 + 1))
    with pytest.raises(BadRequestError) as exc:
        c.runtime.read_file(vm_id, "../etc/passwd")
    assert exc.value.code == "PATH_ESCAPE"
    with pytest.raises(PalConnectionError):
        Client("http://127.0.0.1:9", "k", timeout=2).runtime.list()


def test_defaults_come_from_env(monkeypatch: pytest.MonkeyPatch, live: tuple[ApiEnv, str]) -> None:
    env, url = live
    monkeypatch.setenv("PAL_URL", url)
    monkeypatch.setenv("PAL_API_KEY", env.key_b)
    c = Client()
    assert c.base_url == url and c.runtime.list() == []


async def test_async_client(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    async with AsyncClient(url, env.key_a, timeout=10) as c:
        vm_id = (await c.runtime.schedule())["vmId"]
        assert (await c.runtime.get(vm_id))["state"] == "running"
        assert (await c.runtime.exec(vm_id, "echo", ["hi"])).stdout == "hi\n"
        got = [ev.type async for ev in c.runtime.exec_stream(vm_id, "fail")]
        assert got == ["stderr", "exit"]
        await c.runtime.write_file(vm_id, "f.txt", b"abc")
        assert await c.runtime.read_file(vm_id, "f.txt") == "abc"
        assert len(await c.runtime.list()) == 1
        with pytest.raises(NotFoundError):
            await c.runtime.pause("vm-nope")


async def test_async_client_over_asgi_transport(tmp_path: Path) -> None:
    env = make_api(tmp_path)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=env.app), base_url="http://localhost")
    async with AsyncClient("http://localhost", env.key_a, http_client=http) as c:
        assert (await c.runtime.schedule())["state"] == "running"


def test_sdk_imports_nothing_else_from_pal() -> None:
    code = (
        "import sys, pal.sdk; "
        "bad = sorted(m for m in sys.modules if m.startswith('pal') and not m.startswith('pal.sdk') "
        "and m != 'pal'); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_egress_in_schedule_and_set_egress(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with Client(url, env.key_a, timeout=10) as c:
        vm = c.runtime.schedule(egress={"allow": ["api.test:8080"]}, limits={"maxConnections": 8})
        assert vm["egress"] == {"allow": ["api.test:8080"]} and vm["limits"]["maxConnections"] == 8
        assert c.runtime.set_egress(vm["vmId"], "none")["egress"] == "none"
        assert c.runtime.get(vm["vmId"])["network"]["connections"] == 0
        with pytest.raises(BadRequestError, match="bad entry"):
            c.runtime.set_egress(vm["vmId"], {"allow": ["bad entry!"]})


async def test_async_set_egress(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    async with AsyncClient(url, env.key_a, timeout=10) as c:
        vm_id = (await c.runtime.schedule(egress="open"))["vmId"]
        assert (await c.runtime.set_egress(vm_id, {"deny": ["x.test"]}))["egress"] == {"deny": ["x.test"]}


async def test_images_lists_what_the_tenant_may_schedule(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with Client(url, env.key_a) as c:
        assert [i["name"] for i in c.images()] == ["default"]
    async with AsyncClient(url, env.key_a) as ac:
        [img] = await ac.images()
    assert img["digest"].startswith("sha256-")


def test_files_are_binary_safe(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    with Client(url, env.key_a, timeout=10) as c:
        vm_id = c.runtime.schedule()["vmId"]
        blob = bytes(range(256))
        assert c.runtime.write_file(vm_id, "blob.bin", blob)["bytesWritten"] == 256
        got = c.runtime.read_file_bytes(vm_id, "blob.bin")
        assert got == blob and isinstance(got, bytes) and got.truncated is False
        with pytest.raises(UnicodeDecodeError) as exc:
            c.runtime.read_file(vm_id, "blob.bin")  # never silently replaced
        assert "read_file_bytes" in str(exc.value.__notes__)
        c.runtime.write_file(vm_id, "t.txt", "é" * 10)
        assert c.runtime.read_file(vm_id, "t.txt") == "é" * 10
        assert c.runtime.delete_file(vm_id, "blob.bin") == {"path": "blob.bin", "deleted": True}
        with pytest.raises(NotFoundError):
            c.runtime.read_file_bytes(vm_id, "blob.bin")


async def test_async_files_are_binary_safe(live: tuple[ApiEnv, str]) -> None:
    env, url = live
    async with AsyncClient(url, env.key_a, timeout=10) as c:
        vm_id = (await c.runtime.schedule())["vmId"]
        await c.runtime.write_file(vm_id, "b", b"\xff\x00")
        assert await c.runtime.read_file_bytes(vm_id, "b") == b"\xff\x00"
        assert (await c.runtime.delete_file(vm_id, "b"))["deleted"] is True


def _short_writing_server(taken: bytearray, seen: list[tuple[int, str]]) -> httpx.MockTransport:
    """A stdin endpoint that takes at most 700,000 bytes of each write (as a full pipe would)."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = request.content
        seen.append((len(body), request.url.params["eof"]))
        n = min(len(body), 700_000)
        taken.extend(body[:n])
        return httpx.Response(200, json={"written": n, "closed": request.url.params["eof"] == "true"})

    return httpx.MockTransport(handle)


def _check_stdin_writes(data: bytes, taken: bytearray, seen: list[tuple[int, str]]) -> None:
    assert bytes(taken) == data
    assert all(size <= 1 << 20 for size, _ in seen) and len(seen) > 3
    assert [eof for _, eof in seen[:-1]] == ["false"] * (len(seen) - 1) and seen[-1][1] == "true"


def test_send_stdin_resends_what_the_server_did_not_take_and_closes_with_the_last_part() -> None:
    data = bytes(range(256)) * 10_000  # 2.4 MiB: several parts
    taken, seen = bytearray(), list[tuple[int, str]]()
    http = httpx.Client(base_url="http://pal.test", transport=_short_writing_server(taken, seen))
    with Client("http://pal.test", "k", http_client=http) as c:
        c.runtime.processes.send_stdin("vm1", 7, data, eof=True)
    _check_stdin_writes(data, taken, seen)


async def test_async_send_stdin_resends_what_the_server_did_not_take() -> None:
    data = bytes(range(256)) * 10_000
    taken, seen = bytearray(), list[tuple[int, str]]()
    http = httpx.AsyncClient(base_url="http://pal.test", transport=_short_writing_server(taken, seen))
    async with AsyncClient("http://pal.test", "k", http_client=http) as c:
        await c.runtime.processes.send_stdin("vm1", 7, data, eof=True)
    _check_stdin_writes(data, taken, seen)


def test_a_detached_exec_stream_is_its_own_event() -> None:
    """A streamed exec whose reader fell behind ends with ``detached`` (the command runs on):
    the API's frame and the SDK's event say so, never a made-up exit or a bare error."""
    from pal.api.exec_stream import event_frame
    from pal.sdk._wire import SseParser
    from pal.wire.models import ExecEvent as NodeEvent

    frame = event_frame(NodeEvent(type="detached", reason="slow-reader")).decode()
    (ev,) = SseParser().feed(frame.split("\n"))
    assert ev.type == "detached" and ev.code == "DETACHED" and "slow-reader" in (ev.message or "")
