"""What a fork or a start from a kept snapshot gives each child besides the source's settings
(docs/lifecycle.md, "Kept snapshots" and "fork"): ``metadata`` instead of the source's tags,
``secrets`` (a schedule's, its rules, checked before anything starts) over the source's, as
the children's guests see them (the spawn request's env); E2B's
``Sandbox.create(<snapshot>, envs=...)`` applies its envs so. The real scheduler, store and
API over the fake node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from pal.e2b import ops
from pal.errors import InvalidRequest
from pal.scheduler.states import VmState
from pal.spec import AgentSpec
from tests.apienv import make_api
from tests.fakes import SchedEnv, make_env
from tests.unit.test_kept_snapshot_tags import _e2b

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=8)


async def _source(env: SchedEnv) -> str:
    spec = {"metadata": {"team": "a"}, "secrets": {"KEEP": "src", "OVER": "src"}}
    view, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate(spec))
    assert view.state == S.RUNNING
    return view.vm_id


def _guest_env(env: SchedEnv, vm_id: str) -> dict[str, str]:
    """The environment the VM's guest was given at its (last) spawn or restore."""
    [*_, req] = [r for r in env.manager.spawn_requests if r.vm_id == vm_id]
    return dict(req.env)


def _row_env(env: SchedEnv, vm_id: str) -> dict[str, str]:
    vm = env.store.get_vm(vm_id)
    assert vm is not None
    return env.sched.brokering.env(vm.tenant_id, vm.secrets)


async def test_a_starts_secrets_are_set_over_the_sources(env: SchedEnv) -> None:
    src = await _source(env)
    await env.sched.kept.keep(env.tenant_id, src, "golden")

    res = await env.sched.kept.start(env.tenant_id, "golden", 2, secrets={"OVER": "mine", "NEW": "1"})
    assert [c.state for c in res.forks] == [S.RUNNING, S.RUNNING]
    for child in res.forks:
        want = {"KEEP": "src", "OVER": "mine", "NEW": "1"}
        assert _guest_env(env, child.vm_id) == want, "the source's stay unless overridden"
        assert _row_env(env, child.vm_id) == want, "kept for its next restore"
        vm = env.store.get_vm(child.vm_id)
        assert vm is not None and "mine" not in str(vm.secrets), "sealed in the row, as a schedule's"
    assert _row_env(env, src) == {"KEEP": "src", "OVER": "src"}, "the source keeps its own"

    plain = await env.sched.kept.start(env.tenant_id, "golden")
    assert _guest_env(env, plain.forks[0].vm_id) == {"KEEP": "src", "OVER": "src"}


async def test_a_forks_tags_and_secrets(env: SchedEnv) -> None:
    src = await _source(env)
    res = await env.sched.forking.fork(env.tenant_id, src, 2, {"run": "7"}, {"OVER": "fork"})
    for child in res.forks:
        vm = env.store.get_vm(child.vm_id)
        assert vm is not None and dict(vm.metadata) == {"run": "7"}, "instead of the source's"
        assert _guest_env(env, child.vm_id) == {"KEEP": "src", "OVER": "fork"}
    inherited = await env.sched.forking.fork(env.tenant_id, src, 1)
    vm = env.store.get_vm(inherited.forks[0].vm_id)
    assert vm is not None and dict(vm.metadata) == {"team": "a"}, "no tags given: the source's"
    cleared = await env.sched.forking.fork(env.tenant_id, src, 1, {})
    vm = env.store.get_vm(cleared.forks[0].vm_id)
    assert vm is not None and dict(vm.metadata) == {}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"1A": "x"}, "environment variable name"),
        ({"A": "x\0y"}, "NUL"),
        ({"A": 1}, "string"),
        ({f"K{i}": "v" for i in range(200)}, "at most"),
        ({"A": {"value": "v", "brokered": {"hosts": []}}}, "hosts"),
    ],
    ids=["name", "nul", "not-a-string", "too-many", "brokered"],
)
async def test_bad_secrets_are_refused_before_anything_starts(
    env: SchedEnv, bad: dict[str, Any], words: str
) -> None:
    src = await _source(env)
    await env.sched.kept.keep(env.tenant_id, src, "g")
    with pytest.raises(ValueError, match=words):
        AgentSpec.model_validate({"secrets": bad})  # the schedule's rule: the same words
    before = len(env.store.list_vms())
    with pytest.raises(InvalidRequest, match=words):
        await env.sched.kept.start(env.tenant_id, "g", 1, secrets=bad)
    with pytest.raises(InvalidRequest, match=words):
        await env.sched.forking.fork(env.tenant_id, src, 1, secrets=bad)
    assert len(env.store.list_vms()) == before


async def test_the_merged_secrets_keep_a_schedules_bounds(env: SchedEnv) -> None:
    src = await _source(env)  # 2 secrets
    await env.sched.kept.keep(env.tenant_id, src, "g")
    more = {f"K{i}": "v" for i in range(63)}  # 63 alone pass; with the source's 2: 65 > 64
    before = len(env.store.list_vms())
    with pytest.raises(InvalidRequest, match="the source's secrets with the given ones: at most 64"):
        await env.sched.kept.start(env.tenant_id, "g", 1, secrets=more)
    with pytest.raises(InvalidRequest, match="at most 64"):
        await env.sched.forking.fork(env.tenant_id, src, 1, secrets=more)
    big = {f"K{i}": "v" * 9000 for i in range(3)}  # 27 KB alone; with a brokered 8 KB: > 32 KiB
    brokered = {"value": "b" * 8000, "brokered": {"hosts": ["api.example.com"]}}
    spec = AgentSpec.model_validate({"secrets": {"TOKEN": brokered}})
    view, _ = await env.sched.scheduling.schedule(env.tenant_id, spec)
    with pytest.raises(InvalidRequest, match="KiB"):
        await env.sched.forking.fork(env.tenant_id, view.vm_id, 1, secrets=big)
    assert len(env.store.list_vms()) == before + 1
    ok = await env.sched.forking.fork(env.tenant_id, src, 1, secrets=dict(list(more.items())[:62]))
    assert ok.forks[0].state == S.RUNNING, "64 in all is a schedule's bound, not past it"


async def test_an_e2b_create_from_a_snapshot_applies_its_envs(env: SchedEnv) -> None:
    src = await _source(env)
    await env.sched.kept.keep(env.tenant_id, src, "golden")
    e2b = _e2b(env)
    made = await e2b.create(
        env.tenant_id, ops.CreateSandbox(template="golden", timeout_s=60, env_vars={"OVER": "e2b", "A": "1"})
    )
    assert _guest_env(env, made.sandbox_id) == {"KEEP": "src", "OVER": "e2b", "A": "1"}
    with pytest.raises(InvalidRequest, match="environment variable name"):
        await e2b.create(
            env.tenant_id, ops.CreateSandbox(template="golden", timeout_s=60, env_vars={"a b": "1"})
        )


async def test_the_api_takes_tags_and_secrets_at_a_fork_and_a_start(tmp_path: Path) -> None:
    api = make_api(tmp_path, max_vms=6)
    transport = httpx.ASGITransport(app=api.app)
    h = {"Authorization": f"Bearer {api.key_a}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=h) as c:
        vm = (await c.post("/v1/runtime/schedule", json={"secrets": {"A": "0", "B": "0"}})).json()["vmId"]
        body = {"count": 1, "metadata": {"k": "v"}, "secrets": {"A": "1"}}
        r = await c.post(f"/v1/runtime/vms/{vm}/fork", json=body)
        assert r.status_code == 200, r.text
        child = r.json()["forks"][0]["vmId"]
        assert (await c.get(f"/v1/runtime/vms/{child}")).json()["metadata"] == {"k": "v"}
        assert _guest_env(api.sched, child) == {"A": "1", "B": "0"}
        bad = await c.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 1, "secrets": {"1A": "x"}})
        assert bad.status_code == 400 and "environment variable name" in bad.text
        assert (await c.post(f"/v1/runtime/vms/{vm}/snapshots", json={"name": "s"})).status_code == 200
        r = await c.post("/v1/runtime/snapshots/s/start", json={"secrets": {"B": "2"}})
        assert r.status_code == 200, r.text
        assert _guest_env(api.sched, r.json()["forks"][0]["vmId"]) == {"A": "0", "B": "2"}
        bad = await c.post("/v1/runtime/snapshots/s/start", json={"secrets": {"B": 2}})
        assert bad.status_code == 400, bad.text
