"""Live pause in the scheduler, on the fake node: the operator's live pause and resume,
wait management driven by the node's notices, the idle tiers, quota, reconciliation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pal.errors import BackendError, Conflict, QuotaExceeded
from pal.scheduler.states import Marker, VmState
from pal.spec import AgentSpec, ExecRequest, PauseRequest, WaitPause
from pal.wire import verbs
from pal.wire.models import ExecCall, FileWrite, LiveState, PortOpen, on_vm
from tests.fakes import SchedEnv, make_env

S, M = VmState, Marker
LIVE = PauseRequest(mode="live")
WAITING = AgentSpec.model_validate({"waitPause": {"afterMs": 200, "offloadAfterMs": 1000}})


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _vm(env: SchedEnv, spec: AgentSpec | None = None) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, spec or AgentSpec()))[0].vm_id


def _row(env: SchedEnv, vm_id: str):  # type: ignore[no-untyped-def]
    vm = env.store.get_vm(vm_id)
    assert vm is not None
    return vm


async def _exec(env: SchedEnv, vm_id: str) -> list[str]:
    return [
        ev.type
        async for ev in env.sched.guest.exec_stream(
            env.tenant_id, on_vm(ExecCall, vm_id, ExecRequest(command="true"))
        )
    ]


def _kinds(env: SchedEnv, vm_id: str) -> list[str]:
    return [e.kind for e in env.store.list_events(vm_id)]


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_operator_live_pause_keeps_the_qemu_and_the_slot_and_resume_continues_it(env: SchedEnv) -> None:
    vm_id = await _vm(env)
    before = _row(env, vm_id)
    paused = (await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)).vm
    assert (paused.state, paused.marker, paused.paused_by) == (S.PAUSED, M.LIVE, "operator")
    assert paused.holds_slot and paused.snapshot_id is None and paused.paused_at is not None
    assert env.manager.alive[vm_id].live is not None  # the same "QEMU", stopped
    assert env.manager.live_requests[-1][1].by == "operator"
    view = await env.sched.live.view(paused)
    assert view is not None and view["kind"] == "live" and view["by"] == "operator"
    assert view["offloaded"] is False
    # never woken by a request: 409 that says so
    with pytest.raises(Conflict, match="resume it first"):
        await _exec(env, vm_id)
    running = await env.sched.pauses.resume(env.tenant_id, vm_id)
    assert running.state == S.RUNNING and running.marker == M.NONE and running.paused_by is None
    assert running.incarnation == before.incarnation and running.token == before.token
    assert env.manager.calls.count(("spawn", vm_id)) == 1  # no restore
    assert running.live_stats["livePauses"] == 1 and running.live_stats["livePausedMs"] == 1500
    assert running.live_stats["bytesWhilePaused"] == 2048
    assert await _exec(env, vm_id) == ["exit"]


async def test_live_pause_with_offload_and_an_offload_of_a_paused_vm(env: SchedEnv) -> None:
    vm_id = await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    again = (await env.sched.pauses.pause(env.tenant_id, vm_id, PauseRequest(mode="live", offload=True))).vm
    assert again.state == S.PAUSED and again.marker == M.LIVE
    view = await env.sched.live.view(again)
    assert view is not None and view["offloaded"] is True and view["residentMiB"] == 3
    # a snapshot pause of a live-paused VM frees the slot; resume then restores it
    snap = (await env.sched.pauses.pause(env.tenant_id, vm_id)).vm
    assert snap.state == S.PAUSED and snap.marker == M.NONE and not snap.holds_slot and snap.snapshot_id
    assert (await env.sched.live.view(snap)) == {
        "kind": "snapshot",
        "by": "operator",
        "since": snap.paused_at.isoformat(),
    }  # type: ignore[union-attr]
    assert (await env.sched.pauses.resume(env.tenant_id, vm_id)).incarnation == 2


async def test_each_offload_is_counted_once_whoever_reports_it_and_however_often(env: SchedEnv) -> None:
    """The node reports an offload in the pause's answer and in an ``offloaded`` notice
    (which may come after the answer, or again after a restart); reconciliation sees it in
    the heartbeat. One event and one count per offload."""
    vm_id = await _vm(env)

    async def every_report_again() -> None:
        for n in list(env.manager.notice_log):
            await env.sched.live.handle(n)
        await env.sched.reconciler.reconcile_all()

    await env.sched.pauses.pause(env.tenant_id, vm_id, PauseRequest(mode="live", offload=True))
    assert _row(env, vm_id).live_stats["offloads"] == 1
    await every_report_again()
    await every_report_again()
    stats = _row(env, vm_id).live_stats
    assert (stats["offloads"], stats["freedMib"]) == (1, 250)
    assert _kinds(env, vm_id).count("live_offload") == 1
    # the next pause's offload counts, the first one's reports still do not; a pause taken
    # over and offloaded by the operator is answered and noticed too
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    await env.sched.pauses.pause(env.tenant_id, vm_id, PauseRequest(mode="live", offload=True))
    await every_report_again()
    stats = _row(env, vm_id).live_stats
    assert (stats["offloads"], stats["freedMib"], stats["livePauses"]) == (2, 500, 2)
    assert _kinds(env, vm_id).count("live_offload") == 2
    # an offload no notice told of (it died with a restart) is counted by reconciliation
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    env.manager.offload(vm_id)
    env.manager.notice_log.pop()
    await every_report_again()
    assert _row(env, vm_id).live_stats["offloads"] == 3


async def test_an_offload_notice_during_a_resume_waits_for_it_and_loses_nothing(env: SchedEnv) -> None:
    """The notice of an offload (offloadAfterMs) is acted on while a resume of the same VM
    is under way: both update the VM's counters, one after the other."""
    vm_id = await _vm(env, WAITING)
    assert await env.sched.live.wait_pause(vm_id) is not None
    env.manager.offload(vm_id, freed_mib=200)
    notice = env.manager.notice_log[-1]
    real = env.manager.live_resume
    handled: list[asyncio.Task[None]] = []

    async def racy(vid: str):  # type: ignore[no-untyped-def]
        handled.append(asyncio.create_task(env.sched.live.handle(notice)))
        for _ in range(10):  # let it run as far as it can while the resume is under way
            await asyncio.sleep(0)
        return await real(vid)

    env.manager.live_resume = racy  # type: ignore[method-assign]
    await env.sched.live.wake(vm_id, "data", "data (first-byte)")
    await handled[0]
    stats = _row(env, vm_id).live_stats
    assert (stats["offloads"], stats["freedMib"], stats["livePausedMs"]) == (1, 200, 1500)
    assert _kinds(env, vm_id).count("wait_offload") == 1


async def test_a_live_paused_vm_holds_its_slot_a_snapshot_paused_one_does_not(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_vms=1)
    a = await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, a, LIVE)
    with pytest.raises(QuotaExceeded):
        await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, a)  # -> snapshot
    b = await _vm(env)
    assert _row(env, b).holds_slot and not _row(env, a).holds_slot


async def test_live_pause_of_a_paused_or_failed_vm_is_409_and_changes_nothing(env: SchedEnv) -> None:
    vm_id = await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    with pytest.raises(Conflict, match="cannot live pause"):
        await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    assert _row(env, vm_id).marker == M.NONE and not env.manager.live_requests


async def test_wait_pause_and_wake_follow_the_nodes_notices(env: SchedEnv) -> None:
    vm_id = await _vm(env, WAITING)
    assert _row(env, vm_id).wait_pause == WaitPause.model_validate(
        {"afterMs": 200, "offloadAfterMs": 1000}
    ).model_dump(by_alias=True)
    assert env.manager.spawn_requests[-1].wait_pause is not None
    env.sched.live.start()
    try:
        env.manager.post(vm_id, "wait-ready")
        await _until(lambda: _row(env, vm_id).state == S.PAUSED)
        vm = _row(env, vm_id)
        assert (vm.marker, vm.paused_by) == (M.LIVE_WAIT, "wait") and vm.holds_slot
        req = env.manager.live_requests[-1][1]
        assert req.by == "wait" and req.if_waiting and req.offload_after_ms == 1000 and not req.offload
        env.manager.offload(vm_id, freed_mib=200)  # offloadAfterMs later, on the node
        await _until(lambda: "wait_offload" in _kinds(env, vm_id))
        env.manager.post(vm_id, "wake", reason="data (first-byte)")
        # The row's state, then its event (two writes): a loaded machine may read between.
        await _until(lambda: _row(env, vm_id).state == S.RUNNING and "wait_resume" in _kinds(env, vm_id))
    finally:
        await env.sched.live.close()
    kinds = _kinds(env, vm_id)
    assert kinds.index("wait_pause") < kinds.index("wait_offload") < kinds.index("wait_resume")
    resume = next(e for e in env.store.list_events(vm_id) if e.kind == "wait_resume")
    assert resume.details is not None and resume.details["pausedMs"] == 1500
    assert resume.details["trigger"] == "data" and resume.details["bufferedBytes"] == 2048
    stats = _row(env, vm_id).live_stats
    assert stats["waitPauses"] == 1 and stats["offloads"] == 1 and stats["freedMib"] == 200


async def test_wait_ready_is_ignored_without_wait_management_or_when_nothing_waits(env: SchedEnv) -> None:
    plain = await _vm(env)
    assert await env.sched.live.wait_pause(plain) is None
    waiting = await _vm(env, WAITING)
    env.manager.nothing_waiting.add(waiting)
    assert await env.sched.live.wait_pause(waiting) is None
    assert _row(env, waiting).state == S.RUNNING and _row(env, plain).state == S.RUNNING
    assert [r.by for _, r in env.manager.live_requests] == ["wait"]  # asked once, found nothing


async def test_an_operator_live_pause_is_never_woken_by_data_or_timers(env: SchedEnv) -> None:
    vm_id = await _vm(env, WAITING)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    assert await env.sched.live.wake(vm_id, "data", "data (first-byte)") is None
    assert _row(env, vm_id).state == S.PAUSED


async def test_exec_and_files_wake_a_wait_paused_vm_transparently(env: SchedEnv) -> None:
    vm_id = await _vm(env, WAITING)
    await env.sched.live.wait_pause(vm_id)
    assert await _exec(env, vm_id) == ["exit"]
    assert _row(env, vm_id).state == S.RUNNING
    assert "auto_resume" in _kinds(env, vm_id)
    await env.sched.live.wait_pause(vm_id)
    await env.sched.guest.call(
        env.tenant_id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path="a.txt", data=b"x")
    )
    assert _row(env, vm_id).state == S.RUNNING


async def test_an_exec_that_meets_a_pause_under_way_wakes_the_vm_and_runs(env: SchedEnv) -> None:
    """The exec checked the state before a wait pause took the VM; the node answers 409
    LIVE_PAUSED; the scheduler wakes it and the exec runs (never fails for the pause)."""
    vm_id = await _vm(env, WAITING)
    real = env.manager.exec_stream
    paused_once = False

    async def racy(vid: str, req: ExecRequest):  # type: ignore[no-untyped-def]
        nonlocal paused_once
        if not paused_once:
            paused_once = True
            await env.sched.live.wait_pause(vid)  # lands between the check and the node
        async for ev in real(vid, req):
            yield ev

    env.manager.exec_stream = racy  # type: ignore[method-assign]
    assert await _exec(env, vm_id) == ["exit"]
    assert _row(env, vm_id).state == S.RUNNING and paused_once


async def test_a_port_request_that_meets_a_pause_under_way_wakes_the_vm_and_opens(env: SchedEnv) -> None:
    """Like an exec: the node answers 409 LIVE_PAUSED to a port request that a wait pause
    overtook; the scheduler wakes the VM and opens the stream. An operator's pause: 409."""
    vm_id = await _vm(env, WAITING)
    calls: list[str] = []

    class Stream:
        closed = False

        def on_close(self, fn: object) -> None:
            pass

        async def aclose(self) -> None:
            self.closed = True

    async def open_port(vid: str, port: int) -> Stream:
        calls.append(_row(env, vid).state)
        if len(calls) == 1:
            await env.sched.live.wait_pause(vid)  # lands between the check and the node
            raise Conflict(f"VM {vid} is live-paused (by wait): resume it first", code="LIVE_PAUSED")
        return Stream()

    env.manager.open_port = open_port  # type: ignore[attr-defined]
    assert isinstance(
        await env.sched.guest.open_port(env.tenant_id, PortOpen(vm_id=vm_id, port=8000)), Stream
    )
    assert calls == [S.RUNNING, S.RUNNING] and "auto_resume" in _kinds(env, vm_id)
    async with env.sched.guest.port_stream(env.tenant_id, PortOpen(vm_id=vm_id, port=8000)) as stream:
        assert isinstance(stream, Stream)
    assert stream.closed
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    with pytest.raises(Conflict, match="resume it first"):
        await env.sched.guest.open_port(env.tenant_id, PortOpen(vm_id=vm_id, port=8000))
    assert len(calls) == 3 and _row(env, vm_id).state == S.PAUSED


async def test_idle_tiers_live_then_snapshot_and_a_request_wakes_each(env: SchedEnv) -> None:
    vm_id = await _vm(env, AgentSpec(idle_timeout_secs=60, idle_live_pause_secs=5))
    sweeper = env.sched.sweeper
    env.clock.advance(4)
    assert await sweeper.sweep() == []
    env.clock.advance(2)
    assert await sweeper.sweep() == [vm_id]
    vm = _row(env, vm_id)
    assert (vm.state, vm.marker, vm.paused_by) == (S.PAUSED, M.LIVE_IDLE, "idle") and vm.holds_slot
    assert env.manager.live_requests[-1][1].offload  # the live tier offloads at once
    assert await _exec(env, vm_id) == ["exit"]  # a transparent live wake, same incarnation
    vm = _row(env, vm_id)
    assert vm.state == S.RUNNING and vm.incarnation == 1
    env.clock.advance(6)
    assert await sweeper.sweep() == [vm_id]  # live tier again
    env.clock.advance(60)
    assert await sweeper.sweep() == [vm_id]  # then the snapshot tier
    vm = _row(env, vm_id)
    assert (vm.state, vm.marker, vm.paused_by) == (S.PAUSED, M.NONE, "idle") and not vm.holds_slot
    assert vm.live_stats["livePauses"] == 2 and vm.live_stats["livePausedMs"] > 0
    assert await _exec(env, vm_id) == ["exit"]  # a snapshot wake: a new incarnation
    assert _row(env, vm_id).incarnation == 2


async def test_reconcile_takes_the_nodes_word_on_live_pauses(env: SchedEnv) -> None:
    a, b, c = await _vm(env, WAITING), await _vm(env), await _vm(env)
    # a: the node wait-paused it but the control plane died before recording it
    env.manager.alive[a].live = LiveState(by="wait", since=1.8e9)
    # b: recorded live-paused, but the node resumed it before the crash
    await env.sched.pauses.pause(env.tenant_id, b, LIVE)
    env.manager.alive[b].live = None
    # c: recorded live-paused, its QEMU is gone
    await env.sched.pauses.pause(env.tenant_id, c, LIVE)
    env.manager.kill(c)
    await env.sched.reconciler.reconcile_all()
    assert (_row(env, a).state, _row(env, a).marker, _row(env, a).paused_by) == (
        S.PAUSED,
        M.LIVE_WAIT,
        "wait",
    )
    assert _row(env, b).state == S.RUNNING and _row(env, b).paused_by is None
    assert _row(env, c).state == S.FAILED and not _row(env, c).holds_slot
    assert _row(env, a).holds_slot and _row(env, b).holds_slot
    # the light pass settles disagreements too
    env.manager.alive[b].live = LiveState(by="operator", since=1.8e9)
    await env.sched.reconciler.reconcile_light()
    assert (_row(env, b).state, _row(env, b).marker) == (S.PAUSED, M.LIVE)
    env.manager.kill(b)
    await env.sched.reconciler.reconcile_light()
    assert _row(env, b).state == S.FAILED


async def test_shutdown_snapshots_live_paused_vms_and_keeps_who_paused_them(env: SchedEnv) -> None:
    op, waiting = await _vm(env), await _vm(env, WAITING)
    await env.sched.pauses.pause(env.tenant_id, op, LIVE)
    await env.sched.live.wait_pause(waiting)
    await env.sched.draining.shutdown_vms()
    assert not env.manager.alive
    assert (_row(env, op).state, _row(env, op).marker, _row(env, op).paused_by) == (
        S.PAUSED,
        M.NONE,
        "operator",
    )
    assert (_row(env, waiting).marker, _row(env, waiting).paused_by) == (M.NONE, "idle")


async def test_a_failed_snapshot_of_a_live_paused_vm_leaves_it_running(env: SchedEnv) -> None:
    vm_id = await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    env.manager.fail("snapshot", BackendError("disk full"))
    env.manager.alive[vm_id].live = None  # the node continued it (manager/snapshot.py capture_failed)
    with pytest.raises(BackendError, match="still running"):
        await env.sched.pauses.pause(env.tenant_id, vm_id)
    vm = _row(env, vm_id)
    assert vm.state == S.RUNNING and vm.paused_by is None and vm.paused_at is None and vm.holds_slot


async def test_fork_of_a_live_paused_vm_captures_it_in_place_and_offloadable_or_single_children_get_own_ram(
    env: SchedEnv,
) -> None:
    vm_id = await _vm(env, WAITING)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    res = await env.sched.forking.fork(env.tenant_id, vm_id, 2)
    assert all(c.state == S.RUNNING for c in res.forks)
    src, req = env.manager.snapshot_requests[-1]
    assert src == vm_id and req.keep_running
    assert _row(env, vm_id).state == S.PAUSED and _row(env, vm_id).marker == M.LIVE
    modes = {r.restore.mem_mode for r in env.manager.spawn_requests if r.restore is not None}
    assert modes == {"shared"}  # they may be wait-paused and offloaded: RAM of their own
    for child in res.forks:
        await env.sched.deleting.delete(env.tenant_id, child.vm_id)
    plain = await _vm(env)
    await env.sched.forking.fork(env.tenant_id, plain, 2)  # copies that share the snapshot's pages
    assert [r.restore.mem_mode for r in env.manager.spawn_requests[-2:] if r.restore] == ["private"] * 2
    await env.sched.forking.fork(env.tenant_id, plain, 1)  # one copy: nothing to share, RAM of its own
    assert env.manager.spawn_requests[-1].restore is not None
    assert env.manager.spawn_requests[-1].restore.mem_mode == "shared"


async def test_a_live_paused_vm_is_no_stray_and_still_occupies_its_node(env: SchedEnv) -> None:
    """Cluster bookkeeping: a live-paused VM's QEMU belongs on its node (never stopped as a
    stray), counts in the node's load, and fails with it when the node is lost."""
    vm_id = await _vm(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id, LIVE)
    vm = _row(env, vm_id)
    hb = await env.manager.heartbeat()
    assert env.sched.reconciler.stray_vms(vm.node_id or "", hb) == []
    assert [v.vm_id for v in env.sched.deps.occupying(vm.node_id)] == [vm_id]
    await env.sched.pauses.pause(env.tenant_id, vm_id)  # a snapshot: off the node
    assert env.sched.deps.occupying() == []


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, None),
        ("off", None),
        ("  OFF ", None),
        ("on", WaitPause()),
        (
            '{"afterMs": 800, "deliver": "complete", "offloadAfterMs": null}',
            WaitPause(after_ms=800, deliver="complete", offload_after_ms=None),
        ),
    ],
)
async def test_pal_wait_pause_is_the_default_of_specs_without_one_and_false_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: str | None, want: WaitPause | None
) -> None:
    from pal.config import Settings

    if raw is None:
        monkeypatch.delenv("PAL_WAIT_PAUSE", raising=False)
    else:
        monkeypatch.setenv("PAL_WAIT_PAUSE", raw)
    default = Settings.from_env(tmp_path).wait_pause_default
    assert default == want
    env = make_env(tmp_path, max_vms=5, wait_pause_default=default)
    inherits = await _vm(env)
    as_dict = None if want is None else want.model_dump(by_alias=True)
    assert _row(env, inherits).wait_pause == as_dict
    assert env.manager.spawn_requests[-1].wait_pause == want  # what the node watches for
    own = await _vm(env, AgentSpec.model_validate({"waitPause": {"afterMs": 300}}))
    assert _row(env, own).wait_pause == WaitPause(after_ms=300).model_dump(by_alias=True)
    off = await _vm(env, AgentSpec.model_validate({"waitPause": False}))
    assert _row(env, off).wait_pause is None and env.manager.spawn_requests[-1].wait_pause is None
    # the default decides whether a wait-ready notice pauses a VM that did not say
    paused = await env.sched.live.wait_pause(inherits)
    assert (paused is not None) == (want is not None)
    assert await env.sched.live.wait_pause(off) is None


@pytest.mark.parametrize("raw", ["maybe", '{"afterMs": 1}', '{"deliver": "later"}', '{"afterMs": 500', "[]"])
def test_a_bad_pal_wait_pause_is_refused_at_start_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    from pal.config import Settings

    monkeypatch.setenv("PAL_WAIT_PAUSE", raw)
    with pytest.raises(ValueError, match="PAL_WAIT_PAUSE"):
        Settings.from_env(tmp_path)


async def test_a_wait_that_never_ends_takes_the_snapshot_tier_after_the_idle_timeout(env: SchedEnv) -> None:
    """A wait-paused VM whose upstream never answers would keep its QEMU and its slot for
    ever: with idleTimeoutSecs the sweeper snapshot-pauses it after that long with nothing
    the host saw, unless its answer is arriving or an exec is still in flight."""
    spec = AgentSpec.model_validate({"waitPause": {"afterMs": 200}, "idleTimeoutSecs": 60})
    vm_id, busy = await _vm(env, spec), await _vm(env, spec)
    never = await _vm(env, WAITING)  # no idleTimeoutSecs: never swept
    for v in (vm_id, busy, never):
        assert await env.sched.live.wait_pause(v) is not None
    env.manager.alive[busy].has_active_exec = True  # its waiting client is an exec
    sweeper = env.sched.sweeper
    env.clock.advance(59)
    assert await sweeper.sweep() == []
    env.clock.advance(2)
    env.manager.alive[vm_id].live.buffered_bytes = 512  # type: ignore[union-attr]  # the answer is coming
    assert await sweeper.sweep() == []
    assert _row(env, vm_id).marker == M.LIVE_WAIT
    env.manager.alive[vm_id].live.buffered_bytes = 0  # type: ignore[union-attr]
    assert await sweeper.sweep() == [vm_id]
    vm = _row(env, vm_id)
    assert (vm.state, vm.marker, vm.paused_by) == (S.PAUSED, M.NONE, "idle")
    assert not vm.holds_slot and vm.snapshot_id and vm_id not in env.manager.alive
    assert vm.live_stats["livePausedMs"] > 0
    for v in (busy, never):
        assert (_row(env, v).state, _row(env, v).marker) == (S.PAUSED, M.LIVE_WAIT)
    # the next request wakes it from its snapshot, like any idle-suspended VM
    assert await _exec(env, vm_id) == ["exit"]
    assert _row(env, vm_id).state == S.RUNNING and _row(env, vm_id).incarnation == 2
