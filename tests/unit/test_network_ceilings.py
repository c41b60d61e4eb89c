"""PAL_MAX_* ceilings on what a spec may ask of the network, checked at schedule: a 400
that names the field and the setting; a default over a ceiling is lowered instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.config import Settings, parse_nameservers
from pal.errors import InvalidRequest
from pal.spec import AgentSpec, WaitPause
from tests.fakes import make_env


async def test_a_spec_over_a_ceiling_is_400_naming_the_field(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_connections=64, max_buffer_bytes=1 << 20, max_egress_mbps=100)
    for body, field, setting in [
        ({"limits": {"maxConnections": 65}}, "limits.maxConnections 65", "PAL_MAX_CONNECTIONS=64"),
        ({"limits": {"egressMbps": 101}}, "limits.egressMbps 101", "PAL_MAX_EGRESS_MBPS=100"),
        ({"waitPause": {"maxBufferBytes": 2 << 20}}, "waitPause.maxBufferBytes", "PAL_MAX_BUFFER_BYTES"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate(body))
        assert err.value.status == 400 and field in err.value.message and setting in err.value.message
    assert env.manager.spawn_requests == [], "nothing was started for a refused spec"
    # Within the ceilings; what the spec leaves out is lowered to them.
    vm, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate({"waitPause": {}}))
    req = env.manager.spawn_requests[-1]
    assert (req.max_connections, req.egress_mbps) == (64, 100)
    assert req.wait_pause is not None and req.wait_pause.max_buffer_bytes == 1 << 20
    assert vm.limits["max_connections"] == 64 and vm.limits["egress_mbps"] == 100


async def test_ceilings_apply_to_the_servers_wait_default_and_not_to_waitpause_off(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_buffer_bytes=1 << 20, wait_pause_default=WaitPause(max_buffer_bytes=8 << 20))
    await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    req = env.manager.spawn_requests[-1]
    assert req.wait_pause is not None and req.wait_pause.max_buffer_bytes == 1 << 20
    await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate({"waitPause": False}))
    assert env.manager.spawn_requests[-1].wait_pause is None


async def test_the_default_ceilings_leave_specs_as_they_are(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    spec = AgentSpec.model_validate({"limits": {"maxConnections": 4096}, "waitPause": {}})
    await env.sched.scheduling.schedule(env.tenant_id, spec)
    req = env.manager.spawn_requests[-1]
    assert req.max_connections == 4096 and req.egress_mbps is None
    with pytest.raises(InvalidRequest):
        await env.sched.scheduling.schedule(
            env.tenant_id, AgentSpec.model_validate({"limits": {"maxConnections": 4097}})
        )


def test_settings_read_and_check_the_budgets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAL_MAX_CONNECTIONS", "100")
    monkeypatch.setenv("PAL_MAX_EGRESS_MBPS", "50")
    monkeypatch.setenv("PAL_GATEWAY_MAX_BUFFER_BYTES", str(256 << 20))
    monkeypatch.setenv("PAL_EGRESS_NAMESERVERS", "127.0.0.53,[::1]:5353")
    b = Settings.from_env(tmp_path).net_budgets
    assert (b.max_connections, b.max_egress_mbps, b.node_buffer_bytes) == (100, 50, 256 << 20)
    assert b.gateway_json()["nameservers"] == "127.0.0.53,[::1]:5353"
    assert parse_nameservers(b.nameservers) == [("127.0.0.53", 53), ("::1", 5353)]
    monkeypatch.setenv("PAL_EGRESS_NAMESERVERS", "dns.example:53")
    with pytest.raises(ValueError, match=r"PAL_EGRESS_NAMESERVERS entry 'dns\.example:53'"):
        Settings.from_env(tmp_path)
    monkeypatch.setenv("PAL_EGRESS_NAMESERVERS", "")
    monkeypatch.setenv("PAL_MAX_BUFFER_BYTES", "1000")
    with pytest.raises(ValueError, match="PAL_MAX_BUFFER_BYTES"):
        Settings.from_env(tmp_path)
