"""The node RPC's process verbs (issue 22; docs/processes.md): what they name and answer.

Output bytes travel base64-encoded here; the API decodes them for its text views and
answers with shapes of its own (pal/api/processes.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pal.guest import protocol as p
from pal.ids import SafeId
from pal.spec import ProcessStartRequest, SignalRequest, Terminal
from pal.wire.models import StreamError
from pal.wire.models import WireModel as _Model

# The harness's own bounds (pal/guest/procrequests.py): the longest long poll, and the most
# output one read answers with (here also kept under the channel's line limit once
# base64-encoded: guest_input.MAX_GUEST_LINE_BYTES).
MAX_WAIT_MS = 60_000
MAX_READ_BYTES = p.MAX_FILE_BYTES
MAX_STDIN_BYTES = p.MAX_FILE_BYTES  # one stdin write

Pid = Annotated[int, Field(ge=1, le=2**53)]
Offset = Annotated[int, Field(ge=0, le=2**62)]


class TerminalSize(_Model):
    cols: int
    rows: int


class JournalBounds(_Model):
    """The output journal's offsets: bytes before ``start`` were dropped by its bound
    (``capacity``); ``end`` is the offset after the newest byte."""

    start: int
    end: int
    capacity: int


class ProcessInfo(_Model):
    process_id: int = Field(..., description="the process's id in its VM (stable across pauses and forks)")
    os_pid: int = Field(..., description="its pid inside the guest")
    argv: list[str]
    tag: str
    user: str
    cwd: str
    pty: TerminalSize | None = None
    stdin: bool = Field(..., description="its stdin is open for writes")
    keep_awake: bool
    started_ms: int
    ended_ms: int | None = None
    running: bool
    exit_code: int | None = None
    timed_out: bool
    journal: JournalBounds


class ProcessList(_Model):
    processes: list[ProcessInfo]


class OutputChunk(_Model):
    """Output bytes from ``offset`` on (base64 ``data`` on the node's RPC)."""

    stream: Literal["stdout", "stderr"]
    offset: int
    data: str


class ProcessOutput(_Model):
    """A read of a process's journal from ``from`` on: ``gap`` bytes lost to its bound, then
    the chunks; ``next`` is where the next read starts."""

    from_: int = Field(..., alias="from")
    next: int
    gap: int
    chunks: list[OutputChunk]
    process: ProcessInfo


class ProcessEvent(StreamError):
    """One line of a process's output stream (the node's NDJSON ``attach``).

    ``output``: ``data`` (base64) of ``stream``, ``offset`` the journal offset *after* it;
    ``gap``: ``lost`` bytes dropped by the journal's bound, ``offset`` after them;
    ``exit``: its status, once all its output was sent; ``detached``: the stream ended
    and the process did not (``reason``: ``vm-stopped``, ``live-paused``, ``detached``,
    ``node-unreachable``), never an exit; ``error``: a node error (``status``) or the
    guest's error code."""

    type: Literal["output", "gap", "exit", "detached", "error"]
    stream: Literal["stdout", "stderr"] | None = None
    offset: int | None = None
    data: str | None = None
    lost: int | None = None
    exit_code: int | None = None
    timed_out: bool | None = None
    reason: str | None = None


class StartedEvent(StreamError):
    """One line of ``start_attached``: ``started`` first (``process_id``), then the lines of
    :class:`ProcessEvent` (its fields, the same meanings) from the process's first byte."""

    type: Literal["started", "output", "gap", "exit", "detached", "error"]
    process_id: Pid | None = None
    stream: Literal["stdout", "stderr"] | None = None
    offset: int | None = None
    data: str | None = None
    lost: int | None = None
    exit_code: int | None = None
    timed_out: bool | None = None
    reason: str | None = None


class StdinWritten(_Model):
    written: int = Field(..., description="bytes the process took; fewer than sent: send the rest again")
    closed: bool = Field(..., description="its stdin is closed now")


class ProcessDeleted(_Model):
    process_id: int
    deleted: bool


class ProcessStats(_Model):
    """A process's figures from the guest's /proc, now (the process itself, not its
    children); null once it ended. Bounded: the guest's word, checked here."""

    pid: Pid
    running: bool
    state: str = Field(max_length=16)  # the kernel's state letter (R, S, D, Z, T...) or "exited"
    cpu_user_ms: int | None = Field(default=None, ge=0, le=2**62)
    cpu_system_ms: int | None = Field(default=None, ge=0, le=2**62)
    rss_bytes: int | None = Field(default=None, ge=0, le=2**62)
    threads: int | None = Field(default=None, ge=0, le=2**31)


class SignalSent(_Model):
    process_id: int
    signal: str


class Resized(_Model):
    process_id: int
    cols: int
    rows: int


# ---------------------------------------------------------------------- what a request names


class ProcessStart(ProcessStartRequest):
    """A process to start in a VM: the public request (pal/spec.py) and the VM."""

    vm_id: SafeId


class ProcessRef(_Model):
    vm_id: SafeId
    pid: Pid


class OutputRead(ProcessRef):
    start: Offset = 0  # the offset to read from
    max_bytes: int = Field(MAX_READ_BYTES, ge=1, le=MAX_READ_BYTES)
    wait_ms: int = Field(
        default=0, ge=0, le=MAX_WAIT_MS
    )  # a long poll: waits this long for output past ``from``


class AttachFrom(ProcessRef):
    start: Offset = 0  # the offset to follow from


class StdinWrite(ProcessRef):
    eof: bool = False
    data: bytes = b""  # the body (pal/wire/http.py); at most MAX_STDIN_BYTES (413)


class ProcessSignal(SignalRequest):
    vm_id: SafeId
    pid: Pid


class ProcessResize(Terminal):
    vm_id: SafeId
    pid: Pid


class ProcessWait(ProcessRef):
    timeout_ms: int = Field(default=0, ge=0, le=MAX_WAIT_MS)
