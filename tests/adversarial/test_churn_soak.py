"""Issue 9, item 7.5: a churn soak, bounded and loopback-only. 200 VMs go through schedule,
exec, pause, resume, fork and delete on one `pal up` with a data dir of its own (so what is
left is its). At the end nothing is leaked: no QEMU, no file under vms/, no snapshot byte,
no DB row that is not terminated, no slot, namespace, gateway registration or cgroup, and
the server's and the gateway's descriptors are back where they were after the warm-up (the
store's connections counted against its pool's bound: STORE_FDS_MAX);
their memory stays within 10 % of it.

Each cycle is a source (schedule, exec, pause, resume, exec) forked into FORK_COUNT
children (each one checked to be a copy of it), then all of them deleted; CONCURRENCY
cycles at once, as a busy tenant would. The VMs never touch the network.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pal.config import Settings
from pal.snapshots.layout import SEAL_QUEUE_DIRNAME
from tests.conftest import (
    PalServer,
    gateway_pids_under,
    netns_of,
    qemu_pids_under,
    scratch_run_dir,
    start_server,
    stop_server,
)
from tests.leaks import gateway_vms, open_store, problems, snapshot_bytes, view

pytestmark = pytest.mark.vm

FORK_COUNT = 4
CYCLES = 40  # x (1 source + FORK_COUNT children) = 200 VMs
WARMUP_CYCLES = 10  # the first 50 VMs: caches, pools and the allocator reach their size
CONCURRENCY = 3
RSS_GROWTH = 0.10  # the "memory flat within 10 %"
DEADLINE_S = 900  # a hang guard for the whole soak, not a speed bound
SETTLE_SAMPLES = 5  # RSS read this many times, SETTLE_GAP_S apart, once all is quiet
SETTLE_GAP_S = 0.5
FD_SETTLE_S = 60  # a hang guard for idle pooled connections to close


@pytest.fixture
def server() -> Iterator[PalServer]:
    with scratch_run_dir("soak") as run_dir:
        s = start_server(run_dir)
        try:
            yield s
        finally:
            stop_server(s)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fds(pid: int) -> int:
    """Descriptors held, less the store's (counted apart: :func:`store_fds`)."""
    return sum(1 for t in fd_targets(pid) if not _is_store_file(t))


# The store (SQLite in WAL mode) keeps as many connections as its busiest moment needed, up
# to its pool's bound (SQLAlchemy's QueuePool: 5 kept, 10 more for a burst), each holding
# pal.db and pal.db-wal (and SQLite keeps a closed connection's descriptors for reuse while
# others hold locks). So one connection more after the soak than after the warm-up is no
# leak; a connection leaked per VM (200 of them) goes far past the bound.
STORE_FDS_MAX = 2 * (5 + 10) + 1  # + the one shared pal.db-shm


def _is_store_file(target: str) -> bool:
    return target.split(" -> ", 1)[-1].rsplit("/", 1)[-1] in ("pal.db", "pal.db-wal", "pal.db-shm")


def store_fds(pid: int) -> int:
    return sum(1 for t in fd_targets(pid) if _is_store_file(t))


@dataclass
class Sample:
    server_rss: int
    gateway_rss: int
    server_fds: int
    gateway_fds: int
    server_store_fds: int


def quiet(server: PalServer, deadline: float) -> None:
    """Nothing in flight: every VM row terminated, no QEMU, no seal job pending."""
    seal_queue = Settings.from_env(server.data_dir).snapshots_root / SEAL_QUEUE_DIRNAME
    while time.time() < deadline:
        rows = view(server.data_dir).rows.values()
        pending = os.listdir(seal_queue) if seal_queue.is_dir() else []
        if (
            all(r.state == "terminated" for r in rows)
            and not pending
            and not qemu_pids_under(server.data_dir)
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"the node did not settle:\n{server.log_tail()}")


def sample(server: PalServer, gateway: int) -> Sample:
    """The lowest of a few reads, once the node is quiet: what it holds, not a transient
    of its last requests (a pooled RPC connection closes a few seconds after its last use)."""
    reads = []
    for _ in range(SETTLE_SAMPLES):
        pid = server.proc.pid
        reads.append(Sample(rss_kib(pid), rss_kib(gateway), fds(pid), fds(gateway), store_fds(pid)))
        time.sleep(SETTLE_GAP_S)  # the spacing of a measurement window, not a wait for an event
    return Sample(*(min(getattr(r, f) for r in reads) for f in Sample.__dataclass_fields__))


def fds_back_to(server: PalServer, gateway: int, base: Sample, deadline: float) -> Sample:
    """Poll until both processes hold no more descriptors than after the warm-up (a leaked
    one never closes; a pooled connection does)."""
    now = sample(server, gateway)
    while (now.server_fds > base.server_fds or now.gateway_fds > base.gateway_fds) and time.time() < deadline:
        now = sample(server, gateway)
    return now


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        with contextlib.suppress(OSError):
            out.append(f"{fd} -> {os.readlink(f'/proc/{pid}/fd/{fd}')}")
    return out


def sockets(targets: list[str]) -> list[str]:
    """What `ss` knows of the sockets among ``targets`` (their peers say what they are)."""
    inodes = {t.rsplit("[", 1)[1].rstrip("]") for t in targets if "socket:[" in t}
    if not inodes:
        return []
    out = subprocess.run(["ss", "-anpe", "--unix", "--tcp"], capture_output=True, text=True, check=False)
    lines = out.stdout.splitlines()
    return [line for line in lines if any(f"ino:{i}" in line or f" {i} " in line for i in inodes)]


class Churn:
    def __init__(self, server: PalServer, key: str) -> None:
        self.server, self.key = server, key
        self.vms: list[str] = []
        self._lock = threading.Lock()

    def _made(self, *vm_ids: str) -> None:
        with self._lock:
            self.vms.extend(vm_ids)

    def cycle(self, n: int) -> None:
        with self.server.client(self.key, timeout=300) as c:
            r = c.post("/v1/runtime/schedule", json={})
            assert r.status_code == 200, r.text
            src = r.json()["vmId"]
            self._made(src)
            marker = f"cycle-{n}"
            run(c, src, "/bin/sh", "-c", f"echo {marker} > /tmp/m")
            assert c.post(f"/v1/runtime/vms/{src}/pause").status_code == 200
            r = c.post(f"/v1/runtime/vms/{src}/resume")
            assert r.status_code == 200, r.text
            assert run(c, src, "cat", "/tmp/m") == marker + "\n"
            r = c.post(f"/v1/runtime/vms/{src}/fork", json={"count": FORK_COUNT})
            assert r.status_code == 200, r.text
            children = [f["vmId"] for f in r.json()["forks"]]
            self._made(*children)
            assert [f["state"] for f in r.json()["forks"]] == ["running"] * FORK_COUNT, r.text
            for child in children:
                assert run(c, child, "cat", "/tmp/m") == marker + "\n"
            for vm in [*children, src]:
                d = c.delete(f"/v1/runtime/vms/{vm}")
                assert d.status_code == 200 and d.json()["state"] == "terminated", d.text


def run(c: httpx.Client, vm: str, *argv: str) -> str:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": argv[0], "argv": list(argv[1:])})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return str(r.json()["stdout"])


def churn(churner: Churn, cycles: range) -> None:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for f in [pool.submit(churner.cycle, n) for n in cycles]:
            f.result()


def test_200_vms_of_churn_leak_nothing(server: PalServer) -> None:
    t0 = time.monotonic()
    deadline = time.time() + DEADLINE_S
    key = server.tenant("soak", max_vms=CONCURRENCY * (1 + FORK_COUNT))
    churner = Churn(server, key)
    (gateway,) = gateway_pids_under(server.data_dir)

    churn(churner, range(WARMUP_CYCLES))
    quiet(server, deadline)
    base = sample(server, gateway)
    base_targets = set(fd_targets(server.proc.pid)), set(fd_targets(gateway))
    churn(churner, range(WARMUP_CYCLES, CYCLES))
    quiet(server, deadline)
    end = fds_back_to(server, gateway, base, time.time() + FD_SETTLE_S)
    took = time.monotonic() - t0
    print(f"churn soak: 200 VMs in {took:.0f} s; after the warm-up {base}, at the end {end}")

    run_dir = server.data_dir
    assert len(churner.vms) == CYCLES * (1 + FORK_COUNT) == 200
    found = problems(run_dir)
    assert found == [], found
    assert qemu_pids_under(run_dir) == []
    assert list((run_dir / "vms").iterdir()) == []
    assert snapshot_bytes(run_dir) == 0, "every snapshot went with its VM"
    assert gateway_vms(run_dir) == set() and netns_of(run_dir) == []
    store = open_store(run_dir)
    try:
        rows = store.list_vms()
        (tenant,) = store.list_tenants()
        assert sorted(r.vm_id for r in rows) == sorted(churner.vms)
        assert {r.state for r in rows} == {"terminated"}
        assert store.count_slots(tenant.id) == 0
        assert sum(r.snapshot_bytes for r in rows) == 0, "the tenant is charged for no snapshot"
    finally:
        store.close()
    assert gateway_pids_under(run_dir) == [gateway], "the same gateway throughout"
    assert end.server_store_fds <= STORE_FDS_MAX, (base, end)
    new_fds = sorted(set(fd_targets(server.proc.pid)) - base_targets[0])
    assert end.server_fds <= base.server_fds, (base, end, "new:", new_fds, sockets(new_fds))
    new_fds = sorted(set(fd_targets(gateway)) - base_targets[1])
    assert end.gateway_fds <= base.gateway_fds, (base, end, "new:", new_fds, sockets(new_fds))
    assert end.server_rss <= base.server_rss * (1 + RSS_GROWTH), (base, end)
    assert end.gateway_rss <= base.gateway_rss * (1 + RSS_GROWTH), (base, end)
