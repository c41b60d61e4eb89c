"""A process on a terminal (``runtime.processes.terminal(...)``): type into it, resize it,
read what it shows (docs/processes.md). The terminal is the process's stdin and its one
output stream (``stdout``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from .models import OutputEvent


class _TerminalProcess:
    """What a terminal is: the process as started (``process``) and the calls that reach it."""

    def __init__(self, processes: Any, vm_id: str, process: dict[str, Any]) -> None:
        # processes: the Processes or AsyncProcesses that started it (processes.py imports this module)
        self._p = processes
        self.vm_id = vm_id
        self.process = process
        self.pid: int = int(process["processId"])


class Terminal(_TerminalProcess):
    """A process started on a terminal; ``process`` is it as started."""

    def write(self, data: bytes | str) -> None:
        """Type ``data`` (``str`` as UTF-8), as keys reach the terminal (``"\\x03"`` is ^C)."""
        self._p.send_stdin(self.vm_id, self.pid, data)

    def resize(self, cols: int, rows: int) -> dict[str, Any]:
        """The terminal's new size (the program gets SIGWINCH)."""
        return self._p.resize(self.vm_id, self.pid, cols, rows)

    def output(self, offset: int = 0) -> Iterator[OutputEvent]:
        """What the terminal shows from ``offset`` on, reattaching by itself; ends with ``exit``."""
        return self._p.output(self.vm_id, self.pid, offset)

    def wait(self, timeout_secs: float | None = None) -> dict[str, Any]:
        return self._p.wait(self.vm_id, self.pid, timeout_secs)

    def kill(self) -> dict[str, Any]:
        return self._p.kill(self.vm_id, self.pid)


class AsyncTerminal(_TerminalProcess):
    """:class:`Terminal`, awaitable."""

    async def write(self, data: bytes | str) -> None:
        await self._p.send_stdin(self.vm_id, self.pid, data)

    async def resize(self, cols: int, rows: int) -> dict[str, Any]:
        return await self._p.resize(self.vm_id, self.pid, cols, rows)

    def output(self, offset: int = 0) -> AsyncIterator[OutputEvent]:
        return self._p.output(self.vm_id, self.pid, offset)

    async def wait(self, timeout_secs: float | None = None) -> dict[str, Any]:
        return await self._p.wait(self.vm_id, self.pid, timeout_secs)

    async def kill(self) -> dict[str, Any]:
        return await self._p.kill(self.vm_id, self.pid)
