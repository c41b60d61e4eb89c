"""The benchmark's simulated node (pal_tools/bench/simnode.py) stands where a node runtime stands:
the real node RPC app serves its handler table, the real client reaches it, and it serves
every verb a node serves but those of guests it does not have (so a verb added to the node
shows up here first)."""

from __future__ import annotations

import httpx
import pytest

from pal.errors import Conflict, Unauthorized
from pal.manager import rpc
from pal.scheduler.node_client import HttpNode
from pal.wire import verbs
from pal.wire.models import Empty, RestoreFrom, SnapshotAt, SnapshotRequest, SpawnRequest, StopVm
from pal_tools.bench.simnode import SIM_AGENT_VERSION, SimNode, SimNodeConfig, SimTimes

# What a simulated node has no guest for: processes, code contexts, ports; and a volume's
# files (it keeps its volumes in memory, without files: pal/manager/volume_content.py).
UNSERVED = {
    "start_process",
    "start_attached",
    "list_processes",
    "get_process",
    "delete_process",
    "read_output",
    "attach_process",
    "write_stdin",
    "signal_process",
    "resize_process",
    "wait_process",
    "process_stats",
    "rename_user",
    "create_watch",
    "read_watch",
    "delete_watch",
    "run_code",
    "create_context",
    "list_contexts",
    "delete_context",
    "interrupt_context",
    "restart_context",
    "file_metadata",
    "set_file_metadata",
    "port",
    "volume_list",
    "volume_stat",
    "volume_read",
    "volume_write",
    "volume_mkdir",
    "volume_remove",
    "volume_set_attrs",
}


def test_it_serves_every_verb_but_those_of_guests_it_has_not() -> None:
    node = SimNode(SimNodeConfig("sim0", "http://sim/n/sim0"))
    assert set(node.handlers().unbound()) == UNSERVED


def _client(node: SimNode, token: str = "tok") -> HttpNode:
    app = rpc.create_rpc_app(node.handlers(), token="tok")
    client = HttpNode(url="http://sim/n/a", token=token)
    client._control = httpx.AsyncClient(
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
    res = await c.call(verbs.SPAWN, _spawn("vm-a"))
    assert res.method == "template" and res.agent_version_id == SIM_AGENT_VERSION
    hb = await c.call(verbs.HEARTBEAT, Empty())
    assert [(a.vm_id, a.alive, a.incarnation) for a in hb.vms] == [("vm-a", True, 1)]
    with pytest.raises(Conflict):  # the real RPC's error body, rebuilt by the real client
        await c.call(verbs.SPAWN, _spawn("vm-a"))
    req = SnapshotRequest(
        vm_id="vm-a",
        snapshot_id="snap-1",
        agent_version_id=SIM_AGENT_VERSION,
        tenant_id="t-1",
        keep_running=False,
    )
    taken = await c.call(verbs.SNAPSHOT, req)
    assert taken.stored_bytes is not None and taken.stored_bytes > 0
    assert (await c.call(verbs.HEARTBEAT, Empty())).vms == []
    at = SnapshotAt(agent_version_id=SIM_AGENT_VERSION, vm_id="vm-a", snapshot_id="snap-1")
    assert (await c.call(verbs.SNAPSHOT_STATUS, at)).complete
    restore = RestoreFrom(
        snapshot_id="snap-1", agent_version_id=SIM_AGENT_VERSION, source_vm_id="vm-a", tenant_id="t-1"
    )
    assert (await c.call(verbs.SPAWN, _spawn("vm-a", 2, restore))).method == "restore"
    kept = await c.call(verbs.STOP, StopVm(vm_id="vm-a", incarnation=1))  # another incarnation runs
    assert kept.stopped is False, "left alone (the strays' rule)"
    assert [a.incarnation for a in (await c.call(verbs.HEARTBEAT, Empty())).vms] == [2]
    await c.call(verbs.STOP, StopVm(vm_id="vm-a"))
    assert (await c.call(verbs.HEARTBEAT, Empty())).vms == []
    assert node.calls["spawn"] == 3


async def test_a_wrong_node_token_is_refused() -> None:
    node = SimNode(SimNodeConfig("sim0", "http://sim/n/sim0"))
    with pytest.raises(Unauthorized):
        await _client(node, token="not-it").call(verbs.HEARTBEAT, Empty())
