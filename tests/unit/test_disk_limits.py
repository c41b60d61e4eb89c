"""A VM's disk bounds (limits.diskReadMibps, diskWriteMibps, diskIops): the spec's checks,
the server's defaults (PAL_DISK_*) and ceilings (PAL_MAX_DISK_*) resolved at schedule, what
the node is asked, and how QEMU is told (command line and QMP)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.manager.spawned import disk_limits
from pal.spec import AgentSpec
from pal.vmm.disk_limits import DiskLimits
from tests.apienv import make_api
from tests.fakes import make_env


async def test_defaults_resolve_at_schedule_and_reach_the_node(tmp_path: Path) -> None:
    env = make_env(tmp_path, disk_read_mibps=300, disk_write_mibps=None, disk_iops=2000)
    vm, _ = await env.sched.scheduling.schedule(
        env.tenant_id, AgentSpec.model_validate({"limits": {"diskIops": 50}})
    )
    req = env.manager.spawn_requests[-1]
    assert disk_limits(req) == DiskLimits(300, None, 50), "the spec's own value wins over the default"
    assert (vm.limits["disk_read_mibps"], vm.limits["disk_write_mibps"]) == (300, None)


async def test_over_a_ceiling_is_400_naming_the_field_and_setting(tmp_path: Path) -> None:
    env = make_env(tmp_path, max_disk_read_mibps=100, max_disk_write_mibps=40, max_disk_iops=500)
    for body, field, setting in [
        ({"diskReadMibps": 101}, "limits.diskReadMibps 101", "PAL_MAX_DISK_READ_MIBPS=100"),
        ({"diskWriteMibps": 41}, "limits.diskWriteMibps 41", "PAL_MAX_DISK_WRITE_MIBPS=40"),
        ({"diskIops": 501}, "limits.diskIops 501", "PAL_MAX_DISK_IOPS=500"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate({"limits": body}))
        assert err.value.status == 400 and field in err.value.message and setting in err.value.message
    assert env.manager.spawn_requests == []
    # The defaults (200, 100, 4000) are lowered to the ceilings.
    await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    assert disk_limits(env.manager.spawn_requests[-1]) == DiskLimits(100, 40, 500)


async def test_a_ceiling_bounds_a_vm_even_with_the_default_off(tmp_path: Path) -> None:
    env = make_env(tmp_path, disk_write_mibps=None, max_disk_write_mibps=30)
    await env.sched.scheduling.schedule(env.tenant_id, AgentSpec())
    assert env.manager.spawn_requests[-1].disk_write_mibps == 30


async def test_the_api_answers_400_for_bad_disk_limits(tmp_path: Path) -> None:
    env = make_api(tmp_path)
    transport = httpx.ASGITransport(app=env.app)
    key = {"Authorization": f"Bearer {env.key_a}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=key) as c:
        for bad, words in [
            ({"diskReadMibps": 0}, "diskReadMibps"),
            ({"diskIops": "100"}, "diskIops"),  # strict: a string is not a number
            ({"diskWriteMibps": 1_000_000}, "diskWriteMibps"),
        ]:
            resp = await c.post("/v1/runtime/schedule", json={"limits": bad})
            assert resp.status_code == 400, resp.text
            assert words in resp.json()["error"]["message"]


def test_settings_read_defaults_and_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAL_DISK_READ_MIBPS", "off")
    monkeypatch.setenv("PAL_DISK_IOPS", "250")
    monkeypatch.setenv("PAL_MAX_DISK_WRITE_MIBPS", "80")
    b = Settings.from_env(tmp_path).disk_bounds
    assert (b.read_mibps, b.write_mibps, b.iops) == ((None, None), (100, 80), (250, None))
    monkeypatch.setenv("PAL_DISK_IOPS", "-3")
    with pytest.raises(ValueError, match="PAL_DISK_IOPS"):
        Settings.from_env(tmp_path)


def test_qemu_is_told_the_limits() -> None:
    disk = DiskLimits(read_mibps=10, write_mibps=None, iops=200)
    assert disk.drive_options() == f",throttling.bps-read={10 << 20},throttling.iops-total=200"
    assert DiskLimits().drive_options() == "" and not DiskLimits()
    assert disk.qmp_throttle() == {
        "device": "root",
        "bps": 0,
        "bps_rd": 10 << 20,
        "bps_wr": 0,
        "iops": 200,
        "iops_rd": 0,
        "iops_wr": 0,
    }
    assert disk.describe() == "read 10 MiB/s, 200 IOPS"
