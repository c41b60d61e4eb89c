"""The transition function (pal/scheduler/transition.py) is the only writer of a VM's
lifecycle columns: statically (who calls the store's lifecycle writers) and at run time
(every SQL statement that writes them, through every action, comes from it)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from pal.errors import BackendError
from pal.scheduler.states import STAYS, Action, VmState
from pal.spec import AgentSpec, ExecRequest, PauseRequest
from pal.store import LIFECYCLE_COLUMNS
from pal.wire.models import ExecCall, on_vm
from tests.fakes import Crash, SchedEnv, make_env

PAL = Path(__file__).resolve().parents[2] / "pal"
TRANSITION = PAL / "scheduler" / "transition.py"
QUOTAS = PAL / "scheduler" / "quotas.py"
# method -> the only files that may call it
WRITERS = {
    "write_lifecycle": {TRANSITION},
    "insert_vm": {QUOTAS},
    "set_holds_slot": {QUOTAS},
    "reserve_in": {TRANSITION},
    "release_in": {TRANSITION},
    "force_in": {TRANSITION},
}


def _calls(path: Path) -> list[tuple[str, int, list[str]]]:
    """(method name, line, keyword names) of every ``x.method(...)`` call in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            out.append((node.func.attr, node.lineno, [k.arg for k in node.keywords if k.arg]))
    return out


def test_only_the_transition_function_calls_the_lifecycle_writers() -> None:
    found: dict[str, set[Path]] = {name: set() for name in WRITERS}
    bad = []
    for path in sorted(PAL.rglob("*.py")):
        if path.parent.name == "store":
            continue  # the store defines them
        for name, line, kwargs in _calls(path):
            if name in WRITERS:
                found[name].add(path)
                if path not in WRITERS[name]:
                    bad.append(f"{path.relative_to(PAL)}:{line} calls {name}")
            if name == "update_vm" and set(kwargs) & LIFECYCLE_COLUMNS:
                bad.append(f"{path.relative_to(PAL)}:{line} passes lifecycle columns to update_vm")
    assert bad == []
    assert found == WRITERS, "each writer is still used where expected (the check is not vacuous)"


_SET = re.compile(r"^UPDATE vms SET (.*?)(?: WHERE |$)", re.S)
_INSERT = re.compile(r"^INSERT INTO vms \((.*?)\)", re.S)


def _written_columns(sql: str) -> set[str]:
    m = _SET.match(sql)
    if m:
        return {part.split("=")[0].strip() for part in m.group(1).split(",")}
    m = _INSERT.match(sql)
    return {c.strip() for c in m.group(1).split(",")} if m else set()


@pytest.fixture
def watched(tmp_path: Path) -> tuple[SchedEnv, list[str], list[str]]:
    """A scheduler whose every SQL write of lifecycle columns is checked for its caller."""
    env = make_env(tmp_path, max_vms=20)
    writes: list[str] = []
    strays: list[str] = []

    def before(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        cols = _written_columns(sql.strip()) & LIFECYCLE_COLUMNS
        if not cols:
            return
        writes.append(sql)
        frame: Any = sys._getframe()
        while frame is not None and Path(frame.f_code.co_filename) != TRANSITION:
            frame = frame.f_back
        if frame is None:
            strays.append(f"{sorted(cols)} written outside the transition function: {sql}")

    event.listen(env.store.engine, "before_cursor_execute", before)
    return env, writes, strays


async def test_every_action_writes_lifecycle_columns_only_through_the_transition_function(
    watched: tuple[SchedEnv, list[str], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, writes, strays = watched
    s, t = env.sched, env.tenant_id
    seen: set[Action] = set()
    real = s.transitions.transition

    async def record(vm_id: str, action: Action, **kw: Any) -> Any:
        seen.add(action)
        return await real(vm_id, action, **kw)

    monkeypatch.setattr(s.transitions, "transition", record)
    a = (await s.scheduling.schedule(t, AgentSpec(idle_timeout_secs=1)))[0].vm_id
    await s.pauses.pause(t, a)
    await s.pauses.resume(t, a)
    await s.pauses.idle_pause(a, still_idle=lambda _vm: True)
    [_ async for _ in s.guest.exec_stream(t, on_vm(ExecCall, a, ExecRequest(command="true")))]  # wakes it
    res = await s.forking.fork(t, a, 2)
    env.manager.fail("snapshot", BackendError("disk full"))
    with pytest.raises(BackendError, match="still running"):
        await s.pauses.pause(t, a)  # rolled back
    env.manager.fail("snapshot", BackendError("qemu died"), kill=True)
    with pytest.raises(BackendError):
        await s.pauses.pause(t, a)  # lost
    env.manager.fail("spawn", BackendError("no memory"))
    with pytest.raises(BackendError):
        await s.scheduling.schedule(t, AgentSpec())
    b = (await s.scheduling.schedule(t, AgentSpec()))[0].vm_id
    await s.pauses.pause(t, b)
    env.manager.fail("spawn", BackendError("restore failed"))
    with pytest.raises(BackendError):
        await s.pauses.resume(t, b)
    env.manager.fail("stop", Crash("stop"))
    with pytest.raises(Crash):
        await s.deleting.delete(t, res.forks[0].vm_id)
    # live pause: operator, offload, resume; wait pause and its wake; the idle tiers
    c = (
        await s.scheduling.schedule(t, AgentSpec(idle_timeout_secs=60, idle_live_pause_secs=5, wait_pause={}))
    )[0].vm_id
    await s.pauses.pause(t, c, PauseRequest(mode="live"))
    await s.pauses.pause(t, c, PauseRequest(mode="live", offload=True))
    await s.pauses.resume(t, c)
    await s.live.wait_pause(c)
    await s.live.wake(c, "data", "data (first-byte)")
    await s.pauses.idle_live_pause(c, still_idle=lambda _vm: True)
    await s.pauses.idle_pause(c, still_idle=lambda _vm: True)  # the live tier becomes a snapshot
    [_ async for _ in s.guest.exec_stream(t, on_vm(ExecCall, c, ExecRequest(command="true")))]
    await s.pauses.pause(t, c, PauseRequest(mode="live"))
    await s.pauses.pause(t, c)  # a snapshot pause of a live-paused VM
    d = (await s.scheduling.schedule(t, AgentSpec()))[0].vm_id
    await s.pauses.pause(t, d)
    await s.pauses.resume(t, d)  # it has a snapshot to come back to
    env.manager.kill(res.forks[1].vm_id)
    env.manager.kill(d)
    # finishes the delete, loses the dead fork, recovers d from its snapshot
    await s.reconciler.reconcile_all()
    await s.deleting.delete(t, d)
    await s.deleting.delete(t, b)
    await s.deleting.delete(t, a)
    await s.deleting.delete(t, c)
    assert {v.state for v in env.store.list_vms()} == {VmState.FAILED, VmState.TERMINATED}
    assert seen >= set(Action) - set(STAYS) - {Action.SCHEDULE, Action.FORK}
    assert writes, "the scenario wrote lifecycle columns"
    assert strays == []
