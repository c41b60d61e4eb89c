"""envd's file system (:class:`ops.FilesystemOps`) over Pal's processes: E2B's calls take
any path of the sandbox as the caller's user (``/home/user``, ``/tmp``, ``/`` ...), where
Pal's own file verbs serve ``/workspace`` only, so each call here is one small command of
the guest's coreutils, run as that user through the scheduler's :class:`GuestCalls`:

- Stat, ListDir, MakeDir, Move, Remove: one exec each (``FS_SCRIPT``), entries printed by
  GNU find's ``-printf`` (NUL-terminated, the path last);
- a download: ``cat`` as a process followed from its first byte (binary-safe, any size:
  a follower that is behind holds the process back, nothing is dropped);
- an upload: ``cat > path`` as a process fed through its stdin, 1 MiB a write.

- watching a directory: a watch of the guest's harness (inotify, pal/guest/watches.py:
  bounded, kept across a pause), read by ``WatchDir`` as long polls and by each
  ``GetWatcherEvents``; the polling watcher's id is the guest watch's. Events its bound
  dropped end a ``WatchDir`` stream (after the events it had) and fail that poll, with
  how many: never a silent gap.

- file metadata (``X-Metadata-*``): ``user.e2b.*`` xattrs in the guest (pal/guest/xattrs.py),
  replaced with each upload (in the same guest request as the file for the one-request
  path; one more after a ``cat``), read for Stat, ListDir and Move's entries in one guest
  request a thousand entries. A file system without user xattrs (the guest's ``/tmp``, a
  tmpfs of its 6.1 kernel) refuses metadata with 400; an upload without any there works.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pal.errors import Conflict, Forbidden, InvalidRequest, NotFound, PalError, TooManyRequests
from pal.guest.protocol import MAX_FILE_BYTES
from pal.scheduler.guest import GuestCalls
from pal.wire import verbs
from pal.wire.file_metadata import FileMetadataOf, FileMetadataSet
from pal.wire.models import ExecCall, FileRef, FileWrite, WatchEvents, WatchNew, WatchRead, WatchRef
from pal.wire.processes import MAX_STDIN_BYTES, AttachFrom, ProcessEvent, ProcessStart, StdinWrite

from . import conventions as conv
from . import ops
from .errors import ALREADY_EXISTS

FILES_TAG = "pal-e2b:files"  # the helper processes (hidden from Process/List)
TIMEOUT_S = 120
WATCH_WAIT_MS = 5000  # a WatchDir stream's long poll of its guest watch
MAX_WATCHERS_PER_SANDBOX = 16  # the guest's bound (pal/guest/watches.py)
MAX_WATCH_EVENTS = 4096  # held by a guest watch between two reads
MAX_WATCHERS = 4096  # polling watchers whose entries this server remembers
METADATA_BATCH = 1000  # entries whose metadata one guest request reads (xattrs.MAX_PATHS)
EVENT_TYPES = {
    "create": ops.FsEventType.CREATE,
    "write": ops.FsEventType.WRITE,
    "remove": ops.FsEventType.REMOVE,
    "rename": ops.FsEventType.RENAME,
    "chmod": ops.FsEventType.CHMOD,
}
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
    # The polling watchers (sync SDK) this server made: (sandbox, id) -> what and its root
    # (the watch itself is the guest's: another replica, or this one restarted, reads it too).
    watchers: dict[tuple[str, str], tuple[ops.Watch, str]] = field(default_factory=dict)

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

    async def _with_metadata(self, caller: ops.Caller, entries: list[ops.Entry]) -> list[ops.Entry]:
        """The entries with their metadata (any ``user.e2b.*`` xattr, an upload's or set
        otherwise; a symlink has none), a guest request a thousand."""
        files = [e for e in entries if e.type != ops.FileType.SYMLINK]
        root = conv.pal_user(caller.user) == conv.ROOT
        found: dict[str, dict[str, str]] = {}
        for at in range(0, len(files), METADATA_BATCH):
            paths = [e.path for e in files[at : at + METADATA_BATCH]]
            req = FileMetadataOf(vm_id=caller.sandbox_id, paths=paths, root=root)
            got = await self.guest.call(caller.tenant, verbs.FILE_METADATA, req)
            found.update((p, m) for p, m in zip(paths, got.metadata, strict=False) if m)
        return [dataclasses.replace(e, metadata=found[e.path]) if e.path in found else e for e in entries]

    async def _one_with_metadata(self, caller: ops.Caller, op: str, path: str, *args: str) -> ops.Entry:
        return (await self._with_metadata(caller, [await self._one(caller, op, path, *args)]))[0]

    async def stat(self, caller: ops.Caller, path: str) -> ops.Entry:
        return await self._one_with_metadata(caller, "stat", conv.absolute(caller.user, path))

    async def list_dir(self, caller: ops.Caller, path: str, depth: int) -> list[ops.Entry]:
        out = await self._run(caller, "list", conv.absolute(caller.user, path), str(max(depth, 1)))
        return await self._with_metadata(caller, sorted(parse_entries(out), key=lambda e: e.path))

    async def make_dir(self, caller: ops.Caller, path: str) -> ops.Entry:
        return await self._one(caller, "mkdir", conv.absolute(caller.user, path))

    async def move(self, caller: ops.Caller, source: str, destination: str) -> ops.Entry:
        src, dst = conv.absolute(caller.user, source), conv.absolute(caller.user, destination)
        return await self._one_with_metadata(caller, "move", src, dst)

    async def remove(self, caller: ops.Caller, path: str) -> None:
        await self._run(caller, "remove", conv.absolute(caller.user, path))

    # -- watching: inotify in the guest ----------------------------------------------------

    async def _new_watch(self, caller: ops.Caller, watch: ops.Watch) -> tuple[str, str]:
        root = conv.absolute(caller.user, watch.path)
        req = WatchNew(vm_id=caller.sandbox_id, path=root, recursive=watch.recursive)
        try:
            made = await self.guest.call(caller.tenant, verbs.CREATE_WATCH, req)
        except NotFound:
            raise NotFound(f"path '{root}' does not exist") from None
        except TooManyRequests:
            raise TooManyRequests(
                f"at most {MAX_WATCHERS_PER_SANDBOX} watchers a sandbox: remove one first"
            ) from None
        return made.watch_id, root

    async def _fs_events(
        self, caller: ops.Caller, watch: ops.Watch, root: str, got: WatchEvents
    ) -> list[ops.FsEvent]:
        out = []
        for ev in got.events:
            kind = EVENT_TYPES[ev.op]
            entry = None
            if watch.include_entry and kind not in (ops.FsEventType.REMOVE, ops.FsEventType.RENAME):
                with contextlib.suppress(PalError):  # gone again already: no entry
                    entry = await self._one(caller, "stat", posixpath.join(root, ev.name))
            out.append(ops.FsEvent(ev.name, kind, entry))
        return out

    async def watch(self, caller: ops.Caller, watch: ops.Watch) -> AsyncIterator[ops.FsEvent]:
        watch_id, root = await self._new_watch(caller, watch)  # 404 now for a missing directory

        async def events() -> AsyncIterator[ops.FsEvent]:
            try:
                while True:
                    req = WatchRead(vm_id=caller.sandbox_id, watch_id=watch_id, wait_ms=WATCH_WAIT_MS)
                    got = await self.guest.call(caller.tenant, verbs.READ_WATCH, req)
                    for event in await self._fs_events(caller, watch, root, got):
                        yield event
                    if got.dropped:
                        raise _dropped(got.dropped)
            finally:
                with contextlib.suppress(PalError):
                    ref = WatchRef(vm_id=caller.sandbox_id, watch_id=watch_id)
                    await self.guest.call(caller.tenant, verbs.DELETE_WATCH, ref)

        return events()

    async def create_watcher(self, caller: ops.Caller, watch: ops.Watch) -> str:
        watch_id, root = await self._new_watch(caller, watch)
        self.watchers[(caller.sandbox_id, watch_id)] = (watch, root)
        while len(self.watchers) > MAX_WATCHERS:  # forgotten ones: the guest's bound is 16 a VM
            self.watchers.pop(next(iter(self.watchers)))
        return watch_id

    def _ref(self, caller: ops.Caller, watcher_id: str) -> WatchRef:
        try:
            return WatchRef(vm_id=caller.sandbox_id, watch_id=watcher_id)
        except ValueError:
            raise NotFound(f"watcher {watcher_id} not found") from None

    async def watcher_events(self, caller: ops.Caller, watcher_id: str) -> list[ops.FsEvent]:
        ref = self._ref(caller, watcher_id)
        try:
            got = await self.guest.call(caller.tenant, verbs.READ_WATCH, WatchRead(**ref.model_dump()))
        except NotFound:
            raise NotFound(f"watcher {watcher_id} not found") from None
        if got.dropped:
            raise _dropped(got.dropped)
        # A watcher this server did not make (another replica's, or before a restart) has
        # no entries asked of it: its events come without.
        watch, root = self.watchers.get((caller.sandbox_id, watcher_id), (ops.Watch(""), ""))
        return await self._fs_events(caller, watch, root, got)

    async def remove_watcher(self, caller: ops.Caller, watcher_id: str) -> None:
        ref = self._ref(caller, watcher_id)
        self.watchers.pop((caller.sandbox_id, watcher_id), None)
        try:
            await self.guest.call(caller.tenant, verbs.DELETE_WATCH, ref)
        except NotFound:
            raise NotFound(f"watcher {watcher_id} not found") from None

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
                    meta = json.dumps(dict(metadata))  # replaces the file's: "{}" clears it
                    req = FileWrite(vm_id=caller.sandbox_id, path=rel, data=bytes(head), metadata=meta)
                    await self.guest.call(caller.tenant, verbs.WRITE_FILE, req)
                    return _written(full, len(head), metadata)
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
        root = conv.pal_user(caller.user) == conv.ROOT
        keep = FileMetadataSet(vm_id=caller.sandbox_id, path=full, metadata=dict(metadata), root=root)
        try:
            done = await self.guest.call(caller.tenant, verbs.SET_FILE_METADATA, keep)
        except InvalidRequest as exc:
            if not metadata:  # nothing to keep, none to clear (no xattrs there)
                return found[0]
            raise InvalidRequest(
                f"'{full}' was written, but its metadata was not kept: {exc.message}"
            ) from None
        return dataclasses.replace(found[0], metadata=done.metadata)

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


def _written(path: str, size: int, metadata: Mapping[str, str]) -> ops.Entry:
    """A file Pal's files verb just wrote (as the default user, mode 0644)."""
    return ops.Entry(
        posixpath.basename(path), path, ops.FileType.FILE, size, 0o644, "-rw-r--r--",
        conv.DEFAULT_USER, conv.DEFAULT_USER, datetime.now(UTC), metadata=dict(metadata),
    )  # fmt: skip


def _dropped(n: int) -> PalError:
    return TooManyRequests(
        f"{n} events of this watch were dropped (at most {MAX_WATCH_EVENTS} are held between "
        "two reads): list the directory again, and read the watch more often"
    )
