"""Kept snapshots (pal/scheduler/kept.py) over the fake node: what keeps one, what it
costs, what starts from it, whose it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded, Unavailable
from pal.scheduler.states import VmState
from pal.spec import AgentSpec
from pal.store import kept as kept_rows
from tests.fakes import AGENT_VERSION, SchedEnv, make_env
from tests.unit.test_scheduler_cluster import make_cluster

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _running(env: SchedEnv) -> str:
    view, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    assert view.state == S.RUNNING
    return view.vm_id


def _files(env: SchedEnv) -> set[str]:
    return {sid for (_, _, sid), ok in env.manager.snapshots.items() if ok}


async def test_a_kept_snapshot_outlives_its_vm_and_starts_new_vms(env: SchedEnv) -> None:
    vm_id = await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id, "base-1")
    [(_, req)] = env.manager.snapshot_requests
    assert req.keep_running is True and req.snapshot_id == kept.snapshot_id
    assert env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]
    assert (kept.name, kept.source_vm_id, kept.agent_version_id) == ("base-1", vm_id, AGENT_VERSION)

    await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert kept.snapshot_id in _files(env), "the source's delete left the kept snapshot"
    # It still counts against the tenant's snapshot limit (what its node says it takes).
    assert env.store.get_tenant(env.tenant_id).snapshot_bytes_used == env.manager.snapshot_size  # type: ignore[union-attr]

    for ref in (kept.snapshot_id, "base-1", "base-1:default"):
        res = await env.sched.kept.start(env.tenant_id, ref)
        [child] = res.forks
        assert child.state == S.RUNNING and child.vm_id != vm_id
        spawn = env.manager.spawn_requests[-1]
        assert spawn.restore is not None and spawn.restore.snapshot_id == kept.snapshot_id
        assert spawn.restore.source_vm_id == vm_id and spawn.restore.mem_mode == "shared"
        # A child's delete never lets the kept snapshot go, its source being gone.
        await env.sched.deleting.delete(env.tenant_id, child.vm_id)
        assert kept.snapshot_id in _files(env)


async def test_the_vms_retention_and_the_sweep_keep_it(env: SchedEnv) -> None:
    vm_id = await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id)
    assert kept.name is None
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    pause_req = env.manager.snapshot_requests[-1][1]
    assert kept.snapshot_id in pause_req.protected, "every snapshot of the VM protects it from retention"
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    # What a crash left: the leader's sweep of a terminated VM's snapshots keeps it too.
    env.manager.snapshots[(AGENT_VERSION, vm_id, "snap-leftover")] = True
    await env.sched.snapshot_checks.sweep()
    assert _files(env) == {kept.snapshot_id}


async def test_a_paused_vm_keeps_its_pause_snapshot_without_a_capture(env: SchedEnv) -> None:
    vm_id = await _running(env)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    kept = await env.sched.kept.keep(env.tenant_id, vm_id, "p")
    assert kept.snapshot_id == paused.snapshot_id and len(env.manager.snapshot_requests) == 1
    with pytest.raises(Conflict):
        await env.sched.kept.keep(env.tenant_id, vm_id, "q")  # the same snapshot twice
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert kept.snapshot_id in _files(env)


async def test_a_name_moves_to_the_newest_snapshot_and_bad_names_are_refused(env: SchedEnv) -> None:
    vm_id = await _running(env)
    first = await env.sched.kept.keep(env.tenant_id, vm_id, "nightly")
    second = await env.sched.kept.keep(env.tenant_id, vm_id, "nightly")
    assert env.sched.kept.get(env.tenant_id, "nightly").snapshot_id == second.snapshot_id
    assert env.sched.kept.get(env.tenant_id, first.snapshot_id).name is None  # still kept, unnamed
    with pytest.raises(Conflict):
        await env.sched.kept.keep(env.tenant_id, vm_id, "default")  # an image's name
    with pytest.raises(Conflict):
        await env.sched.kept.keep(env.tenant_id, vm_id, "snap-abc")  # an id's form
    for bad in ("", "-x", "a b", "x" * 101, "a/b"):
        with pytest.raises(InvalidRequest):
            await env.sched.kept.keep(env.tenant_id, vm_id, bad)
    assert len(env.manager.snapshot_requests) == 2


async def test_another_tenants_snapshot_is_not_found(env: SchedEnv) -> None:
    vm_id = await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id, "mine")
    other, _ = env.store.create_tenant("other", 2)
    for ref in (kept.snapshot_id, "mine"):
        with pytest.raises(NotFound):
            env.sched.kept.get(other.id, ref)
        with pytest.raises(NotFound):
            await env.sched.kept.start(other.id, ref)
        with pytest.raises(NotFound):
            await env.sched.kept.delete(other.id, ref)
    with pytest.raises(NotFound):
        await env.sched.kept.keep(other.id, vm_id, "theirs")
    assert env.sched.kept.list(other.id) == []
    assert kept.snapshot_id in _files(env)


async def test_a_deleted_snapshot_is_gone_and_its_files_with_it(env: SchedEnv) -> None:
    vm_id = await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id, "k")
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    gone = await env.sched.kept.delete(env.tenant_id, "k")
    assert gone.snapshot_id == kept.snapshot_id and kept.snapshot_id not in _files(env)
    assert env.store.get_tenant(env.tenant_id).snapshot_bytes_used == 0  # type: ignore[union-attr]
    for ref in (kept.snapshot_id, "k"):
        with pytest.raises(NotFound):
            await env.sched.kept.start(env.tenant_id, ref)
        with pytest.raises(NotFound):
            await env.sched.kept.delete(env.tenant_id, ref)


async def test_a_running_vms_snapshot_deleted_goes_but_a_paused_ones_is_left_to_retention(
    env: SchedEnv,
) -> None:
    vm_id = await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id)
    await env.sched.kept.delete(env.tenant_id, kept.snapshot_id)
    assert kept.snapshot_id not in _files(env)
    other = await env.sched.kept.keep(env.tenant_id, vm_id)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    await env.sched.kept.delete(env.tenant_id, other.snapshot_id)
    assert other.snapshot_id in _files(env), "a paused VM's parked QEMU is not discarded for it"
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    assert other.snapshot_id not in env.manager.snapshot_requests[-1][1].protected  # retention's now


async def test_a_snapshot_over_the_tenants_limit_is_402_and_takes_nothing(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.store.set_tenant_limits(env.tenant_id, max_snapshot_bytes=1024)
    with pytest.raises(QuotaExceeded):
        await env.sched.kept.keep(env.tenant_id, vm_id, "big")
    assert env.manager.snapshot_requests == [] and env.sched.kept.list(env.tenant_id) == []


async def test_the_list_filters_by_vm_and_name_and_pages(env: SchedEnv) -> None:
    a, b = await _running(env), await _running(env)
    made = [await env.sched.kept.keep(env.tenant_id, vm, None) for vm in (a, b, a, a)]
    of_a = env.sched.kept.list(env.tenant_id, vm_id=a)
    assert [k.snapshot_id for k in of_a] == [made[0].snapshot_id, made[2].snapshot_id, made[3].snapshot_id]
    page = env.sched.kept.list(env.tenant_id, vm_id=a, limit=2)
    rest = env.sched.kept.list(env.tenant_id, vm_id=a, after=(page[-1].created_at, page[-1].snapshot_id))
    assert [k.snapshot_id for k in page + rest] == [k.snapshot_id for k in of_a]
    assert [k.snapshot_id for k in env.sched.kept.list(env.tenant_id, name=made[1].snapshot_id)] == [
        made[1].snapshot_id
    ]
    assert env.sched.kept.list(env.tenant_id, name="nope") == []


async def test_removing_the_tenant_removes_its_kept_snapshots(env: SchedEnv) -> None:
    vm_id, running = await _running(env), await _running(env)
    kept = await env.sched.kept.keep(env.tenant_id, vm_id, "k")
    await env.sched.kept.keep(env.tenant_id, running, "r")
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    env.store.mark_tenant_deleting(env.tenant_id)
    assert await env.sched.deleting.purge_deleted_tenants() == [env.tenant_id]
    assert kept_rows.of_vms(env.store, [vm_id, running]) == []
    assert kept.snapshot_id not in _files(env) and _files(env) == set()


async def test_in_a_cluster_a_start_goes_elsewhere_only_through_s3(tmp_path: Path) -> None:
    """The kept snapshot is on the node that took it: a start goes there while it has room;
    with S3 another node restores it (the taking node uploads it first); without S3 no
    other node can read it, so a full node is 503."""
    for s3 in (True, False):
        kw = {"s3_endpoint": "http://127.0.0.1:1", "s3_bucket": "b"} if s3 else {}
        c = await make_cluster(tmp_path / str(s3), ("n1", "n2"), **kw)
        c.nodes["n2"].memory_mib = 0
        await c.beat("n2")
        src, _ = await c.sched.scheduling.schedule(c.tenant_id, AgentSpec())
        kept = await c.sched.kept.keep(c.tenant_id, src.vm_id, "k")
        await c.sched.deleting.delete(c.tenant_id, src.vm_id)
        here = (await c.sched.kept.start(c.tenant_id, "k")).forks[0]
        assert c.store.get_vm(here.vm_id).node_id == "n1"  # type: ignore[union-attr]
        c.nodes["n1"].memory_mib = 256  # full with that child
        c.nodes["n2"].memory_mib = 1 << 20
        await c.beat("n1")
        await c.beat("n2")
        if s3:
            there = (await c.sched.kept.start(c.tenant_id, kept.snapshot_id)).forks[0]
            assert there.state == S.RUNNING and c.store.get_vm(there.vm_id).node_id == "n2"  # type: ignore[union-attr]
            assert ("ensure_uploaded", src.vm_id) in c.nodes["n1"].calls
        else:
            with pytest.raises(Unavailable):
                await c.sched.kept.start(c.tenant_id, kept.snapshot_id)
