"""Tags at a start from a kept snapshot (docs/lifecycle.md, "Kept snapshots"): the start's
``metadata`` replaces the source's on every child, with the schedule's rules; E2B's
``Sandbox.create(<snapshot>, metadata=...)`` shows the create's metadata, over the real
scheduler and store on the fake node."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.e2b import conventions as conv
from pal.e2b import ops
from pal.e2b.sandboxes import PalSandboxes
from pal.errors import InvalidRequest
from pal.scheduler.states import VmState
from pal.spec import AgentSpec
from tests.fakes import SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=6)


async def _tagged(env: SchedEnv, metadata: dict[str, str]) -> str:
    view, _ = await env.sched.scheduling.schedule(
        env.tenant_id, AgentSpec.model_validate({"metadata": metadata})
    )
    assert view.state == S.RUNNING
    return view.vm_id


def _tags(env: SchedEnv, vm_id: str) -> dict[str, str]:
    vm = env.store.get_vm(vm_id)
    assert vm is not None
    return dict(vm.metadata)


async def test_a_starts_tags_replace_the_sources_on_each_child(env: SchedEnv) -> None:
    src = await _tagged(env, {"team": "a", "run": "1"})
    kept = await env.sched.kept.keep(env.tenant_id, src, "tagged")

    inherited = await env.sched.kept.start(env.tenant_id, "tagged")
    assert _tags(env, inherited.forks[0].vm_id) == {"team": "a", "run": "1"}, "no tags given: the source's"

    res = await env.sched.kept.start(env.tenant_id, kept.snapshot_id, 2, {"run": "2"})
    assert [c.state for c in res.forks] == [S.RUNNING, S.RUNNING]
    for child in res.forks:
        assert _tags(env, child.vm_id) == {"run": "2"}, "replaced, not merged: `team` is gone"
    cleared = await env.sched.kept.start(env.tenant_id, "tagged", 1, {})
    assert _tags(env, cleared.forks[0].vm_id) == {}
    assert _tags(env, src) == {"team": "a", "run": "1"}, "the source keeps its own"
    found = await env.sched.listing.vms(env.tenant_id, after=None, limit=50, metadata={"run": "2"})
    assert sorted(v.vm_id for v in found) == sorted(c.vm_id for c in res.forks)


@pytest.mark.parametrize(
    "bad",
    [{"a b": "x"}, {"k": "v" * 300}, {f"k{i}": "v" for i in range(40)}, {"k": 1}],
    ids=["key", "value", "too-many", "not-a-string"],
)
async def test_bad_tags_are_refused_before_anything_starts(env: SchedEnv, bad: dict[str, object]) -> None:
    src = await _tagged(env, {})
    await env.sched.kept.keep(env.tenant_id, src, "t")
    before = len(env.store.list_vms())
    with pytest.raises(InvalidRequest, match="metadata"):
        await env.sched.kept.start(env.tenant_id, "t", 1, bad)  # type: ignore[arg-type]
    assert len(env.store.list_vms()) == before


def _e2b(env: SchedEnv) -> PalSandboxes:
    s = env.sched
    return PalSandboxes(
        s.scheduling,
        s.reads,
        s.listing,
        s.deleting,
        s.lifetimes,
        s.pauses,
        s.forking,
        s.egress_secrets,
        s.guest,
        s.kept,
        b"k" * 32,
    )


async def test_an_e2b_create_from_a_snapshot_shows_the_creates_metadata(env: SchedEnv) -> None:
    # A sandbox made through E2B open (secure=False), of template `base`, with its own metadata.
    source_tags = {"suite": "source", conv.TEMPLATE_KEY: "base", conv.OPEN_KEY: "true"}
    src = await _tagged(env, source_tags)
    await env.sched.kept.keep(env.tenant_id, src, "golden")
    e2b = _e2b(env)

    made = await e2b.create(
        env.tenant_id,
        ops.CreateSandbox(
            template="golden",
            timeout_s=120,
            metadata={"user": "alice", conv.TEMPLATE_KEY: "forged"},
            auto_pause=True,
        ),
    )
    assert made.metadata == {"user": "alice"}, "the create's metadata, not the source's"
    assert made.template_id == "base", "the source's template; a forged reserved key is dropped"
    assert made.access_token is not None, "the create's secure (the SDK's default)"
    vm = env.store.get_vm(made.sandbox_id)
    assert vm is not None and vm.on_lifetime_end == "pause" and vm.lifetime_ends_at is not None
    assert dict(vm.metadata) == {"user": "alice", conv.TEMPLATE_KEY: "base"}
    listed = await e2b.list_sandboxes(env.tenant_id, ops.SandboxQuery(metadata={"user": "alice"}))
    assert [s.sandbox_id for s in listed.items] == [made.sandbox_id]

    opened = await e2b.create(env.tenant_id, ops.CreateSandbox(template="golden", timeout_s=60, secure=False))
    assert opened.metadata == {} and opened.access_token is None
    with pytest.raises(InvalidRequest, match="metadata"):
        await e2b.create(
            env.tenant_id, ops.CreateSandbox(template="golden", timeout_s=60, metadata={"a b": "1"})
        )
