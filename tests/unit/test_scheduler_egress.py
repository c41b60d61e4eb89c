"""The scheduler's side of egress against a FakeManager: the stored policy and its default,
what a spawn is given, live changes, counters across incarnations, denied events."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.errors import Conflict
from pal.scheduler.states import VmState
from pal.spec import AgentSpec, EgressAllow, EgressDeny, EgressUpdate, PauseRequest, SecretUpdate
from tests.fakes import SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def test_default_policy_comes_from_the_server_and_goes_to_the_node(tmp_path: Path) -> None:
    env = make_env(tmp_path, egress_default="none")
    v, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    assert v.egress == "none" and env.manager.spawn_requests[-1].egress == "none"
    spec = AgentSpec.model_validate(
        {"egress": {"allow": ["pypi.org"]}, "limits": {"egressMbps": 50, "maxConnections": 8}}
    )
    v, _ = await env.sched.scheduling.schedule(env.tenant_id, spec)
    req = env.manager.spawn_requests[-1]
    assert req.egress == EgressAllow(allow=["pypi.org"])
    assert (req.egress_mbps, req.max_connections) == (50, 8)
    assert v.egress == {"allow": ["pypi.org"]}


async def test_policy_survives_pause_resume_and_fork(env: SchedEnv) -> None:
    spec = AgentSpec.model_validate({"egress": {"deny": ["evil.test"]}})
    vm = (await env.sched.scheduling.schedule(env.tenant_id, spec))[0].vm_id
    await env.sched.pauses.pause(env.tenant_id, vm)
    await env.sched.pauses.resume(env.tenant_id, vm)
    assert env.manager.spawn_requests[-1].egress == EgressDeny(deny=["evil.test"])
    res = await env.sched.forking.fork(env.tenant_id, vm, 2)
    for child in res.forks:
        assert env.store.get_vm(child.vm_id).egress == {"deny": ["evil.test"]}  # type: ignore[union-attr]
    assert all(r.egress == EgressDeny(deny=["evil.test"]) for r in env.manager.spawn_requests[-2:])


async def test_live_change_reaches_the_node_then_the_store(env: SchedEnv) -> None:
    vm = (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(egress="open")))[0].vm_id
    v = await env.sched.egress_secrets.set_egress(
        env.tenant_id, vm, EgressUpdate(egress=EgressAllow(allow=["api.test"]))
    )
    assert v.egress == {"allow": ["api.test"]}
    assert env.manager.alive[vm].egress == EgressAllow(allow=["api.test"])
    assert [e.kind for e in env.store.list_events(vm)][-1] == "egress_changed"
    # a paused VM keeps the change for its next incarnation
    await env.sched.pauses.pause(env.tenant_id, vm)
    await env.sched.egress_secrets.set_egress(env.tenant_id, vm, EgressUpdate(egress="none"))
    await env.sched.pauses.resume(env.tenant_id, vm)
    assert env.manager.spawn_requests[-1].egress == "none"
    # a node that refuses leaves the stored policy as it was
    env.manager.fail("set_egress", Conflict("nope"), vm_id=vm)
    with pytest.raises(Conflict):
        await env.sched.egress_secrets.set_egress(env.tenant_id, vm, EgressUpdate(egress="open"))
    assert env.store.get_vm(vm).egress == "none"  # type: ignore[union-attr]
    await env.sched.deleting.delete(env.tenant_id, vm)
    with pytest.raises(Conflict):
        await env.sched.egress_secrets.set_egress(env.tenant_id, vm, EgressUpdate(egress="open"))


async def test_counters_add_up_over_incarnations(env: SchedEnv) -> None:
    vm = (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(egress="open")))[0].vm_id
    env.manager.alive[vm].counters = {
        "bytesIn": 100,
        "bytesOut": 10,
        "connections": 2,
        "refused": 1,
        "dnsQueries": 3,
        "active": 1,
    }
    got = await env.sched.reads.network(await env.sched.reads.get(env.tenant_id, vm))
    assert got == {
        "bytesIn": 100,
        "bytesOut": 10,
        "connections": 2,
        "refused": 1,
        "dnsQueries": 3,
        "active": 1,
    }
    await env.sched.pauses.pause(env.tenant_id, vm)
    assert await env.sched.reads.network(await env.sched.reads.get(env.tenant_id, vm)) == {
        "bytesIn": 100,
        "bytesOut": 10,
        "connections": 2,
        "refused": 1,
        "dnsQueries": 3,
    }
    await env.sched.pauses.resume(env.tenant_id, vm)
    env.manager.alive[vm].counters = {"bytesIn": 5, "connections": 1, "active": 0}
    got = await env.sched.reads.network(await env.sched.reads.get(env.tenant_id, vm))
    assert got is not None and got["bytesIn"] == 105 and got["connections"] == 3 and got["active"] == 0


async def test_denied_events_are_recorded_once_on_the_right_vm(env: SchedEnv) -> None:
    vm = (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(egress="none")))[0].vm_id
    env.manager.deny(vm, "evil.test", 443, "egress none")
    env.manager.deny("tmpl-123456", "x.test")  # not a tenant's VM: skipped
    assert await env.sched.egress_events.record() == 1
    assert await env.sched.egress_events.record() == 0  # nothing twice
    env.manager.deny(vm, "again.test", 80)
    assert await env.sched.egress_events.record() == 1
    evs = [e for e in env.store.list_events(vm) if e.kind == "egress_denied"]
    assert [e.details["name"] for e in evs] == ["evil.test", "again.test"]  # type: ignore[index]
    assert evs[0].reason == "refused evil.test (203.0.113.9) port 443: egress none"
    assert evs[0].details == {
        "name": "evil.test",
        "address": "203.0.113.9",
        "port": 443,
        "rule": "egress none",
    }
    # the gateway restarted: a new numbering, read from its start
    env.manager.egress_epoch, env.manager.egress_log, env.manager.egress_seq = "fake-2", [], 0
    env.manager.deny(vm, "third.test")
    assert await env.sched.egress_events.record() == 1


BROKERED = AgentSpec.model_validate(
    {
        "secrets": {"API_KEY": {"value": "old-value", "brokered": {"hosts": ["api.test"]}}},
        "waitPause": {"afterMs": 200},
    }
)


@pytest.mark.parametrize("pause", ["operator", "wait"])
async def test_a_rotation_reaches_a_live_paused_vms_gateway_and_outlives_its_resume(
    env: SchedEnv, pause: str
) -> None:
    """A live-paused VM keeps its QEMU and its gateway registration: a rotated brokered
    secret goes to the node at once (like a policy change), and the live resume (no new
    spawn, nothing registered again) carries on with the new value."""
    vm = (await env.sched.scheduling.schedule(env.tenant_id, BROKERED))[0].vm_id
    assert env.manager.alive[vm].brokered == {"API_KEY": "old-value"}
    if pause == "operator":
        await env.sched.pauses.pause(env.tenant_id, vm, PauseRequest(mode="live"))
    else:
        await env.sched.live.wait_pause(vm)
    assert env.store.get_vm(vm).state == S.PAUSED  # type: ignore[union-attr]
    applied = await env.sched.egress_secrets.rotate_secret(
        env.tenant_id, vm, "API_KEY", SecretUpdate(value="new-value")
    )
    assert applied  # the API answers applied: "now"
    assert env.manager.alive[vm].brokered == {"API_KEY": "new-value"}
    await env.sched.pauses.resume(env.tenant_id, vm)
    assert env.manager.calls.count(("spawn", vm)) == 1  # the same QEMU continued
    assert env.manager.alive[vm].brokered == {"API_KEY": "new-value"}
    # and a later incarnation starts with it too
    await env.sched.pauses.pause(env.tenant_id, vm)
    assert not await env.sched.egress_secrets.rotate_secret(
        env.tenant_id, vm, "API_KEY", SecretUpdate(value="third")
    )
    await env.sched.pauses.resume(env.tenant_id, vm)
    assert env.manager.alive[vm].brokered == {"API_KEY": "third"}
