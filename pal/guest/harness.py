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
    from pal.guest import protocol as P
except ImportError:  # ... in the guest it sits next to this file in /usr/lib/pal
    import protocol as P  # type: ignore[no-redef]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CHUNK = 64 * 1024  # max stdout/stderr bytes per ``out`` message
MAX_LS_ENTRIES = 1000
EXIT_GRACE_S = 0.25  # after the exec exits, how long background children may hold its pipes
CONFIG_DRIVE = "/dev/vdb"
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
            events = poller.poll(1000)
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
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                self._have_children.clear()
                self._have_children.wait(1.0)  # orphans can appear only via our children
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

    def resolve(self, rel: Any, *, allow_root: bool) -> tuple[str, str]:
        """(normalised relative path, real absolute path) or ExecError."""
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
        if workload_user:
            try:
                pw = pwd.getpwnam(workload_user)
                self.uid, self.gid, self.home = pw.pw_uid, pw.pw_gid, pw.pw_dir
            except KeyError:
                self.uid, self.gid, self.home = 1000, 1000, f"/home/{workload_user}"
        self.workspace = Workspace(workspace, self.uid, self.gid)
        self.heartbeat_interval = heartbeat_interval
        self.vm_id = ""
        self.incarnation = 0
        self.token: str | None = None
        self.secrets: dict[str, str] = {}
        self.boot_id = _boot_id()
        self.started = time.monotonic()
        self.last_activity_ms = _now_ms()
        self._lock = threading.Lock()
        self._jobs: dict[int, int] = {}  # request id -> pid of running execs
        self._hb_wake = threading.Event()
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
        elif kind == P.K_CANCEL:
            self._cancel(rid, msg.get("target"))
        elif kind in (P.K_EXEC, P.K_LS, P.K_READ, P.K_WRITE):
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
        if self.system:
            now_ns = msg.get("now_ns")
            if isinstance(now_ns, int) and now_ns > 0:
                set_wall_clock(now_ns)
        seed = msg.get("seed")
        seed_bytes = bytes.fromhex(seed) if isinstance(seed, str) else b""
        if self.system and seed_bytes:
            reseed_kernel_rng(seed_bytes)
        # Forks of one snapshot share Python's RNG state too: mix in the new seed.
        random.seed(seed_bytes + os.urandom(16))
        self._apply_identity(msg)
        if self.system and self.vm_id:
            # A forked or template-started guest must not keep its source's name.
            try:
                socket.sethostname(self.vm_id[:63])
            except OSError as exc:
                _log(f"sethostname failed: {exc}")
        self._reply(rid, P.K_OK, result={"vm_id": self.vm_id, "incarnation": self.incarnation})
        self.send_heartbeat()
        self._hb_wake.set()  # restart the period from now

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
            }

    def send_heartbeat(self) -> None:
        self.channel.send(self.heartbeat())

    def _heartbeats(self) -> None:
        while True:
            woke = self._hb_wake.wait(self.heartbeat_interval)
            self._hb_wake.clear()
            if not woke:
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
        with self._lock:
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
        cwd = msg.get("cwd") or self.workspace.root
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
            status, timed_out = self._stream(rid, proc, timeout)
        finally:
            with self._lock:
                self._jobs.pop(rid, None)
            self.children.release(proc.pid)
            self._touch()
        proc.returncode = _exit_code(status)  # keeps subprocess from waiting on it again
        if timed_out:
            self._reply(rid, P.K_ERR, code=P.ERR_TIMEOUT, msg=f"command timed out after {timeout:g}s")
        else:
            self._reply(rid, P.K_EXIT, code=proc.returncode)

    def _stream(self, rid: int, proc: subprocess.Popen[bytes], timeout: float | None) -> tuple[int, bool]:
        assert proc.stdout is not None and proc.stderr is not None
        streams = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout if timeout else None
        timed_out = False
        status: int | None = None
        exited_at = 0.0
        try:
            while True:
                if streams:
                    for fd, _ev in poller.poll(50):
                        data = os.read(fd, CHUNK)
                        if data:
                            self._reply(rid, P.K_OUT, data, fd=streams[fd])
                        else:
                            poller.unregister(fd)
                            del streams[fd]
                else:
                    status = self.children.wait(proc.pid, 0.05)
                now = time.monotonic()
                if status is None:
                    status = self.children.poll(proc.pid)
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


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), siocgifflags, ifreq))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sh14x", b"lo", flags | iff_up))


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
        subprocess.run(["resize2fs", device], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        _log(f"could not grow the root file system: {exc}")


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
    config = read_config_drive() or {}
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
