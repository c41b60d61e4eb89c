"""Placement rules, in their order: hard constraints, warm template, tenant fair share, load."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from pal.errors import Unavailable
from pal.scheduler import placement
from pal.scheduler.placement import Need, NodeLoad
from pal.store import NodeRecord

AV = "default-abc"


def node(node_id: str, **kw: Any) -> NodeRecord:
    now = datetime.now(UTC)
    base: dict[str, Any] = dict(
        node_id=node_id, url="http://x", region="", labels={},
        capacity={"memoryMib": 4096, "vcpus": 2, "diskFreeMib": 100_000}, templates=[],
        images=[{"name": "default", "agentVersionId": AV}], healthy=True, health=None, vm_count=0,
        state="active", epoch="e", registered_at=now, last_seen_at=now,
    )  # fmt: skip
    base.update(kw)
    return NodeRecord(**base)


WARM = [{"agentVersionId": AV, "memoryMib": 256, "vcpus": 1, "diskMib": 2048}]
NEED = Need(tenant_id="t1", image="default", memory_mib=256, vcpus=1, disk_mib=2048)


def load(vms: int = 0, memory: int = 0, **tenants: int) -> NodeLoad:
    return NodeLoad(memory_mib=memory, vms=vms, by_tenant=dict(tenants))


def test_hard_constraints_rule_nodes_out_and_say_why() -> None:
    nodes = [
        node("drained", state="draining"),
        node("sick", healthy=False, health="disk"),
        node("noimage", images=[]),
        node("full", capacity={"memoryMib": 300, "vcpus": 2, "diskFreeMib": 100_000}),
        node("nodisk", capacity={"memoryMib": 4096, "vcpus": 2, "diskFreeMib": 100}),
        node("eu", region="eu", labels={"gpu": "no"}),
    ]
    loads = {"full": load(1, 256)}
    with pytest.raises(Unavailable) as ei:
        placement.choose(nodes, loads, Need(**{**NEED.__dict__, "region": "us"}))
    msg = ei.value.message
    for part in ("drained: draining", "sick: unhealthy (disk)", "noimage: no image", "full: region",
                 "eu: region eu != us"):  # fmt: skip
        assert part in msg
    with pytest.raises(Unavailable) as ei:
        placement.choose(nodes[3:5], loads, NEED)
    assert "full: 44 MiB of guest RAM free < 256" in ei.value.message
    assert "nodisk: 100 MiB of disk free < 2048" in ei.value.message
    assert placement.choose(nodes, loads, Need(**{**NEED.__dict__, "region": "eu"})).node_id == "eu"
    with pytest.raises(Unavailable, match="label gpu=no != yes"):
        placement.choose(
            [node("eu", labels={"gpu": "no"})], {}, Need(**{**NEED.__dict__, "labels": {"gpu": "yes"}})
        )


def test_warm_template_beats_fair_share_which_beats_load() -> None:
    cold, warm = node("a"), node("b", templates=WARM)
    # b is warm: it wins although the tenant already has VMs there and it is busier.
    got = placement.choose([cold, warm], {"b": load(5, 1024, t1=3)}, NEED)
    assert got.node_id == "b" and "warm template" in got.reason
    # A restore (resume, fork child) does not care about templates: fair share decides.
    assert (
        placement.choose(
            [cold, warm], {"b": load(5, 1024, t1=3)}, Need(**{**NEED.__dict__, "restore": True})
        ).node_id
        == "a"
    )
    # Both warm: the node with fewer of this tenant's VMs, even if it is the busier one.
    w2 = node("c", templates=WARM)
    got = placement.choose([warm, w2], {"b": load(1, 256, t1=1), "c": load(4, 1024, t2=4)}, NEED)
    assert got.node_id == "c" and "tenant has 0 VMs there" in got.reason
    # Tie on tenant: the less loaded one.
    assert placement.choose([warm, w2], {"b": load(3, 768), "c": load(1, 256)}, NEED).node_id == "c"


def test_a_preferred_node_wins_when_it_fits_and_is_skipped_when_not() -> None:
    a, b = node("a"), node("b", templates=WARM)
    assert placement.choose([a, b], {}, NEED, prefer="a", prefer_why="its previous node").reason.endswith(
        "its previous node"
    )
    got = placement.choose(
        [node("a", state="draining"), b], {}, NEED, prefer="a", prefer_why="its previous node"
    )
    assert got.node_id == "b" and "its previous node node a ruled out: draining" in got.reason


def test_loads_count_only_slot_holding_vms_per_node() -> None:
    from pal.store import VmRecord

    now = datetime.now(UTC)

    def vm(i: int, node_id: str | None, holds: bool, tenant: str = "t1") -> VmRecord:
        return VmRecord(vm_id=f"v{i}", tenant_id=tenant, image="default", limits={"memory_mib": 512},
                        created_at=now, updated_at=now, node_id=node_id, holds_slot=holds)  # fmt: skip

    got = placement.loads([vm(1, "a", True), vm(2, "a", True, "t2"), vm(3, "a", False), vm(4, None, True)])
    assert got["a"].vms == 2 and got["a"].memory_mib == 1024 and got["a"].by_tenant == {"t1": 1, "t2": 1}


def test_a_restore_needs_no_image_on_the_node() -> None:
    """A resume or fork child boots its snapshot's own root fs and boot set: the image may
    have been replaced or removed since (docs/images.md)."""
    nodes = [node("n1", images=[])]
    with pytest.raises(Unavailable, match="no image"):
        placement.choose(nodes, {}, NEED)
    assert placement.choose(nodes, {}, Need(**{**NEED.__dict__, "restore": True})).node_id == "n1"


def test_an_idle_tier_vm_counts_a_share_of_its_ram_and_a_woken_one_all_of_it() -> None:
    from pal.scheduler.states import Marker
    from pal.store import VmRecord

    now = datetime.now(UTC)

    def vm(i: int, state: str, marker: str = "") -> VmRecord:
        return VmRecord(vm_id=f"v{i}", tenant_id="t1", image="default", limits={"memory_mib": 256},
                        state=state, marker=marker, created_at=now, updated_at=now, node_id="a",
                        holds_slot=True)  # fmt: skip

    idle = [vm(i, "paused", Marker.LIVE_IDLE) for i in range(8)]
    held = placement.loads(idle)["a"]
    assert held.vms == 8 and held.memory_mib == 8 * 64  # offloaded: a quarter each
    need = Need(tenant_id="t1", image="default", memory_mib=256, vcpus=1, disk_mib=2048)
    full = node("a", capacity={"memoryMib": 1024, "diskFreeMib": 100_000})
    assert placement.why_not(full, held, need) is None, "eight idle VMs leave room for a ninth"
    # The same eight awake (or live-paused by an operator, not offloaded) hold all their RAM.
    awake = placement.loads([vm(i, "running") for i in range(4)] + [vm(9, "paused", Marker.LIVE)])["a"]
    assert awake.memory_mib == 5 * 256
    assert placement.why_not(full, awake, need) == "-256 MiB of guest RAM free < 256"
