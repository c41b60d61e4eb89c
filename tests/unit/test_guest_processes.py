"""Guest processes (pal/guest/processes.py) through the real harness over a socketpair:
background commands, their journals and offsets, stdin, signals, terminals, waiting."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pal.guest import processes
from pal.guest import protocol as p
from tests.harnesshost import TOKEN, Host


def start(host: Host, *argv: str, **fields: Any) -> dict[str, Any]:
    reply = host.call(p.K_PSTART, tok=TOKEN, argv=list(argv), **fields)
    assert reply["k"] == p.K_OK, reply
    return reply["result"]["process"]


def call(host: Host, kind: str, data: bytes | None = None, **fields: Any) -> p.Message:
    return host.call(kind, data, tok=TOKEN, **fields)


def wait(host: Host, pid: int) -> dict[str, Any]:
    while True:  # each long poll ends at its timeout or the exit; the test's own guard is pytest's
        proc = call(host, p.K_PWAIT, pid=pid, timeout_ms=10_000)["result"]["process"]
        if not proc["running"]:
            return proc


def read_all(host: Host, pid: int, start_at: int = 0) -> tuple[int, bytes, int]:
    """(gap, bytes, next offset) of the whole journal from ``start_at``, after the exit."""
    gap, out, at = 0, b"", start_at
    while True:
        reply = call(host, p.K_PREAD, pid=pid, **{"from": at})
        res = reply["result"]
        gap += res["gap"]
        out += p.payload(reply)
        if res["next"] == at and not res["process"]["running"]:
            return gap, out, at
        at = res["next"]


def read_until(host: Host, pid: int, needle: bytes) -> bytes:
    """The output so far, once it holds ``needle`` (long polls: no fixed sleep)."""
    out, at = b"", 0
    while needle not in out:
        reply = call(host, p.K_PREAD, pid=pid, wait_ms=10_000, **{"from": at})
        out += p.payload(reply)
        at = reply["result"]["next"]
        assert reply["result"]["process"]["running"] or needle in out, out
    return out


def attach(host: Host, pid: int, offset: int) -> tuple[list[p.Message], p.Message]:
    msgs = list(host.replies(host.send(p.K_PATTACH, tok=TOKEN, pid=pid, **{"from": offset})))
    return msgs[:-1], msgs[-1]


def test_a_background_process_keeps_its_exit_status_and_output(host: Host) -> None:
    proc = start(host, "/bin/sh", "-c", "echo out; echo err >&2; exit 7", tag="build")
    assert proc["running"] in (True, False) and proc["tag"] == "build" and proc["pid"] >= 1
    done = wait(host, proc["pid"])
    assert (done["exit_code"], done["timed_out"], done["running"]) == (7, False, False)
    listed = call(host, p.K_PLIST)["result"]["processes"]
    assert [x["pid"] for x in listed if x["tag"] == "build"] == [proc["pid"]]
    reply = call(host, p.K_PREAD, pid=proc["pid"], **{"from": 0})
    records = reply["result"]["records"]
    assert {r["fd"] for r in records} == {1, 2}
    data = p.payload(reply)
    assert sorted(data.splitlines()) == [b"err", b"out"]
    assert reply["result"]["next"] == len(data) == done["journal"]["end"]


def test_every_exec_is_a_process_named_first_and_listed_after(host: Host) -> None:
    _, last = host.run("/bin/echo", "hi")
    rid = max(host.started)
    pid = host.started[rid]
    assert last["pid"] == pid
    got = call(host, p.K_PGET, pid=pid)["result"]["process"]
    assert got["argv"] == ["/bin/echo", "hi"] and got["exit_code"] == 0


def test_reattach_at_an_offset_loses_and_repeats_nothing(host: Host) -> None:
    # A deterministic 2.6 MB: read part of it, drop the stream, reattach where it stopped.
    proc = start(host, "seq", "1", "400000")
    pid = proc["pid"]
    rid = host.send(p.K_PATTACH, tok=TOKEN, pid=pid, **{"from": 0})
    first = b""
    offset = 0
    for m in host.replies(rid):
        assert m["k"] == p.K_OUT
        first += p.payload(m)
        offset = m["o"]
        if len(first) > 100_000:
            break
    assert offset == len(first)
    detach = call(host, p.K_DETACH, target=rid)
    assert detach["k"] == p.K_OK
    # What the dropped stream had still in flight is dropped here too: the reader's offset
    # is the last one it received.
    rest: list[p.Message] = []
    for m in host.replies(rid):
        rest.append(m)
    assert rest[-1]["k"] == p.K_OK and rest[-1]["result"]["detached"] is True
    for m in rest[:-1]:
        first += p.payload(m)
        offset = m["o"]
    msgs, last = attach(host, pid, offset)
    tail = b"".join(p.payload(m) for m in msgs if m["k"] == p.K_OUT)
    assert last["k"] == p.K_EXIT and last["code"] == 0
    expected = "".join(f"{i}\n" for i in range(1, 400_001)).encode()
    assert hashlib.sha256(first + tail).hexdigest() == hashlib.sha256(expected).hexdigest()


def test_journal_overflow_reports_the_exact_gap(host: Host) -> None:
    size, cap = 300_000, 64 * 1024
    proc = start(
        host,
        "/bin/sh",
        "-c",
        f"head -c {size} /dev/urandom | od -An -v -tx1 | head -c {size}",
        journal_bytes=cap,
    )
    done = wait(host, proc["pid"])
    assert done["journal"] == {"start": size - cap, "end": size, "capacity": cap}
    gap, data, _ = read_all(host, proc["pid"])
    assert gap == size - cap and len(data) == cap
    msgs, last = attach(host, proc["pid"], 0)
    assert msgs[0]["k"] == p.K_GAP and msgs[0]["n"] == size - cap
    assert b"".join(p.payload(m) for m in msgs[1:]) == data and last["k"] == p.K_EXIT


def test_a_live_reader_loses_nothing_past_the_journal_bound(host: Host) -> None:
    # Attached from its start, a process is slowed rather than its output dropped. It
    # waits for a byte on stdin, sent once the reader is attached.
    size = 5 * 1024 * 1024
    script = f"head -c 1 >/dev/null; head -c {size} /dev/urandom | od -An -v -tx1 | head -c {size}"
    pid = start(host, "/bin/sh", "-c", script, stdin=True, journal_bytes=64 * 1024)["pid"]
    rid = host.send(p.K_PATTACH, tok=TOKEN, pid=pid, **{"from": 0})
    assert call(host, p.K_PSTDIN, b"go", pid=pid)["k"] == p.K_OK
    msgs = list(host.replies(rid))
    assert msgs[-1]["k"] == p.K_EXIT
    assert not [m for m in msgs if m["k"] == p.K_GAP]
    assert sum(len(p.payload(m)) for m in msgs[:-1]) == size


def test_stdin_round_trip_of_binary_data(host: Host) -> None:
    blob = bytes(range(256)) * 1024
    proc = start(host, "/bin/cat", stdin=True)
    assert proc["stdin"] is True
    res = call(host, p.K_PSTDIN, blob, pid=proc["pid"], eof=True)["result"]
    assert res == {"written": len(blob), "closed": True}
    assert wait(host, proc["pid"])["exit_code"] == 0
    assert read_all(host, proc["pid"])[1] == blob
    again = call(host, p.K_PSTDIN, b"x", pid=proc["pid"])
    assert again["k"] == p.K_ERR and again["code"] == p.ERR_STATE


def test_sigint_reaches_the_whole_process_group(host: Host, tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    # The shell's foreground child writes its pid and becomes a sleep: only a signal to
    # the group (not to the shell alone) ends it.
    script = f"trap 'echo got-int; exit 5' INT; sh -c 'echo $$ > {pidfile}; exec sleep 300'; echo not-reached"
    proc = start(host, "/bin/sh", "-c", script)
    while not pidfile.exists() or not pidfile.read_text().strip():
        time.sleep(0.01)
    child = int(pidfile.read_text())
    assert call(host, p.K_PSIGNAL, pid=proc["pid"], signal="INT")["k"] == p.K_OK
    done = wait(host, proc["pid"])
    assert done["exit_code"] == 5 and b"got-int" in read_all(host, proc["pid"])[1]
    with pytest.raises(ProcessLookupError):
        for _ in range(1000):  # the sleep got SIGINT too: gone, or a zombie reaped by now
            os.kill(child, 0)
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                raise ProcessLookupError
            time.sleep(0.01)


def test_a_terminal_is_a_tty_with_its_size_and_follows_a_resize(host: Host) -> None:
    proc = start(host, "/bin/sh", pty={"cols": 100, "rows": 30})
    pid = proc["pid"]
    assert proc["pty"] == {"cols": 100, "rows": 30}
    call(host, p.K_PSTDIN, b"tty; stty size\n", pid=pid)
    read_until(host, pid, b"30 100")
    assert call(host, p.K_PRESIZE, pid=pid, cols=120, rows=40)["k"] == p.K_OK
    call(host, p.K_PSTDIN, b"stty size; exit 3\n", pid=pid)
    done = wait(host, pid)
    out = read_all(host, pid)[1]
    assert done["exit_code"] == 3
    assert b"/dev/pts/" in out and b"30 100" in out and b"40 120" in out
    assert call(host, p.K_PRESIZE, pid=start(host, "/bin/true")["pid"], cols=1, rows=1)["code"] == p.ERR_STATE


def test_delete_kills_and_forgets(host: Host) -> None:
    proc = start(host, "/bin/sleep", "300")
    assert call(host, p.K_PDELETE, pid=proc["pid"])["result"] == {"pid": proc["pid"], "deleted": True}
    assert call(host, p.K_PGET, pid=proc["pid"])["code"] == p.ERR_NOENT


def test_only_attached_or_keep_awake_processes_keep_the_vm_awake(host: Host) -> None:
    host.call(p.K_IDENTIFY, incarnation=2, token=TOKEN, vm_id="vm-1", hb_interval=0.2)
    quiet = start(host, "/bin/sleep", "300")
    assert host.next_heartbeat()["active"] is False
    awake = start(host, "/bin/sleep", "300", keep_awake=True)
    assert host.next_heartbeat()["active"] is True
    call(host, p.K_PDELETE, pid=awake["pid"])
    assert host.next_heartbeat()["active"] is False
    call(host, p.K_PDELETE, pid=quiet["pid"])


def test_finished_processes_are_evicted_oldest_first(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "MAX_FINISHED", 2)
    pids = []
    for _ in range(4):  # each finishes before the next starts: the finishing order is known
        pid = start(host, "/bin/true")["pid"]
        pids.append(pid)
        while (
            call(host, p.K_PGET, pid=pid)["k"] == p.K_OK
            and call(host, p.K_PGET, pid=pid)["result"]["process"]["running"]
        ):
            call(host, p.K_PWAIT, pid=pid, timeout_ms=1000)
    listed = [x["pid"] for x in call(host, p.K_PLIST)["result"]["processes"]]
    assert listed == pids[-2:]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"pty": {"cols": 0, "rows": 5}}, p.ERR_INVAL),
        ({"tag": "x" * 300}, p.ERR_INVAL),
        ({"journal_bytes": 10}, p.ERR_INVAL),
        ({"stdin": "yes"}, p.ERR_INVAL),
    ],
)
def test_bad_start_requests_are_refused(host: Host, fields: dict[str, Any], code: str) -> None:
    reply = host.call(p.K_PSTART, tok=TOKEN, argv=["/bin/true"], **fields)
    assert reply["k"] == p.K_ERR and reply["code"] == code


def test_bad_process_requests_are_refused(host: Host) -> None:
    pid = start(host, "/bin/true")["pid"]
    wait(host, pid)
    assert call(host, p.K_PSIGNAL, pid=pid, signal="SEGV")["code"] == p.ERR_INVAL
    assert call(host, p.K_PSIGNAL, pid=pid, signal="TERM")["code"] == p.ERR_STATE
    assert call(host, p.K_PREAD, pid=pid, **{"from": 10**6})["code"] == p.ERR_INVAL
    assert call(host, p.K_PGET, pid="1")["code"] == p.ERR_NOENT
    assert host.call(p.K_PLIST, tok="stale")["code"] == p.ERR_AUTH


@pytest.mark.parametrize("pty", [None, {"cols": 80, "rows": 24}])
def test_a_process_does_not_inherit_the_harness_ignoring_signals(
    host: Host, pty: dict[str, int] | None
) -> None:
    # In the VM the harness is PID 1 and ignores SIGINT/SIGTERM/SIGHUP (system.py); an
    # ignored signal stays ignored across exec, so no command could be interrupted.
    import signal

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        proc = start(host, "/bin/sh", "-c", "grep SigIgn /proc/self/status", pty=pty)
        wait(host, proc["pid"])
        out = read_all(host, proc["pid"])[1].decode()
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
    ignored = int(out.split()[1], 16)
    for sig in sigs:
        assert not ignored & (1 << (sig - 1)), (sig, out)


def test_a_stream_sends_only_what_its_credit_allows_and_a_detach_names_why(host: Host) -> None:
    """Flow control (protocol.py): an exec of ``yes`` with a window sends about the window,
    then waits (the process is held back, its output kept) while the channel answers other
    requests; a credit lets more through; the host's detach (a slow reader) ends the stream
    with its reason and leaves the process running, its output in the journal."""
    window = 300_000
    rid = host.send(p.K_EXEC, tok=TOKEN, argv=["yes"], window=window)
    got = 0

    def take_until_quiet() -> int:
        """Output bytes on the wire until the harness has stopped at its credit (it sent
        some, then nothing more across three pings, which it answers meanwhile)."""
        n, quiet = 0, 0
        while quiet < 3:
            ping = host.send(p.K_PING)  # answered even while the stream waits
            for m in host.replies(ping):
                assert m["k"] == p.K_OK
            pending = [m for m in host.pending if m["id"] == rid]
            host.pending = [m for m in host.pending if m["id"] != rid]
            n += sum(len(p.encode(m)) for m in pending if m["k"] in p.FLOW_KINDS)
            for m in pending:
                if m["k"] == p.K_STARTED:
                    host.started[rid] = m["pid"]
            quiet = quiet + 1 if n and not pending else 0
            time.sleep(0.05)
        return n

    line = processes.CHUNK * 4 // 3 + 200  # one output line: the most a sender overshoots
    got = take_until_quiet()
    assert window <= got <= window + line, got
    host.send(p.K_CREDIT, target=rid, n=100_000)
    more = take_until_quiet()
    assert window + 100_000 <= got + more <= window + 100_000 + line
    host.send(p.K_DETACH, target=rid, reason="slow-reader")
    end = list(host.replies(rid))[-1]
    assert end["k"] == p.K_OK and end["result"]["detached"] is True
    assert end["result"]["reason"] == "slow-reader"
    pid = host.started[rid]
    proc = call(host, p.K_PGET, pid=pid)["result"]["process"]
    assert proc["running"] and proc["journal"]["end"] > got + more
    call(host, p.K_PSIGNAL, pid=pid, signal="KILL")
