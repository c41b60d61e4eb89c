"""A process attached to this terminal over the WebSocket attach (`pal vm shell`, `pal vm
attach`): raw mode, keystrokes to the process, its output to the screen, the window size
on SIGWINCH, and the remote exit status as ours.

Across a pause, a move or a dropped connection the socket ends with ``detached``: we say so
on stderr and reattach from the offset we got to, so the screen goes on where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Awaitable, Callable
from typing import Any

from pal.sdk import _procwire as pw
from pal.sdk.attach import Attachment
from pal.sdk.errors import PalApiError

Opener = Callable[[int], Awaitable[Attachment]]
HANGUP_EXIT = 129  # 128 + SIGHUP: our terminal went away, the remote one was hung up too


def _note(text: str) -> None:
    # \r: in raw mode a newline does not return the carriage
    sys.stderr.write(f"\r\n[pal] {text}\r\n")
    sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            continue
        view = view[n:]


class Session:
    """One attached process; ``interactive``: this terminal in raw mode drives it."""

    def __init__(self, open_: Opener, offset: int, interactive: bool, label: str, owned: bool) -> None:
        self.open_ = open_
        self.owned = owned  # we started it (`pal vm shell`): our hangup is its hangup
        self.offset = offset
        self.interactive = interactive
        self.label = label  # how to reattach, for the notes
        self.keys: asyncio.Queue[bytes] = asyncio.Queue()
        self.att: Attachment | None = None
        self.hung_up = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        saved = None
        if self.interactive:
            saved = termios.tcgetattr(0)
            tty.setraw(0)
            loop.add_reader(0, self._key)
            loop.add_signal_handler(signal.SIGWINCH, lambda: asyncio.ensure_future(self._resize()))
        for sig in (signal.SIGHUP, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self._hangup()))
        try:
            return await self._attached()
        finally:
            if saved is not None:
                loop.remove_reader(0)
                loop.remove_signal_handler(signal.SIGWINCH)
                termios.tcsetattr(0, termios.TCSADRAIN, saved)

    def _key(self) -> None:
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(0)
        self.keys.put_nowait(data)

    async def _resize(self) -> None:
        if self.att is None:
            return
        cols, rows = os.get_terminal_size(1 if os.isatty(1) else 0)
        with contextlib.suppress(Exception):
            await self.att.resize(cols, rows)

    async def _hangup(self) -> None:
        self.hung_up = True
        if self.att is not None and self.owned:
            with contextlib.suppress(Exception):
                await self.att.signal("HUP")
        if self.att is not None:
            with contextlib.suppress(Exception):
                await self.att.close()

    async def _attached(self) -> int:
        """Attach, and attach again after each detach, until the process exits."""
        backoff = pw.BACKOFF_START_S
        since = asyncio.get_running_loop().time()
        while True:
            try:
                self.att = await self.open_(self.offset)
            except PalApiError as exc:
                waited = asyncio.get_running_loop().time() - since
                if not pw.may_reattach(exc) or waited > pw.REATTACH_TIMEOUT_S:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, pw.BACKOFF_MAX_S)
                continue
            backoff = pw.BACKOFF_START_S
            if self.interactive:
                await self._resize()
            code, reason = await self._follow(self.att)
            if code is not None:
                return code
            if self.hung_up:
                return HANGUP_EXIT
            _note(f"detached ({reason}); reattaching from offset {self.offset} ({self.label})")
            since = asyncio.get_running_loop().time()

    async def _follow(self, att: Attachment) -> tuple[int | None, str]:
        """Output to the screen and keys to the process until the socket ends: (exit code,
        None) or (None, why it detached)."""
        sender = asyncio.create_task(self._send_keys(att)) if self.interactive else None
        try:
            async for ev in att.events():
                if ev.type == "output":
                    _write_all(1, ev.data)
                    self.offset = att.offset
                elif ev.type == "gap":
                    _note(f"{ev.lost} bytes of output were dropped by the journal's bound")
                    self.offset = att.offset
                elif ev.type == "exit":
                    return (ev.exit_code if ev.exit_code is not None else 1), ""
                elif ev.type == "error":
                    raise PalApiError(ev.status or 503, ev.code or "ATTACH_ERROR", ev.message)
                else:
                    self.offset = att.offset
                    return None, ev.reason
            return None, "closed"
        finally:
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            with contextlib.suppress(Exception):
                await att.close()

    async def _send_keys(self, att: Attachment) -> None:
        while True:
            data = await self.keys.get()
            try:
                if data:
                    await att.send(data)
                else:
                    await att.eof()
                    return
            except Exception:
                self.keys.put_nowait(data)  # the socket went: the next attach sends it
                return


def attach_terminal(open_: Opener, offset: int, interactive: bool, label: str, owned: bool = False) -> int:
    """Run a session; the remote exit status (HANGUP_EXIT when our terminal went away).
    ``owned``: the process is this session's (`pal vm shell`), hung up with it."""
    return asyncio.run(Session(open_, offset, interactive, label, owned).run())


def terminal_size() -> dict[str, Any]:
    cols, rows = os.get_terminal_size(1 if os.isatty(1) else 0)
    return {"cols": cols, "rows": rows}
