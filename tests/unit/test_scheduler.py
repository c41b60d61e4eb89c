"""Scheduler operations against a FakeManager: states, slots, events and error codes."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest

from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, QuotaExceeded, Unavailable
from pal.images.paths import ImageNotFound
from pal.scheduler.states import Marker, VmState
from pal.spec import AgentSpec, ExecRequest
from pal.wire import verbs
from pal.wire.models import ExecCall, FileRef, FilesAt, FileWrite, ImageInfo, on_vm
from tests.fakes import AGENT_VERSION, SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=3)


async def _running(env: SchedEnv, **spec: object) -> str:
    view, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(**spec))  # type: ignore[arg-type]
    assert view.state == S.RUNNING
    return view.vm_id


def _slots(env: SchedEnv) -> int:
    return env.store.count_slots(env.tenant_id)


def _states(env: SchedEnv, vm_id: str) -> list[str | None]:
    return [e.to_state for e in env.store.list_events(vm_id) if e.kind == "status"]


# -- schedule ----------------------------------------------------------------------------------


async def test_schedule_runs_the_vm_and_records_each_state(env: SchedEnv) -> None:
    spec = AgentSpec(secrets={"K": "v"}, limits={"memory_mib": 512})  # type: ignore[arg-type]
    view, boot_method = await env.sched.scheduling.schedule(env.tenant_id, spec)
    assert view.state == S.RUNNING and boot_method == "cold" and view.limits["memory_mib"] == 512
    vm_id = view.vm_id
    assert _states(env, vm_id) == ["pending", "spawning", "running"]
    req = env.manager.spawn_requests[0]
    assert req.vm_id == vm_id and req.memory_mib == 512 and req.env == {"K": "v"} and req.restore is None
    assert req.incarnation == 1 and len(req.token) >= 40
    assert _slots(env) == 1
    assert env.store.get_vm(vm_id).agent_version_id == AGENT_VERSION  # type: ignore[union-attr]


async def test_schedule_over_quota_is_402_and_leaves_no_row(env: SchedEnv) -> None:
    for _ in range(3):
        await _running(env)
    with pytest.raises(QuotaExceeded):
        await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    assert len(env.store.list_vms()) == 3


async def test_unknown_image_is_refused_before_any_row_or_slot(env: SchedEnv) -> None:
    for _ in range(3):
        await _running(env)  # quota full: the image is checked first all the same
    with pytest.raises(InvalidRequest) as ei:
        await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(image="nope"))
    assert ei.value.code == "IMAGE_NOT_FOUND" and ei.value.status == 400
    assert len(env.store.list_vms()) == 3


async def test_spawn_failure_fails_the_vm_with_the_reason_and_frees_the_slot(env: SchedEnv) -> None:
    env.manager.fail("spawn", Unavailable("no accelerator"))
    with pytest.raises(Unavailable):
        await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    [vm] = env.store.list_vms()
    assert vm.state == S.FAILED and "no accelerator" in (vm.reason or "")
    assert _slots(env) == 0
    env.manager.fail("spawn", RuntimeError("qemu crashed"))
    with pytest.raises(BackendError):  # a non-Pal error is a 500
        await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())


async def test_unknown_or_hidden_image_is_400_before_any_row_or_reservation(env: SchedEnv) -> None:
    other, _ = env.store.create_tenant("other", 0)  # no quota at all: still 400, never 402
    env.manager.image_infos.append(
        ImageInfo(
            name="private", agent_version_id="sha256-" + "e" * 64, kind="import", tenants=[env.tenant_id]
        )
    )
    for tenant, image in ((env.tenant_id, "nope"), (other.id, "nope"), (other.id, "private")):
        with pytest.raises(ImageNotFound) as err:
            await env.sched.scheduling.schedule(tenant, AgentSpec(image=image))
        assert (err.value.status, err.value.code) == (400, "IMAGE_NOT_FOUND")
    assert env.store.list_vms() == [] and env.manager.spawn_requests == []
    assert [i.name for i in await env.sched.reads.list_images(other.id)] == ["default"]
    assert [i.name for i in await env.sched.reads.list_images(env.tenant_id)] == ["default", "private"]
    vm, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(image="private"))
    assert vm.image == "private" and env.manager.spawn_requests[-1].image == "private"


async def test_get_list_and_events_are_tenant_scoped(env: SchedEnv) -> None:
    vm_id = await _running(env)
    other, _ = env.store.create_tenant("other", 3)
    for call in (
        env.sched.reads.get,
        env.sched.deleting.delete,
        env.sched.pauses.pause,
        env.sched.pauses.resume,
        env.sched.listing.latest_events,
    ):
        with pytest.raises(NotFound):
            await call(other.id, vm_id)
    assert await env.sched.reads.list_vms(other.id) == []
    assert [v.vm_id for v in await env.sched.reads.list_vms(env.tenant_id)] == [vm_id]
    with pytest.raises(NotFound):
        await env.sched.reads.get(env.tenant_id, "vm-nope")


# -- pause / resume ----------------------------------------------------------------------------


async def test_pause_snapshots_stops_and_frees_the_slot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    view = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    assert view.state == S.PAUSED and view.snapshot_id and view.paused_by == "operator"
    assert vm_id not in env.manager.alive
    [(_, req)] = env.manager.snapshot_requests
    assert req.keep_running is False and req.snapshot_id == view.snapshot_id
    assert _slots(env) == 0
    events = [e for e in env.store.list_events(vm_id) if e.to_state == "draining"]
    assert events[0].marker == Marker.PAUSING
    with pytest.raises(Conflict):
        await env.sched.pauses.pause(env.tenant_id, vm_id)


async def test_pause_failure_with_vm_alive_returns_to_running_and_keeps_the_slot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("snapshot", BackendError("migrate failed"))
    with pytest.raises(BackendError):
        await env.sched.pauses.pause(env.tenant_id, vm_id)
    vm = env.store.get_vm(vm_id)
    assert vm is not None and vm.state == S.RUNNING and vm.holds_slot and vm.snapshot_id is None
    assert _slots(env) == 1
    assert _states(env, vm_id)[-2:] == ["draining", "running"]


async def test_pause_failure_with_vm_dead_fails_it_and_frees_the_slot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("snapshot", BackendError("qemu died"), kill=True)
    with pytest.raises(BackendError):
        await env.sched.pauses.pause(env.tenant_id, vm_id)
    assert env.store.get_vm(vm_id).state == S.FAILED  # type: ignore[union-attr]
    assert _slots(env) == 0


async def test_resume_restores_with_a_new_incarnation_and_token(env: SchedEnv) -> None:
    vm_id = await _running(env)
    before = env.store.get_vm(vm_id)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    view = await env.sched.pauses.resume(env.tenant_id, vm_id)
    assert view.state == S.RUNNING and view.vm_id == vm_id and view.paused_by is None
    req = env.manager.spawn_requests[-1]
    assert req.restore is not None and req.restore.snapshot_id == paused.snapshot_id
    assert req.restore.mem_mode == "shared" and req.restore.source_vm_id == vm_id
    assert before is not None and req.incarnation == before.incarnation + 1 and req.token != before.token
    assert _slots(env) == 1
    with pytest.raises(Conflict):
        await env.sched.pauses.resume(env.tenant_id, vm_id)


async def test_resume_over_quota_is_402_and_changes_nothing(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    for _ in range(3):
        await _running(env)
    spawns = len(env.manager.spawn_requests)
    with pytest.raises(QuotaExceeded):
        await env.sched.pauses.resume(env.tenant_id, vm_id)
    assert env.store.get_vm(vm_id).state == S.PAUSED  # type: ignore[union-attr]
    assert len(env.manager.spawn_requests) == spawns


async def test_resume_failure_leaves_it_paused_without_a_slot_and_resumable(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    env.manager.fail("spawn", BackendError("restore failed"))
    with pytest.raises(BackendError):
        await env.sched.pauses.resume(env.tenant_id, vm_id)
    vm = env.store.get_vm(vm_id)
    assert vm is not None and vm.state == S.PAUSED and not vm.holds_slot
    assert "restore failed" in (vm.reason or "")
    assert (await env.sched.pauses.resume(env.tenant_id, vm_id)).state == S.RUNNING


# -- fork --------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, -1, 1001, 101])
async def test_fork_count_out_of_range_is_400(env: SchedEnv, count: int) -> None:
    vm_id = await _running(env)
    with pytest.raises(InvalidRequest):
        await env.sched.forking.fork(env.tenant_id, vm_id, count)
    assert len(env.store.list_vms()) == 1 and env.manager.snapshot_requests == []


async def test_fork_of_a_running_vm_keeps_it_running_and_gives_each_child_its_identity(
    env: SchedEnv,
) -> None:
    vm_id = await _running(env)
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 2)
    assert res.source_vm_id == vm_id and [c.state for c in res.forks] == [S.RUNNING, S.RUNNING]
    [(_, snap)] = env.manager.snapshot_requests
    assert snap.keep_running is True and snap.snapshot_id == res.snapshot_id
    assert vm_id in env.manager.alive
    reqs = env.manager.spawn_requests[1:]
    assert {r.restore.mem_mode for r in reqs if r.restore} == {"private"}
    assert len({r.token for r in reqs} | {env.manager.spawn_requests[0].token}) == 3
    assert {r.incarnation for r in reqs} == {1}
    for child in res.forks:
        view = await env.sched.reads.get(env.tenant_id, child.vm_id)
        assert view.parent_vm_id == vm_id
        assert _states(env, child.vm_id) == ["spawning", "running"]
    assert _slots(env) == 3


async def test_fork_of_a_paused_vm_uses_its_pause_snapshot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 1)
    assert res.snapshot_id == paused.snapshot_id and res.forks[0].state == S.RUNNING
    assert len(env.manager.snapshot_requests) == 1  # no new snapshot
    assert env.store.get_vm(vm_id).state == S.PAUSED  # type: ignore[union-attr]


async def test_fork_over_quota_is_402_and_leaves_no_rows_slots_or_snapshots(env: SchedEnv) -> None:
    vm_id = await _running(env)
    with pytest.raises(QuotaExceeded):
        await env.sched.forking.fork(env.tenant_id, vm_id, 3)
    assert [v.vm_id for v in env.store.list_vms()] == [vm_id]
    assert _slots(env) == 1 and env.manager.snapshot_requests == []


async def test_fork_partial_failure_fails_only_that_child(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("spawn", BackendError("child restore failed"))
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 2)
    failed = [c for c in res.forks if c.state == S.FAILED]
    ok = [c for c in res.forks if c.state == S.RUNNING]
    assert len(failed) == 1 and len(ok) == 1 and "child restore failed" in (failed[0].error or "")
    assert env.store.get_vm(failed[0].vm_id).holds_slot is False  # type: ignore[union-attr]
    assert _slots(env) == 2


async def test_fork_snapshot_failure_fails_all_children(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("snapshot", BackendError("disk full"))
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 2)
    assert [c.state for c in res.forks] == [S.FAILED, S.FAILED]
    assert all("disk full" in (c.error or "") for c in res.forks)
    assert _slots(env) == 1 and env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]


async def test_fork_of_a_vm_in_another_state_is_409(env: SchedEnv) -> None:
    env.manager.fail("spawn", BackendError("boom"))
    with pytest.raises(BackendError):
        await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    [vm] = env.store.list_vms()
    with pytest.raises(Conflict):
        await env.sched.forking.fork(env.tenant_id, vm.vm_id, 1)


async def test_fork_spawns_at_most_fork_concurrency_children_at_once(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_vms=20, fork_concurrency=3)
    vm_id = await _running(env)
    env.manager.spawn_delay = 0.01
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 10)
    assert all(c.state == S.RUNNING for c in res.forks)
    assert env.manager.max_concurrent_spawns == 3


# -- delete ------------------------------------------------------------------------------------


async def test_delete_terminates_frees_the_slot_and_is_idempotent(env: SchedEnv) -> None:
    vm_id = await _running(env)
    view = await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert view.state == S.TERMINATED and vm_id not in env.manager.alive
    assert _states(env, vm_id)[-2:] == ["draining", "terminated"]
    assert _slots(env) == 0
    assert (await env.sched.deleting.delete(env.tenant_id, vm_id)).state == S.TERMINATED


async def test_a_server_keeps_no_lock_of_vms_it_is_done_with(env: SchedEnv) -> None:
    """Each VM's operation and transition locks live while in use: a long-lived server
    that ran many VMs does not keep one of each for every VM it ever saw."""
    vms = [await _running(env) for _ in range(3)]
    for vm_id in vms:
        await env.sched.pauses.pause(env.tenant_id, vm_id)
        await env.sched.pauses.resume(env.tenant_id, vm_id)
        await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert not set(vms) & env.sched.locks.locked_ids() and not set(vms) & set(env.sched.transitions._locks)
    held = env.sched.locks.op_lock(vms[0])
    assert env.sched.locks.op_lock(vms[0]) is held, "one lock per VM while anyone holds it"


async def test_delete_of_a_paused_vm_releases_its_snapshot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert [s for (_, _, s) in env.manager.deleted_snapshots] == [paused.snapshot_id]


async def test_delete_keeps_a_snapshot_that_live_forks_map(env: SchedEnv) -> None:
    vm_id = await _running(env)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 1)
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert env.manager.deleted_snapshots == []
    await env.sched.deleting.delete(env.tenant_id, res.forks[0].vm_id)  # last user gone: now released
    assert [s for (_, _, s) in env.manager.deleted_snapshots] == [paused.snapshot_id]


async def test_a_failed_fork_child_keeps_no_snapshot_of_a_deleted_source(env: SchedEnv) -> None:
    """A failed child can only be deleted, never started: the source's snapshot it would
    have mapped goes with the source (an interrupted fork must not pin it for ever)."""
    vm_id = await _running(env)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    env.manager.fail("spawn", BackendError("restore failed"))
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 1)
    assert [f.state for f in res.forks] == [S.FAILED]
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    assert [s for (_, _, s) in env.manager.deleted_snapshots] == [paused.snapshot_id]


async def test_delete_whose_stop_fails_can_be_retried(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("stop", BackendError("kill failed"))
    with pytest.raises(BackendError):
        await env.sched.deleting.delete(env.tenant_id, vm_id)
    vm = env.store.get_vm(vm_id)
    assert vm is not None and vm.state == S.DRAINING and vm.marker == Marker.DELETING
    assert (await env.sched.deleting.delete(env.tenant_id, vm_id)).state == S.TERMINATED


async def test_shutdown_suspends_running_vms_and_stops_what_it_cannot(env: SchedEnv) -> None:
    a = await _running(env)
    b = await _running(env)
    c = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, b)
    env.manager.fail("snapshot", BackendError("disk full"), vm_id=c)
    await env.sched.draining.shutdown_vms()
    va, vb, vc = (env.store.get_vm(v) for v in (a, b, c))
    assert va is not None and va.state == S.PAUSED and va.paused_by == "idle"
    assert va.reason is not None and "shutdown" in va.reason
    assert vb is not None and vb.state == S.PAUSED and vb.paused_by == "operator"
    assert vc is not None and vc.state == S.TERMINATED
    assert env.manager.alive == {}
    assert env.store.count_slots(env.tenant_id) == 0
    # after the restart, the suspended VM wakes on its next request
    assert await _exec(env, a) == ["stdout", "exit"]
    assert (await env.sched.reads.get(env.tenant_id, a)).state == S.RUNNING


# -- exec, files and auto-resume ---------------------------------------------------------------


async def _exec(env: SchedEnv, vm_id: str) -> list[str]:
    req = ExecRequest(command="echo", argv=["hi"])
    return [ev.type async for ev in env.sched.guest.exec_stream(env.tenant_id, on_vm(ExecCall, vm_id, req))]


async def test_exec_on_running_vm_streams_and_stamps_activity(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.clock.advance(100)
    assert await _exec(env, vm_id) == ["stdout", "exit"]
    assert env.store.get_vm(vm_id).last_activity_unix_ms == int(env.clock.now * 1000)  # type: ignore[union-attr]
    assert env.sched.locks.inflight == {}


async def test_exec_on_idle_paused_vm_resumes_it_and_audits(env: SchedEnv) -> None:
    vm_id = await _running(env, idle_timeout_secs=60)
    env.clock.advance(61)
    assert await env.sched.pauses.idle_pause(vm_id, still_idle=lambda v: True) is not None
    assert await _exec(env, vm_id) == ["stdout", "exit"]
    assert env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]
    kinds = [e.kind for e in await env.sched.listing.latest_events(env.tenant_id, vm_id)]
    assert kinds.count("auto_resume") == 1


async def test_file_calls_also_auto_resume(env: SchedEnv) -> None:
    vm_id = await _running(env, idle_timeout_secs=60)
    await env.sched.guest.call(
        env.tenant_id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path="a.txt", data=b"hi")
    )
    await env.sched.pauses.idle_pause(vm_id, still_idle=lambda v: True)
    written = await env.sched.guest.call(
        env.tenant_id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path="b.txt", data=b"yo")
    )
    assert written.bytes_written == 2
    got = await env.sched.guest.call(env.tenant_id, verbs.READ_FILE, FileRef(vm_id=vm_id, path="b.txt"))
    assert (got.data, got.truncated) == (b"yo", False)
    assert (
        await env.sched.guest.call(env.tenant_id, verbs.LIST_FILES, FilesAt(vm_id=vm_id, path="."))
    ).entries[0]["name"] == "b.txt"


async def test_exec_on_operator_paused_vm_is_409(env: SchedEnv) -> None:
    vm_id = await _running(env, idle_timeout_secs=60)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    with pytest.raises(Conflict, match="paused by an operator"):
        await _exec(env, vm_id)
    assert env.store.get_vm(vm_id).state == S.PAUSED  # type: ignore[union-attr]


async def test_exec_on_failed_vm_is_409(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("snapshot", BackendError("x"), kill=True)
    with pytest.raises(BackendError):
        await env.sched.pauses.pause(env.tenant_id, vm_id)
    with pytest.raises(Conflict):
        await _exec(env, vm_id)


async def test_auto_resume_over_quota_is_402(env: SchedEnv) -> None:
    vm_id = await _running(env, idle_timeout_secs=60)
    await env.sched.pauses.idle_pause(vm_id, still_idle=lambda v: True)
    for _ in range(3):
        await _running(env)
    with pytest.raises(QuotaExceeded):
        await _exec(env, vm_id)


async def test_concurrent_execs_on_an_idle_paused_vm_resume_it_once(env: SchedEnv) -> None:
    vm_id = await _running(env, idle_timeout_secs=60)
    await env.sched.pauses.idle_pause(vm_id, still_idle=lambda v: True)
    env.manager.spawn_delay = 0.01
    results = await asyncio.gather(*(_exec(env, vm_id) for _ in range(3)))
    assert results == [["stdout", "exit"]] * 3
    restores = [r for r in env.manager.spawn_requests if r.restore is not None]
    assert len(restores) == 1


async def test_list_hides_vms_terminated_over_an_hour_ago(env: SchedEnv) -> None:
    from datetime import timedelta

    from pal.store import utcnow

    old = await _running(env)
    recent = await _running(env)
    await env.sched.deleting.delete(env.tenant_id, old)
    await env.sched.deleting.delete(env.tenant_id, recent)
    with env.store.write() as tx:
        tx._conn.exec_driver_sql(
            "UPDATE vms SET updated_at = ? WHERE vm_id = ?",
            ((utcnow() - timedelta(hours=2)).replace(tzinfo=None).isoformat(" "), old),
        )
    assert len(await env.sched.reads.list_vms(env.tenant_id)) == 2  # until the leader's retention sweep
    assert await env.sched.retention.sweep() == {"unlisted": 1, "events": 0}
    assert [v.vm_id for v in await env.sched.reads.list_vms(env.tenant_id)] == [recent]
    assert (await env.sched.reads.get(env.tenant_id, old)).state == S.TERMINATED


async def test_an_image_added_after_the_nodes_last_heartbeat_is_schedulable_at_once(env: SchedEnv) -> None:
    await _running(env)  # the node has heartbeated: its record lists `default` only
    env.manager.image_infos.append(ImageInfo(name="fresh", agent_version_id="sha256-" + "f" * 64))
    vm, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(image="fresh"))
    assert vm.state == S.RUNNING and env.manager.spawn_requests[-1].image == "fresh"


async def test_an_embedded_node_whose_record_aged_is_asked_again_not_refused(env: SchedEnv) -> None:
    """A background tick held up on a loaded host leaves the in-process node's record old;
    placement asks the node itself instead of calling it silent (503 NO_NODE)."""
    await _running(env)
    (node,) = env.store.list_nodes()
    old = node.last_seen_at - timedelta(seconds=10 * env.settings.node_heartbeat_interval_s)
    env.store.record_node(dataclasses.replace(node, last_seen_at=old))
    env.sched.nodes.reload()  # the record as the store has it (a takeover reads it so)
    await _running(env)
    (fresh,) = env.store.list_nodes()
    assert fresh.last_seen_at > old
