"""Lifetimes in the scheduler (real store, fake node): the leader's sweep ends what is past
its deadline as onLifetimeEnd says, busy or not; PUT lifetime moves the deadline; forks
inherit metadata and lifetime. And the CLI's --meta, ls --meta and extend."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pal.cli.main import app
from pal.errors import Conflict
from pal.spec import AgentSpec, LifetimeUpdate
from pal.store import utcnow
from tests.apienv import make_api, serve
from tests.fakes import SchedEnv, make_env


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _vm(env: SchedEnv, **spec: object) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate(spec)))[0].vm_id


def _overdue(env: SchedEnv, vm_id: str) -> None:
    env.store.update_vm(vm_id, lifetime_ends_at=utcnow() - timedelta(seconds=1))


def _ended(env: SchedEnv, vm_id: str) -> list[dict[str, object]]:
    return [e.details or {} for e in env.store.list_events(vm_id) if e.kind == "lifetime_ended"]


async def test_a_busy_vm_is_deleted_at_its_lifetime_and_not_before(env: SchedEnv) -> None:
    vm_id = await _vm(env, lifetimeSecs=3600)
    env.sched.locks.enter(vm_id)  # an exec in flight: the idle sweeper would leave it alone
    assert await env.sched.lifetimes.sweep() == []
    _overdue(env, vm_id)
    assert await env.sched.lifetimes.sweep() == [vm_id]
    assert env.store.get_vm(vm_id).state == "terminated"  # type: ignore[union-attr]
    assert [(d["onLifetimeEnd"], d["action"]) for d in _ended(env, vm_id)] == [("delete", "deleted")]
    assert await env.sched.lifetimes.sweep() == []  # once


@pytest.mark.parametrize(("on_end", "state"), [("delete", "terminated"), ("pause", "paused")])
async def test_whoever_sees_the_end_sees_its_event(env: SchedEnv, on_end: str, state: str) -> None:
    """The lifetime_ended event is written with the VM's last transition: a client that
    polls until the VM is terminated (or paused) then lists its events finds it (the SDK
    contract's lifetime scenario once read an empty list there)."""
    vm_id = await _vm(env, lifetimeSecs=60, onLifetimeEnd=on_end)
    _overdue(env, vm_id)
    seen: list[tuple[str, int]] = []
    write = env.store.write

    def watched() -> object:
        # each commit that leaves the VM in its end state: how many end events it shows then
        class Tx:
            def __enter__(self) -> object:
                self.cm = write()
                return self.cm.__enter__()

            def __exit__(self, *exc: object) -> object:
                out = self.cm.__exit__(*exc)
                vm = env.store.get_vm(vm_id)
                if vm is not None and vm.state == state:
                    seen.append((vm.state, len(_ended(env, vm_id))))
                return out

        return Tx()

    env.store.write = watched  # type: ignore[method-assign]
    try:
        assert await env.sched.lifetimes.sweep() == [vm_id]
    finally:
        env.store.write = write  # type: ignore[method-assign]
    assert seen and seen[0] == (state, 1), seen


async def test_pause_pauses_a_running_vm_and_leaves_a_paused_one(env: SchedEnv) -> None:
    vm_id = await _vm(env, lifetimeSecs=60, onLifetimeEnd="pause")
    _overdue(env, vm_id)
    assert await env.sched.lifetimes.sweep() == [vm_id]
    vm = env.store.get_vm(vm_id)
    assert vm is not None and (vm.state, vm.paused_by, vm.lifetime_ends_at) == ("paused", "operator", None)
    assert [d["action"] for d in _ended(env, vm_id)] == ["paused"]
    # paused already: a new lifetime's end leaves it paused
    await env.sched.lifetimes.set_lifetime(env.tenant_id, vm_id, LifetimeUpdate(extend_secs=5))
    _overdue(env, vm_id)
    assert await env.sched.lifetimes.sweep() == [vm_id]
    assert env.store.get_vm(vm_id).state == "paused"  # type: ignore[union-attr]
    assert [d["action"] for d in _ended(env, vm_id)] == ["paused", "none"]


async def test_a_paused_vm_whose_lifetime_ends_with_delete_is_deleted(env: SchedEnv) -> None:
    vm_id = await _vm(env, lifetimeSecs=60)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    _overdue(env, vm_id)
    assert await env.sched.lifetimes.sweep() == [vm_id]
    assert env.store.get_vm(vm_id).state == "terminated"  # type: ignore[union-attr]


async def test_set_and_extend_and_remove(env: SchedEnv) -> None:
    vm_id = await _vm(env, lifetimeSecs=100)
    set_ = env.sched.lifetimes.set_lifetime
    vm = await set_(env.tenant_id, vm_id, LifetimeUpdate(extend_secs=50, on_lifetime_end="pause"))
    assert (vm.lifetime_ends_at - vm.created_at, vm.on_lifetime_end) == (timedelta(seconds=150), "pause")  # type: ignore[operator]
    vm = await set_(env.tenant_id, vm_id, LifetimeUpdate(lifetime_secs=0))
    assert vm.lifetime_ends_at is None
    vm = await set_(env.tenant_id, vm_id, LifetimeUpdate(extend_secs=10))  # none yet: from now
    assert vm.lifetime_ends_at is not None and vm.lifetime_ends_at > utcnow()
    changed = [e.details for e in env.store.list_events(vm_id) if e.kind == "lifetime_changed"]
    assert [d["lifetimeSecs"] is None for d in changed] == [False, True, False]  # type: ignore[index]
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    with pytest.raises(Conflict):
        await set_(env.tenant_id, vm_id, LifetimeUpdate(extend_secs=10))


async def test_fork_children_inherit_metadata_and_lifetime(env: SchedEnv) -> None:
    src = await _vm(env, metadata={"run": "7"}, lifetimeSecs=600, onLifetimeEnd="pause")
    child_id = (await env.sched.forking.fork(env.tenant_id, src, 1)).forks[0].vm_id
    child = env.store.get_vm(child_id)
    assert child is not None and child.metadata == {"run": "7"} and child.parent_vm_id == src
    assert child.on_lifetime_end == "pause"
    assert child.lifetime_ends_at - child.created_at == timedelta(seconds=600)  # type: ignore[operator]


def test_cli_meta_ls_and_extend(tmp_path: Path) -> None:
    env = make_api(tmp_path, max_vms=5)
    runner = CliRunner()
    with serve(env.app) as url:
        envs = {"PAL_URL": url, "PAL_API_KEY": env.key_a}

        def ok(*args: str) -> object:
            res = runner.invoke(app, list(args), env=envs)
            assert res.exit_code == 0, res.output
            return json.loads(res.stdout)

        a = ok("vm", "schedule", "--meta", "run=1", "--meta", "team=x", "--lifetime", "600")
        b = ok("vm", "schedule", "--meta", "run=1")
        assert a["metadata"] == {"run": "1", "team": "x"} and a["lifetimeSecs"] == 600  # type: ignore[index]
        ids = [v["vmId"] for v in ok("vm", "ls", "--meta", "run=1")]  # type: ignore[attr-defined]
        assert ids == [a["vmId"], b["vmId"]]  # type: ignore[index]
        assert [v["vmId"] for v in ok("vm", "ls", "--meta", "run=1", "--meta", "team=x")] == [a["vmId"]]  # type: ignore[attr-defined,index]
        assert ok("vm", "extend", a["vmId"], "60")["lifetimeSecs"] == 660  # type: ignore[index]
        bad = runner.invoke(app, ["vm", "schedule", "--meta", "bad key=1"], env=envs)
        assert bad.exit_code == 1 and "metadata key 'bad key'" in bad.stderr
