"""The guest harness driven over a socketpair, as the manager drives it over virtio-serial."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pal.guest import protocol as p
from pal.guest.harness import Harness
from tests.harnesshost import TOKEN, Host


def _output(chunks: list[tuple[int, bytes]], fd: int) -> bytes:
    return b"".join(d for f, d in chunks if f == fd)


def test_exec_streams_stdout_and_stderr_then_exit_code(host: Host) -> None:
    chunks, last = host.run("/bin/sh", "-c", "echo hello; echo err >&2; exit 3")
    assert _output(chunks, 1) == b"hello\n"
    assert _output(chunks, 2) == b"err\n"
    assert last == {"id": last["id"], "k": p.K_EXIT, "code": 3, "timed_out": False, "pid": last["pid"]}


def _until(path: Path) -> str:
    """Shell that waits until ``path`` exists: the test decides when a command ends."""
    return f"while [ ! -e {path} ]; do sleep 0.02; done"


def test_exec_output_arrives_before_the_process_ends(host: Host, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    rid = host.send(p.K_EXEC, tok=TOKEN, argv=["/bin/sh", "-c", f"printf partial; {_until(gate)}; echo done"])
    replies = host.replies(rid)
    first = next(replies)  # the command cannot end before the gate exists
    assert first["k"] == p.K_OUT and p.payload(first) == b"partial"  # no newline needed
    gate.touch()
    rest = list(replies)
    assert rest[-1]["k"] == p.K_EXIT and rest[-1]["code"] == 0


def test_exec_resolves_path_sets_env_and_cwd(host: Host, workspace: Path) -> None:
    chunks, last = host.run("sh", "-c", 'echo "$SECRET $EXTRA $(pwd)"', env={"EXTRA": "x"})
    assert last["code"] == 0
    assert _output(chunks, 1).decode() == f"s3 x {workspace}\n"
    (workspace / "sub").mkdir()
    chunks, _ = host.run("pwd", cwd="sub")
    assert _output(chunks, 1).decode() == f"{workspace / 'sub'}\n"


def test_exec_large_output_is_chunked_and_complete(host: Host) -> None:
    chunks, last = host.run("/bin/sh", "-c", "head -c 300000 /dev/zero")
    assert last["code"] == 0
    assert _output(chunks, 1) == b"\0" * 300000
    assert max(len(d) for _, d in chunks) <= 64 * 1024


def test_exec_signal_exit_code_is_128_plus_signal(host: Host) -> None:
    _, last = host.run("/bin/sh", "-c", "kill -TERM $$")
    assert last["k"] == p.K_EXIT and last["code"] == 128 + 15


def test_exec_missing_or_non_executable(host: Host, workspace: Path) -> None:
    _, last = host.run("no-such-binary-xyz")
    assert last["k"] == p.K_ERR and last["code"] == p.ERR_NOENT
    assert last["msg"] == "executable not found: no-such-binary-xyz"
    _, last = host.run("/nonexistent/bin")
    assert last["code"] == p.ERR_NOENT
    script = workspace / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    _, last = host.run("./script.sh")
    assert last["k"] == p.K_ERR and last["code"] == p.ERR_PERM


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def test_exec_timeout_kills_the_group_and_keeps_partial_output(host: Host, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    background = f"sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 300' &"
    started = f"{background} {_until(pidfile)}; echo before; exec sleep 300"
    # the timeout is the feature under test; 3 s leaves room to start both shells
    chunks, last = host.run("/bin/sh", "-c", started, timeout=3)
    assert _output(chunks, 1) == b"before\n"
    assert last["k"] == p.K_ERR and last["code"] == p.ERR_TIMEOUT  # well before 300 s
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 60  # a hang guard: SIGKILL of the group is immediate
    while not _gone(child):
        assert time.monotonic() < deadline, "the background child outlived its process group"
        time.sleep(0.01)


def test_cancel_kills_a_running_exec(host: Host) -> None:
    rid = host.send(p.K_EXEC, tok=TOKEN, argv=["/bin/sh", "-c", "echo started; exec sleep 300"])
    replies = host.replies(rid)
    assert p.payload(next(replies)) == b"started\n"
    cancel = host.send(p.K_CANCEL, target=rid)
    assert list(host.replies(cancel))[-1]["k"] == p.K_OK
    last = list(replies)[-1]
    assert (last["k"], last["code"]) == (p.K_EXIT, 128 + 9)
    assert host.call(p.K_CANCEL, target=rid)["code"] == p.ERR_NOENT


def test_concurrent_execs_do_not_block_each_other(host: Host, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    slow = host.send(p.K_EXEC, tok=TOKEN, argv=["/bin/sh", "-c", f"{_until(gate)}; echo slow"])
    chunks, last = host.run("echo", "fast")  # completes while the slow one cannot
    assert _output(chunks, 1) == b"fast\n" and last["code"] == 0
    gate.touch()
    assert list(host.replies(slow))[-1]["code"] == 0


def test_background_child_holding_pipes_does_not_hang_exec(host: Host, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # the child keeps stdout/stderr open until the gate exists, i.e. after the exit arrived
    _, last = host.run("/bin/sh", "-c", f"({_until(gate)}) & echo started")
    assert last["k"] == p.K_EXIT and last["code"] == 0
    gate.touch()


def test_write_read_ls_roundtrip(host: Host, workspace: Path) -> None:
    ok = host.call(p.K_WRITE, b"hello files\n", tok=TOKEN, path="dir/sub/a.txt")
    assert ok["k"] == p.K_OK and ok["result"] == {"path": "dir/sub/a.txt", "bytesWritten": 12}
    assert (workspace / "dir/sub/a.txt").read_bytes() == b"hello files\n"
    got = host.call(p.K_READ, tok=TOKEN, path="dir/sub/a.txt")
    assert p.payload(got) == b"hello files\n"
    assert got["result"] == {"path": "dir/sub/a.txt", "size": 12, "truncated": False}
    (workspace / "link").symlink_to("dir")
    listing = host.call(p.K_LS, tok=TOKEN, path="")["result"]
    assert listing["truncated"] is False
    assert [(e["name"], e["type"]) for e in listing["entries"]] == [("dir", "dir"), ("link", "symlink")]
    inner = host.call(p.K_LS, tok=TOKEN, path="link/sub")["result"]
    assert inner["entries"] == [{"name": "a.txt", "type": "file", "size": 12}]


def test_rm_removes_files_and_links_never_dirs_or_what_a_link_points_to(
    host: Host, workspace: Path, tmp_path: Path
) -> None:
    (workspace / "d").mkdir()
    (workspace / "d/a.txt").write_text("a")
    (tmp_path / "outside.txt").write_text("keep")
    (workspace / "out").symlink_to(tmp_path / "outside.txt")
    (workspace / "dirlink").symlink_to(workspace / "d")
    assert host.call(p.K_RM, tok=TOKEN, path="d/a.txt")["result"] == {"path": "d/a.txt", "deleted": True}
    assert not (workspace / "d/a.txt").exists()
    assert host.call(p.K_RM, tok=TOKEN, path="out")["result"]["deleted"] is True
    assert not (workspace / "out").is_symlink() and (tmp_path / "outside.txt").read_text() == "keep"
    assert host.call(p.K_RM, tok=TOKEN, path="dirlink")["result"]["deleted"] is True
    assert (workspace / "d").is_dir()
    assert host.call(p.K_RM, tok=TOKEN, path="d")["code"] == p.ERR_ISDIR
    assert host.call(p.K_RM, tok=TOKEN, path="d/missing")["code"] == p.ERR_NOENT
    assert host.call(p.K_RM, tok=TOKEN, path="")["code"] == p.ERR_INVAL
    assert host.call(p.K_RM, tok="stale", path="d/x")["code"] == p.ERR_AUTH


def test_file_errors(host: Host, workspace: Path) -> None:
    assert host.call(p.K_READ, tok=TOKEN, path="missing.txt")["code"] == p.ERR_NOENT
    (workspace / "d").mkdir()
    assert host.call(p.K_READ, tok=TOKEN, path="d")["code"] == p.ERR_ISDIR
    (workspace / "f").write_text("x")
    assert host.call(p.K_LS, tok=TOKEN, path="f")["code"] == p.ERR_NOTDIR
    assert host.call(p.K_WRITE, b"x", tok=TOKEN, path="f/child")["code"] == p.ERR_NOTDIR


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.txt", "a/../../outside.txt", "out/x.txt"])
def test_path_escapes_are_refused(host: Host, workspace: Path, tmp_path: Path, path: str) -> None:
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/x.txt").write_text("secret")
    (workspace / "out").symlink_to(tmp_path / "secret")  # a symlink pointing out
    (tmp_path / "outside.txt").write_text("keep")
    for kind in (p.K_READ, p.K_WRITE, p.K_LS, p.K_RM):
        reply = host.call(kind, b"pwned", tok=TOKEN, path=path)
        assert reply["k"] == p.K_ERR and reply["code"] == p.ERR_ESCAPE, (kind, reply)
    assert (tmp_path / "secret/x.txt").read_text() == "secret"
    assert (tmp_path / "outside.txt").read_text() == "keep"  # neither overwritten nor removed


def test_symlink_to_outside_file_is_refused(host: Host, workspace: Path, tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0")
    (workspace / "leak").symlink_to(tmp_path / "passwd")
    assert host.call(p.K_READ, tok=TOKEN, path="leak")["code"] == p.ERR_ESCAPE
    assert host.call(p.K_WRITE, b"x", tok=TOKEN, path="leak")["code"] == p.ERR_ESCAPE
    assert (tmp_path / "passwd").read_text() == "root:x:0:0"


def test_one_mebibyte_limits(host: Host, workspace: Path) -> None:
    exactly = b"a" * p.MAX_FILE_BYTES
    assert host.call(p.K_WRITE, exactly, tok=TOKEN, path="max.bin")["result"]["bytesWritten"] == len(exactly)
    too_big = host.call(p.K_WRITE, exactly + b"b", tok=TOKEN, path="big.bin")
    assert too_big["code"] == p.ERR_TOOBIG and not (workspace / "big.bin").exists()
    (workspace / "huge.bin").write_bytes(b"z" * (p.MAX_FILE_BYTES + 10))
    got = host.call(p.K_READ, tok=TOKEN, path="huge.bin", limit=10 * p.MAX_FILE_BYTES)
    assert len(p.payload(got)) == p.MAX_FILE_BYTES
    assert got["result"] == {"path": "huge.bin", "size": p.MAX_FILE_BYTES + 10, "truncated": True}
    got = host.call(p.K_READ, tok=TOKEN, path="huge.bin", limit=5)
    assert p.payload(got) == b"zzzzz" and got["result"]["truncated"] is True


def test_ls_truncates_at_1000_entries(host: Host, workspace: Path) -> None:
    for i in range(1005):
        (workspace / f"f{i:04d}").touch()
    result = host.call(p.K_LS, tok=TOKEN, path="")["result"]
    assert result["truncated"] is True and len(result["entries"]) == 1000
    assert result["entries"][0]["name"] == "f0000"


def test_identify_replaces_the_token(host: Host) -> None:
    assert host.call(p.K_LS, tok="wrong", path="")["code"] == p.ERR_AUTH
    ok = host.call(
        p.K_IDENTIFY, incarnation=2, token="tok-2", vm_id="vm-1", now_ns=time.time_ns(), seed="ab" * 32
    )
    assert ok["k"] == p.K_OK
    # The answer names the identity taken (the host checks it instead of awaiting a
    # heartbeat) and the guest's time per step.
    assert ok["result"]["vm_id"] == "vm-1" and ok["result"]["incarnation"] == 2
    steps = ok["result"]["steps_us"]
    assert set(steps) == {"decode", "clock_rng", "net_host_ca"}
    # and the guest's wall clock as it answered, which the host corrects by (guest_clock.py)
    assert abs(ok["result"]["wall_ns"] - time.time_ns()) < 60 * 10**9
    assert all(isinstance(v, int) and v >= 0 for v in steps.values()), steps
    hb = host.next_heartbeat(timeout=2)  # sent right after identify
    assert hb["incarnation"] == 2 and hb["vm_id"] == "vm-1"
    stale = host.call(p.K_EXEC, tok=TOKEN, argv=["true"])
    assert stale["k"] == p.K_ERR and stale["code"] == p.ERR_AUTH
    _, last = host.run("true", tok="tok-2")
    assert last["code"] == 0


def test_identify_env_reaches_execs(host: Host) -> None:
    host.call(p.K_IDENTIFY, incarnation=3, token="t3", vm_id="vm-1", env={"API_KEY": "k"})
    chunks, _ = host.run("/bin/sh", "-c", 'echo "$API_KEY:$SECRET"', tok="t3")
    assert _output(chunks, 1) == b"k:\n"  # the previous identity's secrets are gone


def test_heartbeat_reports_activity(host: Host, tmp_path: Path) -> None:
    host.call(p.K_IDENTIFY, incarnation=4, token="t4", vm_id="vm-1", hb_interval=0.2)
    idle = host.next_heartbeat()
    assert idle["active"] is False and idle["id"] == 0
    assert set(idle) >= {"vm_id", "incarnation", "active", "last_activity_ms", "boot_id", "uptime_s"}
    # the guest's own memory and disk use ride along, for the host's per-VM metrics
    assert 0 < idle["mem_used"] < idle["mem_total"]
    assert 0 < idle["disk_used"] <= idle["disk_total"]
    gate = tmp_path / "gate"  # the exec runs until the test has seen it reported active
    rid = host.send(p.K_EXEC, tok="t4", argv=["/bin/sh", "-c", _until(gate)])
    busy = host.next_heartbeat()
    while not busy["active"]:
        busy = host.next_heartbeat()
    assert busy["last_activity_ms"] >= idle["last_activity_ms"]
    before_end = int(time.time() * 1000)
    gate.touch()
    assert list(host.replies(rid))[-1]["code"] == 0
    after = host.next_heartbeat()
    while after["active"]:
        after = host.next_heartbeat()
    assert after["last_activity_ms"] >= before_end  # stamped when the exec ended


def test_garbage_and_unknown_requests_do_not_break_the_channel(host: Host) -> None:
    host.sock.sendall(b'{"half a line\n\nnot json\n{"k":"exec"}\n')
    assert host.call("frobnicate")["code"] == p.ERR_INVAL
    assert host.call(p.K_EXEC, tok=TOKEN, argv=[])["code"] == p.ERR_INVAL
    assert host.call(p.K_PING)["k"] == p.K_OK


def test_as_subreaper_orphans_are_reaped_and_exit_codes_kept(workspace: Path) -> None:
    """The PID-1 reaping path: statuses of exec children survive the reap-all loop."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pal.guest.harness",
            "--fd",
            str(theirs.fileno()),
            "--workspace",
            str(workspace),
        ],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    try:
        h = Host(ours)
        h.call(p.K_IDENTIFY, incarnation=1, token=TOKEN, vm_id="vm-r")
        for code in (0, 7, 42):
            # The orphaned grandchild is re-parented to the harness and must be reaped.
            _, last = h.run("/bin/sh", "-c", f"(sleep 0.1 &) ; exit {code}")
            assert (last["k"], last["code"]) == (p.K_EXIT, code)
        # The orphans (sleep 0.1) exit on their own; the harness must reap them: it is left
        # with no children at all, zombies included.
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound
        while children := Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            assert time.monotonic() < deadline, f"children never reaped: {children}"
            time.sleep(0.02)
    finally:
        ours.close()
        proc.wait(10)
    assert proc.returncode == 0


def test_workspace_stays_usable_after_many_requests(host: Host) -> None:
    for i in range(20):
        assert host.call(p.K_WRITE, str(i).encode(), tok=TOKEN, path=f"n/{i}")["k"] == p.K_OK
    assert len(host.call(p.K_LS, tok=TOKEN, path="n")["result"]["entries"]) == 20


def test_image_exec_defaults_env_workdir_and_user(workspace: Path, tmp_path: Path) -> None:
    """An image's ENV, WORKDIR and USER (/.pal/config.json) are every exec's defaults; the
    request's env and cwd, and the VM's secrets, still win."""
    workdir = tmp_path / "app"
    workdir.mkdir()
    image = {
        "user": "tester",
        "uid": os.getuid(),
        "gid": os.getgid(),
        "home": "/home/tester",
        "env": {"PATH": "/usr/bin:/bin", "FROM_IMAGE": "1", "SECRET": "image", "HOME": "/custom"},
        "workdir": str(workdir),
    }
    ours, theirs = socket.socketpair()
    harness = Harness(
        theirs.fileno(),
        workspace=str(workspace),
        image=image,
        identity={"vm_id": "vm-i", "incarnation": 1, "token": TOKEN, "env": {"SECRET": "s3"}},
        heartbeat_interval=60,
    )
    t = threading.Thread(target=harness.serve, daemon=True)
    t.start()
    h = Host(ours)
    try:
        script = 'pwd; echo "$PATH|$FROM_IMAGE|$SECRET|$HOME|$USER|$REQ"'
        chunks, last = h.run("sh", "-c", script, env={"REQ": "r"})
        assert last["code"] == 0
        lines = _output(chunks, 1).decode().splitlines()
        assert lines == [str(workdir), "/usr/bin:/bin|1|s3|/custom|tester|r"]
        (workspace / "sub").mkdir()
        chunks, _ = h.run("pwd", cwd="sub")
        assert _output(chunks, 1).decode().strip() == str(workspace / "sub")  # relative: in /workspace
        for user in ("tester", "pal"):  # "pal" names the workload user whatever it is called
            assert h.run("true", user=user)[1]["code"] == 0
        assert h.run("true", user="nobody")[1]["code"] == p.ERR_INVAL
    finally:
        ours.close()
        t.join(5)
        theirs.close()


# -- live pause: clock and probe -------------------------------------------------------------

TIMER_LIST = """Timer List Version: v0.9
cpu: 0
 clock 0:
  .base:       00000000a3c5b1e2
active timers:
 #0: <000000004e1f7d33>, tick_sched_timer, S:01
 # expires at 38476000000-38476000000 nsecs [in 5026215 to 5026215 nsecs]
 #1: <000000008922b4df>, hrtimer_wakeup, S:01
 # expires at 45041362472-45041412472 nsecs [in 6570388687 to 6570438687 nsecs]
 #2: <00000000dc3c929b>, watchdog_timer_fn, S:01
 # expires at 39314724257-39315724249 nsecs [in 843750472 to 844750464 nsecs]
 #3: <0000000015bc1808>, hrtimer_wakeup, S:01
 # expires at 42682125231-42682175231 nsecs [in 4211151446 to 4211201446 nsecs]
 clock 1:
  .base:       00000000b2d1e4f0
active timers:
 #0: <00000000aa00bb11>, hrtimer_wakeup, S:01
 # expires at 1-2 nsecs [in -1500 to -1000 nsecs]
"""


def test_the_nearest_sleeper_deadline_is_read_from_timer_list() -> None:
    from pal.guest.probe import next_sleeper_ms

    # only hrtimer_wakeup timers (sleeping tasks) count; an overdue one counts as now
    assert next_sleeper_ms(TIMER_LIST) == 0
    assert next_sleeper_ms(TIMER_LIST.rsplit(" clock 1:", 1)[0]) == 4211  # tick/watchdog ignored
    assert next_sleeper_ms("cpu: 0\n #0: <0>, tick_sched_timer, S:01\n # expires [in 5 to 6 nsecs]\n") is None


def test_probe_counts_other_runnable_tasks_and_cpu_ticks(tmp_path: Path) -> None:
    from pal.guest.probe import probe

    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  100 0 50 800 20 0 5 0 0 0\ncpu0 100 0 50 800 20 0 5 0 0 0\nprocs_running 3\nprocs_blocked 1\n"
    )
    timers = tmp_path / "timer_list"
    timers.write_text(TIMER_LIST.rsplit(" clock 1:", 1)[0])
    got = probe(str(stat), str(timers))
    assert got == {"runnable": 3, "cpu_busy": 155, "cpu_total": 975, "timer_ms": 4211}
    assert probe(str(tmp_path / "none"), str(tmp_path / "none"))["timer_ms"] is None


def test_clock_and_probe_answer_without_a_token_and_clock_sends_a_heartbeat(host: Host) -> None:
    rid = host.send(p.K_CLOCK, now_ns=time.time_ns())
    last = list(host.replies(rid))[-1]
    assert last["k"] == p.K_OK and isinstance(last["result"]["wall_ns"], int)
    host.next_heartbeat()
    # a relative correction is answered the same way (this harness is no PID 1: it sets nothing)
    assert host.call(p.K_CLOCK, adjust_ns=5_000_000)["k"] == p.K_OK
    got = host.call(p.K_PROBE)
    assert got["k"] == p.K_OK
    assert set(got["result"]) == {"runnable", "cpu_busy", "cpu_total", "timer_ms"}
    assert got["result"]["cpu_total"] >= got["result"]["cpu_busy"] >= 0


def test_a_waiting_exec_holds_no_timer_but_its_deadline_and_ends_on_its_pidfd(host: Host) -> None:
    """An exec waiting on its child sleeps on the child's pidfd and pipes (no periodic
    wake-up), so its only timer is a real deadline (timeoutSecs), and it ends as soon as
    the child exits."""
    # Pipes closed at once, so only the child's exit can end it: an exec that noticed the exit
    # only at its deadline would answer a timeout error, not the exit (no clock read here).
    _, last = host.run("/bin/sh", "-c", "exec 1>&- 2>&-; sleep 0.3", timeout=120)
    assert last["k"] == p.K_EXIT and last["code"] == 0


def test_ticker_waits_for_its_interval_or_a_poke() -> None:
    from pal.guest.ticker import Ticker

    t = Ticker()
    started = time.monotonic()
    assert t.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    t.poke()
    assert t.wait(30) is True  # a poke ends the wait at once


def test_boot_id_is_read_only_once_a_tenants_identity_is_taken(host: Host) -> None:
    """The kernel draws boot_id at its first read: a template's or a pooled VM's guest never
    reads it (so every VM restored from one draws its own, after its RNG reseed); a
    tenant's identity (``own``) does, once."""
    host.call(p.K_IDENTIFY, incarnation=1, token=TOKEN, vm_id="pool-1", own=False)
    assert host.next_heartbeat()["boot_id"] == ""
    host.call(p.K_IDENTIFY, incarnation=2, token=TOKEN, vm_id="vm-1", own=True)
    kernel = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert host.next_heartbeat()["boot_id"] == kernel
