"""``client.runtime.processes``: processes that outlive their request (docs/processes.md).

``output()`` follows a process's output and reattaches by itself from the last offset it
gave (after a dropped connection, or a ``detached`` event: the VM paused, moved, its node
restarted), so the caller sees every byte once, in order, and then the exit. An
idle-suspended VM is woken by the reattach, as an exec wakes it; a VM paused by an operator
is waited for (up to ``reattach_timeout``).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Unpack

import httpx

from . import _procwire as pw
from . import _wire
from .attach import Attachment, open_attach
from .errors import PalApiError
from .models import OutputEvent
from .terminal import AsyncTerminal, Terminal

Argv = builtins.list[str] | None


def _read_result(body: dict[str, Any]) -> dict[str, Any]:
    """A read's answer with each output item's ``data`` as bytes."""
    out = [{"stream": o["stream"], "data": base64.b64decode(o["data"])} for o in body["output"]]
    return {**body, "output": out}


class Processes(_wire.RuntimeCalls):
    def start(
        self, vm_id: str, command: str, argv: Argv = None, **opts: Unpack[pw.ProcessOptions]
    ) -> dict[str, Any]:
        """Start ``command``; ``opts``: env, cwd, timeout_secs, user, stdin (bool), pty
        ((cols, rows) or {cols, rows}), tag, keep_awake, journal_bytes. The process."""
        return dict(
            self._json(
                "POST", f"/vms/{_wire.seg(vm_id)}/processes", json=pw.start_body(command, argv, **opts)
            )
        )

    def terminal(
        self, vm_id: str, command: str = "/bin/sh", argv: Argv = None, **opts: Unpack[pw.TerminalOptions]
    ) -> Terminal:
        """Start ``command`` on a terminal of ``cols`` x ``rows``: a :class:`Terminal` to
        write to, resize and read."""
        return Terminal(self, vm_id, self.start(vm_id, command, argv, **pw.terminal_options(opts)))

    def list(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list(self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes")["processes"])

    def get(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}"))

    def stats(self, vm_id: str, pid: int) -> dict[str, Any]:
        """Its CPU time, resident memory, threads and state now (``{processId, running,
        state, cpuUserMs, cpuSystemMs, rssBytes, threads}``; null figures once it ended)."""
        return dict(self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stats"))

    def read(self, vm_id: str, pid: int, offset: int = 0, *, wait_ms: int = 0) -> dict[str, Any]:
        """One read from ``offset``: ``{from, next, gap, output: [{stream, data: bytes}], process}``."""
        params = {"from": offset, "waitMs": wait_ms, "encoding": "base64"}
        timeout = httpx.Timeout(self._c.timeout + wait_ms / 1000)
        return _read_result(
            self._json(
                "GET",
                f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/output",
                params=params,
                timeout=timeout,
            )
        )

    def output(
        self, vm_id: str, pid: int, offset: int = 0, *, reattach_timeout: float = pw.REATTACH_TIMEOUT_S
    ) -> Iterator[OutputEvent]:
        """The output from ``offset`` on, as it comes, ending with the ``exit`` event."""
        reattach = pw.Reattach(offset, reattach_timeout)
        while True:
            try:
                for ev in self._attach(vm_id, pid, reattach.offset):
                    if not reattach.passes(ev):
                        break
                    yield ev
                    if ev.type == "exit":
                        return
            except PalApiError as exc:
                if not reattach.may_retry(exc):
                    raise
                time.sleep(reattach.next_backoff())

    def _attach(self, vm_id: str, pid: int, offset: int) -> Iterator[OutputEvent]:
        params = {"from": offset, "encoding": "base64"}
        with self._sse(
            "GET", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/output", params=params
        ) as lines:
            sse = pw.SseLines()
            for line in lines:
                got = sse.feed(line)
                ev = pw.output_event(*got) if got else None
                if ev is not None:
                    yield ev

    def send_stdin(self, vm_id: str, pid: int, data: bytes | str, *, eof: bool = False) -> None:
        """Write all of ``data`` (``str`` as UTF-8) to its stdin; ``eof`` closes it after."""
        parts = pw.StdinParts(data, eof)
        while True:
            part, params = parts.next_part()
            body = self._json(
                "POST",
                f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stdin",
                params=params,
                content=part,
            )
            if parts.taken(body):
                return

    def close_stdin(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(self._json("POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stdin/close"))

    def signal(self, vm_id: str, pid: int, signal: str = "INT") -> dict[str, Any]:
        """To its whole process group: INT, TERM, KILL, HUP, QUIT, USR1, USR2, STOP, CONT, WINCH."""
        return dict(
            self._json(
                "POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/signal", json={"signal": signal}
            )
        )

    def resize(self, vm_id: str, pid: int, cols: int, rows: int) -> dict[str, Any]:
        return dict(
            self._json(
                "POST",
                f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/resize",
                json={"cols": cols, "rows": rows},
            )
        )

    def attach_url(
        self, vm_id: str, pid: int, expires_in_secs: int = 300, *, read_only: bool = False
    ) -> dict[str, Any]:
        """A signed link (``{url, expiresAt, linkId}``) that opens the process's WebSocket
        attach without the API key (a browser's terminal); ``read_only``: output only, no
        input. See ``AsyncProcesses.attach``."""
        body = {"expiresInSecs": expires_in_secs, "readOnly": read_only}
        return dict(
            self._json("POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/attach-url", json=body)
        )

    def kill(self, vm_id: str, pid: int) -> dict[str, Any]:
        """Kill it (its group) and forget it."""
        return dict(self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}"))

    def wait(self, vm_id: str, pid: int, timeout_secs: float | None = None) -> dict[str, Any]:
        """The process once it exited, or as it is at ``timeout_secs`` (None: no limit)."""
        polls = pw.WaitPolls(timeout_secs)
        while True:
            poll = polls.next_poll()
            params, timeout = {"timeoutSecs": poll}, httpx.Timeout(self._c.timeout + poll)
            proc = dict(
                self._json(
                    "POST",
                    f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/wait",
                    params=params,
                    timeout=timeout,
                )
            )
            if polls.done(proc):
                return proc


class AsyncProcesses(_wire.AsyncRuntimeCalls):
    """:class:`Processes`, awaitable."""

    async def start(
        self, vm_id: str, command: str, argv: Argv = None, **opts: Unpack[pw.ProcessOptions]
    ) -> dict[str, Any]:
        return dict(
            await self._json(
                "POST", f"/vms/{_wire.seg(vm_id)}/processes", json=pw.start_body(command, argv, **opts)
            )
        )

    async def terminal(
        self, vm_id: str, command: str = "/bin/sh", argv: Argv = None, **opts: Unpack[pw.TerminalOptions]
    ) -> AsyncTerminal:
        proc = await self.start(vm_id, command, argv, **pw.terminal_options(opts))
        return AsyncTerminal(self, vm_id, proc)

    async def list(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list((await self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes"))["processes"])

    async def get(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(await self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}"))

    async def stats(self, vm_id: str, pid: int) -> dict[str, Any]:
        """As :meth:`Processes.stats`."""
        return dict(await self._json("GET", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stats"))

    async def read(self, vm_id: str, pid: int, offset: int = 0, *, wait_ms: int = 0) -> dict[str, Any]:
        params = {"from": offset, "waitMs": wait_ms, "encoding": "base64"}
        timeout = httpx.Timeout(self._c.timeout + wait_ms / 1000)
        body = await self._json(
            "GET",
            f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/output",
            params=params,
            timeout=timeout,
        )
        return _read_result(body)

    async def output(
        self, vm_id: str, pid: int, offset: int = 0, *, reattach_timeout: float = pw.REATTACH_TIMEOUT_S
    ) -> AsyncIterator[OutputEvent]:
        reattach = pw.Reattach(offset, reattach_timeout)
        while True:
            try:
                async for ev in self._attach(vm_id, pid, reattach.offset):
                    if not reattach.passes(ev):
                        break
                    yield ev
                    if ev.type == "exit":
                        return
            except PalApiError as exc:
                if not reattach.may_retry(exc):
                    raise
                await asyncio.sleep(reattach.next_backoff())

    async def _attach(self, vm_id: str, pid: int, offset: int) -> AsyncIterator[OutputEvent]:
        url = f"/v1/runtime/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/output"
        async with _wire.asse_lines(
            self._c, "GET", url, params={"from": offset, "encoding": "base64"}
        ) as lines:
            sse = pw.SseLines()
            async for line in lines:
                got = sse.feed(line)
                ev = pw.output_event(*got) if got else None
                if ev is not None:
                    yield ev

    async def send_stdin(self, vm_id: str, pid: int, data: bytes | str, *, eof: bool = False) -> None:
        parts = pw.StdinParts(data, eof)
        while True:
            part, params = parts.next_part()
            body = await self._json(
                "POST",
                f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stdin",
                params=params,
                content=part,
            )
            if parts.taken(body):
                return

    async def close_stdin(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(
            await self._json("POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/stdin/close")
        )

    async def signal(self, vm_id: str, pid: int, signal: str = "INT") -> dict[str, Any]:
        return dict(
            await self._json(
                "POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/signal", json={"signal": signal}
            )
        )

    async def resize(self, vm_id: str, pid: int, cols: int, rows: int) -> dict[str, Any]:
        return dict(
            await self._json(
                "POST",
                f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/resize",
                json={"cols": cols, "rows": rows},
            )
        )

    async def attach_url(
        self, vm_id: str, pid: int, expires_in_secs: int = 300, *, read_only: bool = False
    ) -> dict[str, Any]:
        body = {"expiresInSecs": expires_in_secs, "readOnly": read_only}
        return dict(
            await self._json(
                "POST", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/attach-url", json=body
            )
        )

    async def attach(self, vm_id: str, pid: int, offset: int = 0) -> Attachment:
        """The process over a WebSocket from ``offset``: output bytes as they come, stdin,
        resize, signals (pal/sdk/attach.py); close it when done."""
        return await open_attach(self._c.base_url, self._c.api_key, vm_id, pid, offset)

    async def kill(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(await self._json("DELETE", f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}"))

    async def wait(self, vm_id: str, pid: int, timeout_secs: float | None = None) -> dict[str, Any]:
        polls = pw.WaitPolls(timeout_secs)
        while True:
            poll = polls.next_poll()
            params, timeout = {"timeoutSecs": poll}, httpx.Timeout(self._c.timeout + poll)
            proc = dict(
                await self._json(
                    "POST",
                    f"/vms/{_wire.seg(vm_id)}/processes/{_wire.seg(pid)}/wait",
                    params=params,
                    timeout=timeout,
                )
            )
            if polls.done(proc):
                return proc
