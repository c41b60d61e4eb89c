"""`pal.sdk` as an agent developer uses it: `Client` and `AsyncClient` against a real `pal up`
with real microVMs — the whole lifecycle, streamed output, concurrency and typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from pal.sdk import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    ExecEvent,
    ExecResult,
    NotFoundError,
    PalApiError,
    PalConnectionError,
    PayloadTooLargeError,
    QuotaExceededError,
)
from tests.conftest import PalServer, free_port

pytestmark = pytest.mark.vm

SHELL_LINE = ["-c", "echo hello; echo err >&2; exit 3"]


@pytest.fixture(scope="module")
def sdk_key(pal_server: PalServer, tenant_key: str) -> str:
    """A tenant of its own; ``tenant_key`` only makes sure the warm template exists."""
    del tenant_key
    return pal_server.tenant("e2e-sdk", max_vms=8)


@pytest.fixture
def client(pal_server: PalServer, sdk_key: str) -> Iterator[Client]:
    with Client(pal_server.url, sdk_key, timeout=120) as c:
        yield c


@pytest.fixture
def vms(client: Client) -> Iterator[list[str]]:
    """VM ids a test made; all deleted afterwards, even when the test fails."""
    made: list[str] = []
    try:
        yield made
    finally:
        for vm_id in made:
            with contextlib.suppress(PalApiError):
                client.runtime.delete(vm_id)


def test_client_reads_pal_url_and_key_from_the_environment(
    pal_server: PalServer, sdk_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAL_URL", pal_server.url)
    monkeypatch.setenv("PAL_API_KEY", sdk_key)
    with Client() as c:
        assert c.base_url == pal_server.url and c.health()["ok"] is True  # this server
        with pytest.raises(NotFoundError) as missing:  # authenticated (not 401) by that key
            c.runtime.get("vm-none")
        assert missing.value.status == 404
    monkeypatch.setenv("PAL_API_KEY", "pal_wrong")
    with Client() as c, pytest.raises(AuthenticationError) as exc:
        c.runtime.list()
    assert exc.value.status == 401


def test_sync_lifecycle(client: Client, vms: list[str]) -> None:
    rt = client.runtime
    vm = rt.schedule(idleTimeoutSecs=0)
    vm_id = vm["vmId"]
    vms.append(vm_id)
    assert vm["state"] == "running"
    assert vm_id in [v["vmId"] for v in rt.list()]

    res = rt.exec(vm_id, "/bin/sh", SHELL_LINE)
    assert res == ExecResult(3, "hello\n", "err\n", process_id=res.process_id) and res.process_id
    assert rt.exec(vm_id, "printenv", ["X"], env={"X": "a b"}).stdout == "a b\n"
    assert rt.exec(vm_id, "pwd", cwd="/tmp").stdout == "/tmp\n"
    streamed = list(rt.exec_stream(vm_id, "/bin/sh", SHELL_LINE))
    assert streamed[0].type == "process" and streamed[0].process_id  # every exec is a process
    assert streamed[1:] == [
        ExecEvent("stdout", data="hello\n"),
        ExecEvent("stderr", data="err\n"),
        ExecEvent("exit", exit_code=3),
    ]

    # files: text and bytes in, text out, listing, and exec sees the same files
    assert rt.write_file(vm_id, "data/greeting.txt", "héllo\n") == {
        "path": "data/greeting.txt",
        "bytesWritten": 7,
    }
    rt.write_file(vm_id, "data/raw.bin", b"\x00\x01\x02")
    text = rt.read_file(vm_id, "data/greeting.txt")
    assert text == "héllo\n" and text.truncated is False
    listing = rt.list_files(vm_id, "data")
    assert sorted((e["name"], e["size"]) for e in listing["entries"]) == [
        ("greeting.txt", 7),
        ("raw.bin", 3),
    ]
    assert rt.exec(vm_id, "wc", ["-c", "data/raw.bin"]).stdout == "3 data/raw.bin\n"
    # bytes come back exactly; a file that is not text is never decoded by mistake
    rt.write_file(vm_id, "data/bin", bytes(range(256)))
    assert rt.read_file_bytes(vm_id, "data/bin") == bytes(range(256))
    with pytest.raises(UnicodeDecodeError):
        rt.read_file(vm_id, "data/bin")
    assert rt.delete_file(vm_id, "data/bin") == {"path": "data/bin", "deleted": True}
    with pytest.raises(NotFoundError):
        rt.delete_file(vm_id, "data/bin")
    with pytest.raises(BadRequestError):
        rt.delete_file(vm_id, "data")  # a directory
    rt.exec(vm_id, "/bin/sh", ["-c", "head -c 1100000 /dev/zero | tr '\\0' b > big.txt"])
    big = rt.read_file(vm_id, "big.txt")
    assert big.truncated is True and len(big) == 1024 * 1024 and set(big) == {"b"}

    paused = rt.pause(vm_id)
    assert paused["state"] == "paused" and paused["snapshotId"]
    assert rt.get(vm_id)["state"] == "paused"
    assert rt.resume(vm_id) == {"vmId": vm_id, "snapshotId": paused["snapshotId"], "state": "running"}
    assert rt.read_file(vm_id, "data/greeting.txt") == "héllo\n"

    forked = rt.fork(vm_id, count=2)
    kids = [f["vmId"] for f in forked["forks"]]
    vms.extend(kids)
    assert forked["sourceVmId"] == vm_id and len(set(kids)) == 2
    for kid in kids:
        assert rt.get(kid)["parentVmId"] == vm_id
        assert rt.read_file(kid, "data/greeting.txt") == "héllo\n"
    rt.write_file(kids[0], "data/greeting.txt", "changed in a fork\n")
    assert rt.read_file(kids[1], "data/greeting.txt") == "héllo\n"
    assert rt.read_file(vm_id, "data/greeting.txt") == "héllo\n"

    settled = [e["toState"] for e in rt.events(vm_id) if e.get("toState") in ("running", "paused")]
    assert settled[:3] == ["running", "paused", "running"]

    for v in (*kids, vm_id):
        assert rt.delete(v)["state"] == "terminated"
    assert rt.get(vm_id)["state"] == "terminated"
    assert not {vm_id, *kids} & {v["vmId"] for v in rt.list() if v["state"] != "terminated"}


def test_exec_stream_yields_output_as_it_happens(client: Client, vms: list[str]) -> None:
    vm_id = client.runtime.schedule()["vmId"]
    vms.append(vm_id)
    # The command cannot end before the test, having got "first", creates the gate.
    line = "echo first; while [ ! -e gate ]; do sleep 0.1; done; echo second"
    seen: list[ExecEvent] = []
    for ev in client.runtime.exec_stream(vm_id, "/bin/sh", ["-c", line]):
        if ev.type == "process":
            continue
        seen.append(ev)
        if ev.data == "first\n":
            client.runtime.write_file(vm_id, "gate", b"")
    assert seen == [
        ExecEvent("stdout", data="first\n"),
        ExecEvent("stdout", data="second\n"),
        ExecEvent("exit", exit_code=0),
    ]


async def test_async_client_concurrent_execs_and_stream(pal_server: PalServer, sdk_key: str) -> None:
    async with AsyncClient(pal_server.url, sdk_key, timeout=120) as c:
        rt = c.runtime
        made = await asyncio.gather(rt.schedule(), rt.schedule())
        ids = [v["vmId"] for v in made]
        try:
            assert len(set(ids)) == 2 and all(v["state"] == "running" for v in made)

            # three commands in each VM at once: they overlap instead of queueing. Each
            # says it started, then waits for /tmp/go: queued ones would never all start.
            def line(vm: str, i: int) -> str:
                return f"touch /tmp/started-{i}; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo {vm}-{i}"

            running = asyncio.gather(
                *(rt.exec(vm, "/bin/sh", ["-c", line(vm, i)]) for vm in ids for i in range(3))
            )
            deadline = time.monotonic() + 300  # a hang guard, not a speed bound
            for vm in ids:
                count = ["-c", "ls /tmp | grep -c '^started-' || true"]
                while (await rt.exec(vm, "/bin/sh", count)).stdout.strip() != "3":
                    assert time.monotonic() < deadline and not running.done(), "the execs did not all start"
                    await asyncio.sleep(0.1)
            for vm in ids:
                await rt.exec(vm, "/bin/touch", ["/tmp/go"])
            results = await running
            assert [r.stdout for r in results] == [f"{vm}-{i}\n" for vm in ids for i in range(3)]
            assert all(r.exit_code == 0 for r in results)

            await rt.write_file(ids[0], "a.txt", "async\n")
            assert await rt.read_file(ids[0], "a.txt") == "async\n"
            assert [e["name"] for e in (await rt.list_files(ids[0]))["entries"]] == ["a.txt"]
            events = [ev async for ev in rt.exec_stream(ids[0], "/bin/sh", SHELL_LINE)]
            assert events.pop(0).type == "process"
            assert events == [
                ExecEvent("stdout", data="hello\n"),
                ExecEvent("stderr", data="err\n"),
                ExecEvent("exit", exit_code=3),
            ]
            assert (await rt.get(ids[1]))["state"] == "running"
            with pytest.raises(NotFoundError):
                await rt.get("vm-no-such-vm")
        finally:
            for vm in ids:
                with contextlib.suppress(PalApiError):
                    await rt.delete(vm)
        assert {(await rt.get(vm))["state"] for vm in ids} == {"terminated"}


def test_typed_errors(pal_server: PalServer, client: Client, vms: list[str]) -> None:
    rt = client.runtime
    with pytest.raises(NotFoundError) as nf:
        rt.get("vm-no-such-vm")
    assert nf.value.status == 404 and nf.value.message
    with pytest.raises(NotFoundError):
        rt.exec("vm-no-such-vm", "true")

    vm_id = rt.schedule()["vmId"]
    vms.append(vm_id)
    with pytest.raises(ConflictError) as conflict:
        rt.resume(vm_id)  # it is running
    assert conflict.value.status == 409
    with pytest.raises(BadRequestError):
        rt.fork(vm_id, count=0)
    with pytest.raises(PayloadTooLargeError):
        rt.write_file(vm_id, "big.bin", b"x" * (1024 * 1024 + 1))

    # an operator-paused VM is never woken by an exec, buffered or streamed
    rt.pause(vm_id)
    with pytest.raises(ConflictError) as conflict:
        rt.exec(vm_id, "true")
    assert conflict.value.status == 409 and conflict.value.code
    with pytest.raises(ConflictError):
        list(rt.exec_stream(vm_id, "true"))
    assert rt.get(vm_id)["state"] == "paused"

    # another tenant's VM does not exist for it
    other = pal_server.tenant("e2e-sdk-quota", max_vms=1)
    with Client(pal_server.url, other, timeout=120) as c2:
        with pytest.raises(NotFoundError):
            c2.runtime.get(vm_id)
        first = c2.runtime.schedule()["vmId"]
        try:
            with pytest.raises(QuotaExceededError) as quota:
                c2.runtime.schedule()
            assert quota.value.status == 402 and quota.value.message
        finally:
            c2.runtime.delete(first)
        # the freed slot can be used again
        c2.runtime.delete(c2.runtime.schedule()["vmId"])

    with Client(pal_server.url, "pal_wrong", timeout=30) as bad, pytest.raises(AuthenticationError):
        bad.runtime.list()
    dead = f"http://127.0.0.1:{free_port()}"
    with Client(dead, "k", timeout=5) as down, pytest.raises(PalConnectionError) as conn:
        down.runtime.list()
    assert dead in conn.value.message
