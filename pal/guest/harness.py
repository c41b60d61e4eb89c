"""Pal guest harness: PID 1 inside the microVM. Stdlib only (shipped into the image as the
``pal.guest`` package, pal/images/bundle.py).

It speaks ``protocol.py`` over the virtio-serial port named ``agent``: runs every command
as a process with an output journal (processes.py), serves files under /workspace as the
workload user, sends heartbeats, and takes a new identity (clock, RNG, token) on
``identify``.

The request handling (:class:`Harness`) works on any stream fd, so tests drive it over a
socketpair on the host; only :func:`main` does the PID-1 system setup.
"""

from __future__ import annotations

import os
import pwd
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from pal.guest import netsetup, portrelay, procrequests, system, usernames, volumes
from pal.guest import protocol as P
from pal.guest.channel import Channel, Credits
from pal.guest.children import DEFAULT_PATH, ChildTracker, resolve_executable
from pal.guest.coderequests import CodeRequests
from pal.guest.errors import ERRNO_CODES, ExecError
from pal.guest.kernels import ContextSpec, Kernels
from pal.guest.oslib import libc, log, now_ms
from pal.guest.probe import boot_id, guest_usage, probe, uptime
from pal.guest.processes import Launch, ProcessTable
from pal.guest.procrequests import ProcessRequests, launch_options
from pal.guest.ticker import Ticker
from pal.guest.watches import Watches
from pal.guest.workspace import Workspace
from pal.guest.xattrs import FileMetadata

FILE_KINDS = frozenset({P.K_LS, P.K_READ, P.K_WRITE, P.K_RM})
WATCH_KINDS = {P.K_WNEW: Watches.new, P.K_WREAD: Watches.read, P.K_WDEL: Watches.delete}
XATTR_KINDS = {P.K_XGET: FileMetadata.get, P.K_XSET: FileMetadata.set}
PROCESS_KINDS = procrequests.KINDS
CODE_KINDS = frozenset({P.K_CNEW, P.K_CLIST, P.K_CDELETE, P.K_CINTERRUPT, P.K_CRESTART, P.K_CRUN})
TOKEN_KINDS = (
    FILE_KINDS | PROCESS_KINDS | CODE_KINDS | {P.K_EXEC, P.K_PSTART, P.K_URENAME, *WATCH_KINDS, *XATTR_KINDS}
)


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
        self.channel.on_connect = self._connected
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
        self.watches = Watches()
        self.file_metadata = FileMetadata(self.workspace.as_user)
        self.workspace_root = workspace
        self.heartbeat_interval = heartbeat_interval
        self.vm_id = ""
        self.incarnation = 0
        self.token: str | None = None
        self.secrets: dict[str, str] = {}
        self.ca_env: dict[str, str] = {}  # set once the tenant CA is installed
        # Read (which makes the kernel draw it) only once a tenant's identity is taken,
        # after the RNG reseed: a template's or a pooled VM's guest never fixes it, so each
        # VM restored from one draws its own (protocol.py, identify ``own``).
        self.boot_id = ""
        self.started = time.monotonic()
        self.last_activity_ms = now_ms()
        self._lock = threading.Lock()
        self.credits = Credits()  # each stream's flow control (protocol.py)
        self.processes = ProcessRequests(ProcessTable(self.children), self._reply)
        self.kernels = Kernels(self.children)
        self.code = CodeRequests(self.kernels, self._reply, self._context_spec)
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
                    log(f"dispatch failed: {exc!r}")

    def _connected(self) -> None:
        # Request ids belong to one connection: the streams of the last one are over.
        self.processes.connection_lost()
        self.credits.close_all()
        self.send_heartbeat()

    def _reply(self, rid: int, kind: str, data: bytes | None = None, **fields: Any) -> bool:
        """One reply; a stream's output (protocol.FLOW_KINDS) waits for its credit first.
        False: not sent (the host went away, or the stream ended while it waited)."""
        line = P.encode({"id": rid, "k": kind, **fields}, data)
        credit = self.credits.get(rid) if kind in P.FLOW_KINDS else None
        if credit is not None and not credit.take(len(line)):
            return False
        return self.channel.send_line(line)

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
        elif kind == P.K_CREDIT:
            self.credits.give(msg.get("target"), msg.get("n"))
        elif kind == P.K_CANCEL and self.kernels.cancel(msg.get("target")):
            self.credits.close(msg.get("target"))
            self._reply(rid, P.K_OK, result={"target": msg.get("target")})
        elif kind in (P.K_CANCEL, P.K_DETACH):
            reason = msg.get("reason")
            why = reason if isinstance(reason, str) and 0 < len(reason) <= 32 else "detached"
            self.processes.cancel(rid, msg.get("target"), kill=kind == P.K_CANCEL, reason=why)
            self.credits.close(msg.get("target"))  # after: a waiting sender then sees why
        elif kind in TOKEN_KINDS:
            # Checked here, in arrival order, so nothing sent after an identify can slip
            # through with the old token.
            with self._lock:
                token = self.token
            if not token or msg.get("tok") != token:
                self._reply(rid, P.K_ERR, code=P.ERR_AUTH, msg="invalid or stale token")
                return
            if kind in P.STREAM_KINDS or _follows(kind, msg):  # before any credit can arrive
                self.credits.open(rid, msg.get("window"))
            threading.Thread(target=self._handle, args=(rid, kind, msg), daemon=True).start()
        else:
            self._reply(rid, P.K_ERR, code=P.ERR_INVAL, msg=f"unknown request kind {kind!r}")

    def _handle(self, rid: int, kind: str, msg: P.Message) -> None:
        self._touch()
        try:
            if kind == P.K_EXEC:
                self.processes.exec(rid, self._launch(msg))
            elif _follows(kind, msg):
                self.processes.start_attached(rid, launch_options(msg, self._launch(msg)))
            elif kind == P.K_PSTART:
                proc = self.processes.table.start(launch_options(msg, self._launch(msg)))
                self._reply(rid, P.K_OK, result={"process": proc.info()})
            elif kind in PROCESS_KINDS:
                self.processes.handle(rid, kind, msg)
            elif kind in CODE_KINDS:
                self.code.handle(rid, kind, msg)
            elif kind == P.K_LS:
                self._reply(rid, P.K_OK, result=self.workspace.ls(msg.get("path")))
            elif kind == P.K_READ:
                result, data = self.workspace.read(msg.get("path"), msg.get("limit"))
                self._reply(rid, P.K_OK, data, result=result)
            elif kind == P.K_WRITE:
                written = self.workspace.write(msg.get("path"), P.payload(msg), msg.get("meta"))
                self._reply(rid, P.K_OK, result=written)
            elif kind == P.K_RM:
                self._reply(rid, P.K_OK, result=self.workspace.remove(msg.get("path")))
            elif kind in WATCH_KINDS:
                self._reply(rid, P.K_OK, result=WATCH_KINDS[kind](self.watches, msg))
            elif kind in XATTR_KINDS:
                self._reply(rid, P.K_OK, result=XATTR_KINDS[kind](self.file_metadata, msg))
            elif kind == P.K_URENAME:
                if not self.system or self.uid is None or self.gid is None:
                    raise ExecError(P.ERR_INVAL, "no workload user to rename here")
                result = usernames.rename_workload_user(self.uid, self.gid, msg, self.workspace.root)
                self._reply(rid, P.K_OK, result=result)
        except ExecError as exc:
            self._reply(rid, P.K_ERR, code=exc.code, msg=exc.msg)
        except OSError as exc:
            code = ERRNO_CODES.get(exc.errno or 0, P.ERR_IO)
            self._reply(rid, P.K_ERR, code=code, msg=f"{exc.strerror or exc}: {msg.get('path', '')}")
        except Exception as exc:
            self._reply(rid, P.K_ERR, code=P.ERR_IO, msg=f"internal error: {exc!r}")
        finally:
            self.credits.close(rid)
            self._touch()

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
                system.set_wall_clock(now_ns)
        seed = msg.get("seed")
        seed_bytes = bytes.fromhex(seed) if isinstance(seed, str) else b""
        if self.system and seed_bytes:
            system.reseed_kernel_rng(seed_bytes)
        # Forks of one snapshot share Python's RNG state too: mix in the new seed (as an
        # int: a bytes seed goes through SHA-512, cold code right after a restore).
        random.seed(int.from_bytes(seed_bytes + os.urandom(16), "big"))
        t1 = time.monotonic_ns()
        if self.system:
            self._network_identity(msg.get("mac"))
            ca = msg.get("ca_pem")
            if isinstance(ca, str) and ca.startswith("-----BEGIN CERTIFICATE-----") and len(ca) < 16384:
                try:
                    env = system.install_ca(ca)
                    with self._lock:
                        self.ca_env = env
                except OSError as exc:
                    log(f"cannot install the brokered-secrets CA: {exc}")
        mount_us: dict[str, int] = {}
        if self.system:
            # Before the answer: a command never sees a volume missing (docs/volumes.md).
            try:
                mount_us = volumes.ensure(volumes.parse(msg.get("mounts")))
            except (OSError, subprocess.SubprocessError) as exc:
                log(f"volume mount failed: {exc}")
                self._reply(rid, P.K_ERR, code=P.ERR_IO, msg=f"volume mount failed: {exc}")
                return
        was = self.vm_id
        self._apply_identity(msg)
        if msg.get("own") is True and not self.boot_id:
            self.boot_id = boot_id()
        if self.system and self.vm_id:
            # A forked or template-started guest must not keep its source's name.
            try:
                socket.sethostname(self.vm_id[:63])
            except OSError as exc:
                log(f"sethostname failed: {exc}")
        # Another VM's kernels (a fork, a template's or pooled VM's) get a new seed; the same
        # VM's (a resume) keep their RNG, which the user may have seeded.
        host = self.vm_id[:63] if self.system else ""
        self.kernels.rekey(self._exec_env(None, False), host, reseed=was != self.vm_id)
        t2 = time.monotonic_ns()
        # decode: from the read that brought this request to here (JSON decode, dispatch).
        decode = (t0 - self.channel.read_ns) // 1000 if self.channel.read_ns else None
        steps = {"decode": decode, "clock_rng": (t1 - t0) // 1000, "net_host_ca": (t2 - t1) // 1000}
        steps |= mount_us  # inside net_host_ca: the volumes' part of it
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
            system.set_wall_clock(now_ns)
        elif (
            self.system
            and isinstance(adjust_ns, int)
            and not isinstance(adjust_ns, bool)
            and 0 < adjust_ns <= P.MAX_CLOCK_ADJUST_NS
        ):
            system.set_wall_clock(time.time_ns() + adjust_ns)
        self._reply(rid, P.K_OK, result={"wall_ns": time.time_ns()})
        self.send_heartbeat()
        self._hb_wake.poke()

    def _network_identity(self, mac: Any) -> None:
        """A restored or forked guest: its own MAC, and no connection whose host side died."""
        if isinstance(mac, str):
            try:
                netsetup.set_mac(mac)
            except (OSError, ValueError) as exc:
                log(f"cannot set MAC {mac!r}: {exc}")
        try:
            n = netsetup.reset_tcp_connections()
            if n:
                log(f"reset {n} TCP connection(s) left open by the snapshot")
        except OSError as exc:
            log(f"cannot reset TCP connections: {exc}")

    def heartbeat(self) -> P.Message:
        with self._lock:
            return {
                "id": 0,
                "k": P.K_HEARTBEAT,
                "vm_id": self.vm_id,
                "incarnation": self.incarnation,
                "active": self.processes.busy() or self.kernels.busy(),
                "last_activity_ms": self.last_activity_ms,
                "boot_id": self.boot_id,
                "uptime_s": round(uptime(self.started), 3),
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
            self.last_activity_ms = now_ms()

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

    def _context_spec(self, language: str, req_cwd: Any, req_env: Any) -> ContextSpec:
        """A code context's environment, cwd and user: an exec's, as the workload user."""
        env = self._exec_env(req_env, False)
        cwd = self._cwd(req_cwd)
        python = None
        if language == "python":
            try:
                python = resolve_executable("python3", env["PATH"], cwd)
            except ExecError:
                raise ExecError(P.ERR_NOKERNEL, "no python3 in this image for a Python kernel") from None
        creds: dict[str, Any] = {}
        if self.uid is not None:
            creds = {"user": self.uid, "group": self.gid, "extra_groups": []}
        vm_env = self._exec_env(None, False)
        return ContextSpec(language=language, env=env, cwd=cwd, vm_env=vm_env, creds=creds, python=python)

    def _cwd(self, req_cwd: Any) -> str:
        cwd = req_cwd or self.workdir or self.workspace.root
        if not isinstance(cwd, str):
            raise ExecError(P.ERR_INVAL, "cwd must be a string")
        cwd = os.path.join(self.workspace.root, cwd)  # relative cwd is inside the workspace
        if not os.path.isdir(cwd):
            raise ExecError(P.ERR_NOENT, f"working directory not found: {cwd}")
        return cwd

    def _launch(self, msg: P.Message) -> Launch:
        """A request's command, checked and resolved: argv, user, env, cwd, timeout."""
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
        cwd = self._cwd(msg.get("cwd"))
        timeout = msg.get("timeout")
        if timeout is not None and (
            not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
        ):
            raise ExecError(P.ERR_INVAL, "timeout must be a positive number of seconds")
        exe = resolve_executable(argv[0], env["PATH"], cwd)
        creds: dict[str, Any] = {}
        if self.uid is not None and not as_root:
            creds = {"user": self.uid, "group": self.gid, "extra_groups": []}
        return Launch(
            argv=argv,
            executable=exe,
            env=env,
            cwd=cwd,
            user="root" if as_root else (self.user_name or P.WORKLOAD_USER),
            creds=creds,
            uid=None if as_root else self.uid,
            timeout=timeout,
        )


def _follows(kind: Any, msg: P.Message) -> bool:
    """A ``pstart`` that follows its process's output (a stream, as ``pattach``)."""
    return kind == P.K_PSTART and msg.get("follow") is True


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
        system.system_setup()
        portrelay.start(log)
    config = system.read_config_drive() or {}
    image = system.read_image_config()
    port = None
    while port is None:
        port = system.find_port()
        if port is None:
            log("virtio port 'agent' not found yet")
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
            log(f"harness crashed, restarting: {exc!r}")
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
