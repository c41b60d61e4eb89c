"""Shared fixtures.

Integration tests run a real `pal up` (subprocess, real QEMU VMs — TCG on hosts without a
usable KVM) against a per-run data dir under PAL_TEST_DATA_DIR (default /var/lib/pal-test).
The guest image and warm templates are cached in PAL_TEST_DATA_DIR itself, outside the
clone, so only the first run on a machine pays for building them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.s3server import s3_server  # noqa: F401  (session fixture: a real S3 server)

REPO = Path(__file__).resolve().parent.parent
TEST_DATA_DIR = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qemu_pids_under(path: Path) -> list[int]:
    """PIDs of QEMU processes whose command line mentions ``path``."""
    pids = []
    needle = str(path).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (d / "cmdline").read_bytes()
            if b"qemu-system" in cmd and needle in cmd:
                pids.append(int(d.name))
    return pids


def pal_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pal.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=check,
        timeout=600,
    )


@dataclass
class PalServer:
    url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    keys: dict[str, str] = field(default_factory=dict)

    def tenant(self, name: str, max_vms: int = 20) -> str:
        """Create a tenant through the CLI (as an operator would) and return its API key."""
        out = pal_cli("tenants", "create", name, "--max-vms", str(max_vms), "--data-dir", str(self.data_dir))
        key = json.loads(out.stdout)["apiKey"]
        self.keys[name] = key
        return key

    def client(self, key: str, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def prepare_base_dir() -> None:
    """Reflink-capable data dir and the guest image, built once per machine."""
    from pal.config import Settings
    from pal.server import ensure_image, prepare_data_dir

    settings = Settings.from_env(TEST_DATA_DIR)
    prepare_data_dir(settings)
    ensure_image(settings)


def start_server(run_dir: Path, extra_env: dict[str, str] | None = None) -> PalServer:
    run_dir.mkdir(parents=True, exist_ok=True)
    for shared in ("images", "templates"):
        (TEST_DATA_DIR / shared).mkdir(exist_ok=True)
        link = run_dir / shared
        if not link.exists():
            link.symlink_to(TEST_DATA_DIR / shared)
    port = free_port()
    log_path = run_dir / "server.log"
    env = {
        **os.environ,
        "PAL_IDLE_SWEEP_INTERVAL": "1",
        "PAL_LOG_LEVEL": "INFO",
        "PAL_DATA_DIR": str(run_dir),
        **(extra_env or {}),
    }
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pal.cli.main", "up", "--port", str(port), "--data-dir", str(run_dir)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    server = PalServer(url=f"http://127.0.0.1:{port}", data_dir=run_dir, proc=proc, log_path=log_path)
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pal up exited with {proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/healthz", timeout=2).status_code == 200:
                return server
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"pal up did not become healthy:\n{server.log_tail()}")


def stop_server(server: PalServer, sig: int = signal.SIGTERM) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(sig)
        try:
            server.proc.wait(120)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def wait_template(server: PalServer, key: str, timeout: float = 600) -> None:
    """Block until the warm template for the default image exists (first run builds it)."""
    deadline = time.time() + timeout
    with server.client(key) as c:
        while time.time() < deadline:
            r = c.post("/v1/runtime/schedule", json={})
            assert r.status_code == 200, r.text
            vm = r.json()
            c.delete(f"/v1/runtime/vms/{vm['vmId']}")
            if vm.get("bootMethod") == "template":
                return
            time.sleep(1)
    raise RuntimeError("warm template was not built in time")


@pytest.fixture(scope="session")
def pal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PalServer]:
    """One real `pal up` for the integration tests of a session."""
    prepare_base_dir()
    run_dir = TEST_DATA_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    server = start_server(run_dir)
    try:
        yield server
    finally:
        stop_server(server)
        leaked = qemu_pids_under(run_dir)
        for pid in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
        assert not leaked, f"QEMU processes outlived the server: {leaked}"


@pytest.fixture(scope="session")
def tenant_key(pal_server: PalServer) -> str:
    key = pal_server.tenant("it-main", max_vms=60)
    wait_template(pal_server, key)
    return key


@pytest.fixture
def api(pal_server: PalServer, tenant_key: str) -> Iterator[httpx.Client]:
    with pal_server.client(tenant_key) as c:
        yield c


@pytest.fixture
def vm(api: httpx.Client) -> Iterator[str]:
    """A running VM, deleted afterwards."""
    r = api.post("/v1/runtime/schedule", json={})
    assert r.status_code == 200, r.text
    vm_id = r.json()["vmId"]
    try:
        yield vm_id
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")
