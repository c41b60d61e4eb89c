"""The node's handle on its egress gateway process: start or adopt it, supervise it, talk to it.

The gateway (gateway.py) is its own process so a flood or a fat download never slows the
API and scheduler loop. It starts as root only long enough to import what it needs, then
drops to GATEWAY_UID for good: every socket it serves is handed over as a descriptor.

Control channel: a unix socket at ``<data dir>/run/gateway.sock`` (directory 0700, socket
0600; the gateway also checks the peer is root), JSON lines, descriptors sent with the
bytes of the request that uses them. The gateway outlives a crash of the node process (own
session); a restarted node adopts it, so VMs keep their connections and DNS tables.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pal.errors import BackendError, Unavailable

log = logging.getLogger(__name__)

# Just below the QEMU jail's range (pal/vmm/jail.py UID_BASE): one uid for the gateways
# of this host, never a login user, owning nothing on disk.
GATEWAY_UID = 199_999
CALL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 20.0
RESTART_BACKOFF_S = (0.2, 1.0, 5.0)


class GatewayError(BackendError):
    pass


class _Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.lock = asyncio.Lock()

    async def call(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fds = list(fds or [])
        data = json.dumps({**msg, "nfds": len(fds)}).encode() + b"\n"
        async with self.lock:
            if fds:
                # The descriptors ride on the request's first byte.
                while True:
                    try:
                        sent = self.sock.sendmsg(
                            [data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                        )
                        break
                    except BlockingIOError:
                        ready = loop.create_future()
                        loop.add_writer(self.sock.fileno(), ready.set_result, None)
                        try:
                            await ready
                        finally:
                            loop.remove_writer(self.sock.fileno())
                data = data[sent:]
            await loop.sock_sendall(self.sock, data)
            while (i := self.buf.find(b"\n")) < 0:
                chunk = await loop.sock_recv(self.sock, 1 << 20)
                if not chunk:
                    raise ConnectionError("the gateway closed the control connection")
                self.buf += chunk
            line = bytes(self.buf[:i])
            del self.buf[: i + 1]
        reply = json.loads(line)
        if not reply.get("ok"):
            raise GatewayError(f"egress gateway: {reply.get('error')}")
        return dict(reply)

    def close(self) -> None:
        self.sock.close()


def _gateway_pid_of(pid: int, data_dir: Path) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pal.network.gateway" in cmd and str(data_dir).encode() in cmd


class GatewayProcess:
    """Start (or adopt) the node's gateway, restart it if it dies, and call it."""

    def __init__(
        self,
        data_dir: Path,
        *,
        resolve: str | None,
        allow_internal: list[str],
        host_dns: bool = True,
        ca_bundle: str | None = None,
        api_addresses: list[str] | None = None,
        budgets: dict[str, Any] | None = None,
        on_restart: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.run_dir = self.data_dir / "run"
        self.sock_path = self.run_dir / "gateway.sock"
        self.pid_path = self.run_dir / "gateway.pid"
        self.log_path = self.run_dir / "gateway.log"
        self.resolve = resolve
        self.host_dns = host_dns
        self.allow_internal = allow_internal
        self.ca_bundle = ca_bundle  # PEM text: the gateway cannot read root's files after its drop
        self.api_addresses = api_addresses or []  # the control plane's: internal like the host's
        self.budgets = budgets or {}  # node totals and name servers (config.NetBudgets.gateway_json)
        self.on_restart = on_restart
        self.volume_ports: dict[str, int] = {}  # the node's volume server's (vmnet.py)
        self.pid: int | None = None
        self.adopted = False
        self._proc: asyncio.subprocess.Process | None = None
        self._chan: _Channel | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self._watcher: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> bool:
        """Adopt a gateway a previous node process left running, or start one. True if adopted."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        if await self._try_adopt():
            self.adopted = True
        else:
            await self._spawn()
        await self.call(self._configure_msg())
        self._watch = asyncio.create_task(self._supervise(), name="gateway-supervisor")
        return self.adopted

    def _configure_msg(self) -> dict[str, Any]:
        return {
            "op": "configure",
            "resolve": self.resolve,
            "hostDns": self.host_dns,
            "allowInternal": self.allow_internal,
            "caBundle": self.ca_bundle,
            "apiAddresses": self.api_addresses,
            "budgets": self.budgets,
            "volumePorts": self.volume_ports,
        }

    async def _try_adopt(self) -> bool:
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return False
        if not _gateway_pid_of(pid, self.data_dir):
            return False
        try:
            await self._connect(timeout=2.0)
            await self.call({"op": "ping"})
        except (OSError, ConnectionError, GatewayError, TimeoutError, ValueError) as exc:
            log.warning("gateway pid %d does not answer (%s); replacing it", pid, exc)
            self._kill_pid(pid)
            return False
        self.pid = pid
        log.info("adopted the egress gateway (pid %d) left by a previous node process", pid)
        return True

    def _kill_pid(self, pid: int) -> None:
        if _gateway_pid_of(pid, self.data_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def _spawn(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._kill_pid(int(self.pid_path.read_text().strip()))
        self.sock_path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                listener.bind(str(self.sock_path))
            finally:
                os.umask(old)
            listener.listen(8)
            log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "pal.network.gateway",
                    "--control-fd",
                    str(listener.fileno()),
                    "--node",
                    str(self.data_dir),
                    "--uid",
                    str(GATEWAY_UID),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=log_fd,
                    pass_fds=(listener.fileno(),),
                    start_new_session=True,  # survives a crash of the node process
                    cwd="/",
                    env=_gateway_env(),
                )
            finally:
                os.close(log_fd)
        finally:
            listener.close()
        self.pid = self._proc.pid
        self.pid_path.write_text(f"{self.pid}\n")
        await self._connect(timeout=START_TIMEOUT_S)
        await self.call({"op": "ping"})
        log.info("egress gateway started (pid %d)", self.pid)

    async def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.returncode is not None:
                code = self._proc.returncode
                raise Unavailable(f"the egress gateway exited with {code}: {self.log_tail()}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(s, str(self.sock_path))
            except OSError as exc:
                s.close()
                last = exc
                await asyncio.sleep(0.02)
                continue
            if self._chan is not None:
                self._chan.close()
            self._chan = _Channel(s)
            return
        raise Unavailable(f"the egress gateway's control socket did not answer: {last}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def _wait_exit(self) -> None:
        if self._proc is not None:
            await self._proc.wait()
            return
        if self.pid is None:
            return
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            return
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def exited() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(pidfd, exited)
        try:
            await gone
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)

    async def _supervise(self) -> None:
        attempt = 0
        while True:
            await self._wait_exit()
            if self._stopping:
                return
            log.error("the egress gateway (pid %s) died; restarting it\n%s", self.pid, self.log_tail())
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            attempt += 1
            try:
                self._proc = None
                await self._spawn()
                await self.call(self._configure_msg())
                if self.on_restart is not None:
                    await self.on_restart()
                attempt = 0
            except Exception as exc:
                log.error("restarting the egress gateway failed: %s", exc)

    # -- events ------------------------------------------------------------------------------

    def watch(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Receive the gateway's events (``waiting``, ``ready``: see gateway.py) on a
        connection of their own, reconnecting whenever the gateway restarts."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_loop(on_event), name="gateway-events")

    async def _watch_loop(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                await loop.sock_connect(s, str(self.sock_path))
                await loop.sock_sendall(s, b'{"op": "watch"}\n')
                buf = bytearray()
                while True:
                    chunk = await loop.sock_recv(s, 65536)
                    if not chunk:
                        break
                    buf += chunk
                    while (i := buf.find(b"\n")) >= 0:
                        line = bytes(buf[:i])
                        del buf[: i + 1]
                        msg = json.loads(line)
                        if isinstance(msg.get("event"), dict):
                            try:
                                on_event(msg["event"])
                            except Exception:
                                log.exception("gateway event %s not handled", msg["event"])
            except (OSError, ValueError) as exc:
                log.debug("gateway event connection: %s", exc)
            finally:
                s.close()
            await asyncio.sleep(0.2)  # the gateway restarts (the supervisor brings it back)

    async def stop(self) -> None:
        """Shut the gateway down (a clean node stop: no VM is left to serve)."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call({"op": "shutdown"}), timeout=2.0)
        if self.pid is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_exit(), timeout=3.0)
            self._kill_pid(self.pid)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        self.pid_path.unlink(missing_ok=True)
        self.sock_path.unlink(missing_ok=True)

    # -- calls -------------------------------------------------------------------------------

    async def call(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        if self._chan is None:
            raise Unavailable("the egress gateway is not connected")
        try:
            return await asyncio.wait_for(self._chan.call(msg, fds), timeout=CALL_TIMEOUT_S)
        except (OSError, ConnectionError, TimeoutError) as exc:
            raise Unavailable(f"the egress gateway did not answer {msg.get('op')}: {exc}") from exc


def _gateway_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "PAL_LOG_LEVEL", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if k in keep}
