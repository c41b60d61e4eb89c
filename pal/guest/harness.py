"""Pal guest harness: PID 1 inside the microVM. Stdlib only (copied into the image).

It speaks ``protocol.py`` over the virtio-serial port named ``agent``: runs commands
execve-style with streamed output, serves files under /workspace as the workload user,
sends heartbeats, and takes a new identity (clock, RNG, token) on ``identify``.

The request handling (:class:`Harness`) works on any stream fd, so tests drive it over a
socketpair on the host; only :func:`main` does the PID-1 system setup.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import pwd
import random
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

try:  # on the host (tests, manager) it is a package module ...
    from pal.guest import portrelay
    from pal.guest import protocol as P
except ImportError:  # ... in the guest it sits next to this file in /.pal/harness
    # python -I leaves the script's directory out of sys.path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import portrelay  # type: ignore[no-redef]
    import protocol as P  # type: ignore[no-redef]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CHUNK = 64 * 1024  # max stdout/stderr bytes per ``out`` message
MAX_LS_ENTRIES = 1000
EXIT_GRACE_S = 0.25  # after the exec exits, how long background children may hold its pipes
POLL_FALLBACK_S = 0.05  # status polling where no pidfd tells us of the exit
TIMER_LIST = "/proc/timer_list"
CONFIG_DRIVE = "/dev/vdb"
# Pal's own files in every image (pal/images/bundle.py): its loader, libraries and tools.
PAL_DIR = "/.pal"
PAL_LOADER = PAL_DIR + "/lib/ld-linux-x86-64.so.2"
IMAGE_CONFIG = PAL_DIR + "/config.json"  # the image's exec defaults (pal/images/config.py)
# Brokered secrets: the tenant CA the egress gateway signs with, trusted system-wide.
PAL_CA_FILE = "/etc/ssl/certs/pal-brokered-ca.pem"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",
)
CA_BEGIN = "# pal brokered-secrets CA (begin)\n"
CA_END = "# pal brokered-secrets CA (end)\n"
_POLL_BAD = select.POLLHUP | select.POLLERR | select.POLLNVAL


class ExecError(Exception):
    """A request failed with one of the protocol's error codes."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


_ERRNO_CODES = {
    errno.ENOENT: P.ERR_NOENT,
    errno.EISDIR: P.ERR_ISDIR,
    errno.ENOTDIR: P.ERR_NOTDIR,
    errno.EACCES: P.ERR_PERM,
    errno.EPERM: P.ERR_PERM,
    errno.EEXIST: P.ERR_NOTDIR,  # makedirs over a file
}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------- channel


class Channel:
    """The byte stream to the host: the virtio port (guest) or a socket (tests).

    A virtio-serial port reads EOF and polls POLLHUP while no host is connected; with
    ``reconnect`` the channel then backs off and waits for the next host instead of ending.
    Writes while disconnected are dropped: request ids belong to one connection, so stale
    output would only confuse the next host.
    """

    def __init__(self, fd: int, *, reconnect: bool) -> None:
        self.fd = fd
        self.reconnect = reconnect
        os.set_blocking(fd, False)
        self.connected = threading.Event()
        self._wlock = threading.Lock()
        self.on_connect: Callable[[], None] | None = None
        self.read_ns = 0  # monotonic time of the latest read (the identify's decode time)

    def send(self, msg: P.Message, data: bytes | None = None) -> bool:
        return self._write(P.encode(msg, data))

    def _write(self, line: bytes) -> bool:
        view = memoryview(line)
        with self._wlock:
            while view:
                if not self.connected.is_set():
                    return False
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    poller = select.poll()
                    poller.register(self.fd, select.POLLOUT)
                    for _, ev in poller.poll(200):
                        if ev & select.POLLHUP and not ev & select.POLLOUT:
                            return False  # host went away mid-line; reconnect sends "\n"
                    continue
                except OSError:
                    return False
                view = view[n:]
        return True

    def _peer_present(self) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)
        events = poller.poll(0)
        return not any(ev & _POLL_BAD for _, ev in events)

    def lines(self) -> Iterator[bytes]:
        """Request lines as they arrive; ends at EOF unless reconnecting."""
        buf = bytearray()
        skipping = False  # inside an over-long line: drop until its newline
        backoff = 0.002
        lost_at = time.monotonic()
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            if not self.connected.is_set():
                if not self._peer_present():
                    time.sleep(backoff)
                    # The port cannot signal the host's return (poll reports POLLHUP until
                    # then), so we poll. Right after a restore or fork the host reconnects
                    # within milliseconds and every ms counts; a long absence backs off.
                    recent = time.monotonic() - lost_at < 3.0
                    backoff = min(backoff * 2, 0.005 if recent else 0.1)
                    continue
                backoff = 0.002
                buf.clear()
                skipping = False
                self.connected.set()
                self._write(b"\n")  # terminate whatever half line the host may have seen
                if self.on_connect:
                    self.on_connect()
            # No timeout: a sleeping harness must hold no timer of its own (see probe), and
            # a host that goes away wakes us with POLLHUP.
            events = poller.poll()
            if not events:
                continue
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                if any(ev & _POLL_BAD for _, ev in events):
                    data = b""
                else:
                    continue
            except OSError:
                data = b""
            if not data:
                self.connected.clear()
                lost_at = time.monotonic()
                if not self.reconnect:
                    return
                continue
            buf += data
            self.read_ns = time.monotonic_ns()
            while (i := buf.find(b"\n")) >= 0:
                line = bytes(buf[:i])
                del buf[: i + 1]
                if skipping:
                    skipping = False
                    continue
                yield line
            if len(buf) > P.MAX_LINE_BYTES:
                buf.clear()
                skipping = True


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


CLOCK_MONOTONIC = 1
TFD_CLOEXEC = 0o2000000


class Ticker:
    """``wait(interval)``: sleep until the interval passes (False) or :meth:`poke` (True).

    Sleeps on a timerfd, not a timed futex or poll: a timerfd is no sleeping task's timer
    (``hrtimer_wakeup`` in /proc/timer_list), so the harness's own period never shows up
    as a workload deadline in :func:`probe`. Falls back to an Event where timerfd is
    missing."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._efd: int | None = None
        self._tfd: int | None = None
        try:
            tfd = libc().timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)
            if tfd >= 0:
                self._tfd = tfd
                self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except (OSError, AttributeError):
            self._tfd = self._efd = None

    def poke(self) -> None:
        if self._efd is not None:
            os.eventfd_write(self._efd, 1)
        else:
            self._event.set()

    def wait(self, interval: float) -> bool:
        if self._tfd is None or self._efd is None:
            woke = self._event.wait(interval)
            self._event.clear()
            return woke
        sec = max(interval, 0.001)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(sec), int((sec % 1) * 1e9)))
        libc().timerfd_settime(self._tfd, 0, ctypes.byref(spec), None)
        poller = select.poll()
        poller.register(self._tfd, select.POLLIN)
        poller.register(self._efd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll()}
        if self._efd in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._efd)
            return True
        with contextlib.suppress(BlockingIOError, OSError):
            os.set_blocking(self._tfd, False)
            os.read(self._tfd, 8)
        return False


# --------------------------------------------------------------------------- children


class ChildTracker:
    """Waits for exec children without losing their exit statuses.

    As PID 1 (``reap_all``) every orphan in the VM is re-parented to us and must be reaped,
    so one thread reaps all children and hands our own children's statuses to their
    waiters. It peeks with WNOWAIT and reaps under ``spawn_lock``, which is held from fork
    to :meth:`register`: a child that dies at once is still recognised as ours.
    Without ``reap_all`` (tests) each child is waited for by pid only.
    """

    def __init__(self, reap_all: bool) -> None:
        self.reap_all = reap_all
        self.spawn_lock = threading.Lock()
        self._cond = threading.Condition()
        self._owned: set[int] = set()
        self._statuses: dict[int, int] = {}
        self._have_children = threading.Event()
        if reap_all:
            threading.Thread(target=self._reaper, name="reaper", daemon=True).start()

    def register(self, pid: int) -> None:
        with self._cond:
            self._owned.add(pid)
        self._have_children.set()

    def release(self, pid: int) -> None:
        with self._cond:
            self._owned.discard(pid)
            self._statuses.pop(pid, None)

    def poll(self, pid: int) -> int | None:
        """The wait status of ``pid`` once it has exited, else None."""
        if not self.reap_all:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return self._statuses.get(pid)
            if got == pid:
                self._statuses[pid] = status
            return self._statuses.get(pid)
        with self._cond:
            return self._statuses.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.poll(pid)
            left = deadline - time.monotonic()
            if status is not None or left <= 0:
                return status
            if self.reap_all:
                with self._cond:
                    if pid not in self._statuses:
                        self._cond.wait(left)
            else:
                time.sleep(min(left, 0.01))

    def _reaper(self) -> None:
        while True:
            # Cleared before looking: a child registered after waitid found none sets it
            # again, so waiting without a timeout cannot miss it (orphans appear only via
            # our children).
            self._have_children.clear()
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                self._have_children.wait()
                continue
            except InterruptedError:
                continue
            if info is None:
                continue
            with self.spawn_lock:
                try:
                    pid, status = os.waitpid(info.si_pid, os.WNOHANG)
                except ChildProcessError:
                    continue  # subprocess reaped its own failed exec
            if pid == 0:
                continue
            with self._cond:
                if pid in self._owned:
                    self._statuses[pid] = status
                    self._cond.notify_all()


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- workspace


_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


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

    def write(self, rel: Any, data: bytes) -> dict[str, Any]:
        if len(data) > P.MAX_FILE_BYTES:
            raise ExecError(P.ERR_TOOBIG, f"file larger than {P.MAX_FILE_BYTES} bytes")
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


class Harness:
    """Serves host requests on ``channel_fd`` until it closes (or forever when reconnecting).

    ``image`` is the image's exec defaults (/.pal/config.json: workload user and its ids,
    home, env, workdir). Without it, ``workload_user`` is looked up in passwd, and
    ``workload_user=None`` runs execs and file I/O as the harness's own user (tests);
    ``system=True`` lets ``identify`` set the wall clock and credit the kernel RNG (PID 1
    only: on a host that would change the host's clock).
    """

    def __init__(
        self,
        channel_fd: int,
        *,
        workspace: str = P.WORKSPACE,
        workload_user: str | None = P.WORKLOAD_USER,
        image: P.Message | None = None,
        identity: P.Message | None = None,
        heartbeat_interval: float = 5.0,
        reconnect: bool = False,
        system: bool = False,
        reap_all: bool = False,
    ) -> None:
        self.channel = Channel(channel_fd, reconnect=reconnect)
        self.channel.on_connect = self.send_heartbeat
        self.system = system
        self.children = ChildTracker(reap_all)
        self.uid: int | None = None
        self.gid: int | None = None
        self.home = os.environ.get("HOME", "/root")
        self.user_name = workload_user or ""
        self.image_env: dict[str, str] = {}
        self.workdir: str | None = None
        if image is not None:
            # Resolved when the image was assembled: no passwd lookup (and no NSS module
            # of the image's libc loaded into this process).
            self.user_name = str(image.get("user") or P.WORKLOAD_USER)
            self.uid, self.gid = int(image.get("uid", 1000)), int(image.get("gid", 1000))
            self.home = str(image.get("home") or "/")
            env = image.get("env")
            if isinstance(env, dict):
                self.image_env = {str(k): str(v) for k, v in env.items()}
            workdir = image.get("workdir")
            self.workdir = workdir if isinstance(workdir, str) and workdir.startswith("/") else None
        elif workload_user:
            try:
                pw = pwd.getpwnam(workload_user)
                self.uid, self.gid, self.home = pw.pw_uid, pw.pw_gid, pw.pw_dir
            except KeyError:
                self.uid, self.gid, self.home = 1000, 1000, f"/home/{workload_user}"
        self.workspace = Workspace(workspace, self.uid, self.gid)
        self.workspace_root = workspace
        self.heartbeat_interval = heartbeat_interval
        self.vm_id = ""
        self.incarnation = 0
        self.token: str | None = None
        self.secrets: dict[str, str] = {}
        self.ca_env: dict[str, str] = {}  # set once the tenant CA is installed
        self.boot_id = _boot_id()
        self.started = time.monotonic()
        self.last_activity_ms = _now_ms()
        self._lock = threading.Lock()
        self._jobs: dict[int, int] = {}  # request id -> pid of running execs
        self._hb_wake = Ticker()
        if identity:
            self._apply_identity(identity)

    # -- loop

    def serve(self) -> None:
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        for line in self.channel.lines():
            msg = P.decode(line)
            if msg is not None:
                try:
                    self._dispatch(msg)
                except Exception as exc:  # never let one bad request end PID 1
                    _log(f"dispatch failed: {exc!r}")

    def _reply(self, rid: int, kind: str, data: bytes | None = None, **fields: Any) -> None:
        self.channel.send({"id": rid, "k": kind, **fields}, data)

    def _dispatch(self, msg: P.Message) -> None:
        rid, kind = msg.get("id"), msg.get("k")
        if not isinstance(rid, int) or isinstance(rid, bool) or rid <= 0:
            return  # nothing we could answer to
        if kind == P.K_PING:
            self._reply(rid, P.K_OK, result={})
        elif kind == P.K_IDENTIFY:
            self._identify(rid, msg)
        elif kind == P.K_CLOCK:
            self._clock(rid, msg)
        elif kind == P.K_PROBE:
            self._reply(rid, P.K_OK, result=probe())
        elif kind == P.K_CANCEL:
            self._cancel(rid, msg.get("target"))
        elif kind in (P.K_EXEC, P.K_LS, P.K_READ, P.K_WRITE, P.K_RM):
            # Checked here, in arrival order, so nothing sent after an identify can slip
            # through with the old token.
            with self._lock:
                token = self.token
            if not token or msg.get("tok") != token:
                self._reply(rid, P.K_ERR, code=P.ERR_AUTH, msg="invalid or stale token")
                return
            threading.Thread(target=self._handle, args=(rid, kind, msg), daemon=True).start()
        else:
            self._reply(rid, P.K_ERR, code=P.ERR_INVAL, msg=f"unknown request kind {kind!r}")

    def _handle(self, rid: int, kind: str, msg: P.Message) -> None:
        try:
            if kind == P.K_EXEC:
                self._exec(rid, msg)
                return
            self._touch()
            if kind == P.K_LS:
                self._reply(rid, P.K_OK, result=self.workspace.ls(msg.get("path")))
            elif kind == P.K_READ:
                result, data = self.workspace.read(msg.get("path"), msg.get("limit"))
                self._reply(rid, P.K_OK, data, result=result)
            elif kind == P.K_WRITE:
                self._reply(rid, P.K_OK, result=self.workspace.write(msg.get("path"), P.payload(msg)))
            elif kind == P.K_RM:
                self._reply(rid, P.K_OK, result=self.workspace.remove(msg.get("path")))
        except ExecError as exc:
            self._reply(rid, P.K_ERR, code=exc.code, msg=exc.msg)
        except OSError as exc:
            code = _ERRNO_CODES.get(exc.errno or 0, P.ERR_IO)
            self._reply(rid, P.K_ERR, code=code, msg=f"{exc.strerror or exc}: {msg.get('path', '')}")
        except Exception as exc:
            self._reply(rid, P.K_ERR, code=P.ERR_IO, msg=f"internal error: {exc!r}")

    # -- identity and heartbeats

    def _apply_identity(self, ident: P.Message) -> None:
        env = ident.get("env") or {}
        hb = ident.get("hb_interval", ident.get("hbInterval"))
        with self._lock:
            self.vm_id = str(ident.get("vm_id", ident.get("vmId", self.vm_id)) or "")
            self.incarnation = int(ident.get("incarnation", self.incarnation) or 0)
            self.token = str(ident["token"]) if ident.get("token") else None
            self.secrets = {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
            if isinstance(hb, int | float) and not isinstance(hb, bool) and hb > 0:
                self.heartbeat_interval = float(hb)

    def _identify(self, rid: int, msg: P.Message) -> None:
        """Take a new identity (clock, RNG, MAC, hostname, CA, token) before answering;
        the answer carries the guest's time per step (µs)."""
        t0 = time.monotonic_ns()
        if self.system:
            now_ns = msg.get("now_ns")
            if isinstance(now_ns, int) and now_ns > 0:
                set_wall_clock(now_ns)
        seed = msg.get("seed")
        seed_bytes = bytes.fromhex(seed) if isinstance(seed, str) else b""
        if self.system and seed_bytes:
            reseed_kernel_rng(seed_bytes)
        # Forks of one snapshot share Python's RNG state too: mix in the new seed (as an
        # int: a bytes seed goes through SHA-512, cold code right after a restore).
        random.seed(int.from_bytes(seed_bytes + os.urandom(16), "big"))
        t1 = time.monotonic_ns()
        if self.system:
            self._network_identity(msg.get("mac"))
            ca = msg.get("ca_pem")
            if isinstance(ca, str) and ca.startswith("-----BEGIN CERTIFICATE-----") and len(ca) < 16384:
                try:
                    env = install_ca(ca)
                    with self._lock:
                        self.ca_env = env
                except OSError as exc:
                    _log(f"cannot install the brokered-secrets CA: {exc}")
        self._apply_identity(msg)
        if self.system and self.vm_id:
            # A forked or template-started guest must not keep its source's name.
            try:
                socket.sethostname(self.vm_id[:63])
            except OSError as exc:
                _log(f"sethostname failed: {exc}")
        t2 = time.monotonic_ns()
        # decode: from the read that brought this request to here (JSON decode, dispatch).
        decode = (t0 - self.channel.read_ns) // 1000 if self.channel.read_ns else None
        steps = {"decode": decode, "clock_rng": (t1 - t0) // 1000, "net_host_ca": (t2 - t1) // 1000}
        result = {"vm_id": self.vm_id, "incarnation": self.incarnation, "steps_us": steps}
        self._reply(rid, P.K_OK, result={**result, "wall_ns": time.time_ns()})
        self.send_heartbeat()
        self._hb_wake.poke()  # restart the period from now

    def _clock(self, rid: int, msg: P.Message) -> None:
        """After a live resume: the guest's clocks stood still while its vCPUs were
        stopped, so the wall clock lags by the pause. Take the host's; or move forward by
        the host's correction (the delay this guest took to read the last clock it was
        sent: relative, so this message's own delay does not matter)."""
        now_ns, adjust_ns = msg.get("now_ns"), msg.get("adjust_ns")
        if self.system and isinstance(now_ns, int) and not isinstance(now_ns, bool) and now_ns > 0:
            set_wall_clock(now_ns)
        elif (
            self.system
            and isinstance(adjust_ns, int)
            and not isinstance(adjust_ns, bool)
            and 0 < adjust_ns <= P.MAX_CLOCK_ADJUST_NS
        ):
            set_wall_clock(time.time_ns() + adjust_ns)
        self._reply(rid, P.K_OK, result={"wall_ns": time.time_ns()})
        self.send_heartbeat()
        self._hb_wake.poke()

    def _network_identity(self, mac: Any) -> None:
        """A restored or forked guest: its own MAC, and no connection whose host side died."""
        if isinstance(mac, str):
            try:
                set_mac(mac)
            except (OSError, ValueError) as exc:
                _log(f"cannot set MAC {mac!r}: {exc}")
        try:
            n = reset_tcp_connections()
            if n:
                _log(f"reset {n} TCP connection(s) left open by the snapshot")
        except OSError as exc:
            _log(f"cannot reset TCP connections: {exc}")

    def heartbeat(self) -> P.Message:
        with self._lock:
            return {
                "id": 0,
                "k": P.K_HEARTBEAT,
                "vm_id": self.vm_id,
                "incarnation": self.incarnation,
                "active": bool(self._jobs),
                "last_activity_ms": self.last_activity_ms,
                "boot_id": self.boot_id,
                "uptime_s": round(_uptime(self.started), 3),
                **guest_usage(self.workspace_root),
            }

    def send_heartbeat(self) -> None:
        self.channel.send(self.heartbeat())

    def _heartbeats(self) -> None:
        while True:
            if not self._hb_wake.wait(self.heartbeat_interval):
                self.send_heartbeat()

    def _touch(self) -> None:
        with self._lock:
            self.last_activity_ms = _now_ms()

    # -- exec

    def _exec_env(self, req_env: Any, as_root: bool) -> dict[str, str]:
        if as_root:
            home, user = "/root", "root"
        elif self.uid is not None:
            home, user = self.home, self.user_name
        else:  # tests: no workload user, run as whoever runs the harness
            home, user = self.home, pwd.getpwuid(os.geteuid()).pw_name
        env = {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "USER": user, "LOGNAME": user}
        env.update(self.image_env)  # the image's ENV (Docker semantics: it wins over defaults)
        with self._lock:
            env.update(self.ca_env)
            env.update(self.secrets)
            # Who am I: lets a workload tell its sandbox (and incarnation) apart from a fork's.
            env["PAL_VM_ID"] = self.vm_id or ""
            env["PAL_INCARNATION"] = str(self.incarnation)
        if req_env is not None:
            if not isinstance(req_env, dict):
                raise ExecError(P.ERR_INVAL, "env must be an object")
            for k, v in req_env.items():
                if not isinstance(k, str) or not k or "=" in k or "\0" in k + str(v):
                    raise ExecError(P.ERR_INVAL, f"invalid environment variable {k!r}")
                env[k] = str(v)
        return env

    def _exec(self, rid: int, msg: P.Message) -> None:
        argv = msg.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ExecError(P.ERR_INVAL, "argv must be a non-empty list of strings")
        if any("\0" in a for a in argv) or not argv[0]:
            raise ExecError(P.ERR_INVAL, "argv must not contain NUL bytes or an empty command")
        user = msg.get("user")
        if user not in (None, "", "root", self.user_name or None, P.WORKLOAD_USER):
            raise ExecError(P.ERR_INVAL, f"unknown user {user!r}: use '{P.WORKLOAD_USER}' or 'root'")
        as_root = user == "root"
        env = self._exec_env(msg.get("env"), as_root)
        cwd = msg.get("cwd") or self.workdir or self.workspace.root
        if not isinstance(cwd, str):
            raise ExecError(P.ERR_INVAL, "cwd must be a string")
        cwd = os.path.join(self.workspace.root, cwd)  # relative cwd is inside the workspace
        if not os.path.isdir(cwd):
            raise ExecError(P.ERR_NOENT, f"working directory not found: {cwd}")
        timeout = msg.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ExecError(P.ERR_INVAL, "timeout must be a positive number of seconds")
        exe = resolve_executable(argv[0], env["PATH"], cwd)
        creds: dict[str, Any] = {}
        if self.uid is not None and not as_root:
            creds = {"user": self.uid, "group": self.gid, "extra_groups": []}
        self._touch()
        try:
            with self.children.spawn_lock:
                proc = subprocess.Popen(
                    argv,
                    executable=exe,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # own process group: timeout/cancel kill it all
                    close_fds=True,
                    **creds,
                )
                self.children.register(proc.pid)
                pidfd = _pidfd(proc.pid)  # before the reaper may reap it
        except FileNotFoundError:
            raise ExecError(P.ERR_NOENT, f"executable not found: {argv[0]}") from None
        except PermissionError:
            raise ExecError(P.ERR_PERM, f"permission denied: {argv[0]}") from None
        except OSError as exc:
            if exc.errno == errno.ENOEXEC:
                raise ExecError(P.ERR_PERM, f"not an executable format: {argv[0]}") from None
            raise
        with self._lock:
            self._jobs[rid] = proc.pid
        try:
            status, timed_out = self._stream(rid, proc, timeout, pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)
            with self._lock:
                self._jobs.pop(rid, None)
            self.children.release(proc.pid)
            self._touch()
        proc.returncode = _exit_code(status)  # keeps subprocess from waiting on it again
        if timed_out:
            self._reply(rid, P.K_ERR, code=P.ERR_TIMEOUT, msg=f"command timed out after {timeout:g}s")
        else:
            self._reply(rid, P.K_EXIT, code=proc.returncode)

    def _stream(
        self,
        rid: int,
        proc: subprocess.Popen[bytes],
        timeout: float | None,
        pidfd: int | None,
    ) -> tuple[int, bool]:
        """Relay the command's output until it has exited and its pipes are drained.

        Event-driven: the pipes and a pidfd of the child wake us, and the only timers are
        the command's own deadline and the short grace after it exits. A waiting exec
        therefore costs the guest no CPU, and its deadline is a real one the host may wake
        the VM for (probe)."""
        assert proc.stdout is not None and proc.stderr is not None
        streams = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout if timeout else None
        timed_out = False
        status: int | None = None
        exited = False  # the pidfd said so; the status may still be on its way from the reaper
        exited_at = 0.0
        try:
            while True:
                now = time.monotonic()
                waits = (
                    deadline - now if deadline is not None and not timed_out else None,
                    exited_at + EXIT_GRACE_S - now if status is not None else None,
                    POLL_FALLBACK_S if status is None and (pidfd is None or exited) else None,
                )
                wait_s = min((w for w in waits if w is not None), default=None)
                if streams or (pidfd is not None and not exited):
                    ms = -1 if wait_s is None else max(0, int(wait_s * 1000) + 1)
                    for fd, _ev in poller.poll(ms):
                        if fd == pidfd:
                            exited = True
                            poller.unregister(fd)
                            continue
                        data = os.read(fd, CHUNK)
                        if data:
                            self._reply(rid, P.K_OUT, data, fd=streams[fd])
                        else:
                            poller.unregister(fd)
                            del streams[fd]
                if status is None:
                    # Exited with its pipes closed: only the status is missing (the reaper
                    # records it any moment), so wait for that rather than poll.
                    if not streams and (exited or pidfd is None):
                        status = self.children.wait(proc.pid, POLL_FALLBACK_S)
                    else:
                        status = self.children.poll(proc.pid)
                now = time.monotonic()
                if status is not None:
                    exited_at = exited_at or now
                    # Output first, then exit; but a background child holding the pipes
                    # open must not keep the exec from finishing.
                    if not streams or now - exited_at > EXIT_GRACE_S:
                        return status, timed_out
                elif deadline is not None and now >= deadline and not timed_out:
                    timed_out = True
                    _kill_group(proc.pid)
        finally:
            proc.stdout.close()
            proc.stderr.close()

    def _cancel(self, rid: int, target: Any) -> None:
        with self._lock:
            pid = self._jobs.get(target) if isinstance(target, int) else None
        if pid is None:
            self._reply(rid, P.K_ERR, code=P.ERR_NOENT, msg=f"no running exec {target!r}")
            return
        _kill_group(pid)
        self._reply(rid, P.K_OK, result={"target": target})


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when ``pid`` exits (None where unsupported)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def resolve_executable(name: str, path: str, cwd: str) -> str:
    """execvp's lookup, with errors the caller can tell apart (ENOENT vs EPERM)."""
    if "/" in name:
        full = os.path.join(cwd, name)
        if not os.path.exists(full):
            raise ExecError(P.ERR_NOENT, f"executable not found: {name}")
        if os.path.isdir(full) or not os.access(full, os.X_OK):
            raise ExecError(P.ERR_PERM, f"not executable: {name}")
        return full
    found_unusable = False
    for d in (path or DEFAULT_PATH).split(":"):
        full = os.path.join(d or ".", name)
        if os.path.isfile(full):
            if os.access(full, os.X_OK):
                return full
            found_unusable = True
    if found_unusable:
        raise ExecError(P.ERR_PERM, f"not executable: {name}")
    raise ExecError(P.ERR_NOENT, f"executable not found: {name}")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def guest_usage(disk_path: str) -> dict[str, int]:
    """Memory and disk use for the host's metrics: one small /proc read and one statvfs,
    cheap enough for every heartbeat. Missing figures are left out."""
    out: dict[str, int] = {}
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
        if len(fields) == 2:
            out["mem_total"] = fields["MemTotal"]
            out["mem_used"] = fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    try:
        st = os.statvfs(disk_path)
        out["disk_total"] = st.f_blocks * st.f_frsize
        out["disk_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        pass
    return out


def probe(stat_path: str = "/proc/stat", timer_list: str = TIMER_LIST) -> dict[str, Any]:
    """Is the guest idle? What the host needs to decide a wait pause (protocol: probe).

    ``runnable``: tasks running or in uninterruptible sleep besides the prober itself;
    ``cpu_busy``/``cpu_total``: /proc/stat ticks (the host compares two probes);
    ``timer_ms``: the nearest deadline of a sleeping task (:func:`next_sleeper_ms`)."""
    out: dict[str, Any] = {"runnable": 0, "cpu_busy": 0, "cpu_total": 0, "timer_ms": None}
    running = blocked = 0
    try:
        with open(stat_path) as f:
            for line in f:
                if line.startswith("cpu "):
                    vals = [int(x) for x in line.split()[1:9]]
                    total = sum(vals)
                    out["cpu_total"], out["cpu_busy"] = total, total - vals[3] - vals[4]  # - idle, iowait
                elif line.startswith("procs_running "):
                    running = int(line.split()[1])
                elif line.startswith("procs_blocked "):
                    blocked = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    out["runnable"] = max(0, running - 1) + blocked
    try:
        with open(timer_list) as f:
            out["timer_ms"] = next_sleeper_ms(f.read())
    except OSError:
        pass
    return out


def next_sleeper_ms(timer_list: str) -> int | None:
    """Milliseconds until the nearest ``hrtimer_wakeup`` timer in /proc/timer_list: the
    deadline of a task sleeping with a timeout (nanosleep, poll/select/epoll, futex).
    Timer-wheel timeouts and the kernel's own hrtimers (tick, watchdog) are not those."""
    best: int | None = None
    want = False
    for line in timer_list.splitlines():
        if ", hrtimer_wakeup," in line:
            want = True
            continue
        if want and "[in " in line:
            want = False
            try:
                ns = int(line.split("[in ", 1)[1].split()[0])
            except (ValueError, IndexError):
                continue
            ms = max(0, ns // 1_000_000)
            best = ms if best is None else min(best, ms)
        elif line.lstrip().startswith("#") and ": <" in line:
            want = False
    return best


def _uptime(fallback_start: float) -> float:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic() - fallback_start


# --------------------------------------------------------------------------- system (PID 1)


def set_wall_clock(now_ns: int) -> None:
    """After a restore the guest clock lags by the paused time: take the host's."""
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, now_ns)
    except OSError as exc:
        _log(f"clock_settime failed: {exc}")


RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_kernel_rng(seed: bytes) -> None:
    """Forks share the kernel RNG state of their snapshot: mix in and credit a fresh seed."""
    try:
        with open("/dev/urandom", "wb") as f:
            f.write(seed)  # mixes in, credits nothing
            # rand_pool_info {int entropy_count (bits); int buf_size; u32 buf[]}
            fcntl.ioctl(f.fileno(), RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            # Credited entropy only reaches the CRNG at its next scheduled reseed (up to a
            # minute later on 6.1): force it now, so the next read already differs per fork.
            fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)
    except OSError as exc:
        _log(f"RNG reseed failed: {exc}")


def _mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    if os.path.ismount(target):
        return
    rc = libc().mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None)
    if rc != 0:
        _log(f"mount {fstype} on {target} failed: errno {ctypes.get_errno()}")


_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCSIFHWADDR, _SIOCADDRT = 0x8916, 0x891C, 0x8924, 0x890B
_RTF_UP, _RTF_GATEWAY = 0x1, 0x2


def _if_up(s: socket.socket, name: str) -> None:
    ifreq = struct.pack("16sh14x", name.encode(), 0)
    flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, ifreq))[1]
    fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh14x", name.encode(), flags | _IFF_UP))


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        _if_up(s, "lo")


def _sockaddr_in(addr: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(addr))


def nic_name(sys_dir: str = "/sys/class/net") -> str | None:
    """The guest's one NIC (eth0 on these kernels), or None if the VM has none."""
    try:
        names = sorted(n for n in os.listdir(sys_dir) if n != "lo")
    except OSError:
        return None
    return names[0] if names else None


def network_up() -> None:
    """Static address, the host side as default gateway (every packet goes to the egress
    gateway, which decides). No DHCP: it costs ~1 s of boot and there is nothing to learn."""
    nic = nic_name()
    if nic is None:
        return
    mask = socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - P.NET_PREFIX)) & 0xFFFFFFFF))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = nic.encode()
        fcntl.ioctl(s.fileno(), _SIOCSIFADDR, struct.pack("16s16s8x", name, _sockaddr_in(P.GUEST_IP)))
        fcntl.ioctl(s.fileno(), _SIOCSIFNETMASK, struct.pack("16s16s8x", name, _sockaddr_in(mask)))
        _if_up(s, nic)
        # struct rtentry (x86-64): pad, dst, gateway, genmask, flags, pad, pad, pad, metric,
        # dev, mtu, window, irtt; native alignment does the padding.
        rt = struct.pack(
            "@L16s16s16sHhLPhPLLH6x",
            0,
            _sockaddr_in("0.0.0.0"),
            _sockaddr_in(P.GATEWAY_IP),
            _sockaddr_in("0.0.0.0"),
            _RTF_UP | _RTF_GATEWAY,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        )
        try:
            fcntl.ioctl(s.fileno(), _SIOCADDRT, rt)
        except FileExistsError:
            pass


def set_mac(mac: str) -> None:
    """Give the NIC this incarnation's MAC (the old one came with the snapshot's device state)."""
    nic = nic_name()
    if nic is None:
        return
    raw = bytes.fromhex(mac.replace(":", ""))
    if len(raw) != 6:
        raise ValueError(f"bad MAC {mac!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFHWADDR, struct.pack("16sH6s8x", nic.encode(), 1, raw))


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY, _SOCK_DESTROY = 20, 21
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN, _TCP_TIME_WAIT = 10, 6
_SOCKID_LEN = 48  # struct inet_diag_sockid


def _diag_msg(kind: int, flags: int, seq: int, states: int, sockid: bytes) -> bytes:
    body = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, states) + sockid
    return struct.pack("=LHHLL", 16 + len(body), kind, flags, seq, 0) + body


def _netlink_replies(sock: socket.socket) -> Iterator[tuple[int, bytes]]:
    while True:
        data = sock.recv(65536)
        off = 0
        while off + 16 <= len(data):
            length, kind, _flags, _seq, _pid = struct.unpack_from("=LHHLL", data, off)
            if length < 16:
                return
            yield kind, data[off + 16 : off + length]
            if kind in (_NLMSG_DONE, _NLMSG_ERROR):
                return
            off += (length + 3) & ~3


def reset_tcp_connections() -> int:
    """Abort every TCP connection to a non-local peer (SOCK_DESTROY); returns how many.

    After a restore or fork the host side of each such connection is gone: a client
    blocked reading would otherwise wait forever, since it sends nothing that could draw a
    reset. The application sees ECONNABORTED.
    """
    local_prefix = socket.inet_aton(P.GUEST_IP)
    states = (0xFFF & ~(1 << _TCP_LISTEN) & ~(1 << _TCP_TIME_WAIT)) & ~1
    victims: list[bytes] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.send(_diag_msg(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, states, b"\0" * _SOCKID_LEN))
        for kind, body in _netlink_replies(nl):
            if kind != _SOCK_DIAG_BY_FAMILY or len(body) < 4 + _SOCKID_LEN:
                continue
            sockid = body[4 : 4 + _SOCKID_LEN]
            dst = sockid[20:24]  # sport(2) dport(2) src(16) dst(16)...
            if dst[0] == 127 or dst == local_prefix:
                continue
            victims.append(sockid)
        done = 0
        for i, sockid in enumerate(victims):
            nl.send(_diag_msg(_SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, 2 + i, 0xFFFFFFFF, sockid))
            for kind, body in _netlink_replies(nl):
                if kind == _NLMSG_ERROR and struct.unpack_from("=i", body)[0] == 0:
                    done += 1
    return done


def install_ca(
    pem: str, bundles: tuple[str, ...] = SYSTEM_BUNDLES, ca_file: str = PAL_CA_FILE
) -> dict[str, str]:
    """Trust ``pem`` system-wide: its own file, and a marked block in the system bundle
    (replaced, not repeated, on the next identify). Returns the env vars that point
    OpenSSL, Python's requests and Node at it."""
    os.makedirs(os.path.dirname(ca_file), exist_ok=True)
    block = pem if pem.endswith("\n") else pem + "\n"
    _write_atomic(ca_file, block)
    bundle = next((b for b in bundles if os.path.exists(b)), bundles[0])
    real = os.path.realpath(bundle)
    try:
        with open(real) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if CA_BEGIN in text and CA_END in text:
        head, rest = text.split(CA_BEGIN, 1)
        text = head + rest.split(CA_END, 1)[1]
    if text and not text.endswith("\n"):
        text += "\n"
    os.makedirs(os.path.dirname(real), exist_ok=True)
    _write_atomic(real, text + CA_BEGIN + block + CA_END)
    return {"SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle, "NODE_EXTRA_CA_CERTS": ca_file}


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".pal-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def system_setup() -> None:
    nosuid, nodev, noexec = 2, 4, 8
    _mount("proc", "/proc", "proc", nosuid | nodev | noexec)
    _mount("sysfs", "/sys", "sysfs", nosuid | nodev | noexec)
    _mount("devtmpfs", "/dev", "devtmpfs", nosuid, "mode=0755")
    _mount("devpts", "/dev/pts", "devpts", nosuid | noexec, "gid=5,mode=0620,ptmxmode=0666")
    _mount("tmpfs", "/dev/shm", "tmpfs", nosuid | nodev, "mode=1777")
    _mount("tmpfs", "/tmp", "tmpfs", nosuid | nodev, "mode=1777")
    _mount("tmpfs", "/run", "tmpfs", nosuid | nodev, "mode=0755")
    for link, target in (("/dev/fd", "/proc/self/fd"), ("/dev/ptmx", "pts/ptmx")):
        if not os.path.lexists(link):
            with contextlib.suppress(OSError):
                os.symlink(target, link)
    try:
        _loopback_up()
    except OSError as exc:
        _log(f"cannot bring up lo: {exc}")
    try:
        network_up()
    except OSError as exc:
        _log(f"cannot configure the NIC: {exc}")
    with contextlib.suppress(OSError):
        socket.sethostname("pal")
    os.environ.update({"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
    os.umask(0o022)
    # A stray SIGTERM/SIGINT to PID 1 must not stop the VM; SIGCHLD stays default so
    # children can be waited for (the reaper thread collects them).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    grow_root_fs()


def grow_root_fs(device: str = "/dev/vda") -> None:
    """Grow / to fill its disk when the host made the disk larger than the image (diskMib).

    Only at boot: a restored VM's disk comes from its snapshot, already grown.
    """
    try:
        with open(f"/sys/block/{os.path.basename(device)}/size") as f:
            disk_bytes = int(f.read()) * 512
        st = os.statvfs("/")
    except (OSError, ValueError):
        return
    if disk_bytes <= st.f_blocks * st.f_frsize + 128 * 1024 * 1024:
        return  # same size as the image, give or take the file system's own overhead
    try:
        subprocess.run(pal_tool("resize2fs", device), check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        _log(f"could not grow the root file system: {exc}")


def pal_tool(name: str, *args: str) -> list[str]:
    """argv running one of Pal's bundled tools with Pal's own loader and libraries (any
    image, whatever its libc); the plain name where there is no bundle (host tests)."""
    if os.path.exists(PAL_LOADER):
        lib = PAL_DIR + "/lib"
        return [PAL_LOADER, "--library-path", lib, "--inhibit-cache", f"{PAL_DIR}/bin/{name}", *args]
    return [name, *args]


def read_image_config(path: str = IMAGE_CONFIG) -> P.Message | None:
    """The image's exec defaults, or None (an image without Pal's config: legacy defaults)."""
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read(1024 * 1024))
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def find_port(name: str = P.PORT_NAME, sys_dir: str = "/sys/class/virtio-ports") -> str | None:
    """/dev path of the virtio-serial port called ``name``, creating its node if missing."""
    try:
        ports = sorted(os.listdir(sys_dir))
    except FileNotFoundError:
        return None
    for port in ports:
        try:
            with open(os.path.join(sys_dir, port, "name")) as f:
                if f.read().strip() != name:
                    continue
            dev = f"/dev/{port}"
            if not os.path.exists(dev):
                with open(os.path.join(sys_dir, port, "dev")) as f:
                    major, minor = (int(x) for x in f.read().strip().split(":"))
                os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
            return dev
        except OSError:
            continue
    return None


def read_config_drive(path: str = CONFIG_DRIVE) -> P.Message | None:
    try:
        with open(path, "rb") as f:
            return P.decode_config(f.read(64 * 1024))
    except OSError:
        return None


def _log(text: str) -> None:
    # No console in the VM: the kernel log is the one place a host can read it (dmesg).
    try:
        with open("/dev/kmsg", "w") as f:
            f.write(f"pal-harness: {text}\n")
    except OSError:
        print(f"pal-harness: {text}", file=sys.stderr)


def _set_subreaper() -> None:
    pr_set_child_subreaper = 36
    libc().prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    """Guest entry point (PID 1), or ``--fd N`` to serve an inherited socket (tests)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--fd" in args:  # host-side test mode: a subreaper standing in for PID 1
        i = args.index("--fd")
        fd = int(args[i + 1])
        workspace = args[args.index("--workspace") + 1] if "--workspace" in args else P.WORKSPACE
        _set_subreaper()
        Harness(fd, workspace=workspace, workload_user=None, reap_all=True).serve()
        return 0
    pid1 = os.getpid() == 1
    if pid1:
        system_setup()
        portrelay.start(_log)
    config = read_config_drive() or {}
    image = read_image_config()
    port = None
    while port is None:
        port = find_port()
        if port is None:
            _log("virtio port 'agent' not found yet")
            time.sleep(0.5)
    fd = os.open(port, os.O_RDWR | os.O_CLOEXEC)
    while True:  # PID 1 must never exit: that panics the kernel
        try:
            Harness(
                fd,
                image=image,
                identity=config,
                reconnect=True,
                system=pid1,
                reap_all=pid1,
            ).serve()
        except Exception as exc:
            _log(f"harness crashed, restarting: {exc!r}")
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
