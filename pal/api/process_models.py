"""A process as the REST API gives it (docs/processes.md): the API's own shapes, read from
the node's (pal/wire/processes.py) by field name."""

from __future__ import annotations

from pydantic import Field

from .shapes import Shape as _Model


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


class StdinWritten(_Model):
    written: int = Field(..., description="bytes the process took; fewer than sent: send the rest again")
    closed: bool = Field(..., description="its stdin is closed now")


class ProcessDeleted(_Model):
    process_id: int
    deleted: bool
