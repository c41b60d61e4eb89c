"""Result types of the SDK. VM, fork, file-list and event answers are returned as the
server's JSON (camelCase dicts, documented by /openapi.json); exec and file reads get
small typed wrappers because callers branch on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    process_id: int | None = None  # the exec's process: its output and status stay readable


@dataclass(frozen=True)
class OutputEvent:
    """One event of a process's output (``runtime.processes.output``): ``stdout``/``stderr``
    (``data`` bytes; ``offset``: the journal offset after them, where a reader resumes),
    ``gap`` (``lost`` bytes the journal's bound dropped), ``exit`` (``exit_code``)."""

    type: str
    data: bytes
    offset: int
    lost: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    reason: str = ""


@dataclass(frozen=True)
class ExecEvent:
    """One streamed exec event: `process` (process_id, first), `stdout`/`stderr` (data),
    `exit` (exit_code), `error`, or `detached` (the stream ended before the command, which
    runs on: its process's output is read on by process_id)."""

    type: str
    data: str | None = None
    exit_code: int | None = None
    code: str | None = None
    message: str | None = None
    timed_out: bool = False
    process_id: int | None = None


class FileText(str):
    """File content as text; ``truncated`` is True when the server cut it at 1 MiB."""

    truncated: bool

    def __new__(cls, text: str, truncated: bool = False) -> FileText:
        return _marked(super().__new__(cls, text), truncated)


class FileBytes(bytes):
    """File content as bytes, exactly as stored; ``truncated`` as for :class:`FileText`."""

    truncated: bool

    def __new__(cls, data: bytes, truncated: bool = False) -> FileBytes:
        return _marked(super().__new__(cls, data), truncated)


_Content = TypeVar("_Content", FileText, FileBytes)


def _marked(content: _Content, truncated: bool) -> _Content:
    content.truncated = truncated
    return content
