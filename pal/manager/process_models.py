"""The node's answers about guest processes (issue 22; docs/processes.md).

The API answers with the same shapes (camelCase JSON), so a process looks alike from the
node's RPC, the REST API and the SDKs. Output bytes travel base64-encoded here; the API
decodes them for its text views.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pal.manager.models import StreamError
from pal.manager.models import WireModel as _Model


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


class StdinWritten(_Model):
    written: int = Field(..., description="bytes the process took; fewer than sent: send the rest again")
    closed: bool = Field(..., description="its stdin is closed now")


class ProcessDeleted(_Model):
    process_id: int
    deleted: bool
