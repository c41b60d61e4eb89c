"""Issue 22: processes that outlive their request, over the REST API, on real VMs.

One VM is shared by the module's tests (each starts processes of its own); pauses, forks
and the other tenant's view are the few that need more. Output is read back byte-exact
(``encoding=base64``) and compared by sha256 with what the command must print.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import PalServer

pytestmark = pytest.mark.vm

SEQ_N = 400_000  # `seq 1 SEQ_N`: 2.7 MB, deterministic
SEQ_BYTES = "".join(f"{i}\n" for i in range(1, SEQ_N + 1)).encode()


@pytest.fixture(scope="module")
def shared(pal_server: PalServer, tenant_key: str) -> Iterator[tuple[httpx.Client, str]]:
    with pal_server.client(tenant_key) as api:
        r = api.post("/v1/runtime/schedule", json={})
        assert r.status_code == 200, r.text
        vm_id = r.json()["vmId"]
        try:
            yield api, vm_id
        finally:
            api.delete(f"/v1/runtime/vms/{vm_id}")


def procs(vm: str) -> str:
    return f"/v1/runtime/vms/{vm}/processes"


def start(api: httpx.Client, vm: str, script: str, **extra: Any) -> int:
    r = api.post(procs(vm), json={"command": "/bin/sh", "argv": ["-c", script], **extra})
    assert r.status_code == 201, r.text
    assert r.json()["running"] is True or r.json()["exitCode"] is not None
    return int(r.json()["processId"])


POLLS = 20  # long polls (30 s each) a test gives a process to do what it must


def wait(api: httpx.Client, vm: str, pid: int) -> dict[str, Any]:
    for _ in range(POLLS):
        r = api.post(f"{procs(vm)}/{pid}/wait", params={"timeoutSecs": 30}, timeout=60)
        assert r.status_code == 200, r.text
        if not r.json()["running"]:
            return r.json()  # type: ignore[no-any-return]
    raise AssertionError(f"process {pid} did not exit")


def read_until(api: httpx.Client, vm: str, pid: int, needle: str, count: int = 1) -> str:
    """The text output from the start until it holds ``needle`` ``count`` times."""
    text, nxt = "", 0
    for _ in range(POLLS * 6):
        r = api.get(f"{procs(vm)}/{pid}/output", params={"from": nxt, "waitMs": 5000}, timeout=60)
        assert r.status_code == 200, r.text
        text += "".join(o["data"] for o in r.json()["output"])
        nxt = r.json()["next"]
        if text.count(needle) >= count:
            return text
        assert r.json()["process"]["running"], text
    raise AssertionError(f"{needle!r} never came: {text!r}")


def read_all(api: httpx.Client, vm: str, pid: int, start_at: int = 0) -> tuple[bytes, int]:
    """Every byte from ``start_at`` to the end of the (exited) process's output, by polls."""
    got, nxt = b"", start_at
    for _ in range(POLLS * 10):
        r = api.get(
            f"{procs(vm)}/{pid}/output",
            params={"from": nxt, "encoding": "base64", "waitMs": 5000},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["gap"] == 0, body["gap"]
        got += b"".join(base64.b64decode(o["data"]) for o in body["output"])
        nxt = body["next"]
        if not body["process"]["running"] and nxt == body["process"]["journal"]["end"]:
            return got, nxt
    raise AssertionError(f"process {pid}'s output never ended")


def sse_events(resp: httpx.Response) -> Iterator[tuple[str, str | None, str]]:
    """(event, id, data) of an SSE response, as they come."""
    event, eid, data = "message", None, []
    for line in resp.iter_lines():
        if line == "":
            if data:
                yield event, eid, "\n".join(data)
            event, eid, data = "message", None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "id":
                eid = value
            elif field == "data":
                data.append(value)


def follow(
    api: httpx.Client,
    vm: str,
    pid: int,
    offset: int,
    stop_after: int | None = None,
    attached: threading.Event | None = None,
) -> tuple[bytes, int, str, dict[str, Any]]:
    """Follow the SSE output from ``offset``: (bytes, last id, how it ended, its data).
    ``stop_after``: drop the connection once that many bytes came (a client gone away);
    ``attached`` is set once the first output arrived."""
    import json

    got = b""
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(offset)}
    with api.stream(
        "GET", f"{procs(vm)}/{pid}/output", params={"encoding": "base64"}, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for event, eid, data in sse_events(resp):
            body = json.loads(data)
            if event in ("stdout", "stderr"):
                got += base64.b64decode(body["data"])
                assert eid is not None and int(eid) == offset + len(base64.b64decode(body["data"]))
                offset = int(eid)
                if attached is not None:
                    attached.set()
                if stop_after is not None and len(got) >= stop_after:
                    return got, offset, "dropped", {}
            elif event == "gap":
                raise AssertionError(f"unexpected gap: {body}")
            else:
                return got, offset, event, body
    return got, offset, "eof", {}


# ----------------------------------------------------------------------------- the basics


def test_a_process_runs_on_and_keeps_its_exit_code(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    pid = start(api, vm, "echo out; echo err >&2; exit 3", tag="basics")
    done = wait(api, vm, pid)
    assert done["exitCode"] == 3 and done["timedOut"] is False and done["tag"] == "basics"
    listed = api.get(procs(vm)).json()["processes"]
    assert [p["exitCode"] for p in listed if p["processId"] == pid] == [3]
    r = api.get(f"{procs(vm)}/{pid}/output")
    assert r.status_code == 200, r.text
    body = r.json()
    assert {o["stream"]: o["data"] for o in body["output"]} == {"stdout": "out\n", "stderr": "err\n"}
    assert body["next"] == 8 and body["gap"] == 0
    r = api.delete(f"{procs(vm)}/{pid}")
    assert r.status_code == 200 and r.json() == {"processId": pid, "deleted": True}
    assert api.get(f"{procs(vm)}/{pid}").status_code == 404


def test_a_dropped_stream_reattaches_without_losing_or_repeating_a_byte(
    shared: tuple[httpx.Client, str],
) -> None:
    api, vm = shared
    pid = start(api, vm, f"seq 1 {SEQ_N}", journalBytes=64 * 1024 * 1024)
    first, offset, how, _ = follow(api, vm, pid, 0, stop_after=len(SEQ_BYTES) // 3)
    assert how == "dropped" and 0 < offset < len(SEQ_BYTES)
    rest, end, how, body = follow(api, vm, pid, offset)
    assert how == "exit" and body == {"exitCode": 0, "timedOut": False}, (how, body)
    assert hashlib.sha256(first + rest).hexdigest() == hashlib.sha256(SEQ_BYTES).hexdigest()
    assert end == len(SEQ_BYTES)
    # The polling read gives the same bytes, from any offset.
    polled, nxt = read_all(api, vm, pid, 1000)
    assert polled == SEQ_BYTES[1000:] and nxt == len(SEQ_BYTES)


def test_stdin_round_trip_of_binary_data(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    pid = start(api, vm, "cat", stdin=True)
    data = bytes(range(256)) * 512  # every byte value, 128 KiB
    sent = 0
    while sent < len(data):
        r = api.post(f"{procs(vm)}/{pid}/stdin", content=data[sent : sent + 65536])
        assert r.status_code == 200, r.text
        sent += r.json()["written"]
    r = api.post(f"{procs(vm)}/{pid}/stdin/close")
    assert r.status_code == 200 and r.json()["closed"] is True, r.text
    assert wait(api, vm, pid)["exitCode"] == 0
    assert read_all(api, vm, pid)[0] == data
    # Its stdin is closed now: 409.
    r = api.post(f"{procs(vm)}/{pid}/stdin", content=b"more")
    assert r.status_code == 409, r.text


SIGINT_SCRIPT = """
import os, time
pid = os.fork()
who = "child" if pid == 0 else "parent"
print(who, "ready", flush=True)
try:
    time.sleep(300)
except KeyboardInterrupt:
    print(who, "got INT", flush=True)
if pid:
    os.waitpid(pid, 0)
"""


def test_sigint_reaches_the_process_group(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    r = api.post(procs(vm), json={"command": "python3", "argv": ["-c", SIGINT_SCRIPT]})
    assert r.status_code == 201, r.text
    pid = r.json()["processId"]
    read_until(api, vm, pid, "ready", 2)
    r = api.post(f"{procs(vm)}/{pid}/signal", json={"signal": "INT"})
    assert r.status_code == 200, r.text
    assert wait(api, vm, pid)["exitCode"] == 0
    out = read_all(api, vm, pid)[0].decode()
    assert "parent got INT" in out and "child got INT" in out, out
    # An exited process takes no signal.
    assert api.post(f"{procs(vm)}/{pid}/signal", json={"signal": "TERM"}).status_code == 409


def test_a_terminal_reports_itself_and_follows_a_resize(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    pid = start(api, vm, "tty; stty size; read x; stty size", pty={"cols": 100, "rows": 30})
    text = read_until(api, vm, pid, "30 100")
    assert "/dev/pts/" in text, text
    r = api.post(f"{procs(vm)}/{pid}/resize", json={"cols": 120, "rows": 40})
    assert r.status_code == 200, r.text
    assert api.post(f"{procs(vm)}/{pid}/stdin", content=b"\n").status_code == 200
    assert wait(api, vm, pid)["exitCode"] == 0
    assert "40 120" in read_all(api, vm, pid)[0].decode()
    # A process without a terminal cannot be resized.
    plain = start(api, vm, "true")
    assert api.post(f"{procs(vm)}/{plain}/resize", json={"cols": 80, "rows": 24}).status_code == 409


def test_journal_overflow_is_a_gap_of_the_exact_byte_count(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    size, bound = 300_000, 64 * 1024
    pid = start(api, vm, f"head -c {size} /dev/zero | tr '\\0' a", journalBytes=bound)
    info = wait(api, vm, pid)
    assert info["journal"] == {"start": size - bound, "end": size, "capacity": bound}
    r = api.get(f"{procs(vm)}/{pid}/output", params={"from": 0, "encoding": "base64"})
    body = r.json()
    assert body["gap"] == size - bound
    assert b"".join(base64.b64decode(o["data"]) for o in body["output"]) == b"a" * bound
    with api.stream(
        "GET", f"{procs(vm)}/{pid}/output", headers={"Accept": "text/event-stream"}, params={"from": 0}
    ) as resp:
        import json

        first = next(sse_events(resp))
        assert first[0] == "gap" and json.loads(first[2]) == {"lost": size - bound}
        assert first[1] == str(size - bound)


# ----------------------------------------------------------------------------- exec


def test_every_exec_names_its_process(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/echo", "argv": ["hi"]})
    assert r.status_code == 200, r.text
    pid = int(r.headers["X-Pal-Process-Id"])
    assert r.json()["processId"] == pid and r.json()["stdout"] == "hi\n"
    assert api.get(f"{procs(vm)}/{pid}").json()["exitCode"] == 0
    with api.stream(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "/bin/echo", "argv": ["sse"]},
        headers={"Accept": "text/event-stream"},
    ) as resp:
        events = list(sse_events(resp))
    assert events[0][0] == "process" and str(events[0][2]).startswith('{"processId":'), events


def test_yield_after_ms_both_ways(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    exec_url = f"/v1/runtime/vms/{vm}/exec"
    r = api.post(exec_url, json={"command": "/bin/echo", "argv": ["quick"], "yieldAfterMs": 30000})
    assert r.status_code == 200, r.text
    assert r.json()["exitCode"] == 0 and r.json()["stdout"] == "quick\n" and "running" not in r.json()
    script = "echo started; sleep 600"
    r = api.post(exec_url, json={"command": "/bin/sh", "argv": ["-c", script], "yieldAfterMs": 200})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["running"] is True and "exitCode" not in body, body
    pid = body["processId"]
    assert "started\n".startswith(body["stdout"]) and body["next"] == len(body["stdout"])
    # It runs on, until deleted.
    assert api.get(f"{procs(vm)}/{pid}").json()["running"] is True
    assert api.delete(f"{procs(vm)}/{pid}").status_code == 200


# ----------------------------------------------------------------------------- refusals


def test_a_processs_stats_come_from_the_guest(
    pal_server: PalServer, tenant_key: str, shared: tuple[httpx.Client, str]
) -> None:
    """GET .../stats: the guest's /proc of the process now, through a verb the node relays
    with no code of its own; and the SDK's call of it."""
    from pal.sdk import Client

    api, vm = shared
    base = procs(vm)
    idle = start(api, vm, "echo up; exec sleep 600")
    read_until(api, vm, idle, "up")
    r = api.get(f"{base}/{idle}/stats")
    assert r.status_code == 200, r.text
    now = r.json()
    # /proc's word now: S once sleep blocks; before that R (the shell exec'ing it) or D
    # (sleep paged in from the disk), on a slow guest (TCG)
    assert now["processId"] == idle and now["running"] is True and now["state"] in ("R", "S", "D"), now
    assert now["threads"] == 1 and now["rssBytes"] > 0 and now["cpuUserMs"] >= 0, now
    # a shell that counted to 300 000 spent CPU time, which its own figures show
    busy = start(api, vm, "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo done; read x", stdin=True)
    read_until(api, vm, busy, "done")
    with Client(pal_server.url, tenant_key, timeout=60) as sdk:
        spent = sdk.runtime.processes.stats(vm, busy)
    assert spent["running"] is True and spent["cpuUserMs"] + spent["cpuSystemMs"] > 0, spent
    assert api.post(f"{base}/{idle}/signal", json={"signal": "TERM"}).status_code == 200
    assert wait(api, vm, idle)["running"] is False
    ended = api.get(f"{base}/{idle}/stats").json()
    assert (ended["running"], ended["state"], ended["rssBytes"], ended["cpuUserMs"]) == (
        False,
        "exited",
        None,
        None,
    )
    r = api.get(f"{base}/999999/stats")
    assert r.status_code == 404 and r.json()["error"]["code"] == "PROCESS_NOT_FOUND", r.text
    api.post(f"{base}/{busy}/stdin/close")


def test_bad_input_is_400_and_unknown_processes_404(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    base = procs(vm)
    bad_starts = [
        {"command": "/bin/true", "pty": {"cols": 0, "rows": 24}},
        {"command": "/bin/true", "journalBytes": 1},
        {"command": "/bin/true", "tag": "a\u0000b"},
        {"command": "/bin/true", "yieldAfterMs": 10},
        {"command": "/no/such/program"},
    ]
    for body in bad_starts:
        r = api.post(base, json=body)
        assert r.status_code == 400, (body, r.text)
    pid = start(api, vm, "true")
    assert api.get(f"{base}/{pid}/output", params={"from": -1}).status_code == 400
    assert api.get(f"{base}/{pid}/output", params={"from": 10**9}).status_code == 400
    r = api.get(f"{base}/{pid}/output", headers={"Accept": "text/event-stream", "Last-Event-ID": "x"})
    assert r.status_code == 400, r.text
    assert api.post(f"{base}/{pid}/signal", json={"signal": "BOGUS"}).status_code == 400
    assert api.get(f"{base}/999999").status_code == 404
    assert api.get(f"{base}/0").status_code in (400, 422)
    r = api.get(f"{base}/999999/output", headers={"Accept": "text/event-stream"})
    assert r.status_code == 404, r.text


def test_another_tenants_vm_is_404(pal_server: PalServer, shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    pid = start(api, vm, "true")
    other = pal_server.tenant("it-processes-other", max_vms=1)
    with pal_server.client(other) as them:
        assert them.get(procs(vm)).status_code == 404
        assert them.get(f"{procs(vm)}/{pid}").status_code == 404
        assert them.post(procs(vm), json={"command": "/bin/true"}).status_code == 404
        assert them.delete(f"{procs(vm)}/{pid}").status_code == 404
    assert api.get(f"{procs(vm)}/{pid}").status_code == 200


# ----------------------------------------------------------------------------- across pauses


# 400 lines over a pause: the second 200 wait for GATE (the test opens it after the resume),
# so the pause always lands while the process runs, however slow the host. One Python
# process, not a `sleep` per line: a fork and exec per line cost seconds under TCG.
GATE = "/tmp/slow-gate"
SLOW = (
    f"rm -f {GATE}; python3 -u -c 'import os, time\n"
    "for i in range(400):\n"
    f'    while i == 200 and not os.path.exists("{GATE}"): time.sleep(0.05)\n'
    '    print("line", i); time.sleep(0.02 if i < 200 else 0.005)\''
)
SLOW_BYTES = "".join(f"line {i}\n" for i in range(400)).encode()


def open_gate(api: httpx.Client, vm: str) -> None:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/touch", "argv": [GATE]})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text


@pytest.mark.parametrize("mode", ["snapshot", "live"])
def test_a_stream_ends_detached_on_a_pause_and_resumes_after_it(
    shared: tuple[httpx.Client, str], mode: str
) -> None:
    api, vm = shared
    pid = start(api, vm, SLOW)
    got, offset, how, _ = follow(api, vm, pid, 0, stop_after=200)
    assert how == "dropped"
    # A reader attached while the VM pauses: its stream ends with `detached`, no exit.
    ended: dict[str, Any] = {}
    attached = threading.Event()

    def reader() -> None:
        try:
            more, off, why, body = follow(api, vm, pid, offset, attached=attached)
            ended.update(more=more, offset=off, how=why, body=body)
        except BaseException as exc:
            ended["error"] = exc
            attached.set()

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert attached.wait(300), "the reader got no output before the gate"  # a hang guard
        r = api.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": mode})
        assert r.status_code == 200, r.text
        t.join(300)  # a hang guard: the stream must end by itself
        assert ended.get("how") == "detached", ended
        assert ended["body"]["reason"] == ("vm-stopped" if mode == "snapshot" else "live-paused"), ended
    finally:
        if api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "paused":
            r = api.post(f"/v1/runtime/vms/{vm}/resume")
            assert r.status_code == 200, r.text
        open_gate(api, vm)
    got += ended["more"]
    rest, end, how, body = follow(api, vm, pid, ended["offset"])
    assert how == "exit" and body["exitCode"] == 0, (how, body)
    assert got + rest == SLOW_BYTES and end == len(SLOW_BYTES)
    # The exit code survives another pause.
    assert api.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": mode}).status_code == 200
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    assert api.get(f"{procs(vm)}/{pid}").json()["exitCode"] == 0


def test_a_fork_child_carries_the_parents_processes(shared: tuple[httpx.Client, str]) -> None:
    api, vm = shared
    pid = start(api, vm, "echo before; read x; echo after $x", stdin=True)
    read_until(api, vm, pid, "before")
    r = api.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 1})
    assert r.status_code == 200, r.text
    child = r.json()["forks"][0]["vmId"]
    try:
        assert api.get(f"{procs(child)}/{pid}").json()["running"] is True
        for who, name in ((child, "child"), (vm, "parent")):
            r = api.post(f"{procs(who)}/{pid}/stdin", params={"eof": "true"}, content=f"{name}\n".encode())
            assert r.status_code == 200, r.text
            assert wait(api, who, pid)["exitCode"] == 0
            assert read_all(api, who, pid)[0] == f"before\nafter {name}\n".encode()
    finally:
        api.delete(f"/v1/runtime/vms/{child}")


# ----------------------------------------------------------------------------- the SDK


def test_the_sdk_iterator_reattaches_across_a_pause_by_itself(
    pal_server: PalServer, tenant_key: str, shared: tuple[httpx.Client, str]
) -> None:
    from pal.sdk import AsyncClient, Client

    api, vm = shared
    seen: list[Any] = []
    with Client(pal_server.url, tenant_key, timeout=300) as sdk:
        p = sdk.runtime.processes
        proc = p.start(vm, "/bin/sh", ["-c", SLOW], tag="sdk")
        pid = proc["processId"]
        events = p.output(vm, pid)
        while sum(len(e.data) for e in seen) < 200:
            seen.append(next(events))
        # Paused and resumed while the iterator is in the middle: it reattaches itself.
        assert api.post(f"/v1/runtime/vms/{vm}/pause", json={"mode": "live"}).status_code == 200
        resumer = threading.Thread(
            target=lambda: (api.post(f"/v1/runtime/vms/{vm}/resume"), open_gate(api, vm))
        )
        resumer.start()
        seen += list(events)
        resumer.join()
        assert seen[-1].type == "exit" and seen[-1].exit_code == 0
        assert b"".join(e.data for e in seen) == SLOW_BYTES
        offsets = [e.offset for e in seen if e.type in ("stdout", "stderr")]
        assert offsets == sorted(offsets) and offsets[-1] == len(SLOW_BYTES)
        # The other calls, briefly: stdin, wait, kill.
        cat = p.start(vm, "cat", stdin=True)["processId"]
        p.send_stdin(vm, cat, b"\x00\xffbytes", eof=True)
        assert p.wait(vm, cat)["exitCode"] == 0
        assert b"".join(o["data"] for o in p.read(vm, cat)["output"]) == b"\x00\xffbytes"
        assert p.kill(vm, cat)["deleted"] is True

    async def async_side() -> bytes:
        async with AsyncClient(pal_server.url, tenant_key, timeout=300) as client:
            ap = client.runtime.processes
            started = await ap.start(vm, "/bin/echo", ["async"])
            return b"".join([ev.data async for ev in ap.output(vm, started["processId"])])

    import asyncio

    assert asyncio.run(async_side()) == b"async\n"


def test_a_reader_reattaching_wakes_an_idle_suspended_vm(api: httpx.Client) -> None:
    import time

    vm = api.post("/v1/runtime/schedule", json={"idleTimeoutSecs": 5}).json()["vmId"]
    try:
        # Prints for a while with nobody reading: not activity, so the VM is suspended
        # while it runs; its output waits in the journal, in the snapshot.
        script = "i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.5; done"
        pid = start(api, vm, script)
        for _ in range(1200):  # a hang guard (0.25 s polls), not a speed bound
            if api.get(f"/v1/runtime/vms/{vm}").json()["state"] == "paused":
                break
            time.sleep(0.25)
        else:
            raise AssertionError("the VM was never idle-suspended")
        # The reader wakes it and gets everything, from the first byte to the exit.
        got, end, how, body = follow(api, vm, pid, 0)
        assert how == "exit" and body["exitCode"] == 0, (how, body)
        assert got == "".join(f"tick {i}\n" for i in range(40)).encode() and end == len(got)
        events = api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
        assert any(e["kind"] == "auto_resume" for e in events), events
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")
