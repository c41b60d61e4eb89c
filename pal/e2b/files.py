"""envd's file system (:class:`ops.FilesystemOps`) over Pal's processes: E2B's calls take
any path of the sandbox as the caller's user (``/home/user``, ``/tmp``, ``/`` ...), where
Pal's own file verbs serve ``/workspace`` only, so each call here is one small command of
the guest's coreutils, run as that user through the scheduler's :class:`GuestCalls`:

- Stat, ListDir, MakeDir, Move, Remove: one exec each (``FS_SCRIPT``), entries printed by
  GNU find's ``-printf`` (NUL-terminated, the path last);
- a download: ``cat`` as a process followed from its first byte (binary-safe, any size:
  a follower that is behind holds the process back, nothing is dropped);
- an upload: ``cat > path`` as a process fed through its stdin, 1 MiB a write.

- watching a directory: it is listed again (``WatchDir``: every ``WATCH_POLL_S``; the
  polling watchers: at each ``GetWatcherEvents``) and compared with the last listing.

What differs from envd: file metadata (``X-Metadata-*``) is not kept; a watch sees changes
between two listings (a file made and removed between them is no event, a rename is a
REMOVE and a CREATE), not each inotify event.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import posixpath
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pal.errors import Conflict, Forbidden, InvalidRequest, NotFound, PalError, TooManyRequests
from pal.guest.protocol import MAX_FILE_BYTES
from pal.scheduler.guest import GuestCalls
from pal.wire import verbs
from pal.wire.models import ExecCall, FileRef, FileWrite
from pal.wire.processes import MAX_STDIN_BYTES, AttachFrom, ProcessEvent, ProcessStart, StdinWrite

from . import conventions as conv
from . import ops
from .errors import ALREADY_EXISTS

FILES_TAG = "pal-e2b:files"  # the helper processes (hidden from Process/List)
TIMEOUT_S = 120
WATCH_POLL_S = 0.5  # how often a WatchDir stream lists its directory again
WATCH_DEPTH = 16  # a recursive watch's depth
MAX_WATCHERS_PER_SANDBOX = 16
MAX_WATCHERS = 4096
_FMT = r"%y\t%s\t%m\t%M\t%u\t%g\t%T@\t%l\t%p\0"
FS_SCRIPT = (
    'op=$1; shift; fmt="' + _FMT + '"\n'
    r"""exists() { [ -e "$1" ] || [ -L "$1" ]; }
case $op in
stat) exists "$1" || exit 2; exec find "$1" -maxdepth 0 -printf "$fmt" ;;
list) if [ ! -d "$1" ]; then exists "$1" && exit 20; exit 2; fi
      exec find "$1" -mindepth 1 -maxdepth "$2" -printf "$fmt" ;;
mkdir) exists "$1" && exit 17; mkdir -p -- "$1" || exit 1; exec find "$1" -maxdepth 0 -printf "$fmt" ;;
move) exists "$1" || exit 2; mkdir -p -- "$(dirname -- "$2")" && mv -T -- "$1" "$2" || exit 1
      exec find "$2" -maxdepth 0 -printf "$fmt" ;;
remove) exists "$1" || exit 2; exec rm -rf -- "$1" ;;
read) [ -d "$1" ] && exit 21; exists "$1" || exit 2; exec cat -- "$1" ;;
write) [ -d "$1" ] && exit 21; mkdir -p -- "$(dirname -- "$1")" && cat > "$1" || exit 1
       exec find "$1" -maxdepth 0 -printf "$fmt" ;;
esac
exit 64
"""
)
_TYPES = {"f": ops.FileType.FILE, "d": ops.FileType.DIRECTORY, "l": ops.FileType.SYMLINK}


def _failed(code: int | None, path: str, stderr: str) -> PalError:
    why = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if code == 2:
        return NotFound(f"path '{path}' does not exist")
    if code == 17:
        return Conflict(f"path '{path}' already exists", code=ALREADY_EXISTS)
    if code == 20:
        return InvalidRequest(f"path '{path}' is not a directory")
    if code == 21:
        return InvalidRequest(f"path '{path}' is a directory")
    if "Permission denied" in why:
        return Forbidden(f"permission denied: '{path}'")
    if "No space left" in why:
        return PalError(f"no space left writing '{path}'", status=507)
    return PalError(f"'{path}': {why or f'failed ({code})'}", status=500)


def parse_entries(out: str) -> list[ops.Entry]:
    entries = []
    for record in out.split("\0"):
        if not record:
            continue
        kind, size, mode, perms, owner, group, mtime, link, path = record.lstrip("\n").split("\t", 8)
        entries.append(
            ops.Entry(
                name=posixpath.basename(path) or "/",
                path=path,
                type=_TYPES.get(kind, ops.FileType.FILE),
                size=int(size or 0),
                mode=int(mode or "0", 8),
                permissions=perms,
                owner=owner,
                group=group,
                modified_time=datetime.fromtimestamp(float(mtime or 0), UTC),
                symlink_target=link or None,
            )
        )
    return entries


@dataclass(frozen=True)
class PalFiles:
    guest: GuestCalls
    # The polling watchers (sync SDK): id -> (sandbox, what, the last listing). In memory:
    # a restarted server knows none (the SDK's next poll is a 404).
    watchers: dict[str, tuple[str, ops.Watch, dict[str, ops.Entry]]] = field(default_factory=dict)

    def _argv(self, op: str, *args: str) -> list[str]:
        return ["-c", FS_SCRIPT, "sh", op, *args]

    async def _run(self, caller: ops.Caller, op: str, path: str, *args: str) -> str:
        """One exec of FS_SCRIPT: its stdout, or its failure as Pal's error."""
        call = ExecCall.model_validate(
            {
                "vmId": caller.sandbox_id,
                "command": "/bin/sh",
                "argv": self._argv(op, path, *args),
                "user": conv.pal_user(caller.user),
                "env": {"LC_ALL": "C.UTF-8"},
                "timeoutSecs": TIMEOUT_S,
            }
        )
        out: list[str] = []
        err: list[str] = []
        code: int | None = None
        async for ev in self.guest.exec_stream(caller.tenant, call):
            if ev.type == "stdout" and ev.data:
                out.append(ev.data)
            elif ev.type == "stderr" and ev.data:
                err.append(ev.data)
            elif ev.type == "exit":
                code = ev.exit_code
            elif ev.type == "error":
                raise PalError(f"the guest refused '{op}': {ev.message or ev.code}", status=ev.status or 500)
        if code != 0:
            raise _failed(code, path, "".join(err))
        return "".join(out)

    async def _one(self, caller: ops.Caller, op: str, path: str, *args: str) -> ops.Entry:
        found = parse_entries(await self._run(caller, op, path, *args))
        if not found:
            raise NotFound(f"path '{path}' does not exist")
        return found[0]

    async def stat(self, caller: ops.Caller, path: str) -> ops.Entry:
        return await self._one(caller, "stat", conv.absolute(caller.user, path))

    async def list_dir(self, caller: ops.Caller, path: str, depth: int) -> list[ops.Entry]:
        out = await self._run(caller, "list", conv.absolute(caller.user, path), str(max(depth, 1)))
        return sorted(parse_entries(out), key=lambda e: e.path)

    async def make_dir(self, caller: ops.Caller, path: str) -> ops.Entry:
        return await self._one(caller, "mkdir", conv.absolute(caller.user, path))

    async def move(self, caller: ops.Caller, source: str, destination: str) -> ops.Entry:
        src, dst = conv.absolute(caller.user, source), conv.absolute(caller.user, destination)
        return await self._one(caller, "move", src, dst)

    async def remove(self, caller: ops.Caller, path: str) -> None:
        await self._run(caller, "remove", conv.absolute(caller.user, path))

    # -- watching: the directory listed again and compared ----------------------------------

    async def _snapshot(self, caller: ops.Caller, watch: ops.Watch) -> dict[str, ops.Entry]:
        root = conv.absolute(caller.user, watch.path)
        depth = str(WATCH_DEPTH if watch.recursive else 1)
        return {
            posixpath.relpath(e.path, root): e
            for e in parse_entries(await self._run(caller, "list", root, depth))
        }

    async def watch(self, caller: ops.Caller, watch: ops.Watch) -> AsyncIterator[ops.FsEvent]:
        seen = await self._snapshot(caller, watch)  # 404 now for a missing directory

        async def events() -> AsyncIterator[ops.FsEvent]:
            nonlocal seen
            while True:
                await asyncio.sleep(WATCH_POLL_S)
                now = await self._snapshot(caller, watch)
                for event in changes(seen, now, watch.include_entry):
                    yield event
                seen = now

        return events()

    async def create_watcher(self, caller: ops.Caller, watch: ops.Watch) -> str:
        mine = [w for w in self.watchers.values() if w[0] == caller.sandbox_id]
        if len(mine) >= MAX_WATCHERS_PER_SANDBOX or len(self.watchers) >= MAX_WATCHERS:
            raise TooManyRequests(f"at most {MAX_WATCHERS_PER_SANDBOX} watchers a sandbox: remove one first")
        seen = await self._snapshot(caller, watch)
        watcher_id = "w-" + secrets.token_hex(8)
        self.watchers[watcher_id] = (caller.sandbox_id, watch, seen)
        return watcher_id

    def _watcher(self, caller: ops.Caller, watcher_id: str) -> tuple[str, ops.Watch, dict[str, ops.Entry]]:
        got = self.watchers.get(watcher_id)
        if got is None or got[0] != caller.sandbox_id:
            raise NotFound(f"watcher {watcher_id} not found")
        return got

    async def watcher_events(self, caller: ops.Caller, watcher_id: str) -> list[ops.FsEvent]:
        sandbox, watch, seen = self._watcher(caller, watcher_id)
        now = await self._snapshot(caller, watch)
        if watcher_id in self.watchers:
            self.watchers[watcher_id] = (sandbox, watch, now)
        return changes(seen, now, watch.include_entry)

    async def remove_watcher(self, caller: ops.Caller, watcher_id: str) -> None:
        self._watcher(caller, watcher_id)
        self.watchers.pop(watcher_id, None)

    # -- contents: processes -----------------------------------------------------------------

    async def _start(self, caller: ops.Caller, op: str, path: str, stdin: bool) -> int:
        req = ProcessStart.model_validate(
            {
                "vmId": caller.sandbox_id,
                "command": "/bin/sh",
                "argv": self._argv(op, path),
                "user": conv.pal_user(caller.user),
                "stdin": stdin,
                "tag": FILES_TAG,
                "timeoutSecs": 3600,
            }
        )
        return (await self.guest.call(caller.tenant, verbs.START_PROCESS, req)).process_id

    def _events(self, caller: ops.Caller, pid: int) -> AsyncGenerator[ProcessEvent, None]:
        return self.guest.attach(caller.tenant, AttachFrom(vm_id=caller.sandbox_id, pid=pid, start=0))

    async def read(self, caller: ops.Caller, path: str) -> AsyncIterator[bytes]:
        full = conv.absolute(caller.user, path)
        rel = conv.in_workspace(caller.user, full)
        if rel is not None:  # one guest request (Pal's files verb) when it is all of the file
            with contextlib.suppress(PalError):
                got = await self.guest.call(
                    caller.tenant, verbs.READ_FILE, FileRef(vm_id=caller.sandbox_id, path=rel)
                )
                if not got.truncated:
                    return _once(got.data)
        pid = await self._start(caller, "read", full, stdin=False)
        events = self._events(caller, pid)
        err: list[bytes] = []
        first: bytes | None = None
        async for ev in events:  # up to the first byte of the file, or the end
            if ev.type == "output" and ev.data:
                data = base64.b64decode(ev.data)
                if ev.stream == "stderr":
                    err.append(data)
                    continue
                first = data
                break
            if ev.type == "exit":
                if ev.exit_code != 0:
                    raise _failed(ev.exit_code, full, b"".join(err).decode(errors="replace"))
                break
            if ev.type in ("detached", "error"):
                raise PalError(f"reading '{full}' broke off: {ev.reason or ev.message}", status=502)

        async def rest() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(events):
                if first is None:
                    return
                yield first
                async for ev in events:
                    if ev.type == "output" and ev.data and ev.stream != "stderr":
                        yield base64.b64decode(ev.data)
                    elif ev.type in ("exit", "detached", "error"):
                        return

        return rest()

    async def write(
        self, caller: ops.Caller, path: str, chunks: AsyncIterator[bytes], metadata: Mapping[str, str]
    ) -> ops.Entry:
        full = conv.absolute(caller.user, path)
        head = bytearray()
        rel = conv.in_workspace(caller.user, full)
        if rel is not None:  # a file of at most 1 MiB: one guest request (Pal's files verb)
            async for chunk in chunks:
                head += chunk
                if len(head) > MAX_FILE_BYTES:
                    break
            else:
                with contextlib.suppress(PalError):
                    req = FileWrite(vm_id=caller.sandbox_id, path=rel, data=bytes(head))
                    await self.guest.call(caller.tenant, verbs.WRITE_FILE, req)
                    return _written(full, len(head))
        pid = await self._start(caller, "write", full, stdin=True)
        pending = head
        async for chunk in chunks:
            pending += chunk
            while len(pending) >= MAX_STDIN_BYTES:
                await self._feed(caller, pid, bytes(pending[:MAX_STDIN_BYTES]))
                del pending[:MAX_STDIN_BYTES]
        while pending:
            await self._feed(caller, pid, bytes(pending[:MAX_STDIN_BYTES]))
            del pending[:MAX_STDIN_BYTES]
        await self.guest.call(
            caller.tenant, verbs.WRITE_STDIN, StdinWrite(vm_id=caller.sandbox_id, pid=pid, eof=True)
        )
        out, err = bytearray(), bytearray()
        async with contextlib.aclosing(self._events(caller, pid)) as events:
            async for ev in events:
                if ev.type == "output" and ev.data:
                    (err if ev.stream == "stderr" else out).extend(base64.b64decode(ev.data))
                elif ev.type == "exit":
                    if ev.exit_code != 0:
                        raise _failed(ev.exit_code, full, err.decode(errors="replace"))
                    break
                elif ev.type in ("detached", "error"):
                    raise PalError(f"writing '{full}' broke off: {ev.reason or ev.message}", status=502)
        found = parse_entries(out.decode(errors="replace"))
        if not found:
            raise PalError(f"'{full}' was written but cannot be read back", status=500)
        return found[0]

    async def _feed(self, caller: ops.Caller, pid: int, data: bytes) -> None:
        rest = data
        while rest:
            req = StdinWrite(vm_id=caller.sandbox_id, pid=pid, data=rest)
            got = await self.guest.call(caller.tenant, verbs.WRITE_STDIN, req)
            rest = rest[got.written :]


def _once(data: bytes) -> AsyncIterator[bytes]:
    async def one() -> AsyncIterator[bytes]:
        if data:
            yield data

    return one()


def _written(path: str, size: int) -> ops.Entry:
    """A file Pal's files verb just wrote (as the default user, mode 0644)."""
    return ops.Entry(
        posixpath.basename(path), path, ops.FileType.FILE, size, 0o644, "-rw-r--r--",
        conv.DEFAULT_USER, conv.DEFAULT_USER, datetime.now(UTC),
    )  # fmt: skip


def changes(
    before: Mapping[str, ops.Entry], after: Mapping[str, ops.Entry], entries: bool
) -> list[ops.FsEvent]:
    """What changed between two listings of a watched directory: new paths are CREATE,
    gone ones REMOVE, a file whose size or mtime moved WRITE, a mode that moved CHMOD."""
    out = []
    for name, e in after.items():
        old = before.get(name)
        if old is None:
            kind = ops.FsEventType.CREATE
        elif (old.size, old.modified_time) != (e.size, e.modified_time) and e.type != ops.FileType.DIRECTORY:
            kind = ops.FsEventType.WRITE
        elif old.mode != e.mode:
            kind = ops.FsEventType.CHMOD
        else:
            continue
        out.append(ops.FsEvent(name, kind, e if entries else None))
    out += [ops.FsEvent(name, ops.FsEventType.REMOVE) for name in before if name not in after]
    return out
