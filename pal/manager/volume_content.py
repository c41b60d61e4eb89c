"""A volume's files without a sandbox (docs/volumes.md, "Files"): list, stat, read, write,
make a directory, remove, on the node that holds the volume, under its ``data/``.

The volume is hostile: guests write it (over NFS), so it may hold symlinks to anywhere,
fifos, device nodes, hard links and huge files. Hence, for every call:

- a path is relative, without ``..`` or NUL, and is walked one component at a time from
  the data dir's descriptor with ``O_NOFOLLOW | O_DIRECTORY``: a symlink anywhere on the
  way is refused (PATH_ESCAPE), never followed, so nothing outside the volume is reached;
- a file is read only once an ``O_PATH`` descriptor of it (not followed) says it is a
  regular file; it is then reopened through that very descriptor, so a fifo or a device
  swapped in between is never opened;
- a write goes to a new file beside the target and is renamed over it: it never writes
  through an existing inode (a hard link to something else stays as it was, a symlink is
  replaced, not followed), and a reader sees the old file or the new one;
- reads are cut at 1 MiB, listings at 1000 entries (and 100 000 names read from one
  directory), writes at 1 MiB and at the volume's ``sizeMib`` (507 when it would pass);
- what the node makes is the workload user's (uid/gid 1000): the NFS export squashes every
  guest's write to that user, so host and guests own the volume's files alike.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from typing import Any

from pal.errors import Conflict, InsufficientStorage, InvalidRequest, NotFound, PalError, PathEscape, TooLarge
from pal.guest.protocol import MAX_FILE_BYTES
from pal.manager.volumes import VolumeFiles
from pal.wire import volumes as w

WORKLOAD_UID = WORKLOAD_GID = 1000  # the image's workload user, as the export squashes to
MAX_ENTRIES = 1000  # one listing's entries, as a sandbox's
MAX_NAMES = 100_000  # names read from one directory for one listing
USAGE_TTL_S = 5.0  # how long a measured usage is trusted (plus what was written since)
MAX_USAGE_WALK = 1_000_000  # entries counted by one measure of usage
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
TMP_PREFIX = ".pal-write-"


def split(rel: str, *, allow_root: bool) -> list[str]:
    """The components of ``rel``, a relative path that stays lexically in the volume."""
    if "\0" in rel:
        raise InvalidRequest("path contains a NUL byte")
    if rel.startswith("/"):
        raise PathEscape(f"path {rel!r} is absolute; paths are relative to the volume's root")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathEscape(f"path {rel!r} leaves the volume (.. component)")
    if not parts and not allow_root:
        raise InvalidRequest("path is required (a file in the volume)")
    if any(len(p.encode()) > 255 for p in parts):
        raise InvalidRequest("a component of the path is longer than 255 bytes")
    return parts


def _not_found(norm: str) -> NotFound:
    return NotFound(f"no such file in the volume: {norm or '/'}", code="FILE_NOT_FOUND")


def _os_error(exc: OSError, norm: str) -> PalError:
    """An OSError of a call on ``norm`` as the files API says it (the sandbox's codes)."""
    e = exc.errno
    if e == errno.ENOENT:
        return _not_found(norm)
    if e == errno.ELOOP:
        return PathEscape(f"a symlink on the way to {norm}: symlinks in a volume are not followed")
    if e in (errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENAMETOOLONG):
        return InvalidRequest(f"{os.strerror(e)}: {norm}")
    if e in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"the volume's disk is full: {norm}")
    return PalError(f"{os.strerror(e or 0)}: {norm}", code="BACKEND_ERROR")


def _type(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _entry(dfd: int, name: str, path: str) -> w.VolumeEntry:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    target = None
    if stat.S_ISLNK(st.st_mode):
        target = os.fsdecode(os.readlink(name, dir_fd=dfd))[: w.MAX_VOLUME_PATH]
    return w.VolumeEntry(
        name=name, path=path, type=_type(st.st_mode), size=st.st_size, mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid, gid=st.st_gid, mtime=st.st_mtime, atime=st.st_atime, ctime=st.st_ctime,
        target=target,
    )  # fmt: skip


class VolumeContent:
    """The files API of the volumes of one node (``VolumeFiles``)."""

    def __init__(self, volumes: VolumeFiles, uid: int = WORKLOAD_UID, gid: int = WORKLOAD_GID) -> None:
        self.volumes = volumes
        self.uid, self.gid = uid, gid
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._usage: dict[str, tuple[float, int]] = {}  # volume id -> (measured at, bytes)

    # -- the walk ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _root(self, volume_id: str) -> Iterator[int]:
        """The volume's data dir, open; 404 for a volume this node does not hold."""
        try:
            fd = os.open(self.volumes.data_dir(volume_id), _DIR)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"volume {volume_id} not found on this node") from None
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _dir(self, root: int, parts: list[str], norm: str, *, make: bool = False) -> Iterator[int]:
        """The directory ``parts`` under ``root``, walked without following a symlink;
        ``make``: the missing ones made (the workload user's, 0755)."""
        fd = os.dup(root)
        try:
            for name in parts:
                try:
                    nfd = os.open(name, _DIR, dir_fd=fd)
                except NotADirectoryError:  # O_DIRECTORY | O_NOFOLLOW on a symlink says so too
                    if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise OSError(errno.ELOOP, "a symlink") from None
                    raise
                except FileNotFoundError:
                    if not make:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                        os.chown(name, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                    nfd = os.open(name, _DIR, dir_fd=fd)
                os.close(fd)
                fd = nfd
            yield fd
        except OSError as exc:
            raise _os_error(exc, norm) from None
        finally:
            os.close(fd)

    # -- the verbs -------------------------------------------------------------------------

    async def stat(self, r: w.VolumePath) -> w.VolumeEntry:
        return await asyncio.to_thread(self._stat, r)

    def _stat(self, r: w.VolumePath) -> w.VolumeEntry:
        parts = split(r.path, allow_root=True)
        norm = "/".join(parts)
        with self._root(r.volume_id) as root:
            if not parts:
                st = os.fstat(root)
                return w.VolumeEntry(
                    name="", path="", type="dir", size=st.st_size, mode=stat.S_IMODE(st.st_mode),
                    uid=st.st_uid, gid=st.st_gid, mtime=st.st_mtime, atime=st.st_atime, ctime=st.st_ctime,
                )  # fmt: skip
            with self._dir(root, parts[:-1], norm) as dfd:
                try:
                    return _entry(dfd, parts[-1], norm)
                except OSError as exc:
                    raise _os_error(exc, norm) from None

    async def list_dir(self, r: w.VolumeList) -> w.VolumeListing:
        return await asyncio.to_thread(self._list, r)

    def _list(self, r: w.VolumeList) -> w.VolumeListing:
        parts = split(r.path, allow_root=True)
        norm = "/".join(parts)
        entries: list[w.VolumeEntry] = []
        truncated = False
        with self._root(r.volume_id) as root, self._dir(root, parts, norm) as top:
            # breadth first, each directory's names in order, down to ``depth``
            queue: collections.deque[tuple[int, str, int]] = collections.deque([(os.dup(top), norm, 1)])
            try:
                while queue:
                    dfd, at, level = queue.popleft()
                    try:
                        names, cut = self._names(dfd)
                        truncated = truncated or cut
                        for name in names:
                            if len(entries) >= MAX_ENTRIES:
                                truncated = True
                                break
                            path = f"{at}/{name}" if at else name
                            try:
                                e = _entry(dfd, name, path)
                            except FileNotFoundError:
                                continue  # removed while listing
                            entries.append(e)
                            if e.type == "dir" and level < r.depth:
                                with contextlib.suppress(OSError):  # gone, or swapped for a link
                                    queue.append((os.open(name, _DIR, dir_fd=dfd), path, level + 1))
                    finally:
                        os.close(dfd)
                    if len(entries) >= MAX_ENTRIES and queue:
                        truncated = True
                        break
            finally:
                for dfd, _, _ in queue:
                    os.close(dfd)
        return w.VolumeListing(path=norm, entries=entries, truncated=truncated)

    @staticmethod
    def _names(dfd: int) -> tuple[list[str], bool]:
        names: list[str] = []
        with os.scandir(os.dup(dfd)) as it:  # scandir closes the descriptor it was given
            for e in it:
                if len(names) >= MAX_NAMES:
                    return sorted(names), True
                names.append(e.name)
        return sorted(names), False

    async def read(self, r: w.VolumePath) -> w.VolumeContent:
        return await asyncio.to_thread(self._read, r)

    def _read(self, r: w.VolumePath) -> w.VolumeContent:
        parts = split(r.path, allow_root=False)
        norm = "/".join(parts)
        with self._root(r.volume_id) as root, self._dir(root, parts[:-1], norm) as dfd:
            try:
                # O_PATH opens nothing (no fifo waits, no device driver runs): look first.
                pfd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as exc:
                raise _os_error(exc, norm) from None
            try:
                st = os.fstat(pfd)
                if stat.S_ISDIR(st.st_mode):
                    raise InvalidRequest(f"is a directory: {norm}")
                if stat.S_ISLNK(st.st_mode):
                    raise PathEscape(f"{norm} is a symlink: symlinks in a volume are not followed")
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidRequest(f"not a regular file: {norm}")
                # the same inode, through its descriptor (a magic link of our own process)
                fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
            finally:
                os.close(pfd)
            try:
                data = _read_upto(fd, MAX_FILE_BYTES + 1)
            finally:
                os.close(fd)
        truncated = len(data) > MAX_FILE_BYTES
        return w.VolumeContent(
            data=data[:MAX_FILE_BYTES], truncated=truncated, size=max(st.st_size, len(data))
        )

    async def write(self, r: w.VolumeWrite) -> w.VolumeWritten:
        if len(r.data) > MAX_FILE_BYTES:
            raise TooLarge(f"file larger than {MAX_FILE_BYTES} bytes", code="PAYLOAD_TOO_LARGE")
        async with self._locks[r.volume_id]:  # one write of a volume at a time: its usage
            return await asyncio.to_thread(self._write, r)

    def _write(self, r: w.VolumeWrite) -> w.VolumeWritten:
        parts = split(r.path, allow_root=False)
        norm, name = "/".join(parts), parts[-1]
        limit = self.volumes.size_mib(r.volume_id) << 20
        with self._root(r.volume_id) as root, self._dir(root, parts[:-1], norm, make=True) as dfd:
            replaced = 0
            try:
                old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(old.st_mode):
                    raise InvalidRequest(f"is a directory: {norm}")
                replaced = old.st_blocks * 512 if old.st_nlink == 1 else 0
            except FileNotFoundError:
                pass
            used = self._used(r.volume_id, root)
            if used - replaced + len(r.data) > limit:
                raise InsufficientStorage(
                    f"the volume is full: {used >> 20} MiB of {limit >> 20} MiB used, "
                    f"{len(r.data)} bytes more do not fit (resize it)"
                )
            tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dfd)  # fmt: skip
                try:
                    os.fchown(fd, self.uid, self.gid)
                    os.fchmod(fd, 0o644 if r.mode is None else r.mode)
                    view = memoryview(r.data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise _os_error(exc, norm) from None
            self._add_usage(r.volume_id, len(r.data) - replaced)
        return w.VolumeWritten(path=norm, bytes_written=len(r.data))

    async def mkdir(self, r: w.VolumeMkdir) -> w.VolumeMade:
        return await asyncio.to_thread(self._mkdir, r)

    def _mkdir(self, r: w.VolumeMkdir) -> w.VolumeMade:
        parts = split(r.path, allow_root=False)
        norm, name = "/".join(parts), parts[-1]
        with self._root(r.volume_id) as root, self._dir(root, parts[:-1], norm, make=r.parents) as dfd:
            try:
                os.mkdir(name, 0o700, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if r.parents and stat.S_ISDIR(st.st_mode):
                    return w.VolumeMade(path=norm, created=False)
                raise Conflict(f"it exists: {norm}") from None
            except OSError as exc:
                raise _os_error(exc, norm) from None
            try:
                fd = os.open(name, _DIR, dir_fd=dfd)  # a guest may have swapped it already
            except OSError as exc:
                raise _os_error(exc, norm) from None
            try:
                os.fchown(fd, self.uid, self.gid)
                os.fchmod(fd, 0o755 if r.mode is None else r.mode)
            finally:
                os.close(fd)
        return w.VolumeMade(path=norm, created=True)

    async def set_attrs(self, r: w.VolumeAttrs) -> w.VolumeEntry:
        return await asyncio.to_thread(self._set_attrs, r)

    def _set_attrs(self, r: w.VolumeAttrs) -> w.VolumeEntry:
        """chmod / chown of a file or directory (never a symlink, nor through one): the
        inode an O_PATH descriptor holds, changed through that descriptor."""
        parts = split(r.path, allow_root=False)
        norm, name = "/".join(parts), parts[-1]
        with self._root(r.volume_id) as root, self._dir(root, parts[:-1], norm) as dfd:
            try:
                pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as exc:
                raise _os_error(exc, norm) from None
            try:
                if stat.S_ISLNK(os.fstat(pfd).st_mode):
                    raise PathEscape(f"{norm} is a symlink: symlinks in a volume are not followed")
                held = f"/proc/self/fd/{pfd}"
                if r.mode is not None:
                    os.chmod(held, r.mode)
                if r.uid is not None or r.gid is not None:
                    os.chown(held, -1 if r.uid is None else r.uid, -1 if r.gid is None else r.gid)
                return _entry(dfd, name, norm)
            except OSError as exc:
                raise _os_error(exc, norm) from None
            finally:
                os.close(pfd)

    async def remove(self, r: w.VolumeRemove) -> w.VolumeRemoved:
        async with self._locks[r.volume_id]:
            return await asyncio.to_thread(self._remove, r)

    def _remove(self, r: w.VolumeRemove) -> w.VolumeRemoved:
        parts = split(r.path, allow_root=False)
        norm, name = "/".join(parts), parts[-1]
        with self._root(r.volume_id) as root, self._dir(root, parts[:-1], norm) as dfd:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=dfd)  # the link itself, wherever it points
                elif not r.recursive:
                    raise InvalidRequest(f"is a directory: {norm} (remove it with recursive)")
                else:
                    # fd-based: never follows a symlink out (shutil.rmtree.avoids_symlink_attacks)
                    shutil.rmtree(name, dir_fd=dfd)
            except OSError as exc:
                raise _os_error(exc, norm) from None
            self._usage.pop(r.volume_id, None)
        return w.VolumeRemoved(path=norm, deleted=True)

    # -- the volume's usage, for ``sizeMib`` ---------------------------------------------

    def _used(self, volume_id: str, root: int) -> int:
        """The bytes the volume's files take (blocks, each inode once), measured at most
        every USAGE_TTL_S plus what this node wrote since (guests write too)."""
        now = time.monotonic()
        got = self._usage.get(volume_id)
        if got is not None and now - got[0] < USAGE_TTL_S:
            return got[1]
        used = measure(root)
        self._usage[volume_id] = (now, used)
        return used

    def _add_usage(self, volume_id: str, n: int) -> None:
        got = self._usage.get(volume_id)
        if got is not None:
            self._usage[volume_id] = (got[0], max(0, got[1] + n))

    def forget(self, volume_id: str) -> None:
        self._usage.pop(volume_id, None)
        self._locks.pop(volume_id, None)


def measure(root: int) -> int:
    """Blocks under the open directory ``root``, each inode once, symlinks not followed, at
    most MAX_USAGE_WALK entries counted."""
    seen: set[tuple[int, int]] = set()
    total = count = 0
    for _, dirs, files, dfd in os.fwalk(".", dir_fd=root, follow_symlinks=False):
        for name in dirs + files:
            count += 1
            if count > MAX_USAGE_WALK:
                return total
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                key = (st.st_dev, st.st_ino)
                if key not in seen:
                    seen.add(key)
                    total += st.st_blocks * 512
    return total


def _read_upto(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    left = n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def entries_json(listing: w.VolumeListing) -> list[dict[str, Any]]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in listing.entries]
