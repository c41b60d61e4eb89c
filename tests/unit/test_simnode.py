"""The benchmark's simulated node (pal/bench/simnode.py) stands where a node runtime stands:
the real node RPC app serves it, the real client reaches it, and it has every call the
RPC's routes make on a runtime (so a verb added to the node shows up here first)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import httpx
import pytest

from pal.bench.simnode import SIM_AGENT_VERSION, SimNode, SimNodeConfig, SimTimes
from pal.errors import Conflict, Unauthorized
from pal.manager import rpc
from pal.manager.client import ManagerClient
from pal.manager.models import RestoreFrom, SnapshotRequest, SpawnRequest
from pal.manager.runtime import NodeRuntime


def test_it_has_every_call_the_rpc_routes_make_on_a_runtime() -> None:
    used = set(re.findall(r"\bruntime\.(\w+)", Path(rpc.__file__).read_text()))
    assert len(used) > 20
    missing = sorted(name for name in used if not hasattr(SimNode, name))
    assert missing == []


def _client(node: SimNode, token: str = "tok") -> ManagerClient:
    app = rpc.create_rpc_app(cast(NodeRuntime, node), token="tok")
    client = ManagerClient(url="http://sim/n/a", token=token)
    client._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://sim",
        headers={"Authorization": f"Bearer {token}"},
    )
    return client


def _spawn(vm_id: str, incarnation: int = 1, restore: RestoreFrom | None = None) -> SpawnRequest:
    return SpawnRequest(vm_id=vm_id, tenant_id="t-1", image="default", vcpus=1, memory_mib=256, disk_mib=2048,
                        token="x", incarnation=incarnation, restore=restore)  # fmt: skip


async def test_a_vm_s_life_through_the_real_rpc() -> None:
    node = SimNode(SimNodeConfig("sim0", "http://sim/n/sim0", times=SimTimes(0, 0, 0, 0, 0)))
    c = _client(node)
    res = await c.spawn(_spawn("vm-a"))
    assert res.method == "template" and res.agent_version_id == SIM_AGENT_VERSION
    hb = await c.heartbeat()
    assert [(a.vm_id, a.alive, a.incarnation) for a in hb.vms] == [("vm-a", True, 1)]
    with pytest.raises(Conflict):  # the real RPC's error body, rebuilt by the real client
        await c.spawn(_spawn("vm-a"))
    req = SnapshotRequest(
        snapshot_id="snap-1", agent_version_id=SIM_AGENT_VERSION, tenant_id="t-1", keep_running=False
    )
    await c.snapshot("vm-a", req)
    assert (await c.heartbeat()).vms == []
    assert (await c.snapshot_status(SIM_AGENT_VERSION, "vm-a", "snap-1")).complete
    restore = RestoreFrom(
        snapshot_id="snap-1", agent_version_id=SIM_AGENT_VERSION, source_vm_id="vm-a", tenant_id="t-1"
    )
    assert (await c.spawn(_spawn("vm-a", 2, restore))).method == "restore"
    await c.stop("vm-a", 1)  # another incarnation runs: left alone (the strays' rule)
    assert [a.incarnation for a in (await c.heartbeat()).vms] == [2]
    await c.stop("vm-a")
    assert (await c.heartbeat()).vms == []
    assert node.calls["spawn"] == 3


async def test_a_wrong_node_token_is_refused() -> None:
    node = SimNode(SimNodeConfig("sim0", "http://sim/n/sim0"))
    with pytest.raises(Unauthorized):
        await _client(node, token="not-it").heartbeat()
