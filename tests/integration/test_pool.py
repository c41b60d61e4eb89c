"""The claimable warm pool (pal/manager/pool.py) with real VMs: a schedule of a pooled size
claims a pooled VM (restored from the template, live-paused, offloaded), which takes the
tenant's identity and spec afresh; two claims never share anything; the pool refills; a
pooled VM holds little guest RAM; and nothing is left behind."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pal.vmm.offload import resident_bytes
from tests.conftest import (
    PalServer,
    assert_guest_clock_is_the_hosts,
    qemu_pids_under,
    scratch_run_dir,
    start_server,
    stop_server,
)
from tests.integration.test_code import SPEC as CODE_SPEC
from tests.integration.test_code import code_image  # noqa: F401 (a fixture: the image, built)
from tests.leaks import pooled_vms, problems, vm_slots, vm_states

pytestmark = pytest.mark.vm

POOL_ENV = {"PAL_POOL": "256m-1c-2048d:2"}
DEADLINE_S = 600  # a hang guard, not a speed bound (a TCG restore on a busy host)
MIB = 1 << 20
CODE_SIZE = "256m-1c-2048d"  # the default size, which has templates in the tests


@pytest.fixture
def run_dir() -> Iterator[Path]:
    with scratch_run_dir("pool") as d:
        yield d


def node_metric(server: PalServer, family: str) -> float:
    """The one node's gauge ``family`` in /metrics."""
    r = httpx.get(
        server.url + "/metrics", headers={"Authorization": f"Bearer {server.operator_token}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    m = re.search(rf"^{family}\{{[^}}]*\}} ([0-9.e+]+)$", r.text, re.M)
    assert m is not None, f"{family} is not in /metrics"
    return float(m.group(1))


def pool_metric(server: PalServer, name: str) -> float:
    return node_metric(server, f"pal_pool_{name}")


def wait_pool_ready(
    server: PalServer, n: int, not_among: frozenset[str] | set[str] = frozenset()
) -> dict[str, str]:
    """Block until the pool holds ``n`` ready VMs (none of ``not_among``); pool id -> slot."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        pooled = pooled_vms(server.data_dir)
        if pool_metric(server, "ready") >= n and len(pooled) == n and not set(pooled) & not_among:
            return pooled
        assert server.proc.poll() is None, server.log_tail()
        time.sleep(0.5)
    raise AssertionError(f"the pool did not get {n} VMs ready:\n{server.log_tail()}")


def sh(c: httpx.Client, vm: str, line: str) -> str:
    r = c.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return str(r.json()["stdout"])


def test_a_schedule_claims_a_pooled_vm_with_a_fresh_identity_and_the_pool_refills(run_dir: Path) -> None:
    server = start_server(run_dir, POOL_ENV)
    try:
        key = server.tenant("pool-claims", max_vms=4)
        pooled = wait_pool_ready(server, 2)
        tokens = {slot: vm_states(run_dir)[slot]["token"] for slot in pooled.values()}
        for slot in pooled.values():  # stopped and offloaded: little of its guest RAM is resident
            (pid,) = qemu_pids_under(run_dir / "vms" / slot)
            assert resident_bytes(pid, run_dir / "vms" / slot / "mem") < 64 * MIB
        assert pool_metric(server, "rss_bytes") > 0
        with server.client(key) as c:
            vms = []
            for n in range(2):
                r = c.post("/v1/runtime/schedule", json={"secrets": {"WHO": f"tenant-{n}"}})
                assert r.status_code == 200, r.text
                assert r.json()["bootMethod"] == "pool", r.json()
                vms.append(r.json()["vmId"])
            slots = vm_slots(run_dir)
            # Each claimed one pooled VM, a different one, and it left the pool.
            assert {slots[v] for v in vms} == set(pooled.values())
            seen = {}
            for n, vm in enumerate(vms):
                out = sh(
                    c,
                    vm,
                    "hostname; cat /sys/class/net/eth0/address /proc/sys/kernel/random/boot_id;"
                    " head -c 32 /dev/urandom | od -An -tx1; echo $WHO",
                )
                host, mac, boot, *rng, who = out.split("\n")[:-1]
                assert host == vm[:63] and who == f"tenant-{n}"
                seen[vm] = (mac, boot, "".join(rng))
                # A token of its own, not the pooled VM's.
                assert vm_states(run_dir)[slots[vm]]["token"] != tokens[slots[vm]]
                assert_guest_clock_is_the_hosts(lambda vm=vm: float(sh(c, vm, "date +%s.%N")))
            # Nothing of the template's boot state is shared that a restore can redraw: the
            # kernel's boot_id is drawn by each claim (docs/security.md, "What restored VMs share").
            (mac_a, boot_a, rng_a), (mac_b, boot_b, rng_b) = seen.values()
            assert mac_a != mac_b and rng_a != rng_b and boot_a != boot_b
            assert pool_metric(server, "claims") == 2
            # The pool refills with new VMs (never the claimed ones: they are the tenant's).
            refilled = wait_pool_ready(server, 2, not_among=set(pooled))
            assert not set(refilled.values()) & {slots[v] for v in vms}
            assert problems(run_dir) == []
            for vm in vms:
                assert c.delete(f"/v1/runtime/vms/{vm}").status_code == 200
            assert problems(run_dir) == []
    finally:
        stop_server(server)
    assert qemu_pids_under(run_dir / "vms") == [], "a stopped server leaves no pooled QEMU"


def test_a_size_without_a_pool_boots_as_before_and_counts_no_claim(run_dir: Path) -> None:
    server = start_server(run_dir, {"PAL_POOL": "256m-1c-2048d:1"})
    try:
        key = server.tenant("pool-miss", max_vms=2)
        wait_pool_ready(server, 1)
        with server.client(key) as c:
            r = c.post("/v1/runtime/schedule", json={"limits": {"memoryMib": 192, "diskMib": 3072}})
            assert r.status_code == 200, r.text
            assert r.json()["bootMethod"] != "pool"
            assert pool_metric(server, "claims") == 0 and pool_metric(server, "ready") == 1
            c.delete(f"/v1/runtime/vms/{r.json()['vmId']}")
    finally:
        stop_server(server)


# A first cell that reports what its kernel held before it: the names a user defined (none
# but IPython's own), the outputs kept, who the sandbox is, and a draw of Python's RNG.
FIRST_CELL = (
    "names = sorted(k for k in globals()"
    " if not k.startswith('_') and k not in ('In', 'Out', 'exit', 'quit', 'get_ipython'))\n"
    "import json, os, random, socket\n"
    "print(json.dumps({'names': names, 'outs': len(Out), 'ins': len(In),"
    " 'vm': os.environ.get('PAL_VM_ID'), 'who': os.environ.get('WHO'), 'host': socket.gethostname(),"
    " 'cwd': os.getcwd(), 'draw': random.random()}))"
)


@pytest.mark.usefixtures("code_image")
def test_a_schedule_of_a_pooled_image_claims_a_vm_whose_warm_kernel_is_fresh_and_its_own(
    run_dir: Path,
) -> None:
    # The code-interpreter image pooled at its own size: its pooled VMs come from its
    # template, whose kernel is started; a claim's first cell runs in that kernel, which
    # holds nothing from before the claim and sees the tenant's identity, not the pool's.
    server = start_server(run_dir, {"PAL_POOL": f"{CODE_SPEC['image']}@{CODE_SIZE}:1"})
    try:
        key = server.tenant("pool-code", max_vms=3)
        pooled = wait_pool_ready(server, 1)
        seen: list[dict[str, object]] = []
        with server.client(key) as c:
            for n in range(2):
                if n:
                    pooled = wait_pool_ready(server, 1, not_among=set(pooled))
                spec = {"image": CODE_SPEC["image"], "secrets": {"WHO": f"tenant-{n}"}}
                r = c.post("/v1/runtime/schedule", json=spec)
                assert r.status_code == 200, r.text
                assert r.json()["bootMethod"] == "pool", r.json()
                vm = r.json()["vmId"]
                assert vm_slots(run_dir)[vm] in pooled.values()
                r = c.post(f"/v1/runtime/vms/{vm}/code", json={"code": FIRST_CELL})
                assert r.status_code == 200, r.text
                cell = r.json()
                assert cell["error"] is None and cell["executionCount"] == 1, cell
                got = json.loads(cell["stdout"])
                assert got["names"] == [] and got["outs"] == 0 and got["ins"] == 2, got
                assert got["vm"] == vm and got["host"] == vm[:63] and got["who"] == f"tenant-{n}", got
                assert got["cwd"] == "/workspace"
                seen.append(got)
                assert c.delete(f"/v1/runtime/vms/{vm}").status_code == 200
            # Two VMs of one template: their kernels were reseeded, not left at its state.
            assert seen[0]["draw"] != seen[1]["draw"]
            assert pool_metric(server, "claims") == 2
        wait_pool_ready(server, 1, not_among=set(pooled))  # refilled: no fill under way
        assert problems(run_dir) == []
    finally:
        stop_server(server)
    assert qemu_pids_under(run_dir / "vms") == [], "a stopped server leaves no pooled QEMU"


def test_a_claim_with_a_volume_mounts_it_and_leaves_nothing_exported(run_dir: Path) -> None:
    """The claim exports the volume while the gateway takes the VM (pool.py), before the
    guest mounts it at identify; the VM's delete takes it off the export again."""
    server = start_server(run_dir, {"PAL_POOL": f"{CODE_SIZE}:1"})
    try:
        key = server.tenant("pool-volume", max_vms=2)
        wait_pool_ready(server, 1)
        with server.client(key) as c:
            assert c.post("/v1/volumes", json={"name": "pooled", "sizeMib": 64}).status_code == 200
            r = c.post("/v1/runtime/schedule", json={"volumes": [{"name": "pooled", "path": "/mnt/vol"}]})
            assert r.status_code == 200, r.text
            assert r.json()["bootMethod"] == "pool", r.json()
            vm = r.json()["vmId"]
            assert " /mnt/vol nfs " in sh(c, vm, "cat /proc/mounts")
            sh(c, vm, "echo claimed > /mnt/vol/f && sync")
            conf = run_dir / "run" / "volumes" / "ganesha.conf"
            assert conf.exists() and "CLIENT" in conf.read_text()
            assert c.delete(f"/v1/runtime/vms/{vm}").status_code == 200
            got = c.get("/v1/volumes/pooled/files/content", params={"path": "f"})
            assert got.status_code == 200 and got.content == b"claimed\n", got.text
            assert "CLIENT" not in conf.read_text()  # no VM mounts it any more
            assert problems(run_dir) == []
    finally:
        stop_server(server)
