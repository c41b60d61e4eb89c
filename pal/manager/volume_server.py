"""The node's volume server (docs/volumes.md, "The mount"): one nfs-ganesha (NFSv3 and
MOUNT over TCP, VFS FSAL) and the rpcbind it needs to start, run as the node's own
supervised process group, started at the first mount and restarted when it dies.

- **Namespaces.** The pair runs in a mount namespace of its own whose ``/run`` is a fresh
  tmpfs (ganesha registers with rpcbind through ``/run/rpcbind.sock``: a host that runs its
  own NFS server keeps its rpcbind and never sees Pal's) and whose ganesha recovery
  directory is the node's. rpcbind also gets a network namespace of its own (nothing in it
  but a down loopback: it listens nowhere anyone reaches; ganesha only has to register).
  ganesha itself listens on 127.0.0.1 only, on two ports picked at its start: the egress
  gateway is the one that connects to it (each VM's guest connections to 10.0.2.2:2049 and
  :20048, from the VM's own loopback source address, vm_gateway.py).
- **Exports.** One per volume some VM of the node mounts, named by its ``Tag`` (the volume
  id: the guest never learns a host path), ``All_Squash`` to the mounting image's workload
  uid, and a ``CLIENT`` block per VM source address (RO or RW as its spec says). An
  address not listed reaches nothing (ganesha checks every request against the export's
  clients) and takes it only from a source port below 1024 (``PrivilegedPort``): any
  local process may bind 127.77.x.y, but only the gateway (which keeps CAP_NET_BIND_SERVICE)
  binds such a port, so no local user speaks NFS as a VM (pal/network/resvport.py). A
  change rewrites the config and sends SIGHUP (measured: in force at once, harmless to
  writes in flight). Each export's ``Export_Id`` is the volume's own (volume_ids.py: it is
  in every file handle, so the same on every node and across restarts), and its attributes
  are never cached (``Attr_Expiration_Time = 0``): the volume's files change behind this
  server's back, through another node's ganesha on a shared PAL_VOLUMES_DIR or through the
  files API (measured: with ganesha's default 60 s, a file another server appended to was
  read at its old size).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pal.network.resvport import unprivileged_low_ports

log = logging.getLogger(__name__)

PACKAGES = ("nfs-ganesha", "nfs-ganesha-vfs", "rpcbind")
START_TIMEOUT_S = 20.0
RESTART_BACKOFF_S = (0.2, 1.0, 5.0)
SOURCE_PREFIX = "127.77"  # each VM's source address toward the server: 127.77.x.y

CORE_CONF = """NFS_CORE_PARAM {{
    Protocols = 3;
    NFS_Port = {nfs};
    MNT_Port = {mnt};
    Bind_addr = 127.0.0.1;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}}
NFSV4 {{ Graceless = true; }}
NFS_KRB5 {{ Active_krb5 = false; }}
"""

EXPORT_CONF = """EXPORT {{
    Export_Id = {id};
    Path = {path};
    Pseudo = /{tag};
    Tag = {tag};
    Access_Type = None;
    Squash = All_Squash;
    Protocols = 3;
    Transports = TCP;
    SecType = sys;
    Attr_Expiration_Time = 0;
    FSAL {{ Name = VFS; }}
{clients}}}
"""

CLIENT_CONF = """    CLIENT {{
        Clients = {addrs};
        Access_Type = {access};
        PrivilegedPort = true;
        Squash = All_Squash;
        Anonymous_Uid = {uid};
        Anonymous_Gid = {gid};
    }}
"""

# Run under `unshare --mount --propagation private`: a private /run, the node's recovery
# directory, rpcbind in a network namespace of its own, then ganesha in the foreground.
WRAPPER = """set -e
mount -t tmpfs -o mode=0755 pal-volumes /run
mkdir -p /var/lib/nfs/ganesha
mount --bind "$PAL_VOL_RECOVERY" /var/lib/nfs/ganesha
unshare --net rpcbind -f &
RPCBIND=$!
i=0
while [ ! -S /run/rpcbind.sock ]; do
    i=$((i + 1)); [ $i -gt 400 ] && { echo "rpcbind did not start" >&2; kill $RPCBIND; exit 1; }
    sleep 0.05
done
set +e
ganesha.nfsd -F -L "$PAL_VOL_LOG" -f "$PAL_VOL_CONF" -p "$PAL_VOL_PID" -N NIV_EVENT
rc=$?
kill $RPCBIND 2>/dev/null
exit $rc
"""


def missing_tools() -> list[str]:
    """What this host lacks to serve volumes (empty: it can)."""
    return [t for t in ("ganesha.nfsd", "rpcbind", "unshare") if shutil.which(t) is None] + [
        "nfs-ganesha-vfs (FSAL_VFS)"
        for _ in [0]
        if not any(
            Path(d, "libfsalvfs.so").exists()
            for d in ("/usr/lib/x86_64-linux-gnu/ganesha", "/usr/lib/ganesha")
        )
    ]


@dataclass
class _Mount:
    source: str  # the VM's source address
    read_only: bool
    uid: int
    gid: int


@dataclass
class _Export:
    export_id: int
    path: Path
    mounts: dict[str, _Mount] = field(default_factory=dict)  # by VM id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VolumeServer:
    """The node's ganesha: its exports, its process, its supervision."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "volumes"
        self.conf = self.dir / "ganesha.conf"
        self.log_path = self.dir / "ganesha.log"
        self.pid_path = self.dir / "ganesha.pid"
        self.exports: dict[str, _Export] = {}  # by volume id
        self.ports: tuple[int, int] | None = None  # (nfs, mount) while running
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_ports: tuple[int, int] | None = None  # a restart keeps them (the gateway knows them)

    # -- exports ---------------------------------------------------------------------------

    async def attach(
        self, vm_id: str, source: str, mounts: list[tuple[str, Path, bool, int]], uid: int, gid: int
    ) -> tuple[int, int]:
        """Export each (volume id, data dir, read only, Export_Id) to ``source`` for
        ``vm_id`` (and drop the VM from any export it no longer mounts); the server's ports.
        The Export_Id is the volume's own (volume_ids.py): ganesha puts it in every file
        handle, so the same volume must have the same id on every node and after a restart."""
        async with self._lock:
            wanted = {m[0] for m in mounts}
            for vid, old in self.exports.items():
                if vid not in wanted:
                    old.mounts.pop(vm_id, None)
            for vid, path, ro, export_id in mounts:
                if vid not in self.exports:
                    self.exports[vid] = _Export(export_id, path)
                self.exports[vid].mounts[vm_id] = _Mount(source, ro, uid, gid)
            await self._apply()
            assert self.ports is not None
            return self.ports

    async def detach(self, vm_id: str) -> None:
        """The VM mounts nothing any more (it stopped): off every export's client list."""
        async with self._lock:
            if not any(vm_id in e.mounts for e in self.exports.values()):
                return
            for exp in self.exports.values():
                exp.mounts.pop(vm_id, None)
            await self._apply()

    async def drop(self, volume_id: str) -> None:
        """A volume deleted: its export goes (the VMs that still mount it get errors)."""
        async with self._lock:
            if self.exports.pop(volume_id, None) is not None and self.running:
                await self._apply()

    def render(self) -> str:
        assert self.ports is not None
        parts = [CORE_CONF.format(nfs=self.ports[0], mnt=self.ports[1])]
        for vid, exp in sorted(self.exports.items(), key=lambda kv: kv[1].export_id):
            groups: dict[tuple[bool, int, int], list[str]] = {}
            for m in exp.mounts.values():
                groups.setdefault((m.read_only, m.uid, m.gid), []).append(m.source)
            clients = "".join(
                CLIENT_CONF.format(addrs=", ".join(sorted(a)), access="RO" if ro else "RW", uid=uid, gid=gid)
                for (ro, uid, gid), a in sorted(groups.items())
            )
            parts.append(EXPORT_CONF.format(id=exp.export_id, path=exp.path, tag=vid, clients=clients))
        return "".join(parts)

    async def _apply(self) -> None:
        if not self.running:
            await self._start()
            return
        self._write_conf()
        pid = self._ganesha_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def _write_conf(self) -> None:
        tmp = self.conf.with_suffix(".tmp")
        tmp.write_text(self.render())
        os.replace(tmp, self.conf)

    # -- the process -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and self.ports is not None

    def _ganesha_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None

    async def _start(self) -> None:
        missing = missing_tools()
        if missing:
            from pal.errors import Unavailable

            raise Unavailable(
                f"this host cannot mount volumes: {', '.join(missing)} missing (scripts/install.sh)"
            )
        low = unprivileged_low_ports()
        if low is not None:
            from pal.errors import Unavailable

            raise Unavailable(
                f"this host cannot mount volumes: net.ipv4.ip_unprivileged_port_start is {low}: "
                "below 1024, any local user could speak to the volume server as a sandbox"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        (self.dir / "recovery").mkdir(exist_ok=True)
        self._kill_leftover()
        self.pid_path.unlink(missing_ok=True)
        self.ports = self._last_ports or (_free_port(), _free_port())
        self._last_ports = self.ports
        self._write_conf()
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "PAL_VOL_RECOVERY": str(self.dir / "recovery"),
            "PAL_VOL_LOG": str(self.log_path),
            "PAL_VOL_CONF": str(self.conf),
            "PAL_VOL_PID": str(self.pid_path),
        }
        out = os.open(self.dir / "wrapper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                "unshare", "--mount", "--propagation", "private", "sh", "-c", WRAPPER,
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd="/",
                start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(out)
        (self.dir / "server.pid").write_text(f"{self._proc.pid}\n")
        try:
            await self._wait_listening()
        except BaseException:
            await self._kill()
            raise
        log.info("volume server started (pid %s, ports %s)", self._proc.pid, self.ports)
        if self._watch is None:
            self._watch = asyncio.create_task(self._supervise(), name="volume-server")

    async def _wait_listening(self) -> None:
        assert self.ports is not None and self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while loop.time() < deadline:
            if self._proc.returncode is not None:
                break
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.ports[1])
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        from pal.errors import Unavailable

        raise Unavailable(f"the volume server did not start: {self.log_tail()}")

    def sweep(self) -> None:
        """At the node's start: a server a previous node process left goes."""
        self._kill_leftover()

    def _kill_leftover(self) -> None:
        """A server a previous node process left (it died without stopping it): its
        exports are gone with that process's state, so it goes too."""
        try:
            pid = int((self.dir / "server.pid").read_text().strip())
            if b"pal-volumes" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass

    def log_tail(self, n: int = 12) -> str:
        lines: list[str] = []
        for p in (self.dir / "wrapper.log", self.log_path):
            with contextlib.suppress(OSError):
                lines += p.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        self.ports = None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _supervise(self) -> None:
        attempt = 0
        while not self._stopping:
            proc = self._proc
            if proc is not None:
                await proc.wait()
            if self._stopping:
                return
            log.error("the volume server died; restarting it\n%s", self.log_tail())
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1
            async with self._lock:
                with contextlib.suppress(ProcessLookupError):
                    if proc is not None:
                        os.killpg(proc.pid, signal.SIGKILL)
                self._proc = None
                try:
                    await self._start()
                    attempt = 0
                except Exception as exc:
                    log.error("restarting the volume server failed: %s", exc)

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        await self._kill()
