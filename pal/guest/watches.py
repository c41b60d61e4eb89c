"""Directory watches with inotify (E2B's WatchDir and its polling watchers, pal/e2b/files.py):
``wnew {path, recursive}`` -> {watch_id}, ``wread {watch_id, wait_ms}`` -> {events, dropped},
``wdel {watch_id}``.

A watch lives in the guest, so it survives a pause the way a process does (its inotify
descriptor and what it holds are the guest's memory): whoever reads it next, after a
resume or from another replica, gets what happened in between. Bounded: at most
MAX_WATCHES, each holding at most MAX_EVENTS events; past that the oldest go and
``dropped`` says how many (as does a kernel queue overflow), memory never grows. A
recursive watch adds each directory made under it as it appears.

Events (fsnotify's words, E2B's): ``create``, ``write``, ``remove``, ``rename`` (the old
name of a move; its new name is a ``create``), ``chmod``; ``name`` relative to the root.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import secrets
import select
import struct
import threading
import time
from typing import Any

from pal.guest import protocol as P
from pal.guest.errors import ExecError
from pal.guest.oslib import libc

MAX_WATCHES = 16
MAX_EVENTS = 4096  # held per watch between two reads
MAX_DIRS = 4096  # directories one recursive watch follows
MAX_WAIT_MS = 10_000  # within the relay's guest request bound (GUEST_REQUEST_TIMEOUT_S)
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_IGNORED, IN_Q_OVERFLOW, IN_ISDIR = 0x400, 0x800, 0x8000, 0x4000, 0x40000000
IN_ONLYDIR, IN_NONBLOCK, IN_CLOEXEC = 0x1000000, 0o4000, 0o2000000
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
HEADER = struct.Struct("iIII")


def _op(mask: int) -> str | None:
    if mask & IN_CREATE or mask & IN_MOVED_TO:
        return "create"
    if mask & IN_DELETE:
        return "remove"
    if mask & IN_MOVED_FROM:
        return "rename"
    if mask & IN_MODIFY:
        return "write"
    if mask & IN_ATTRIB:
        return "chmod"
    return None


class Watch:
    def __init__(self, root: str, recursive: bool) -> None:
        self.root, self.recursive = root, recursive
        fd = libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), root)
        self.fd = fd
        self.dirs: dict[int, str] = {}  # watch descriptor -> directory relative to root
        self.events: collections.deque[dict[str, str]] = collections.deque()
        self.dropped = 0
        self.closed = False
        self.lock = threading.Condition()
        self._add("")
        if recursive:
            for dirpath, dirnames, _ in os.walk(root):
                for d in dirnames:
                    self._add(os.path.relpath(os.path.join(dirpath, d), root))

    def _add(self, rel: str) -> None:
        if len(self.dirs) >= MAX_DIRS:
            return
        path = os.path.join(self.root, rel) if rel else self.root
        wd = libc().inotify_add_watch(self.fd, path.encode(), MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if rel:
                return  # gone already, or not a directory any more: nothing to follow
            raise OSError(err, os.strerror(err), path)
        self.dirs[wd] = rel

    def _push(self, name: str, op: str) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.events.popleft()
            self.dropped += 1
        self.events.append({"name": name, "op": op})

    def drain(self) -> None:
        """What the kernel holds for this watch, into its bounded queue."""
        while not self.closed:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            at = 0
            while at + HEADER.size <= len(buf):
                wd, mask, _cookie, size = HEADER.unpack_from(buf, at)
                raw = buf[at + HEADER.size : at + HEADER.size + size]
                at += HEADER.size + size
                self._one(wd, mask, raw.split(b"\0", 1)[0].decode(errors="surrogateescape"))

    def _one(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self.dropped += 1
            return
        if mask & IN_IGNORED:
            self.dirs.pop(wd, None)
            return
        base = self.dirs.get(wd)
        if base is None or not name:
            return  # the directory itself (its own removal shows in its parent)
        rel = os.path.join(base, name) if base else name
        op = _op(mask)
        if op is not None:
            self._push(rel, op)
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._add(rel)
            # What was made in it before its watch was: created, as far as a watch can tell.
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root, rel)):
                for d in dirnames:
                    self._add(os.path.relpath(os.path.join(dirpath, d), self.root))
                for n in dirnames + filenames:
                    self._push(os.path.relpath(os.path.join(dirpath, n), self.root), "create")

    def read(self, wait_ms: int) -> dict[str, Any]:
        with self.lock:
            self.drain()
            if not self.events and wait_ms > 0:
                self.lock.wait_for(lambda: bool(self.events) or self.closed, wait_ms / 1000)
                self.lock.release()  # a write's few events together, not one a poll
                try:
                    time.sleep(0.02)
                finally:
                    self.lock.acquire()
                self.drain()
            events, dropped = list(self.events), self.dropped
            self.events.clear()
            self.dropped = 0
        return {"events": events, "dropped": dropped}

    def close(self) -> None:
        self.closed = True
        os.close(self.fd)
        self.lock.notify_all()


class Watches:
    """The guest's watches, drained as events come by one thread (so a recursive watch
    follows a new directory at once, and the bound is the watch's, not the kernel's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[str, Watch] = {}
        self._wake_r, self._wake_w = -1, -1

    def _drainer(self) -> None:
        while True:
            with self._lock:
                watches = list(self._watches.values())
            by_fd = {w.fd: w for w in watches if not w.closed}
            try:
                ready, _, _ = select.select([self._wake_r, *by_fd], [], [])
            except OSError:
                continue  # a watch closed while we waited: look again
            for fd in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                w = by_fd[fd]
                with w.lock:
                    if not w.closed:
                        w.drain()
                        w.lock.notify_all()

    def _poke(self) -> None:
        if self._wake_w < 0:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            threading.Thread(target=self._drainer, name="watches", daemon=True).start()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _get(self, msg: P.Message) -> Watch:
        with self._lock:
            w = self._watches.get(str(msg.get("watch_id")))
        if w is None:
            raise ExecError(P.ERR_NOENT, f"watch {msg.get('watch_id')!r} not found")
        return w

    def new(self, msg: P.Message) -> dict[str, Any]:
        path, recursive = msg.get("path"), msg.get("recursive") is True
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise ExecError(P.ERR_INVAL, "path must be an absolute path")
        if not os.path.isdir(path):
            raise ExecError(
                P.ERR_NOENT if not os.path.exists(path) else P.ERR_NOTDIR, f"not a directory: {path}"
            )
        with self._lock:
            if len(self._watches) >= MAX_WATCHES:
                raise ExecError(P.ERR_LIMIT, f"at most {MAX_WATCHES} watches: remove one first")
            watch_id = "w-" + secrets.token_hex(8)
            self._watches[watch_id] = Watch(os.path.normpath(path), recursive)
            self._poke()
        return {"watch_id": watch_id}

    def read(self, msg: P.Message) -> dict[str, Any]:
        wait = msg.get("wait_ms", 0)
        wait_ms = wait if isinstance(wait, int) and not isinstance(wait, bool) else 0
        return self._get(msg).read(max(0, min(wait_ms, MAX_WAIT_MS)))

    def delete(self, msg: P.Message) -> dict[str, Any]:
        w = self._get(msg)
        with self._lock:
            self._watches.pop(str(msg.get("watch_id")), None)
        with w.lock:
            w.close()
        self._poke()
        return {"watch_id": msg.get("watch_id"), "deleted": True}
