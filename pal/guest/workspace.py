"""Files under /workspace, read and written with the workload user's permissions."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import Any

from pal.guest import protocol as P
from pal.guest import xattrs
from pal.guest.errors import ExecError
from pal.guest.oslib import libc

MAX_LS_ENTRIES = 1000


class Workspace:
    """Files under the workspace root, accessed with the workload user's permissions.

    Paths are relative; absolute paths, ``..`` and symlinks resolving outside the root are
    refused. File I/O runs with the thread's fsuid/fsgid set to the workload user
    (setfsuid is per thread), so the kernel checks permissions as that user and new files
    are owned by it; a symlink swapped in between check and use cannot reach anything the
    workload user could not reach anyway.
    """

    def __init__(self, root: str, uid: int | None, gid: int | None) -> None:
        self.root = os.path.realpath(root)
        self.uid = uid
        self.gid = gid

    @contextlib.contextmanager
    def as_user(self) -> Iterator[None]:
        if self.uid is None or self.gid is None:
            yield
            return
        lib = libc()
        lib.setfsgid(self.gid)
        lib.setfsuid(self.uid)
        if lib.setfsuid(-1) != self.uid:  # -1 is invalid: returns the current fsuid
            raise ExecError(P.ERR_IO, "cannot switch to the workload user")
        try:
            yield
        finally:
            lib.setfsuid(0)
            lib.setfsgid(0)

    @staticmethod
    def split(rel: Any, *, allow_root: bool) -> list[str]:
        """The components of a relative path that stays lexically under the root."""
        if rel is None:
            rel = ""
        if not isinstance(rel, str) or "\0" in rel:
            raise ExecError(P.ERR_INVAL, "path must be a string")
        if rel.startswith("/"):
            raise ExecError(P.ERR_ESCAPE, f"absolute paths are not allowed: {rel}")
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ExecError(P.ERR_ESCAPE, f"'..' is not allowed in paths: {rel}")
        if not parts and not allow_root:
            raise ExecError(P.ERR_INVAL, "a file path is required")
        return parts

    def resolve(self, rel: Any, *, allow_root: bool) -> tuple[str, str]:
        """(normalised relative path, real absolute path) or ExecError."""
        parts = self.split(rel, allow_root=allow_root)
        real = os.path.realpath(os.path.join(self.root, *parts))
        if real != self.root and not real.startswith(self.root + "/"):
            raise ExecError(P.ERR_ESCAPE, f"path leaves {P.WORKSPACE}: {rel}")
        return "/".join(parts), real

    def ls(self, rel: Any) -> dict[str, Any]:
        norm, real = self.resolve(rel, allow_root=True)
        with self.as_user():
            if not stat.S_ISDIR(os.stat(real).st_mode):
                raise ExecError(P.ERR_NOTDIR, f"not a directory: {norm}")
            with os.scandir(real) as it:
                names = sorted(e.name for e in it)
            entries = []
            for name in names[:MAX_LS_ENTRIES]:
                try:
                    st = os.lstat(os.path.join(real, name))
                except FileNotFoundError:
                    continue  # removed while listing
                entries.append({"name": name, "type": _file_type(st.st_mode), "size": st.st_size})
        return {"path": norm, "entries": entries, "truncated": len(names) > MAX_LS_ENTRIES}

    def read(self, rel: Any, limit: Any) -> tuple[dict[str, Any], bytes]:
        if limit is None:
            limit = P.MAX_FILE_BYTES
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ExecError(P.ERR_INVAL, "limit must be a non-negative integer")
        limit = min(limit, P.MAX_FILE_BYTES)
        norm, real = self.resolve(rel, allow_root=False)
        with self.as_user():
            # O_NONBLOCK: a FIFO must not hang the request; it is refused below.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                _require_regular(st.st_mode, norm)
                os.set_blocking(fd, True)
                data = _read_upto(fd, limit + 1)
            finally:
                os.close(fd)
        truncated = len(data) > limit
        return {"path": norm, "size": max(st.st_size, len(data)), "truncated": truncated}, data[:limit]

    def write(self, rel: Any, data: bytes, metadata: Any = None) -> dict[str, Any]:
        """Write a file; with ``metadata`` (a map), its ``user.e2b.*`` xattrs replaced by it
        (xattrs.py: E2B's file metadata), else left as they were."""
        if len(data) > P.MAX_FILE_BYTES:
            raise ExecError(P.ERR_TOOBIG, f"file larger than {P.MAX_FILE_BYTES} bytes")
        if metadata is not None and (why := xattrs.check_metadata(metadata)) is not None:
            raise ExecError(P.ERR_INVAL, why)
        norm, real = self.resolve(rel, allow_root=False)
        with self.as_user():
            parent = os.path.dirname(real)
            try:
                os.makedirs(parent, mode=0o755, exist_ok=True)
            except (FileExistsError, NotADirectoryError):
                raise ExecError(P.ERR_NOTDIR, f"a parent of {norm} is not a directory") from None
            # Re-check after creating parents: the checked prefix must still be ours.
            self.resolve(norm, allow_root=False)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                fd = os.open(real, flags, 0o644)
            except IsADirectoryError:
                raise ExecError(P.ERR_ISDIR, f"is a directory: {norm}") from None
            try:
                _require_regular(os.fstat(fd).st_mode, norm)
                os.set_blocking(fd, True)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if metadata is not None:
                    xattrs.replace(fd, metadata, norm)
            finally:
                os.close(fd)
        return {"path": norm, "bytesWritten": len(data)}

    def remove(self, rel: Any) -> dict[str, Any]:
        """Unlink a file or symlink (the link itself, wherever it points); never a directory."""
        *dirs, name = self.split(rel, allow_root=False)
        norm = "/".join([*dirs, name])
        _, parent = self.resolve("/".join(dirs), allow_root=True)  # the parent stays inside
        with self.as_user():
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    raise ExecError(P.ERR_ISDIR, f"is a directory: {norm}")
                os.unlink(name, dir_fd=dfd)
            finally:
                os.close(dfd)
        return {"path": norm, "deleted": True}


def _file_type(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _require_regular(mode: int, norm: str) -> None:
    if stat.S_ISDIR(mode):
        raise ExecError(P.ERR_ISDIR, f"is a directory: {norm}")
    if not stat.S_ISREG(mode):
        raise ExecError(P.ERR_INVAL, f"not a regular file: {norm}")


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


# --------------------------------------------------------------------------- harness
