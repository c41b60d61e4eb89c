"""Processes: every command the harness runs, whoever is or is not listening.

A process has an id of the harness's own (stable across snapshots and forks, unlike an OS
pid it also reports), its output journal (journal.py), optionally a stdin pipe or a
terminal, and, once it has exited, its status, kept until it is deleted or evicted by
:data:`MAX_FINISHED`. Readers attach at an offset and follow the journal; while a reader
is attached and behind, the process is slowed (its pipe fills) rather than its output
dropped, so a live stream loses nothing; with nobody attached the journal's bound drops
the oldest output, and the next reader sees a gap of exactly that many bytes.

One pump thread per process reads its output and waits for its exit, holding no timer
but the process's own deadline (the host's idle probe reads sleeping tasks' timers as
the workload's deadlines).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pal.guest import protocol as P
from pal.guest.children import ChildTracker, exit_code, kill_group, pidfd
from pal.guest.errors import ExecError
from pal.guest.journal import Journal
from pal.guest.oslib import now_ms

CHUNK = 64 * 1024  # most output bytes per read, and per ``out`` message
EXIT_GRACE_S = 0.25  # after the process exits, how long background children may hold its pipes
POLL_FALLBACK_S = 0.05  # status polling where no pidfd tells us of the exit
MAX_RUNNING = 256  # processes running at once in one VM
MAX_FINISHED = 128  # exited processes kept for their status and output (oldest evicted)
STDIN_WRITE_WAIT_S = 5.0  # a stdin write waits this long for a process that reads nothing
SIGNALS = {
    name: int(getattr(signal, "SIG" + name))
    for name in ("INT", "TERM", "KILL", "HUP", "QUIT", "USR1", "USR2", "STOP", "CONT", "WINCH")
}
_WINSIZE = "HHHH"  # struct winsize: rows, cols, xpixel, ypixel


@dataclass(eq=False)
class Attachment:
    """One reader following a process's journal (an ``exec`` or ``pattach`` stream)."""

    offset: int
    stopped: bool = False
    reason: str = ""


@dataclass(eq=False)
class Process:
    id: int
    argv: list[str]
    tag: str
    user: str
    cwd: str
    keep_awake: bool
    journal: Journal
    started_ms: int = field(default_factory=now_ms)
    os_pid: int = 0
    cols: int = 0  # terminal size; 0: no terminal
    rows: int = 0
    stdin_fd: int | None = None  # pipe write end, or the terminal's master
    master_fd: int | None = None
    stdin_open: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    ended_ms: int | None = None
    output_done: bool = False  # exited and its output drained into the journal
    cond: threading.Condition = field(default_factory=threading.Condition)
    readers: list[Attachment] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def info(self) -> dict[str, Any]:
        with self.cond:
            return {
                "pid": self.id,
                "os_pid": self.os_pid,
                "argv": self.argv,
                "tag": self.tag,
                "user": self.user,
                "cwd": self.cwd,
                "pty": {"cols": self.cols, "rows": self.rows} if self.cols else None,
                "stdin": self.stdin_open,
                "keep_awake": self.keep_awake,
                "started_ms": self.started_ms,
                "ended_ms": self.ended_ms,
                "running": self.running,
                "exit_code": self.exit_code,
                "timed_out": self.timed_out,
                "journal": self.journal.stats(),
            }

    # -- output, under ``cond``

    def _lagging(self, incoming: int) -> bool:
        """Would ``incoming`` more bytes push an attached reader's next bytes out?"""
        live = [r.offset for r in self.readers if not r.stopped]
        return bool(live) and self.journal.end + incoming - min(live) > self.journal.capacity

    def record(self, fd: int, data: bytes, deadline: float | None) -> None:
        with self.cond:
            while self._lagging(len(data)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break  # the deadline kills it next; a stalled reader must not stop that
                self.cond.wait(left)
            self.journal.append(fd, data)
            self.cond.notify_all()

    def finish(self, code: int, timed_out: bool) -> None:
        with self.cond:
            self.exit_code, self.timed_out, self.ended_ms = code, timed_out, now_ms()
            self.cond.notify_all()

    def drained(self) -> None:
        """Its output is all in the journal: readers and waiters are told by :meth:`settled`
        (after the table has done its bookkeeping, so a waiter sees the table as it stays)."""
        with self.cond:
            self.output_done = True
        self.close_stdin()
        if self.master_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.master_fd)
            self.master_fd = None

    # -- readers

    def attach(self, offset: int) -> Attachment:
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ExecError(P.ERR_INVAL, "from must be a non-negative byte offset")
        with self.cond:
            if offset > self.journal.end:
                raise ExecError(P.ERR_INVAL, f"offset {offset} is past the output's end ({self.journal.end})")
            att = Attachment(offset)
            self.readers.append(att)
            return att

    def detach(self, att: Attachment, reason: str) -> None:
        with self.cond:
            if not att.stopped:
                att.stopped, att.reason = True, reason
            if att in self.readers:
                self.readers.remove(att)
            self.cond.notify_all()

    def next_output(self, att: Attachment, max_bytes: int) -> tuple[int, list[Any], bool]:
        """Block until there is output past the reader's offset, the output is complete,
        or the reader is stopped: ``(gap, records, done)``; advances the reader."""
        with self.cond:
            while not att.stopped and self.journal.end <= att.offset and not self.output_done:
                self.cond.wait()
            gap, recs = self.journal.read(att.offset, max_bytes)
            if recs:
                last_off, _fd, last = recs[-1]
                att.offset = last_off + len(last)
            elif gap:
                att.offset = self.journal.end
            self.cond.notify_all()  # a pump held back by this reader may go on
            done = self.output_done and att.offset >= self.journal.end
            return gap, recs, done

    def wait_output(self, offset: int, timeout: float) -> None:
        with self.cond:
            deadline = time.monotonic() + timeout
            while self.journal.end <= offset and not self.output_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def settled(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait_exit(self, timeout: float) -> bool:
        """Until it has exited and its output is all in the journal (or the timeout)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.output_done, timeout)

    # -- input

    def write_stdin(self, data: bytes) -> int:
        fd = self.stdin_fd
        if fd is None or not self.stdin_open:
            raise ExecError(P.ERR_STATE, f"process {self.id} has no open stdin")
        view = memoryview(data)
        deadline = time.monotonic() + STDIN_WRITE_WAIT_S
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, OSError) as exc:
                raise ExecError(P.ERR_STATE, f"process {self.id} closed its stdin: {exc}") from None
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(int(left * 1000) + 1):
                break  # it reads nothing: the host learns how much went in
        return len(data) - len(view)

    def close_stdin(self) -> None:
        fd, self.stdin_fd = self.stdin_fd, None
        was_open, self.stdin_open = self.stdin_open, False
        if fd is None:
            return
        if fd == self.master_fd:
            if was_open and self.running:
                with contextlib.suppress(OSError):
                    os.write(fd, b"\x04")  # a terminal's end of input: ^D at the line start
            return
        with contextlib.suppress(OSError):
            os.close(fd)

    def resize(self, cols: int, rows: int) -> None:
        if self.master_fd is None:
            raise ExecError(P.ERR_STATE, f"process {self.id} has no terminal")
        fcntl.ioctl(self.master_fd, termios.TIOCSWINSZ, struct.pack(_WINSIZE, rows, cols, 0, 0))
        self.cols, self.rows = cols, rows

    def signal(self, signum: int) -> None:
        if not self.running:
            raise ExecError(P.ERR_STATE, f"process {self.id} has exited")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.os_pid, signum)


def terminal_size(pty: Any) -> tuple[int, int]:
    if not isinstance(pty, dict):
        raise ExecError(P.ERR_INVAL, "pty must be an object {cols, rows}")
    cols, rows = pty.get("cols", 80), pty.get("rows", 24)
    for name, v in (("cols", cols), ("rows", rows)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1000:
            raise ExecError(P.ERR_INVAL, f"pty.{name} must be an integer from 1 to 1000")
    return cols, rows


def signal_number(value: Any) -> int:
    name = value.upper().removeprefix("SIG") if isinstance(value, str) else None
    if name in SIGNALS:
        return SIGNALS[name]
    if isinstance(value, int) and not isinstance(value, bool) and value in SIGNALS.values():
        return value
    raise ExecError(P.ERR_INVAL, f"unsupported signal {value!r}: one of {', '.join(SIGNALS)}")


class Pump:
    """Moves one process's output into its journal until it has exited and drained."""

    def __init__(self, proc: Process, popen: subprocess.Popen[bytes], children: ChildTracker) -> None:
        self.proc, self.popen, self.children = proc, popen, children
        self.pidfd = pidfd(popen.pid)  # before the reaper may reap it

    def run(self, timeout: float | None, on_exit: Callable[[Process], None]) -> None:
        try:
            status = self._loop(timeout)
            self.popen.returncode = exit_code(status)  # keeps subprocess from waiting again
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
            self.children.release(self.popen.pid)
            self.proc.drained()
            on_exit(self.proc)
            self.proc.settled()

    def _sources(self) -> dict[int, int]:
        if self.proc.master_fd is not None:
            return {self.proc.master_fd: 1}
        assert self.popen.stdout is not None and self.popen.stderr is not None
        return {self.popen.stdout.fileno(): 1, self.popen.stderr.fileno(): 2}

    def _loop(self, timeout: float | None) -> int:
        proc, pfd = self.proc, self.pidfd
        streams = self._sources()
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        if pfd is not None:
            poller.register(pfd, select.POLLIN)
        deadline = time.monotonic() + timeout if timeout else None
        timed_out = exited = False
        status: int | None = None
        exited_at = 0.0
        try:
            while True:
                now = time.monotonic()
                waits = (
                    deadline - now if deadline is not None and not timed_out else None,
                    exited_at + EXIT_GRACE_S - now if status is not None else None,
                    POLL_FALLBACK_S if status is None and (pfd is None or exited) else None,
                )
                wait_s = min((w for w in waits if w is not None), default=None)
                if streams or (pfd is not None and not exited):
                    ms = -1 if wait_s is None else max(0, int(wait_s * 1000) + 1)
                    for fd, _ev in poller.poll(ms):
                        if fd == pfd:
                            exited = True
                            poller.unregister(fd)
                            continue
                        try:
                            data = os.read(fd, CHUNK)
                        except BlockingIOError:
                            continue  # a terminal's master is non-blocking (stdin writes)
                        except OSError:  # EIO: a terminal whose last slave closed
                            data = b""
                        if data:
                            proc.record(streams[fd], data, deadline if not timed_out else None)
                        else:
                            poller.unregister(fd)
                            del streams[fd]
                if status is None:
                    if not streams and (exited or pfd is None):
                        status = self.children.wait(self.popen.pid, POLL_FALLBACK_S)
                    else:
                        status = self.children.poll(self.popen.pid)
                    if status is not None:
                        proc.finish(exit_code(status), timed_out)
                now = time.monotonic()
                if status is not None:
                    exited_at = exited_at or now
                    # Output first, then the end; but a background child holding the pipes
                    # open must not keep the process from finishing.
                    if not streams or now - exited_at > EXIT_GRACE_S:
                        return status
                elif deadline is not None and now >= deadline and not timed_out:
                    timed_out = True
                    kill_group(self.popen.pid)
        finally:
            for f in (self.popen.stdout, self.popen.stderr):
                if f is not None:
                    f.close()


@dataclass
class Launch:
    """A process to start, checked and resolved by the harness (argv, env, user, cwd)."""

    argv: list[str]
    executable: str
    env: dict[str, str]
    cwd: str
    user: str
    creds: dict[str, Any]
    uid: int | None = None
    timeout: float | None = None
    stdin: bool = False
    pty: tuple[int, int] | None = None  # (cols, rows)
    tag: str = ""
    keep_awake: bool = False
    journal_bytes: int = 0


# The harness is PID 1 and ignores these (system.py); an ignored signal stays ignored
# across exec, so without this no command could be interrupted (psignal INT) or trap them.
_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _default_signals() -> None:
    for sig in _DEFAULT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _take_terminal() -> None:
    # In the child, after setsid: the terminal on fd 0 becomes its controlling terminal.
    _default_signals()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ProcessTable:
    """The VM's processes by id: start, look up, list, forget."""

    def __init__(self, children: ChildTracker) -> None:
        self.children = children
        self._lock = threading.Lock()
        self._procs: dict[int, Process] = {}
        self._next_id = 1

    def start(self, launch: Launch) -> Process:
        with self._lock:
            running = sum(1 for p in self._procs.values() if p.running)
            if running >= MAX_RUNNING:
                raise ExecError(P.ERR_LIMIT, f"{MAX_RUNNING} processes are running already")
            pid, self._next_id = self._next_id, self._next_id + 1
        proc = Process(
            id=pid,
            argv=launch.argv,
            tag=launch.tag,
            user=launch.user,
            cwd=launch.cwd,
            keep_awake=launch.keep_awake,
            journal=Journal(launch.journal_bytes) if launch.journal_bytes else Journal(),
        )
        popen = self._spawn(proc, launch)
        with self._lock:
            self._procs[pid] = proc
        pump = Pump(proc, popen, self.children)
        threading.Thread(
            target=pump.run, args=(launch.timeout, self._finished), name=f"proc-{pid}", daemon=True
        ).start()
        return proc

    def _spawn(self, proc: Process, launch: Launch) -> subprocess.Popen[bytes]:
        slave: int | None = None
        io: dict[str, Any] = {
            "stdin": subprocess.PIPE if launch.stdin else subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
        }
        extra: dict[str, Any] = {"preexec_fn": _default_signals}
        if launch.pty is not None:
            cols, rows = launch.pty
            master, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack(_WINSIZE, rows, cols, 0, 0))
            if launch.uid is not None:
                os.fchown(slave, launch.uid, -1)  # the user's own terminal, as a login gives
            os.set_blocking(master, False)
            proc.master_fd = proc.stdin_fd = master
            proc.cols, proc.rows, proc.stdin_open = cols, rows, True
            io = {"stdin": slave, "stdout": slave, "stderr": slave}
            extra["preexec_fn"] = _take_terminal
        try:
            with self.children.spawn_lock:
                popen = subprocess.Popen(
                    launch.argv,
                    executable=launch.executable,
                    cwd=launch.cwd,
                    env=launch.env,
                    start_new_session=True,  # its own process group: signals reach it all
                    close_fds=True,
                    **io,
                    **extra,
                    **launch.creds,
                )
                self.children.register(popen.pid)
        except BaseException:
            if proc.master_fd is not None:
                os.close(proc.master_fd)
            raise
        finally:
            if slave is not None:
                os.close(slave)
        proc.os_pid = popen.pid
        if popen.stdin is not None:
            # Our own descriptor: closing it must never race the file object's close.
            proc.stdin_fd = os.dup(popen.stdin.fileno())
            popen.stdin.close()
            os.set_blocking(proc.stdin_fd, False)
            proc.stdin_open = True
        return popen

    def _finished(self, proc: Process) -> None:
        with self._lock:
            done = [p for p in self._procs.values() if not p.running and p.output_done]
            for old in sorted(done, key=lambda p: p.id)[: max(0, len(done) - MAX_FINISHED)]:
                del self._procs[old.id]

    def get(self, pid: Any) -> Process:
        with self._lock:
            proc = self._procs.get(pid) if isinstance(pid, int) and not isinstance(pid, bool) else None
        if proc is None:
            raise ExecError(P.ERR_NOENT, f"no process {pid!r}")
        return proc

    def all(self) -> list[Process]:
        with self._lock:
            return sorted(self._procs.values(), key=lambda p: p.id)

    def remove(self, pid: Any) -> None:
        """Kill (the whole group) if running, and forget it."""
        proc = self.get(pid)
        if proc.running:
            kill_group(proc.os_pid)
            proc.wait_exit(5.0)
        with self._lock:
            self._procs.pop(proc.id, None)

    def busy(self) -> bool:
        """Keeps the VM awake: someone is attached, or a running process asked for it."""
        with self._lock:
            procs = list(self._procs.values())
        return any(p.readers or (p.keep_awake and p.running) for p in procs)

    def detach_all(self, reason: str) -> None:
        for proc in self.all():
            for att in list(proc.readers):
                proc.detach(att, reason)
