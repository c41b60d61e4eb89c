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
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pal_tools.localcluster.postgres import LocalPostgres
from pal_tools.localcluster.processes import qemu_pids_under
from tests.netservers import (
    ALLOW_INTERNAL_ENV,
    RESOLVE_ENV,
    Upstream,
    upstream,  # noqa: F401  (session fixture: HTTP/TLS servers on 127.0.0.2)
)
from tests.s3server import s3_server  # noqa: F401  (session fixture: a real S3 server)

REPO = Path(__file__).resolve().parent.parent
# scripts/test.sh runs the VM tests in two pytest-xdist workers. Each worker's servers get a
# cache of their own (images, templates), so no worker's template build, prune or image
# removal touches what the other's servers read: gw0 keeps PAL_TEST_DATA_DIR, every other
# worker a dir inside it (short: QEMU's unix socket paths stay under 108 bytes), its image
# cloned from the first's (prepare_base_dir).
BASE_DATA_DIR = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
TEST_DATA_DIR = BASE_DATA_DIR if _WORKER == "gw0" else BASE_DATA_DIR / f"w{_WORKER.removeprefix('gw')}"
os.environ["PAL_TEST_DATA_DIR"] = str(TEST_DATA_DIR)  # what tests and `pal` read it from

# Test files that run in the same worker: the TypeScript SDK's two build its dist/ in place
# (beside each other, one would read the other's half-written output); the code
# interpreter's three use the image that test_code.py's fixture builds (minutes under TCG:
# once, not once per worker).
XDIST_GROUPS = {
    "tests/e2e/test_sdk_contract.py": "typescript-sdk",
    "tests/e2e/test_typescript_sdk.py": "typescript-sdk",
    "tests/e2e/test_readme.py": "typescript-sdk",  # it builds the SDK's dist/ too
    "tests/integration/test_code.py": "code-image",
    "tests/integration/test_pool.py": "code-image",
    "tests/e2e/test_dashboard_code.py": "code-image",
    "tests/e2b/test_real_interpreter.py": "code-image",
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile`` a test file runs whole in one worker (its module fixtures are
    set up once), and the files of one XDIST_GROUPS group in the same one. (xdist's own
    ``loadgroup`` renames each test's node id, which pytest 9 no longer lets it do: the
    groups were silently ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return XDIST_GROUPS.get(path, path)

    return ByFileGroup(config, log)


@pytest.fixture(scope="session")
def postgres() -> Iterator[LocalPostgres]:
    """A real PostgreSQL (Debian's, initdb + pg_ctl in a temp dir, 127.0.0.1) for the session."""
    with LocalPostgres() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each kind the store supports."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'pal.db'}"
    pg: LocalPostgres = request.getfixturevalue("postgres")
    return pg.new_database()


# How far a TCG guest's clock may drift from the host's after it was set at identify: 1.4 s
# was seen at a load of 15 on 2 cores. A clock frozen in a snapshot or template is off by
# much more (the tests make sure of it), so it still fails.
CLOCK_TOLERANCE_S = 2.0


def assert_guest_clock_is_the_hosts(read_guest_clock: Callable[[], float]) -> None:
    """The guest's wall clock (read by one exec) lies between the host's clock just before
    and just after that exec: however loaded the host, a clock frozen at a snapshot or
    template fails it, a right one does not."""
    before = time.time()
    guest = read_guest_clock()
    after = time.time()
    assert before - CLOCK_TOLERANCE_S <= guest <= after + CLOCK_TOLERANCE_S, (before, guest, after)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_runs_no_guest(vm_dir: Path) -> None:
    """A snapshot-paused VM runs no guest: it has no QEMU, or its parked one (stopped,
    kept for a fast resume: pal/manager/parked.py) whose guest RAM is handed back."""
    from pal.vmm.offload import resident_bytes

    deadline = time.monotonic() + 120  # a hang guard: the RAM goes back ~2 s after the pause
    while pids := qemu_pids_under(vm_dir):
        (pid,) = pids
        try:
            resident = resident_bytes(pid, vm_dir / "mem")
        except Exception:  # it went away meanwhile
            continue
        if resident < 16 * 1024 * 1024:
            return
        assert time.monotonic() < deadline, f"the paused VM's QEMU {pid} still holds {resident} bytes"
        time.sleep(0.25)


def gateway_pids_under(path: Path) -> list[int]:
    return qemu_pids_under(path, b"pal.network.gateway")


def netns_of(data_dir: Path) -> list[str]:
    """Network namespaces of the node using ``data_dir``."""
    from pal.network import netns

    return netns.list_names(netns.node_tag(data_dir))


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
    ports_port: int = 0  # the ports listener: {port}-{vm}.localhost:ports_port
    e2b_port: int = 0  # the E2B agent listener (PAL_E2B_PORT; 0: off)
    keys: dict[str, str] = field(default_factory=dict)

    def port_origin(self, vm: str, port: int) -> str:
        """A VM port's own origin, as a browser (or curl) reaches it."""
        return f"http://{port}-{vm}.localhost:{self.ports_port}"

    def ports_client(self, vm: str, port: int, key: str | None = None, timeout: float = 300) -> httpx.Client:
        """A client of the VM port's own origin. glibc does not resolve ``*.localhost`` here
        (notes: origins-on-these-hosts.md), so it connects to 127.0.0.1 and names the port in
        ``Host``, as a browser's request would."""
        headers = {"Host": f"{port}-{vm}.localhost:{self.ports_port}"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        base = f"http://127.0.0.1:{self.ports_port}"
        return httpx.Client(base_url=base, headers=headers, timeout=timeout)

    def tenant(self, name: str, max_vms: int = 20) -> str:
        """Create a tenant through the CLI (as an operator would) and return its API key."""
        out = pal_cli("tenants", "create", name, "--max-vms", str(max_vms), "--data-dir", str(self.data_dir))
        key = json.loads(out.stdout)["apiKey"]
        self.keys[name] = key
        return key

    def client(self, key: str, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)

    @property
    def operator_token(self) -> str:
        """The token `pal up` made in its data dir at first start (what the CLI reads)."""
        return (self.data_dir / "keys" / "operator.token").read_text().strip()

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def prepare_base_dir() -> None:
    """Reflink-capable data dir and the guest image, built once per machine (a second
    xdist worker's dir gets a clone of the first's image, built under a lock)."""
    from pal.config import Settings
    from pal.images.paths import load_image
    from pal.server import ensure_image, prepare_data_dir

    with open_lock(BASE_DATA_DIR.parent / f".{BASE_DATA_DIR.name}.prepare.lock"):
        base = Settings.from_env(BASE_DATA_DIR)
        prepare_data_dir(base)
        ensure_image(base)
        if TEST_DATA_DIR != BASE_DATA_DIR:
            settings = Settings.from_env(TEST_DATA_DIR)
            prepare_data_dir(settings)
            want = load_image(base, "default").agent_version_id
            with contextlib.suppress(Exception):
                if load_image(settings, "default").agent_version_id == want:
                    return
            copy_default_image(BASE_DATA_DIR, TEST_DATA_DIR)
            ensure_image(settings)  # a no-op unless the clone is incomplete


@contextlib.contextmanager
def open_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of a test run (xdist workers)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def copy_default_image(src: Path, dst: Path) -> None:
    """Clone (reflink) the built ``default`` image of data dir ``src`` into ``dst``: its
    root fs and meta and the boot set it names (kernel + initrd), as built."""
    from pal.config import Settings
    from pal.images.paths import load_image
    from pal.vmm import disks

    base = src / "images"
    image = load_image(Settings.from_env(src), "default")
    for src_dir in {image.dir, image.vmlinux.parent}:
        dst_dir = dst / "images" / src_dir.relative_to(base)
        dst_dir.mkdir(parents=True, exist_ok=True)
        for f in src_dir.iterdir():
            if f.is_file():
                with contextlib.suppress(FileNotFoundError):
                    (dst_dir / f.name).unlink()
                disks.clone(f, dst_dir / f.name, qcow2_ok=False)
                os.chmod(dst_dir / f.name, f.stat().st_mode)
    with contextlib.suppress(FileNotFoundError):
        shutil.copy(base / "accel.json", dst / "images" / "accel.json")


def start_server(
    run_dir: Path,
    extra_env: dict[str, str] | None = None,
    *,
    share_cache: bool = True,
    healthy: bool = True,
    within_s: float = 900,
) -> PalServer:
    """A real `pal up` on ``run_dir``. With ``share_cache`` its images and templates are
    symlinks into TEST_DATA_DIR (built once per machine); without, the data dir is the
    server's alone (see :func:`private_data_dir`). Returns once /healthz answers 200 (with
    ``healthy=False``: once it answers at all) within ``within_s``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for shared in ("images", "templates") if share_cache else ():
        (TEST_DATA_DIR / shared).mkdir(exist_ok=True)
        link = run_dir / shared
        if not link.exists():
            link.symlink_to(TEST_DATA_DIR / shared)
    port, ports_port, e2b_port = free_port(), free_port(), free_port()
    log_path = run_dir / "server.log"
    env = {
        **os.environ,
        "PAL_IDLE_SWEEP_INTERVAL": "1",
        "PAL_LOG_LEVEL": "INFO",
        "PAL_DATA_DIR": str(run_dir),
        # Test names point at servers on 127.0.0.2, the one internal address guests may reach.
        "PAL_EGRESS_RESOLVE": RESOLVE_ENV,
        "PAL_EGRESS_ALLOW_INTERNAL": ALLOW_INTERNAL_ENV,
        # No lookup ever leaves the machine: only PAL_EGRESS_RESOLVE's names resolve.
        "PAL_EGRESS_DNS": "static",
        # A hang guard, not a speed bound: a restored guest on a loaded 2-core host can take
        # longer than the default 5 s to answer identify (seen: a session's first schedule).
        "PAL_HARNESS_READY_TIMEOUT_MS": "60000",
        # The default size and the one tests/integration/test_templates.py grows a disk with.
        "PAL_TEMPLATE_SIZES": "256m-1c-2048d,192m-1c-3072d",
        # No warm pool unless a test asks for one (tests/integration/test_pool.py): its
        # background fills would add VMs (and CPU load) to every other test's node.
        "PAL_POOL": "0",
        # No pre-started QEMUs unless a test asks for them (tests/integration/test_prestart.py),
        # for the same reason.
        "PAL_PRESTART": "0",
        # The ports listener (VM ports on origins of their own): never the default 8081,
        # which servers of other tests (or people) on this machine may hold.
        "PAL_PORTS_PORT": str(ports_port),
        # The E2B agent listener: never the default 49983, which another server may hold.
        "PAL_E2B_PORT": str(e2b_port),
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
    server = PalServer(
        url=f"http://127.0.0.1:{port}",
        data_dir=run_dir,
        proc=proc,
        log_path=log_path,
        ports_port=int((extra_env or {}).get("PAL_PORTS_PORT") or ports_port),
        e2b_port=int((extra_env or {}).get("PAL_E2B_PORT") or e2b_port),
    )
    _STARTED.append(server)
    deadline = time.time() + within_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pal up exited with {proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/healthz", timeout=2).status_code == 200 or not healthy:
                return server
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"pal up did not become healthy:\n{server.log_tail()}")


@contextlib.contextmanager
def private_data_dir() -> Iterator[Path]:
    """A data dir where users make one: ``<mktemp -d>/d``, under a 0700 parent with capitals
    in its name, shared with nothing. On a file system without reflinks (ext4 /tmp) it becomes
    a loop-mounted XFS like any user's; ``pal data-dir umount`` takes it down at the end, so
    no mount is left under /tmp. The guest image is copied in (building one from scratch is not under test).
    """
    from pal.config import Settings
    from pal.server import prepare_data_dir

    prepare_base_dir()
    parent = Path(tempfile.mkdtemp(prefix="Pal-Private-"))
    data = parent / "d"
    try:
        prepare_data_dir(Settings.from_env(data))
        copy_default_image(TEST_DATA_DIR, data)
        yield data
    finally:
        for pid in qemu_pids_under(data):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        umount = pal_cli("data-dir", "umount", "--data-dir", str(data), check=False)
        mounted = os.path.ismount(data)
        if mounted:  # never leave a mount under /tmp, even when the command is broken
            subprocess.run(["umount", str(data)], check=False)
        shutil.rmtree(parent, ignore_errors=True)
        assert umount.returncode == 0 and not mounted, umount.stderr


@contextlib.contextmanager
def scratch_run_dir(prefix: str) -> Iterator[Path]:
    """A data dir of its own under TEST_DATA_DIR/runs (images and templates shared by
    start_server); afterwards nothing of it is left, whatever the test left running: its
    QEMUs and gateway are killed, its namespaces deleted, the dir removed."""
    prepare_base_dir()
    d = TEST_DATA_DIR / "runs" / f"{prefix}-{uuid.uuid4().hex[:8]}"
    try:
        yield d
    finally:
        for pid in qemu_pids_under(d) + gateway_pids_under(d):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        from pal.network import netns

        for name in netns_of(d):
            netns.delete(name)
        shutil.rmtree(d, ignore_errors=True)


_STARTED: list[PalServer] = []  # every start_server of the session, for the end-of-session stop


@pytest.fixture(scope="session", autouse=True)
def _no_server_outlives_the_session() -> Iterator[None]:
    """A test that fails between its start_server and its stop leaves the server (and its
    VMs) running: stop whatever is still up once the session ends."""
    yield
    for server in _STARTED:
        stop_server(server)


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
    raise RuntimeError(f"warm template was not built in time:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def pal_server(upstream: Upstream) -> Iterator[PalServer]:  # noqa: F811
    """One real `pal up` for the integration tests of a session (its egress gateway trusts
    the test TLS server's CA, for brokered secrets)."""
    prepare_base_dir()
    run_dir = TEST_DATA_DIR / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    server = start_server(run_dir, {"PAL_EGRESS_CA_BUNDLE": str(upstream.ca_path)})
    try:
        yield server
    finally:
        stop_server(server)
        leaked = qemu_pids_under(run_dir) + gateway_pids_under(run_dir)
        for pid in leaked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        namespaces = netns_of(run_dir)
        from pal.network import netns

        for name in namespaces:
            netns.delete(name)
        shutil.rmtree(run_dir, ignore_errors=True)
        assert not leaked, f"QEMU or gateway processes outlived the server: {leaked}"
        assert not namespaces, f"network namespaces outlived the server: {namespaces}"


@pytest.fixture(scope="session")
def tenant_key(pal_server: PalServer) -> str:
    key = pal_server.tenant("it-main", max_vms=60)
    wait_template(pal_server, key)
    return key


@pytest.fixture(scope="session")
def warm_template(tenant_key: str) -> None:
    """The worker's cache holds the default image's warm template (on a fresh machine the
    second worker's is empty). Tests that kill servers at failpoints need it: a server that
    built it would hit their failpoints in the build, and the next server's build of it
    would look like a leaked QEMU."""
    del tenant_key  # its fixture waited for the template


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
