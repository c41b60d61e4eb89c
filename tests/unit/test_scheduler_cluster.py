"""The scheduler with several nodes (in-memory fakes standing for `pal node`s registered by
their heartbeats): placement recorded in events, resume on another node, forks that spill,
node loss, strays stopped on return, drain, and a fork that is all or nothing across a
control-plane crash. The same with real processes: tests/integration/test_cluster.py."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from pal.config import Settings
from pal.errors import Unavailable
from pal.scheduler.scheduler import Scheduler
from pal.scheduler.states import VmState
from pal.spec import AgentSpec
from pal.store import Store, utcnow
from pal.wire.models import ExecCall, on_vm
from tests.fakes import Crash, FakeClock, FakeManager, crash_at

S = VmState


@dataclasses.dataclass
class Cluster:
    store: Store
    sched: Scheduler
    nodes: dict[str, FakeManager]
    tenant_id: str
    settings: Settings
    clock: FakeClock

    async def beat(self, name: str) -> Any:
        return await self.sched.reconciler.node_heartbeat(await self.nodes[name].heartbeat())

    def silence(self, name: str, secs: float = 60) -> None:
        """The node's last heartbeat was ``secs`` ago."""
        rec = self.store.get_node(name)
        assert rec is not None
        self.store.record_node(dataclasses.replace(rec, last_seen_at=utcnow() - timedelta(seconds=secs)))
        self.sched.nodes.reload()  # the leader's copy, as it reads it when it takes over


async def make_cluster(tmp_path: Path, names: tuple[str, ...] = ("n1", "n2", "n3"), **kw: Any) -> Cluster:
    # A long heartbeat period: placement reads a node's silence on the wall clock, and a
    # loaded CI machine took 16 s over six schedules (3 periods of 5 s: the nodes were
    # "silent"). Tests that silence a node say how long, in periods where it matters.
    kw.setdefault("node_heartbeat_interval_s", 30.0)
    settings = Settings(data_dir=tmp_path, **kw)
    store = Store.open(settings)
    tenant, _ = store.create_tenant("acme", 20)
    clock = FakeClock()
    sched = Scheduler(settings, store, clock=clock)
    shared: dict[tuple[str, str, str], bool] = {}  # "S3": every node sees every snapshot
    nodes = {}
    for i, name in enumerate(names):
        fake = FakeManager(node_id=name)
        fake.url = f"http://127.0.0.1:{9000 + i}"
        fake.snapshots = shared
        sched.nodes.use_client(name, fake)
        nodes[name] = fake
    c = Cluster(store, sched, nodes, tenant.id, settings, clock)
    for name in names:
        await c.beat(name)
    sched.lead.since = clock() - 3600
    return c


def _reasons(c: Cluster, vm_id: str) -> list[str]:
    return [e.reason or "" for e in c.store.list_events(vm_id)]


async def test_a_tenants_vms_spread_and_each_placement_is_explained(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path)
    vms = [(await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0] for _ in range(6)]
    per_node: dict[str | None, int] = {}
    for vm in vms:
        per_node[vm.node_id] = per_node.get(vm.node_id, 0) + 1
        assert any(r.startswith(f"placed on {vm.node_id}: ") for r in _reasons(c, vm.vm_id))
    assert per_node == {"n1": 2, "n2": 2, "n3": 2}
    for name, fake in c.nodes.items():  # each VM runs where its row says
        assert {v.vm_id for v in vms if v.node_id == name} == set(fake.alive)


async def test_placement_constraints_and_no_fitting_node(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path)
    c.nodes["n2"].region, c.nodes["n2"].labels = "eu", {"tier": "gold"}
    await c.beat("n2")
    spec = AgentSpec.model_validate({"placement": {"region": "eu", "labels": {"tier": "gold"}}})
    for _ in range(3):
        vm, _ = await c.sched.scheduling.schedule(c.tenant_id, spec)
        assert vm.node_id == "n2"
    from pal.errors import InvalidRequest, Unavailable

    rows = len(c.store.list_vms(tenant_id=c.tenant_id))
    # No node, in any state, is in region us: it can never be placed, so a 400 before any row.
    with pytest.raises(InvalidRequest, match="no node has this placement's region and labels") as bad:
        await c.sched.scheduling.schedule(
            c.tenant_id, AgentSpec.model_validate({"placement": {"region": "us"}})
        )
    assert bad.value.status == 400
    assert len(c.store.list_vms(tenant_id=c.tenant_id)) == rows
    # The one node of region eu is draining: placement may succeed later, so a 503.
    c.sched.nodes.set_state("n2", "draining")
    with pytest.raises(Unavailable, match="no node can run this VM") as ei:
        await c.sched.scheduling.schedule(c.tenant_id, spec)
    assert ei.value.status == 503
    assert c.store.count_slots(c.tenant_id) == 3  # the refused one holds nothing


async def test_resume_on_another_node_when_its_node_is_draining(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1", "n2"))
    vm, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    home = vm.node_id
    assert home is not None
    other = "n2" if home == "n1" else "n1"
    await c.sched.pauses.pause(c.tenant_id, vm.vm_id)
    resumed = await c.sched.pauses.resume(c.tenant_id, vm.vm_id)
    assert resumed.node_id == home  # its previous node, healthy with room
    await c.sched.pauses.pause(c.tenant_id, vm.vm_id)
    c.sched.nodes.set_state(home, "draining")
    resumed = await c.sched.pauses.resume(c.tenant_id, vm.vm_id)
    assert resumed.node_id == other and vm.vm_id in c.nodes[other].alive
    assert ("ensure_uploaded", vm.vm_id) in c.nodes[home].calls  # published to S3 first
    assert any("its previous node node " + home + " ruled out: draining" in r for r in _reasons(c, vm.vm_id))


async def test_many_nodes_silent_at_once_are_the_control_planes_trouble_not_theirs(tmp_path: Path) -> None:
    """Five of ten nodes silent at once (a control plane too slow to take their heartbeats,
    or cut off from them): none is declared lost and no VM fails; one silent alone is."""
    names = tuple(f"n{i}" for i in range(10))
    c = await make_cluster(tmp_path, names)
    vm, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    for name in names[:5]:
        c.silence(name, 60)
    assert await c.sched.reconciler.lose_silent_nodes() == []
    assert all(n.state == "active" for n in c.sched.nodes.nodes())
    for name in names[1:5]:
        await c.beat(name)
    assert "node n0: lost" in await c.sched.reconciler.lose_silent_nodes()
    assert [n.node_id for n in c.sched.nodes.nodes() if n.state == "lost"] == ["n0"]
    assert c.store.get_vm(vm.vm_id).state == (S.FAILED if vm.node_id == "n0" else S.RUNNING)  # type: ignore[union-attr]


async def test_node_loss_fails_its_running_vms_once_and_keeps_paused_ones(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1", "n2"))
    c.nodes["n2"].memory_mib = 0  # everything lands on n1
    await c.beat("n2")
    running = [(await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0].vm_id for _ in range(2)]
    paused = (await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0].vm_id
    await c.sched.pauses.pause(c.tenant_id, paused)
    assert c.store.count_slots(c.tenant_id) == 2
    assert await c.sched.reconciler.lose_silent_nodes() == []  # fresh heartbeats: nothing
    c.silence("n1", 31)
    fixes = await c.sched.reconciler.lose_silent_nodes()
    assert "node n1: lost" in fixes
    for vm_id in running:
        vm = c.store.get_vm(vm_id)
        assert vm is not None and vm.state == S.FAILED and vm.reason == "node lost" and not vm.holds_slot
    assert c.store.count_slots(c.tenant_id) == 0
    assert await c.sched.reconciler.lose_silent_nodes() == []  # exactly once
    # The paused VM resumes elsewhere (n2 given room again), from "S3".
    c.nodes["n2"].memory_mib = 1 << 20
    await c.beat("n2")
    moved = await c.sched.pauses.resume(c.tenant_id, paused)
    assert moved.state == S.RUNNING and moved.node_id == "n2"
    # n1 comes back with its QEMUs (adopted): the lost VMs are stopped, none runs twice.
    assert set(running) <= set(c.nodes["n1"].alive)
    ack = await c.beat("n1")
    assert ack.state == "active" and sorted(ack.stopping) == sorted(running)
    for t in list(c.sched.chores.tasks):
        await t
    assert not set(running) & set(c.nodes["n1"].alive)


async def test_a_silent_node_is_not_lost_right_after_a_failover(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1",))
    await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    c.silence("n1", 60)
    c.sched.lead.since = c.clock()  # this replica just took over: heartbeats went nowhere
    assert await c.sched.reconciler.lose_silent_nodes() == []
    c.clock.advance(31)
    fixes = await c.sched.reconciler.lose_silent_nodes()
    assert fixes[0] == "node n1: lost" and len(fixes) == 2  # and its one VM failed
    assert c.store.get_node("n1").state == "lost"  # type: ignore[union-attr]


async def test_stray_of_an_older_incarnation_is_stopped_by_incarnation(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1", "n2"))
    vm, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    assert c.sched.reconciler.stray_vms(vm.node_id or "", await c.nodes[vm.node_id or ""].heartbeat()) == []
    other = "n2" if vm.node_id == "n1" else "n1"
    c.nodes[other].alive[vm.vm_id] = dataclasses.replace(c.nodes[vm.node_id or ""].alive[vm.vm_id])
    assert c.sched.reconciler.stray_vms(other, await c.nodes[other].heartbeat()) == [(vm.vm_id, 1)]


async def test_forks_stay_on_the_source_node_and_spill_when_it_is_full(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1", "n2"))
    c.nodes["n2"].memory_mib = 0
    await c.beat("n2")
    src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    assert src.node_id == "n1"
    c.nodes["n1"].memory_mib = 256 * 3  # room for the source and two children
    c.nodes["n2"].memory_mib = 1 << 20
    await c.beat("n1")
    await c.beat("n2")
    res = await c.sched.forking.fork(c.tenant_id, src.vm_id, 4)
    assert [f.state for f in res.forks] == [S.RUNNING] * 4
    where = [c.store.get_vm(f.vm_id).node_id for f in res.forks]  # type: ignore[union-attr]
    assert where == ["n1", "n1", "n2", "n2"]
    assert ("ensure_uploaded", src.vm_id) in c.nodes["n1"].calls  # the snapshot went to S3
    assert any("shares its pages" in r for r in _reasons(c, res.forks[0].vm_id))


async def test_forks_do_not_spill_onto_a_silent_node(tmp_path: Path) -> None:
    """A node that stopped heartbeating gets no spilled fork child, however roomy its last
    heartbeat said it was (as for a schedule or a resume)."""
    c = await make_cluster(tmp_path)
    for name, mib in (("n1", 256), ("n2", 0), ("n3", 0)):
        c.nodes[name].memory_mib = mib
        await c.beat(name)
    src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    assert src.node_id == "n1"  # and n1 is now full
    c.nodes["n2"].memory_mib = 1 << 21  # the roomiest: ranked first while it heartbeats
    c.nodes["n3"].memory_mib = 1 << 20
    await c.beat("n2")
    await c.beat("n3")
    c.silence("n2", 3 * c.settings.node_heartbeat_interval_s + 5)
    res = await c.sched.forking.fork(c.tenant_id, src.vm_id, 2)
    assert [f.state for f in res.forks] == [S.RUNNING] * 2
    assert [c.store.get_vm(f.vm_id).node_id for f in res.forks] == ["n3", "n3"]  # type: ignore[union-attr]
    assert not c.nodes["n2"].alive
    assert any("(1 of 3 nodes fit)" in r for r in _reasons(c, res.forks[0].vm_id))


async def test_a_fork_interrupted_by_a_crash_keeps_no_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await make_cluster(tmp_path, ("n1",))
    src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    real = c.sched.transitions.transition_all

    async def crash(*a: Any, **kw: Any) -> Any:
        raise Crash("before the children's commit")

    monkeypatch.setattr(c.sched.transitions, "transition_all", crash)
    with pytest.raises(Crash):
        await c.sched.forking.fork(c.tenant_id, src.vm_id, 3)
    monkeypatch.setattr(c.sched.transitions, "transition_all", real)
    children = c.store.list_vms(parent_vm_id=src.vm_id)
    assert len(children) == 3 and all(ch.vm_id in c.nodes["n1"].alive for ch in children)  # all came up
    fresh = Scheduler(c.settings, c.store, clock=c.clock)
    fresh.nodes.use_client("n1", c.nodes["n1"])
    await fresh.reconciler.reconcile_all()
    for ch in c.store.list_vms(parent_vm_id=src.vm_id):
        assert ch.state == S.FAILED and not ch.holds_slot
        assert ch.vm_id not in c.nodes["n1"].alive
    assert c.store.count_slots(c.tenant_id) == 1  # the source's only


async def _crashed_fork(c: Cluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fork of 2 whose children came up but whose commit never happened."""
    src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    real = c.sched.transitions.transition_all

    async def crash(*a: Any, **kw: Any) -> Any:
        raise Crash("before the children's commit")

    monkeypatch.setattr(c.sched.transitions, "transition_all", crash)
    with pytest.raises(Crash):
        await c.sched.forking.fork(c.tenant_id, src.vm_id, 2)
    monkeypatch.setattr(c.sched.transitions, "transition_all", real)
    return src.vm_id


async def test_a_new_leader_asks_a_node_silent_during_the_failover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two leaders died within a heartbeat period or three: the node's heartbeats went
    nowhere, so its last one is old, yet it answers: the interrupted fork is settled."""
    c = await make_cluster(tmp_path, ("n1",))
    src = await _crashed_fork(c, monkeypatch)
    c.silence("n1", 3 * c.settings.node_heartbeat_interval_s + 5)
    fresh = Scheduler(c.settings, c.store, clock=c.clock)
    fresh.nodes.use_client("n1", c.nodes["n1"])
    await fresh.reconciler.reconcile_all()
    assert {ch.state for ch in c.store.list_vms(parent_vm_id=src)} == {S.FAILED}
    assert c.store.count_slots(c.tenant_id) == 1 and not fresh.reconciler.unreconciled_nodes


async def test_vms_of_a_node_that_did_not_answer_are_settled_when_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new leader's reconciliation could not reach the node: its VMs wait (nothing is
    decided without the node's word), and are settled once it heartbeats again."""
    c = await make_cluster(tmp_path, ("n1",))
    src = await _crashed_fork(c, monkeypatch)
    fresh = Scheduler(c.settings, c.store, clock=c.clock)
    fresh.nodes.use_client("n1", c.nodes["n1"])
    real_hb = c.nodes["n1"].heartbeat

    async def down() -> Any:
        raise Unavailable("connection refused")

    monkeypatch.setattr(c.nodes["n1"], "heartbeat", down)
    await fresh.reconciler.reconcile_all()
    assert {ch.state for ch in c.store.list_vms(parent_vm_id=src)} == {S.SPAWNING}
    assert fresh.reconciler.unreconciled_nodes == {"n1"}
    monkeypatch.setattr(c.nodes["n1"], "heartbeat", real_hb)
    await fresh.reconciler.reconcile_unanswered()
    assert {ch.state for ch in c.store.list_vms(parent_vm_id=src)} == {S.FAILED}
    assert not any(ch.vm_id in c.nodes["n1"].alive for ch in c.store.list_vms(parent_vm_id=src))
    assert c.store.count_slots(c.tenant_id) == 1 and not fresh.reconciler.unreconciled_nodes


async def test_a_fork_crash_before_the_snapshot_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await make_cluster(tmp_path, ("n1",))
    src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
    crash_at(monkeypatch, "fork:reserved")
    with pytest.raises(Crash):
        await c.sched.forking.fork(c.tenant_id, src.vm_id, 2)
    fresh = Scheduler(c.settings, c.store, clock=c.clock)
    fresh.nodes.use_client("n1", c.nodes["n1"])
    await fresh.reconciler.reconcile_all()
    assert {ch.state for ch in c.store.list_vms(parent_vm_id=src.vm_id)} == {S.FAILED}
    assert c.store.count_slots(c.tenant_id) == 1


async def test_drain_pauses_and_migrate_moves(tmp_path: Path) -> None:
    c = await make_cluster(tmp_path, ("n1", "n2"))
    c.nodes["n2"].memory_mib = 0
    await c.beat("n2")
    a = (await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0].vm_id
    b = (await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0].vm_id
    c.nodes["n2"].memory_mib = 1 << 20
    await c.beat("n2")
    out = await c.sched.draining.drain_node("n1")
    assert out["paused"] == sorted([a, b]) and out["failed"] == {}
    assert c.store.get_node("n1").state == "draining"  # type: ignore[union-attr]
    await c.beat("n1")  # a heartbeat does not undo an operator's drain
    assert c.store.get_node("n1").state == "draining"  # type: ignore[union-attr]
    # The next request wakes the VM on the other node.
    from pal.spec import ExecRequest

    events = [
        ev
        async for ev in c.sched.guest.exec_stream(
            c.tenant_id, on_vm(ExecCall, a, ExecRequest(command="true"))
        )
    ]
    assert events[-1].type == "exit"
    assert c.store.get_vm(a).node_id == "n2"  # type: ignore[union-attr]
    await c.sched.draining.set_node_active("n1")
    c.sched.nodes.set_state("n2", "draining")
    c2 = (await c.sched.scheduling.schedule(c.tenant_id, AgentSpec()))[0]
    assert c2.node_id == "n1"
    await c.sched.draining.set_node_active("n2")
    out = await c.sched.draining.drain_node("n1", migrate=True)
    assert out["migrated"] == {c2.vm_id: "n2"} and c2.vm_id in c.nodes["n2"].alive
