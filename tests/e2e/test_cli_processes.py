"""`pal vm shell/ps/attach/kill` and `pal vm exec --detach` / piped stdin as a user types
them: a real terminal (a PTY from python's pty module) where one is needed, a real `pal up`
behind, real microVMs."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO, PalServer
from tests.e2e.test_cli import error_of, pal, pal_json

pytestmark = pytest.mark.vm

DEADLINE_S = 240  # for one thing to appear on the terminal: a bound, never a wait


@pytest.fixture(scope="module")
def env(pal_server: PalServer, tenant_key: str) -> dict[str, str]:
    del tenant_key  # the warm template exists
    return {"PAL_URL": pal_server.url, "PAL_API_KEY": pal_server.tenant("e2e-cli-processes", max_vms=3)}


@pytest.fixture(scope="module")
def vm(env: dict[str, str]) -> Iterator[str]:
    vm_id = str(pal_json(env, "vm", "schedule")["vmId"])
    try:
        yield vm_id
    finally:
        pal(env, "vm", "rm", vm_id)


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    """`pal ARGS` on a terminal of its own, as a person at a terminal runs it."""

    def __init__(self, env: dict[str, str], *args: str, rows: int = 30, cols: int = 100) -> None:
        self.master, slave = pty.openpty()
        set_size(slave, rows, cols)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pal.cli.main", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, **env},
            cwd=REPO,
            start_new_session=True,  # the PTY is its controlling terminal
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.seen = b""

    def expect(self, pattern: bytes) -> re.Match[bytes]:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            m = re.search(pattern, self.seen)
            if m:
                self.seen = self.seen[m.end() :]
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} never came; the terminal shows {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # the program ended and closed the terminal
                    assert re.search(pattern, self.seen), f"{pattern!r} never came: {self.seen[-2000:]!r}"

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def resize(self, rows: int, cols: int) -> None:
        set_size(self.master, rows, cols)
        self.proc.send_signal(signal.SIGWINCH)

    def wait(self) -> int:
        code = self.proc.wait(timeout=DEADLINE_S)
        os.close(self.master)
        return code


def test_shell_is_an_interactive_terminal_that_outlives_a_pause_with_the_remote_exit_status(
    env: dict[str, str], vm: str
) -> None:
    t = Terminal(env, "vm", "shell", vm, rows=30, cols=100)
    try:
        t.expect(rb"\$ ")  # the prompt: typed before it, a line may be dropped by the starting shell
        t.send(b"tty; stty size\r")
        t.expect(rb"/dev/pts/\d+")
        t.expect(rb"30 100")
        t.resize(40, 120)
        t.send(b"stty size\r")
        t.expect(rb"40 120")
        t.send(b"echo $((6*7))-$TERM\r")
        t.expect(rb"42-xterm-256color")
        # the shell shows up in `pal vm ps`, on a terminal
        procs = pal_json(env, "vm", "ps", vm)
        shells = [p for p in procs if p["running"] and p["tag"] == "pal vm shell"]
        assert shells and shells[0]["pty"] == {"cols": 120, "rows": 40}, procs
        # a pause detaches it; it reattaches by itself after the resume and goes on
        pal_json(env, "vm", "pause", vm)
        t.expect(rb"\[pal\] detached \(")
        pal_json(env, "vm", "resume", vm)
        t.send(b"echo back-$((1+1))\r")
        t.expect(rb"back-2")
        t.send(b"exit 5\r")
        assert t.wait() == 5
    finally:
        if t.proc.poll() is None:
            t.proc.kill()


def test_shell_needs_a_terminal(env: dict[str, str], vm: str) -> None:
    res = pal(env, "vm", "shell", vm)  # stdin a pipe, stdout captured
    assert res.returncode == 2 and error_of(res)["code"] == "NOT_A_TERMINAL", res


def run_with_stdin(env: dict[str, str], data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "pal.cli.main", *args],
        input=data,
        capture_output=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=300,
    )


def test_exec_passes_piped_stdin(env: dict[str, str], vm: str) -> None:
    data = bytes(range(256)) * 2048  # 512 KiB of every byte value
    res = run_with_stdin(env, data, "vm", "exec", vm, "--", "sha256sum")
    assert res.returncode == 0, res
    assert res.stdout.decode().split()[0] == hashlib.sha256(data).hexdigest()
    res = run_with_stdin(
        env, b"abc", "vm", "exec", vm, "--", "/bin/sh", "-c", "cat; echo; echo e >&2; exit 3"
    )
    assert (res.returncode, res.stdout, res.stderr) == (3, b"abc\n", b"e\n"), res


def test_detach_ps_attach_from_kill(env: dict[str, str], vm: str) -> None:
    res = pal(env, "vm", "exec", vm, "--detach", "--", "/bin/sh", "-c", "seq 1 5; exec sleep 600")
    assert res.returncode == 0, res
    pid = int(res.stdout.strip())
    procs: list[dict[str, Any]] = pal_json(env, "vm", "ps", vm)
    assert any(p["processId"] == pid and p["running"] for p in procs), procs
    table = pal(env, "vm", "ps", vm, "--table").stdout
    assert re.search(rf"^{pid}\s", table, re.M), table
    # attach (no terminal): its output exactly, from an offset, then its exit status
    detached = pal(env, "vm", "exec", vm, "--detach", "--", "/bin/sh", "-c", "echo one; echo two; exit 6")
    assert detached.returncode == 0, detached
    done = int(detached.stdout.strip())
    whole = pal(env, "vm", "attach", vm, str(done))
    assert (whole.returncode, whole.stdout) == (6, "one\ntwo\n"), whole
    tail = pal(env, "vm", "attach", vm, str(done), "--from", "4")
    assert (tail.returncode, tail.stdout) == (6, "two\n"), tail
    # attached on a terminal: the output as it comes; a signal ends it with 128 + its number
    t = Terminal(env, "vm", "attach", vm, str(pid))
    try:
        t.expect(rb"4\r?\n5\r?\n")
        assert pal_json(env, "vm", "kill", vm, str(pid), "--signal", "TERM")["signal"] == "TERM"
        assert t.wait() == 128 + signal.SIGTERM
    finally:
        if t.proc.poll() is None:
            t.proc.kill()
    # kill: its group is killed and it is forgotten
    assert pal_json(env, "vm", "kill", vm, str(pid))["deleted"] is True
    gone = pal(env, "vm", "attach", vm, str(pid))
    assert gone.returncode == 1 and error_of(gone)["code"] == "PROCESS_NOT_FOUND", gone
    bad = pal(env, "vm", "kill", vm, str(done), "--signal", "NOPE")
    assert bad.returncode == 2, bad
