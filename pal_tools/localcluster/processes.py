"""Control-plane replicas and nodes as separate processes on this machine, for the cluster
tests, `pal bench cluster` and scripts/cluster-demo.sh.

Every node gets its own data dir under one base dir (on a reflink file system: the caller
prepares it), sharing the built guest image (and, where asked, the warm templates) by
symlink, as the single-node tests do. All processes listen on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pal.wire.auth import node_token
from pal_tools.localcluster.throwaway import free_port


@dataclass
class Proc:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    env: dict[str, str]
    data_dir: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


@dataclass
class LocalCluster:
    base: Path  # on a reflink file system; node data dirs go under it
    database_url: str
    shared_images: Path  # a data dir whose images/ (and templates/) are built
    s3_endpoint: str | None = None
    s3_bucket: str = "pal-cluster"
    extra_env: dict[str, str] = field(default_factory=dict)
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    replicas: dict[str, Proc] = field(default_factory=dict)
    nodes: dict[str, Proc] = field(default_factory=dict)
    leftovers: list[int] = field(default_factory=list)  # processes stop_all had to kill

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "PAL_LOG_LEVEL": "INFO",
            "PAL_CLUSTER_SECRET": self.secret,
            "PAL_ADMIN_TOKEN": self.admin_token,
            "PAL_DATABASE_URL": self.database_url,
            # One snapshot HMAC key and encryption key for every node (snapshots move between
            # them through S3)
            # and one secrets key for every replica (they share the store).
            "PAL_SNAPSHOT_KEY_FILE": str(self.base / "keys" / "snapshot.key"),
            "PAL_SNAPSHOT_ENCRYPTION_KEY_FILE": str(self.base / "keys" / "snapshot-encryption.key"),
            "PAL_SECRETS_KEY_FILE": str(self.base / "keys" / "secrets.key"),
            **self.extra_env,
            **(extra or {}),
        }
        if self.s3_endpoint:
            env.update(S3_ENDPOINT=self.s3_endpoint, S3_BUCKET=self.s3_bucket)
        return env

    def _spawn(
        self, name: str, url: str, argv: list[str], env: dict[str, str], data_dir: Path | None
    ) -> Proc:
        log_path = self.base / f"{name}.log"
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return Proc(name, url, proc, log_path, argv, env, data_dir)

    # -- replicas ----------------------------------------------------------------------------

    def start_replica(self, name: str, port: int | None = None) -> Proc:
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "pal.cli.main", "server", "--port", str(port), "--advertise-url", url]
        argv += ["--ports-port", str(free_port())]  # each replica serves the VM ports too
        p = self._spawn(name, url, argv, self._env(), None)
        self.replicas[name] = p
        return p

    def restart(self, p: Proc) -> Proc:
        new = self._spawn(p.name, p.url, p.argv, p.env, p.data_dir)
        (self.replicas if p.name in self.replicas else self.nodes)[p.name] = new
        return new

    def health(self, p: Proc) -> dict[str, Any] | None:
        try:
            # The role is an operator's detail: /healthz hides it without the admin token.
            r = httpx.get(
                p.url + "/healthz",
                headers={"Authorization": f"Bearer {self.admin_token}"},
                timeout=2,
            )
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def leader(self) -> Proc | None:
        for p in self.replicas.values():
            if p.alive() and (self.health(p) or {}).get("role") == "leader":
                return p
        return None

    def wait_leader(self, timeout: float, exclude: Proc | None = None) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.leader()
            if p is not None and p is not exclude:
                return p
            time.sleep(0.05)
        raise TimeoutError(f"no leader within {timeout} s")

    def follower(self, timeout: float = 120) -> Proc:
        """A replica that answers as a follower: waited for, since one that just started (or
        lost the lead) answers its health only once it is up (a hang guard, not a bound)."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.replicas.values():
                if p.alive() and (self.health(p) or {}).get("role") == "follower":
                    return p
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no follower replica within {timeout} s")
            time.sleep(0.1)

    # -- nodes -------------------------------------------------------------------------------

    def node_dir(self, name: str, share_templates: bool) -> Path:
        d = self.base / name  # short: QEMU's unix socket paths must stay under 108 bytes
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # as users run it (the jail needs no more)
        shared = ["images"] + (["templates"] if share_templates else [])
        for sub in shared:
            (self.shared_images / sub).mkdir(exist_ok=True)
            link = d / sub
            if not link.exists():
                link.symlink_to(self.shared_images / sub)
        return d

    def start_node(
        self,
        name: str,
        *,
        region: str = "",
        labels: dict[str, str] | None = None,
        memory_mib: int | None = None,
        templates: bool = True,
        port: int | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> Proc:
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        data_dir = self.node_dir(name, share_templates=templates)
        argv = [sys.executable, "-m", "pal.cli.main", "node", "--port", str(port), "--name", name]
        argv += ["--data-dir", str(data_dir), "--region", region]
        for r in self.replicas.values():
            argv += ["--server", r.url]
        for k, v in (labels or {}).items():
            argv += ["--label", f"{k}={v}"]
        if memory_mib is not None:
            argv += ["--memory-mib", str(memory_mib)]
        env = self._env({"PAL_NODE_TOKEN": node_token(self.secret, name), **(extra_env or {})})
        for secret in ("PAL_DATABASE_URL", "PAL_CLUSTER_SECRET", "PAL_ADMIN_TOKEN"):
            env.pop(secret, None)  # a node holds its own token only
        if not templates:
            env["PAL_TEMPLATES"] = "0"
        p = self._spawn(name, url, argv, env, data_dir)
        self.nodes[name] = p
        return p

    def admin(self, method: str, path: str, via: Proc | None = None, **kw: Any) -> httpx.Response:
        target = via or self.wait_leader(30)
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.request(method, target.url + path, headers=headers, timeout=600, **kw)

    def node_views(self) -> dict[str, dict[str, Any]]:
        r = self.admin("GET", "/v1/nodes")
        r.raise_for_status()
        return {n["nodeId"]: n for n in r.json()["nodes"]}

    def wait_nodes(self, names: list[str], timeout: float) -> None:
        """Until every named node is registered, active and healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in names:
                p = self.nodes[name]
                if not p.alive():
                    raise RuntimeError(f"node {name} exited:\n{p.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                views = self.node_views()
                if all(views.get(n, {}).get("state") == "active" and views[n].get("healthy") for n in names):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"nodes {names} did not register within {timeout} s")

    # -- the end -----------------------------------------------------------------------------

    @staticmethod
    def kill(p: Proc, sig: int = signal.SIGKILL) -> None:
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, sig)
            p.proc.wait(60)

    def stop_all(self) -> None:
        for p in [*self.replicas.values(), *self.nodes.values()]:
            if p.alive():
                p.proc.send_signal(signal.SIGTERM)
        for p in [*self.replicas.values(), *self.nodes.values()]:
            try:
                p.proc.wait(60)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        # Nodes leave their VMs (and egress gateways, and volume servers) running on
        # SIGTERM, for a restarted node to adopt: here nothing restarts, so every QEMU,
        # gateway, volume server and VM network namespace of these nodes goes.
        self.leftovers = kill_qemus_under(self.base) + kill_qemus_under(self.base, b"pal.network.gateway")
        from pal.manager.volume_server import VolumeServer
        from pal.network import netns

        for p in self.nodes.values():
            if p.data_dir is not None:
                VolumeServer(p.data_dir / "run").sweep()
                for name in netns.list_names(netns.node_tag(p.data_dir)):
                    with contextlib.suppress(Exception):
                        netns.delete(name)


def qemu_pids_under(path: Path, program: bytes = b"qemu-system") -> list[int]:
    """PIDs of QEMU processes (or ``program``) whose command line mentions ``path``."""
    pids = []
    needle = str(path).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (d / "cmdline").read_bytes()
            if program in cmd and needle in cmd:
                pids.append(int(d.name))
    return pids


def kill_qemus_under(path: Path, program: bytes = b"qemu-system") -> list[int]:
    pids = qemu_pids_under(path, program)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
