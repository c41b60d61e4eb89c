"""One resolved VM per request (issue 38): a guest request reads its VM's record once and
writes it at most once, whatever it does on the node (a wake adds one read under the VM's
lock and the resume's own transitions); a WebSocket session's input frames go straight to
the node (no store access per frame); a pause makes one node call and answers with what
the snapshot wrote."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pal.spec import AgentSpec, ExecRequest
from pal.wire import verbs
from pal.wire.models import ExecCall, FileRef, on_vm
from pal.wire.processes import StdinWrite
from tests.fakes import SchedEnv, make_env

WAITING = AgentSpec.model_validate({"waitPause": {"afterMs": 200, "offloadAfterMs": 1000}})


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path)


def _count_store(env: SchedEnv, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every read and write of a VM's record from now on, by kind (``transition``: a
    lifecycle change through the transition function, transition.py)."""
    seen: Counter[str] = Counter()
    for target, name, kind in (
        (env.store, "get_vm", "read"),
        (env.store, "list_vms", "read"),
        (env.store, "update_vm", "write"),
        (env.sched.transitions, "transition", "transition"),
    ):
        real = getattr(target, name)
        if kind == "transition":

            async def counted_async(*a: Any, _real: Any = real, **kw: Any) -> Any:
                seen["transition"] += 1
                return await _real(*a, **kw)

            monkeypatch.setattr(target, name, counted_async)
            continue

        def counted(*a: Any, _real: Any = real, _kind: str = kind, **kw: Any) -> Any:
            seen[_kind] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(target, name, counted)
    return seen


async def _running(env: SchedEnv) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec()))[0].vm_id


async def test_an_exec_reads_its_vm_once_and_writes_it_once(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    seen = _count_store(env, monkeypatch)
    call = on_vm(ExecCall, vm_id, ExecRequest(command="echo", argv=["hi"]))
    events = [ev async for ev in env.sched.guest.exec_stream(env.tenant_id, call)]
    assert [e.type for e in events] == ["stdout", "exit"]
    assert seen == Counter(read=1, write=1), seen
    # its one write is the activity stamp, after it ended
    assert env.store.get_vm(vm_id).last_activity_unix_ms == env.sched.deps.now_ms()  # type: ignore[union-attr]


async def test_an_exec_that_wakes_its_vm_reads_it_once_more_under_the_lock(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wake reads the record again under the VM's operation lock (another request may
    have woken it since the first read) and hands that record to the resume, which reads
    it no more; the resume's transition is the wake's write, the activity stamp the
    request's own."""
    vm_id = (await env.sched.scheduling.schedule(env.tenant_id, WAITING))[0].vm_id
    await env.sched.live.wait_pause(vm_id)  # an automatic live pause: woken on demand
    seen = _count_store(env, monkeypatch)
    before = len(env.manager.calls)
    call = on_vm(ExecCall, vm_id, ExecRequest(command="echo", argv=["hi"]))
    events = [ev async for ev in env.sched.guest.exec_stream(env.tenant_id, call)]
    assert [e.type for e in events] == ["stdout", "exit"]
    assert seen == Counter(read=2, transition=1, write=1), seen
    assert [c[0] for c in env.manager.calls[before:]] == ["live_resume", "exec"]


async def test_a_snapshot_wake_reads_the_record_once_more_under_the_lock(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.idle_pause(vm_id, still_idle=lambda _vm: True)  # idle suspend
    seen = _count_store(env, monkeypatch)
    got = await env.sched.guest.call(env.tenant_id, verbs.LIST_FILES, FileRef(vm_id=vm_id, path="."))
    assert got.path
    # the restore's two transitions (paused -> spawning -> running), then the stamp
    assert seen == Counter(read=2, transition=2, write=1), seen
    assert env.store.get_vm(vm_id).incarnation == 2  # type: ignore[union-attr]


async def test_any_guest_call_reads_once_and_writes_once(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    env.manager.alive[vm_id].files["a.txt"] = b"x"
    seen = _count_store(env, monkeypatch)
    got = await env.sched.guest.call(env.tenant_id, verbs.READ_FILE, FileRef(vm_id=vm_id, path="a.txt"))
    assert got.data == b"x"
    assert seen == Counter(read=1, write=1), seen


async def test_frames_on_a_resolved_vm_touch_no_record(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WebSocket attach resolves its VM once for the session (pal/api/process_attach.py):
    each input frame is then one node call and nothing else."""
    vm_id = await _running(env)
    seen = _count_store(env, monkeypatch)
    async with env.sched.waker.resolve(env.tenant_id, vm_id) as vm:
        assert seen == Counter(read=1)
        before = len(env.manager.calls)
        for _ in range(5):
            with pytest.raises(Exception, match="not found"):  # the fake guest runs no processes
                await vm.call(verbs.WRITE_STDIN, StdinWrite(vm_id=vm_id, pid=1, data=b"ls\n"))
        assert seen == Counter(read=1), "no store access per frame"
        assert [c for c in env.manager.calls[before:]] == [("write_stdin", vm_id)] * 5
    assert seen == Counter(read=1, write=1)


async def test_a_pause_makes_one_node_call_and_books_what_the_snapshot_wrote(env: SchedEnv) -> None:
    vm_id = await _running(env)
    before = len(env.manager.calls)
    paused = await env.sched.pauses.pause(env.tenant_id, vm_id)
    assert [c[0] for c in env.manager.calls[before:]] == ["snapshot"], "no second call for the byte count"
    assert paused.vm.state == "paused" and paused.live is None
    assert env.store.get_vm(vm_id).snapshot_bytes == env.manager.snapshot_size  # type: ignore[union-attr]
