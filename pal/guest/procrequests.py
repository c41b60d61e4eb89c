"""The host's process requests (protocol.py: exec, pstart ... pdelete, cancel, detach).

Each request runs on its own thread (the harness starts it); a stream (``exec``,
``pattach``) holds its thread while it follows a journal. Streams belong to one channel
connection: a host that reconnects (after a pause, a restart, a move) finds every old
stream detached and reattaches from the offsets it had.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from pal.guest import protocol as P
from pal.guest.children import kill_group
from pal.guest.errors import ExecError
from pal.guest.processes import (
    CHUNK,
    Attachment,
    Launch,
    Process,
    ProcessTable,
    signal_number,
    terminal_size,
)

MAX_WAIT_MS = 60_000  # the longest long-poll (pread, pwait) a request may ask for
MAX_READ_BYTES = 4 * 1024 * 1024  # the most output one pread answers with

Reply = Callable[..., bool]
Answer = tuple[dict[str, Any], bytes | None]  # a request's result, and the bytes it carries


def _int(msg: P.Message, name: str, default: int, lo: int, hi: int) -> int:
    value = msg.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ExecError(P.ERR_INVAL, f"{name} must be an integer from {lo} to {hi}")
    return value


def launch_options(msg: P.Message, launch: Launch) -> Launch:
    """The pstart-only options (stdin, pty, tag, keep_awake, journal size), checked."""
    stdin, keep = msg.get("stdin", False), msg.get("keep_awake", False)
    if not isinstance(stdin, bool) or not isinstance(keep, bool):
        raise ExecError(P.ERR_INVAL, "stdin and keep_awake must be booleans")
    tag = msg.get("tag") or ""
    if not isinstance(tag, str) or len(tag) > P.MAX_TAG_CHARS or "\0" in tag:
        raise ExecError(P.ERR_INVAL, f"tag must be a string of at most {P.MAX_TAG_CHARS} characters")
    pty = msg.get("pty")
    launch.pty = terminal_size(pty) if pty is not None else None
    launch.stdin, launch.keep_awake, launch.tag = stdin, keep, tag
    launch.journal_bytes = _int(msg, "journal_bytes", 0, 0, P.JOURNAL_MAX_BYTES)
    if launch.journal_bytes and launch.journal_bytes < P.JOURNAL_MIN_BYTES:
        raise ExecError(P.ERR_INVAL, f"journal_bytes must be at least {P.JOURNAL_MIN_BYTES}")
    if launch.pty is not None:
        launch.env.setdefault("TERM", "xterm-256color")
    return launch


class ProcessRequests:
    """Serves the process kinds over one harness's channel."""

    def __init__(self, table: ProcessTable, reply: Reply) -> None:
        self.table = table
        self.reply = reply  # (rid, kind, data=None, **fields) -> sent?
        self._lock = threading.Lock()
        # Streams by request id: (process, reader, kill the process on cancel?)
        self._streams: dict[int, tuple[Process, Attachment, bool]] = {}

    # -- streams

    def exec(self, rid: int, launch: Launch) -> None:
        """A command followed from its first byte to its exit (the classic exec)."""
        proc = self.table.start(launch)
        att = proc.attach(0)
        self._follow(rid, proc, att, kill_on_cancel=True, announce=True)

    def start_attached(self, rid: int, launch: Launch) -> None:
        """A process (``pstart``'s) followed from its first byte in the same request
        (``follow``): ``started``, then an attach's replies; the process outlives the stream."""
        proc = self.table.start(launch)
        att = proc.attach(0)
        self._follow(rid, proc, att, kill_on_cancel=False, announce=True)

    def attach(self, rid: int, msg: P.Message) -> None:
        proc = self.table.get(msg.get("pid"))
        att = proc.attach(msg.get("from", 0))
        self._follow(rid, proc, att, kill_on_cancel=False, announce=False)

    def _follow(
        self, rid: int, proc: Process, att: Attachment, *, kill_on_cancel: bool, announce: bool
    ) -> None:
        with self._lock:
            self._streams[rid] = (proc, att, kill_on_cancel)
        done = False
        try:
            if announce and not self.reply(rid, P.K_STARTED, pid=proc.id):
                proc.detach(att, "channel")
            while not att.stopped and not done:
                gap, records, done = proc.next_output(att, 4 * CHUNK)
                sent = (not gap or self.reply(rid, P.K_GAP, n=gap)) and all(
                    self.reply(rid, P.K_OUT, d, fd=fd, o=off + len(d)) for off, fd, d in records
                )
                if not sent:
                    done = False
                    if not att.stopped:  # the host went away: the stream is over, the process is not
                        proc.detach(att, "channel")
                    # else detached while it waited for credit: said below, with the reason
        finally:
            proc.detach(att, att.reason or "ended")
            with self._lock:  # gone before the last reply: a late cancel finds no stream
                self._streams.pop(rid, None)
        if done:
            self._ended(rid, proc, kill_on_cancel)
        elif att.reason != "channel":
            self.reply(rid, P.K_OK, result={"detached": True, "reason": att.reason, "offset": att.offset})

    def _ended(self, rid: int, proc: Process, classic: bool) -> None:
        code, timed_out = proc.exit_code, proc.timed_out
        if classic and timed_out:
            self.reply(rid, P.K_ERR, code=P.ERR_TIMEOUT, msg="command timed out", pid=proc.id)
        else:
            self.reply(rid, P.K_EXIT, code=code, timed_out=timed_out, pid=proc.id)

    def cancel(self, rid: int, target: Any, *, kill: bool, reason: str = "detached") -> None:
        """``cancel``: an exec's process is killed, an attach only detached; ``detach``:
        the stream ends (with ``reason``), the process runs on."""
        with self._lock:
            stream = self._streams.get(target) if isinstance(target, int) else None
        if stream is None:
            self.reply(rid, P.K_ERR, code=P.ERR_NOENT, msg=f"no running stream {target!r}")
            return
        proc, att, kill_on_cancel = stream
        if kill and kill_on_cancel:
            kill_group(proc.os_pid)  # its stream ends with the exit, as before
        else:
            proc.detach(att, reason)
        self.reply(rid, P.K_OK, result={"target": target})

    def connection_lost(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for proc, att, _ in streams:
            proc.detach(att, "channel")

    def busy(self) -> bool:
        return self.table.busy()

    # -- single answers

    def handle(self, rid: int, kind: str, msg: P.Message) -> None:
        if kind == P.K_PATTACH:
            self.attach(rid, msg)
            return
        answer = ANSWERS.get(kind)
        if answer is None:
            raise ExecError(P.ERR_INVAL, f"unknown process request {kind!r}")
        result, data = answer(self, msg)
        self.reply(rid, P.K_OK, data, result=result)

    def _list(self, msg: P.Message) -> Answer:
        return {"processes": [p.info() for p in self.table.all()]}, None

    def _get(self, msg: P.Message) -> Answer:
        return {"process": self.table.get(msg.get("pid")).info()}, None

    def _signal(self, msg: P.Message) -> Answer:
        self.table.get(msg.get("pid")).signal(signal_number(msg.get("signal")))
        return {}, None

    def _resize(self, msg: P.Message) -> Answer:
        proc = self.table.get(msg.get("pid"))
        proc.resize(_int(msg, "cols", 80, 1, 1000), _int(msg, "rows", 24, 1, 1000))
        return {}, None

    def _wait(self, msg: P.Message) -> Answer:
        proc = self.table.get(msg.get("pid"))
        proc.wait_exit(_int(msg, "timeout_ms", 0, 0, MAX_WAIT_MS) / 1000)
        return {"process": proc.info()}, None

    def _stats(self, msg: P.Message) -> Answer:
        """``pstats {pid}`` -> ok {pid, running, state, cpu_user_ms, cpu_system_ms, rss_bytes,
        threads}: the process itself (not its children) as /proc/<its pid> says now; the
        figures are null once it ended (the kernel forgot it)."""
        proc = self.table.get(msg.get("pid"))
        out: dict[str, Any] = {"pid": proc.id, "running": proc.running, "state": "exited"}
        out |= dict.fromkeys(("cpu_user_ms", "cpu_system_ms", "rss_bytes", "threads"))
        try:
            with open(f"/proc/{proc.os_pid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            return out, None  # reaped: no figures left
        # "pid (comm) state ..." where comm may hold spaces and parentheses: split after the last ")"
        fields = raw[raw.rindex(")") + 2 :].split()
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        out |= {
            "state": fields[0],
            "cpu_user_ms": int(int(fields[11]) * tick_ms),
            "cpu_system_ms": int(int(fields[12]) * tick_ms),
            "threads": int(fields[17]),
            "rss_bytes": int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
        }
        return out, None

    def _delete(self, msg: P.Message) -> Answer:
        self.table.remove(msg.get("pid"))
        return {"pid": msg.get("pid"), "deleted": True}, None

    def _read(self, msg: P.Message) -> Answer:
        proc = self.table.get(msg.get("pid"))
        start = _int(msg, "from", 0, 0, 2**62)
        limit = _int(msg, "max_bytes", MAX_READ_BYTES, 1, MAX_READ_BYTES)
        wait_ms = _int(msg, "wait_ms", 0, 0, MAX_WAIT_MS)
        if wait_ms:
            proc.wait_output(start, wait_ms / 1000)
        with proc.cond:
            if start > proc.journal.end:
                raise ExecError(P.ERR_INVAL, f"from {start} is past the output's end ({proc.journal.end})")
            gap, records = proc.journal.read(start, limit)
        nxt = records[-1][0] + len(records[-1][2]) if records else max(start, proc.journal.start)
        meta = [{"fd": fd, "o": off, "n": len(d)} for off, fd, d in records]
        result = {"process": proc.info(), "from": start, "next": nxt, "gap": gap, "records": meta}
        return result, b"".join(d for _, _, d in records)

    def _stdin(self, msg: P.Message) -> Answer:
        proc = self.table.get(msg.get("pid"))
        eof = msg.get("eof", False)
        if not isinstance(eof, bool):
            raise ExecError(P.ERR_INVAL, "eof must be a boolean")
        data = P.payload(msg)
        written = proc.write_stdin(data) if data else 0
        if eof and written == len(data):
            proc.close_stdin()
        return {"written": written, "closed": not proc.stdin_open}, None


# The process requests answered once, each by its method: the one table of them (the
# harness takes every kind here, and ``pattach``, as a process request).
ANSWERS: dict[str, Callable[[ProcessRequests, P.Message], Answer]] = {
    P.K_PLIST: ProcessRequests._list,
    P.K_PGET: ProcessRequests._get,
    P.K_PREAD: ProcessRequests._read,
    P.K_PSTDIN: ProcessRequests._stdin,
    P.K_PSIGNAL: ProcessRequests._signal,
    P.K_PRESIZE: ProcessRequests._resize,
    P.K_PWAIT: ProcessRequests._wait,
    P.K_PDELETE: ProcessRequests._delete,
    "pstats": ProcessRequests._stats,
}
KINDS = frozenset({P.K_PATTACH, *ANSWERS})
