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
from typing import Any

import httpx

from . import _procwire as pw
from . import _wire
from .errors import PalApiError
from .models import OutputEvent
from .terminal import AsyncTerminal, Terminal

STREAM_HEADERS = {"Accept": "text/event-stream"}


def _read_result(body: dict[str, Any]) -> dict[str, Any]:
    """A read's answer with each output item's ``data`` as bytes."""
    out = [{"stream": o["stream"], "data": base64.b64decode(o["data"])} for o in body["output"]]
    return {**body, "output": out}


class Processes:
    def __init__(self, client: Any) -> None:  # a Client (client.py imports this module)
        self._c = client

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._c.request(method, f"/v1/runtime{path}", **kw).json()

    def start(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Any
    ) -> dict[str, Any]:
        """Start ``command``; ``opts``: env, cwd, timeout_secs, user, stdin (bool), pty
        ((cols, rows) or {cols, rows}), tag, keep_awake, journal_bytes. The process."""
        return dict(self._json("POST", f"/vms/{vm_id}/processes", json=pw.start_body(command, argv, **opts)))

    def terminal(
        self,
        vm_id: str,
        command: str = "/bin/sh",
        argv: builtins.list[str] | None = None,
        *,
        cols: int = 80,
        rows: int = 24,
        **opts: Any,
    ) -> Terminal:
        """Start ``command`` on a terminal of ``cols`` x ``rows``: a :class:`Terminal` to
        write to, resize and read."""
        return Terminal(self, vm_id, self.start(vm_id, command, argv, pty=(cols, rows), **opts))

    def list(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list(self._json("GET", f"/vms/{vm_id}/processes")["processes"])

    def get(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(self._json("GET", f"/vms/{vm_id}/processes/{pid}"))

    def read(self, vm_id: str, pid: int, offset: int = 0, *, wait_ms: int = 0) -> dict[str, Any]:
        """One read from ``offset``: ``{from, next, gap, output: [{stream, data: bytes}], process}``."""
        params = {"from": offset, "waitMs": wait_ms, "encoding": "base64"}
        timeout = httpx.Timeout(self._c.timeout + wait_ms / 1000)
        return _read_result(
            self._json("GET", f"/vms/{vm_id}/processes/{pid}/output", params=params, timeout=timeout)
        )

    def output(
        self, vm_id: str, pid: int, offset: int = 0, *, reattach_timeout: float = pw.REATTACH_TIMEOUT_S
    ) -> Iterator[OutputEvent]:
        """The output from ``offset`` on, as it comes, ending with the ``exit`` event."""
        backoff, since = pw.BACKOFF_START_S, time.monotonic()
        while True:
            try:
                for ev in self._attach(vm_id, pid, offset):
                    if ev.type == "detached":
                        break
                    if ev.type == "error":
                        raise PalApiError(503, "STREAM_ERROR", ev.reason)
                    backoff, since = pw.BACKOFF_START_S, time.monotonic()
                    offset = ev.offset or offset
                    yield ev
                    if ev.type == "exit":
                        return
            except PalApiError as exc:
                if not pw.may_reattach(exc) or time.monotonic() - since > reattach_timeout:
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, pw.BACKOFF_MAX_S)

    def _attach(self, vm_id: str, pid: int, offset: int) -> Iterator[OutputEvent]:
        params = {"from": offset, "encoding": "base64"}
        try:
            with self._c._http.stream(
                "GET",
                f"/v1/runtime/vms/{vm_id}/processes/{pid}/output",
                params=params,
                headers=STREAM_HEADERS,
                timeout=_wire.exec_timeout(self._c.timeout),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _wire.check(resp)
                sse = pw.SseLines()
                for line in resp.iter_lines():
                    got = sse.feed(line)
                    ev = pw.output_event(*got) if got else None
                    if ev is not None:
                        yield ev
        except httpx.TransportError as exc:
            raise _wire.connection_error(exc, self._c.base_url) from exc

    def send_stdin(self, vm_id: str, pid: int, data: bytes | str, *, eof: bool = False) -> None:
        """Write all of ``data`` (``str`` as UTF-8) to its stdin; ``eof`` closes it after."""
        raw = data.encode() if isinstance(data, str) else data
        view = memoryview(raw)
        while True:
            part = bytes(view[: 1 << 20])
            last = len(part) == len(view)
            params = {"eof": "true" if eof and last else "false"}
            body = self._json("POST", f"/vms/{vm_id}/processes/{pid}/stdin", params=params, content=part)
            view = view[int(body["written"]) :]
            if not view:
                return

    def close_stdin(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(self._json("POST", f"/vms/{vm_id}/processes/{pid}/stdin/close"))

    def signal(self, vm_id: str, pid: int, signal: str = "INT") -> dict[str, Any]:
        """To its whole process group: INT, TERM, KILL, HUP, QUIT, USR1, USR2, STOP, CONT, WINCH."""
        return dict(self._json("POST", f"/vms/{vm_id}/processes/{pid}/signal", json={"signal": signal}))

    def resize(self, vm_id: str, pid: int, cols: int, rows: int) -> dict[str, Any]:
        return dict(
            self._json("POST", f"/vms/{vm_id}/processes/{pid}/resize", json={"cols": cols, "rows": rows})
        )

    def kill(self, vm_id: str, pid: int) -> dict[str, Any]:
        """Kill it (its group) and forget it."""
        return dict(self._json("DELETE", f"/vms/{vm_id}/processes/{pid}"))

    def wait(self, vm_id: str, pid: int, timeout_secs: float | None = None) -> dict[str, Any]:
        """The process once it exited, or as it is at ``timeout_secs`` (None: no limit)."""
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        while True:
            left = pw.WAIT_POLL_SECS if deadline is None else max(0.0, deadline - time.monotonic())
            poll = min(left, pw.WAIT_POLL_SECS)
            proc = dict(
                self._json(
                    "POST",
                    f"/vms/{vm_id}/processes/{pid}/wait",
                    params={"timeoutSecs": poll},
                    timeout=httpx.Timeout(self._c.timeout + poll),
                )
            )
            if not proc["running"] or (deadline is not None and time.monotonic() >= deadline):
                return proc


class AsyncProcesses:
    """:class:`Processes`, awaitable."""

    def __init__(self, client: Any) -> None:  # an AsyncClient
        self._c = client

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self._c.request(method, f"/v1/runtime{path}", **kw)).json()

    async def start(
        self, vm_id: str, command: str, argv: builtins.list[str] | None = None, **opts: Any
    ) -> dict[str, Any]:
        return dict(
            await self._json("POST", f"/vms/{vm_id}/processes", json=pw.start_body(command, argv, **opts))
        )

    async def terminal(
        self,
        vm_id: str,
        command: str = "/bin/sh",
        argv: builtins.list[str] | None = None,
        *,
        cols: int = 80,
        rows: int = 24,
        **opts: Any,
    ) -> AsyncTerminal:
        proc = await self.start(vm_id, command, argv, pty=(cols, rows), **opts)
        return AsyncTerminal(self, vm_id, proc)

    async def list(self, vm_id: str) -> builtins.list[dict[str, Any]]:
        return list((await self._json("GET", f"/vms/{vm_id}/processes"))["processes"])

    async def get(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(await self._json("GET", f"/vms/{vm_id}/processes/{pid}"))

    async def read(self, vm_id: str, pid: int, offset: int = 0, *, wait_ms: int = 0) -> dict[str, Any]:
        params = {"from": offset, "waitMs": wait_ms, "encoding": "base64"}
        timeout = httpx.Timeout(self._c.timeout + wait_ms / 1000)
        body = await self._json("GET", f"/vms/{vm_id}/processes/{pid}/output", params=params, timeout=timeout)
        return _read_result(body)

    async def output(
        self, vm_id: str, pid: int, offset: int = 0, *, reattach_timeout: float = pw.REATTACH_TIMEOUT_S
    ) -> AsyncIterator[OutputEvent]:
        backoff, since = pw.BACKOFF_START_S, time.monotonic()
        while True:
            try:
                async for ev in self._attach(vm_id, pid, offset):
                    if ev.type == "detached":
                        break
                    if ev.type == "error":
                        raise PalApiError(503, "STREAM_ERROR", ev.reason)
                    backoff, since = pw.BACKOFF_START_S, time.monotonic()
                    offset = ev.offset or offset
                    yield ev
                    if ev.type == "exit":
                        return
            except PalApiError as exc:
                if not pw.may_reattach(exc) or time.monotonic() - since > reattach_timeout:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, pw.BACKOFF_MAX_S)

    async def _attach(self, vm_id: str, pid: int, offset: int) -> AsyncIterator[OutputEvent]:
        params = {"from": offset, "encoding": "base64"}
        try:
            async with self._c._http.stream(
                "GET",
                f"/v1/runtime/vms/{vm_id}/processes/{pid}/output",
                params=params,
                headers=STREAM_HEADERS,
                timeout=_wire.exec_timeout(self._c.timeout),
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _wire.check(resp)
                sse = pw.SseLines()
                async for line in resp.aiter_lines():
                    got = sse.feed(line)
                    ev = pw.output_event(*got) if got else None
                    if ev is not None:
                        yield ev
        except httpx.TransportError as exc:
            raise _wire.connection_error(exc, self._c.base_url) from exc

    async def send_stdin(self, vm_id: str, pid: int, data: bytes | str, *, eof: bool = False) -> None:
        raw = data.encode() if isinstance(data, str) else data
        view = memoryview(raw)
        while True:
            part = bytes(view[: 1 << 20])
            last = len(part) == len(view)
            params = {"eof": "true" if eof and last else "false"}
            body = await self._json(
                "POST", f"/vms/{vm_id}/processes/{pid}/stdin", params=params, content=part
            )
            view = view[int(body["written"]) :]
            if not view:
                return

    async def close_stdin(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(await self._json("POST", f"/vms/{vm_id}/processes/{pid}/stdin/close"))

    async def signal(self, vm_id: str, pid: int, signal: str = "INT") -> dict[str, Any]:
        return dict(await self._json("POST", f"/vms/{vm_id}/processes/{pid}/signal", json={"signal": signal}))

    async def resize(self, vm_id: str, pid: int, cols: int, rows: int) -> dict[str, Any]:
        return dict(
            await self._json(
                "POST", f"/vms/{vm_id}/processes/{pid}/resize", json={"cols": cols, "rows": rows}
            )
        )

    async def kill(self, vm_id: str, pid: int) -> dict[str, Any]:
        return dict(await self._json("DELETE", f"/vms/{vm_id}/processes/{pid}"))

    async def wait(self, vm_id: str, pid: int, timeout_secs: float | None = None) -> dict[str, Any]:
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        while True:
            left = pw.WAIT_POLL_SECS if deadline is None else max(0.0, deadline - time.monotonic())
            poll = min(left, pw.WAIT_POLL_SECS)
            proc = dict(
                await self._json(
                    "POST",
                    f"/vms/{vm_id}/processes/{pid}/wait",
                    params={"timeoutSecs": poll},
                    timeout=httpx.Timeout(self._c.timeout + poll),
                )
            )
            if not proc["running"] or (deadline is not None and time.monotonic() >= deadline):
                return proc
