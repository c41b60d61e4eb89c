"""The shared SDK contract (sdk/contract/scenarios.json) in the Python SDK: one function
per active scenario, keyed by its id. tests/e2e/test_sdk_contract.py runs them in the file's
order against a real server; the Go and TypeScript runners implement the same ids."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pal.sdk import (
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    NotFoundError,
    PalApiError,
    PayloadTooLargeError,
    QuotaExceededError,
)
from pal.sdk.models import OutputEvent
from pal.sdk.processes import Processes

POLL_DEADLINE_S = 300  # a hang guard: the server sweeps lifetimes every second in the tests
SCENARIOS_FILE = Path(__file__).resolve().parents[2] / "sdk" / "contract" / "scenarios.json"


def load() -> dict[str, Any]:
    return dict(json.loads(SCENARIOS_FILE.read_text()))


@dataclass
class State:
    """What the scenarios share: the client, and the VM `schedule` made."""

    client: Client
    vm: str = ""

    def need_vm(self) -> str:
        assert self.vm, "no VM: the schedule scenario failed"
        return self.vm


def _shell(line: str) -> tuple[str, list[str]]:
    return "/bin/sh", ["-c", line]


def expect_error(exc: pytest.ExceptionInfo[PalApiError], status: int, code: str) -> None:
    err = exc.value
    assert (err.status, err.code) == (status, code), err
    assert err.message and err.request_id, err


def schedule(st: State) -> None:
    rt = st.client.runtime
    vm = rt.schedule()
    assert vm["vmId"] and vm["state"] == "running", vm
    st.vm = vm["vmId"]
    got = rt.get(st.vm)
    assert (got["vmId"], got["state"]) == (st.vm, "running")
    assert st.vm in {v["vmId"] for v in rt.list()}


def exec_buffered(st: State) -> None:
    res = st.client.runtime.exec(st.need_vm(), *_shell("echo out; echo err >&2; exit 3"))
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n"), res


def exec_stream(st: State) -> None:
    events = list(st.client.runtime.exec_stream(st.need_vm(), *_shell("echo one; echo two >&2; exit 5")))
    assert "".join(e.data or "" for e in events if e.type == "stdout") == "one\n", events
    assert "".join(e.data or "" for e in events if e.type == "stderr") == "two\n", events
    assert [e.type for e in events].count("exit") == 1, events
    assert events[-1].type == "exit" and events[-1].exit_code == 5, events


def exec_stream_close(st: State) -> None:
    vm = st.need_vm()
    stream = st.client.runtime.exec_stream(vm, *_shell("echo ready; exec sleep 600"))
    first = next(stream)
    if first.type == "process":  # the command's process id comes first (docs/processes.md)
        assert isinstance(first.process_id, int), first
        first = next(stream)
    assert (first.type, first.data) == ("stdout", "ready\n"), first
    stream.close()  # closes the connection: the server stops the command
    res = st.client.runtime.exec(vm, *_shell("echo again"))
    assert (res.exit_code, res.stdout) == (0, "again\n"), res


def files_bytes(st: State) -> None:
    rt, vm = st.client.runtime, st.need_vm()
    data = bytes(range(256))
    assert rt.write_file(vm, "contract/bin.dat", data)["bytesWritten"] == 256
    got = rt.read_file_bytes(vm, "contract/bin.dat")
    assert bytes(got) == data and not got.truncated
    entries = rt.list_files(vm, "contract")["entries"]
    assert {"name": "bin.dat", "type": "file", "size": 256} in entries, entries
    assert rt.delete_file(vm, "contract/bin.dat")["deleted"] is True
    with pytest.raises(NotFoundError) as nf:
        rt.read_file_bytes(vm, "contract/bin.dat")
    expect_error(nf, 404, "FILE_NOT_FOUND")


def pause_resume(st: State) -> None:
    rt, vm = st.client.runtime, st.need_vm()
    rt.write_file(vm, "keep.txt", "kept")
    paused = rt.pause(vm)
    assert paused["state"] == "paused" and paused["snapshotId"], paused
    assert rt.get(vm)["state"] == "paused"
    with pytest.raises(ConflictError) as conflict:
        rt.exec(vm, "/bin/true")
    expect_error(conflict, 409, "FAILED_PRECONDITION")
    resumed = rt.resume(vm)
    assert (resumed["vmId"], resumed["state"]) == (vm, "running"), resumed
    assert rt.read_file(vm, "keep.txt") == "kept"


def fork(st: State) -> None:
    rt, vm = st.client.runtime, st.need_vm()
    res = rt.fork(vm, 1)
    assert res["sourceVmId"] == vm and len(res["forks"]) == 1, res
    child = res["forks"][0]
    try:
        assert child["state"] == "running" and not child.get("error"), child
        assert child["vmId"] and child["vmId"] != vm
        assert rt.read_file(child["vmId"], "keep.txt") == "kept"
        assert rt.get(child["vmId"])["parentVmId"] == vm
        assert rt.delete(child["vmId"])["state"] == "terminated"
    finally:
        try:
            rt.delete(child["vmId"])
        except PalApiError:
            pass


def errors(st: State) -> None:
    rt, vm = st.client.runtime, st.need_vm()
    with pytest.raises(NotFoundError) as nf:
        rt.get("vm-does-not-exist")
    expect_error(nf, 404, "NOT_FOUND")
    with Client(st.client.base_url, "pal_not_a_key") as stranger:
        with pytest.raises(AuthenticationError) as unauth:
            stranger.runtime.list()
    expect_error(unauth, 401, "UNAUTHENTICATED")
    with pytest.raises(BadRequestError) as bad:
        rt.read_file(vm, "../etc/passwd")
    expect_error(bad, 400, "PATH_ESCAPE")
    with pytest.raises(PayloadTooLargeError) as big:
        rt.write_file(vm, "big.bin", bytes(1024 * 1024 + 1))
    expect_error(big, 413, "PAYLOAD_TOO_LARGE")
    with pytest.raises(ConflictError) as conflict:
        rt.resume(vm)
    expect_error(conflict, 409, "FAILED_PRECONDITION")
    with pytest.raises(QuotaExceededError) as quota:
        rt.fork(vm, 50)
    expect_error(quota, 402, "QUOTA_EXCEEDED")


def delete(st: State) -> None:
    assert st.client.runtime.delete(st.need_vm())["state"] == "terminated"
    st.vm = ""


P_SCRIPT = 'echo ready; while IFS= read -r l; do echo "got:$l"; done; echo eof; exit 3'
Q_SCRIPT = 'trap "echo caught; exit 42" INT; echo armed; while :; do sleep 1; done'
R_SCRIPT = "i=0; while :; do i=$((i+1)); echo tick $i; [ -e /tmp/stop ] && exit 0; sleep 0.2; done"


def ticks_in_order(text: str) -> bool:
    """'tick 1\\n' ... 'tick N\\n' for some N >= 3: no line lost or repeated."""
    lines = text.splitlines()
    return len(lines) >= 3 and lines == [f"tick {i}" for i in range(1, len(lines) + 1)]


def follow(events: Iterable[OutputEvent]) -> tuple[bytes, list[OutputEvent]]:
    """stdout joined, and every event; checks each stdout event's offset and one last exit."""
    out, seen = b"", list(events)
    for ev in seen:
        if ev.type == "stdout":
            out += ev.data
    assert [e.type for e in seen].count("exit") == 1 and seen[-1].type == "exit", seen
    return out, seen


def processes(st: State) -> None:
    rt = st.client.runtime
    pvm = rt.schedule()["vmId"]
    try:
        _processes(rt.processes, pvm)
        _across_a_pause(st.client, pvm)
        _kill(rt.processes, pvm)
    finally:
        assert rt.delete(pvm)["state"] == "terminated"


def _processes(pr: Processes, vm: str) -> None:
    p = pr.start(vm, *_shell(P_SCRIPT), stdin=True, tag="contract")
    pid = p["processId"]
    assert isinstance(pid, int) and p["running"] is True, p
    assert any(x["processId"] == pid and x["tag"] == "contract" for x in pr.list(vm))
    pr.send_stdin(vm, pid, b"hello\n")
    pr.close_stdin(vm, pid)
    base = 0
    for ev in (events := list(pr.output(vm, pid, 0))):
        if ev.type == "stdout":
            base += len(ev.data)
            assert ev.offset == base, events
    out, seen = follow(events)
    assert out == b"ready\ngot:hello\neof\n" and seen[-1].exit_code == 3, seen
    done = pr.wait(vm, pid)
    assert (done["running"], done["exitCode"]) == (False, 3), done
    out, seen = follow(pr.output(vm, pid, 6))
    assert out == b"got:hello\neof\n" and seen[-1].exit_code == 3, seen

    q = pr.start(vm, *_shell(Q_SCRIPT))["processId"]
    text, signalled = b"", False
    for ev in pr.output(vm, q):
        text += ev.data
        if b"armed" in text and not signalled:
            pr.signal(vm, q, "INT")
            signalled = True
        last = ev
    assert b"caught" in text and (last.type, last.exit_code) == ("exit", 42), (text, last)

    t = pr.terminal(vm, *_shell("stty size; read x; stty size"), cols=80, rows=24)
    text, resized = b"", False
    for ev in t.output():
        text += ev.data
        if b"24 80" in text and not resized:
            t.resize(100, 30)
            t.write("\n")
            resized = True
        last = ev
    assert text.index(b"24 80") < text.index(b"30 100") and last.exit_code == 0, (text, last)


def _across_a_pause(client: Client, vm: str) -> None:
    rt = client.runtime
    r = rt.processes.start(vm, *_shell(R_SCRIPT))["processId"]
    text, resumer, failed = b"", None, []

    def resume() -> None:
        try:
            rt.resume(vm)
            rt.exec(vm, "touch", ["/tmp/stop"])
        except PalApiError as exc:  # the reader then fails too: say why
            failed.append(exc)

    for ev in rt.processes.output(vm, r):
        text += ev.data
        if b"tick 3\n" in text and resumer is None:
            assert rt.pause(vm, "live")["state"] == "paused"
            resumer = threading.Thread(target=resume)
            resumer.start()
        last = ev
    assert resumer is not None
    resumer.join()
    assert not failed, failed
    assert ticks_in_order(text.decode()) and (last.type, last.exit_code) == ("exit", 0), (text, last)


def _kill(pr: Processes, vm: str) -> None:
    s = pr.start(vm, "sleep", ["600"])["processId"]
    assert pr.kill(vm, s)["deleted"] is True
    with pytest.raises(NotFoundError) as nf:
        pr.get(vm, s)
    expect_error(nf, 404, "PROCESS_NOT_FOUND")


def _unique() -> str:
    return uuid.uuid4().hex[:12]


def _poll(what: str, fn: Callable[[], bool]) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < POLL_DEADLINE_S:
        if fn():
            return
        time.sleep(0.25)
    raise AssertionError(f"never: {what}")


def metadata(st: State) -> None:
    rt, run = st.client.runtime, _unique()
    tags = {"sdk": "python", "run": run}
    m = rt.schedule(metadata=tags)["vmId"]
    child = ""
    try:
        assert rt.get(m)["metadata"] == tags
        child = rt.fork(m, 1)["forks"][0]["vmId"]
        got = rt.get(child)
        assert (got["metadata"], got["forkedFrom"]) == (tags, m), got
        assert [v["vmId"] for v in rt.list({"run": run})] == [m, child]
        assert rt.list({"run": run, "sdk": "nobody"}) == []
        with pytest.raises(BadRequestError) as bad:
            rt.schedule(metadata={"bad key": "x"})
        expect_error(bad, 400, "INVALID_ARGUMENT")
    finally:
        for vm in (child, m):
            if vm:
                assert rt.delete(vm)["state"] == "terminated"


def lifetime(st: State) -> None:
    rt = st.client.runtime
    vm = rt.schedule(lifetimeSecs=3600, onLifetimeEnd="delete")
    lid = vm["vmId"]
    try:
        assert (vm["lifetimeSecs"], vm["onLifetimeEnd"]) == (3600, "delete") and vm["lifetimeEndsAt"], vm
        assert rt.extend_lifetime(lid, 60)["lifetimeSecs"] == 3660
        assert rt.set_lifetime(lid, 1)["lifetimeSecs"] == 1
        _poll(f"{lid} terminated", lambda: rt.get(lid)["state"] == "terminated")
        ended = [e for e in rt.events(lid) if e["kind"] == "lifetime_ended"]
        assert [e["details"]["action"] for e in ended] == ["deleted"], ended
    finally:
        rt.delete(lid)


def pagination(st: State) -> None:
    rt, page = st.client.runtime, _unique()
    p1 = rt.schedule(metadata={"page": page})["vmId"]
    p2 = rt.schedule(metadata={"page": page})["vmId"]
    try:
        assert [v["vmId"] for v in rt.iter_vms({"page": page}, page_size=1)] == [p1, p2]
        events = list(rt.iter_events(p1, page_size=1))
        assert events and events == rt.events(p1)
        images = list(st.client.iter_images(page_size=1))
        assert images and images == st.client.images()
        assert list(rt.iter_snapshots(p1, page_size=1)) == rt.snapshots(p1)
        with pytest.raises(BadRequestError) as bad:
            st.client.request("GET", "/v1/runtime/vms", params={"cursor": "not-a-cursor"})
        expect_error(bad, 400, "INVALID_ARGUMENT")
    finally:
        for vm in (p1, p2):
            assert rt.delete(vm)["state"] == "terminated"


def volumes(st: State) -> None:
    vols, name = st.client.volumes, "c-" + _unique()
    v = vols.create(name, 8)
    assert (v["state"], v["sizeMib"]) == ("ready", 8)
    try:
        wrote = vols.write_file(name, "dir/a.bin", b"\x00\xff\x01\x02")
        assert wrote == {"path": "dir/a.bin", "bytesWritten": 4}
        got = vols.read_file_bytes(name, "dir/a.bin")
        assert got == b"\x00\xff\x01\x02" and not got.truncated
        listed = vols.list_files(name, depth=2)["entries"]
        assert [(e["path"], e["type"]) for e in listed] == [("dir", "dir"), ("dir/a.bin", "file")]
        assert vols.stat(name, "dir/a.bin")["size"] == 4
        assert vols.exists(name, "nope") is False
        with pytest.raises(BadRequestError) as bad:
            vols.read_file_bytes(name, "../escape")
        expect_error(bad, 400, "PATH_ESCAPE")
        assert vols.delete_file(name, "dir", recursive=True)["deleted"] is True
    finally:
        assert vols.delete(v["volumeId"])["state"] == "deleted"
    with pytest.raises(NotFoundError) as gone:
        vols.get(v["volumeId"])
    expect_error(gone, 404, "NOT_FOUND")


SCENARIOS: dict[str, Callable[[State], None]] = {
    "schedule": schedule,
    "exec-buffered": exec_buffered,
    "exec-stream": exec_stream,
    "exec-stream-close": exec_stream_close,
    "files-bytes": files_bytes,
    "pause-resume": pause_resume,
    "fork": fork,
    "errors": errors,
    "delete": delete,
    "processes": processes,
    "metadata": metadata,
    "lifetime": lifetime,
    "pagination": pagination,
    "volumes": volumes,
}
