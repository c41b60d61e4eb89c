"""Issue 9 items 5 and 6 on the real Scheduler and store (fake manager): per-tenant caps on
paused VMs and snapshot bytes, API key rotation and expiry, `pal tenants rm`, a VM's
snapshots deleted with it (kept while a live fork maps one), and the startup sweep."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pal.cli.main import app as cli
from pal.config import Settings
from pal.errors import QuotaExceeded
from pal.scheduler.states import VmState
from pal.spec import AgentSpec
from pal.store import Store
from tests.apienv import make_api
from tests.fakes import SchedEnv, make_env

MIB = 1 << 20


async def _running(env: SchedEnv, memory_mib: int = 256) -> str:
    vm, _ = await env.sched.scheduling.schedule(
        env.tenant_id, AgentSpec.model_validate({"limits": {"memoryMib": memory_mib}})
    )
    return vm.vm_id


def _snaps_of(env: SchedEnv, vm_id: str) -> list[str]:
    return [sid for (_, vid, sid) in env.manager.snapshots if vid == vm_id]


async def test_max_paused_refuses_the_next_pause_and_the_vm_keeps_running(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    env.store.set_tenant_limits(env.tenant_id, max_paused=1)
    a, b = await _running(env), await _running(env)
    await env.sched.pauses.pause(env.tenant_id, a)
    with pytest.raises(QuotaExceeded, match="max_paused=1"):
        await env.sched.pauses.pause(env.tenant_id, b)
    row = env.store.get_vm(b)
    assert row is not None and row.state == VmState.RUNNING and not _snaps_of(env, b)
    await env.sched.pauses.resume(env.tenant_id, a)
    await env.sched.pauses.pause(env.tenant_id, b)  # room again


async def test_snapshot_bytes_cap_refuses_pause_and_fork_before_any_snapshot(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    env.store.set_tenant_limits(env.tenant_id, max_snapshot_bytes=200 * MIB)
    small, big = await _running(env, 128), await _running(env, 256)
    await env.sched.pauses.pause(env.tenant_id, small)  # ~128 MiB estimated; the node then says 4 KiB
    row = env.store.get_vm(small)
    assert row is not None and row.snapshot_bytes == env.manager.snapshot_size
    with pytest.raises(QuotaExceeded, match="GiB of snapshots"):
        await env.sched.pauses.pause(env.tenant_id, big)
    vms_before = len(env.store.list_vms())
    with pytest.raises(QuotaExceeded):
        await env.sched.forking.fork(env.tenant_id, big, 2)
    assert len(env.store.list_vms()) == vms_before and not _snaps_of(env, big)
    # A server shutdown suspends every VM whatever the limits (nothing may be lost).
    await env.sched.draining.shutdown_vms()
    row = env.store.get_vm(big)
    assert row is not None and row.state == VmState.PAUSED


async def test_delete_removes_every_snapshot_but_what_a_live_fork_maps(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    src = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, src)
    await env.sched.pauses.resume(env.tenant_id, src)
    result = await env.sched.forking.fork(env.tenant_id, src, 1)
    [child] = result.forks
    assert len(_snaps_of(env, src)) == 2  # the pause's and the fork's
    await env.sched.deleting.delete(env.tenant_id, src)
    assert _snaps_of(env, src) == [result.snapshot_id]  # the live child maps it
    await env.sched.deleting.delete(env.tenant_id, child.vm_id)
    assert _snaps_of(env, src) == []


async def test_sweep_deletes_snapshots_of_vms_gone_during_a_crash(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    keep = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, keep)
    gone = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, gone)
    av = env.store.get_vm(gone).agent_version_id  # type: ignore[union-attr]
    env.manager.snapshots[(av, "vm-0123456789abcdef0123", "snap-orphan")] = True  # row gone (tenant rm)
    # A delete whose snapshot cleanup did not happen (node unreachable, or a crash right
    # after the row became terminated): the row is terminated, the snapshot still there.
    env.manager.delete_vm_snapshots = None  # type: ignore[assignment,method-assign]
    await env.sched.deleting.delete(env.tenant_id, gone)
    del env.manager.delete_vm_snapshots
    assert _snaps_of(env, gone)
    fixes = await env.sched.snapshot_checks.sweep()
    assert len(fixes) == 2 and not _snaps_of(env, gone) and not _snaps_of(env, "vm-0123456789abcdef0123")
    assert _snaps_of(env, keep)  # a live VM's snapshot stays


async def test_rotated_expired_and_removed_keys_are_refused_with_the_reason(tmp_path: Path) -> None:
    api = make_api(tmp_path)
    store = api.sched.store

    async def status(key: str) -> tuple[int, str]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api.app), base_url="http://localhost"
        ) as c:
            r = await c.get("/v1/runtime/vms", headers={"Authorization": f"Bearer {key}"})
            return r.status_code, (r.json().get("error") or {}).get("message", "")

    tid = api.sched.tenant_id
    new = store.rotate_api_key(tid, grace=timedelta(hours=1))
    assert (await status(api.key_a))[0] == 200 and (await status(new))[0] == 200  # in the grace
    newer = store.rotate_api_key(tid)  # no grace: both older keys refused at once
    assert await status(new) == (401, "invalid API key")
    assert await status(api.key_a) == (401, "invalid API key")
    assert (await status(newer))[0] == 200
    _, short = store.create_tenant("brief", 1, key_ttl=timedelta(seconds=-1))
    code, msg = await status(short)
    assert code == 401 and msg.startswith("API key expired at")
    vm = await _running(api.sched)
    await api.sched.sched.pauses.pause(tid, vm)
    store.mark_tenant_deleting(tid)
    assert await status(newer) == (401, "this tenant is being deleted")
    assert await api.sched.sched.deleting.purge_deleted_tenants() == [tid]
    assert (
        store.get_tenant(tid) is None and not store.list_vms(tenant_id=tid) and not _snaps_of(api.sched, vm)
    )
    assert await status(newer) == (401, "invalid API key")
    assert (await status(api.key_b))[0] == 200  # the other tenant is untouched


def test_tenants_cli_sets_limits_rotates_and_removes(tmp_path: Path) -> None:
    runner, data = CliRunner(), str(tmp_path / "data")
    Store.open(Settings(data_dir=Path(data))).close()  # a data dir a server has used

    def run(*args: str) -> dict:
        res = runner.invoke(cli, ["tenants", *args, "--data-dir", data])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    made = run("create", "acme", "--max-paused", "3", "--max-snapshot-gib", "1.5", "--key-ttl-days", "30")
    assert (made["maxPaused"], made["maxSnapshotGib"]) == (3, 1.5) and made["keyExpiresAt"]
    changed = run("set", "acme", "--max-paused", "none", "--max-vms", "4")
    assert (changed["maxPaused"], changed["maxSnapshotGib"], changed["maxVms"]) == (None, 1.5, 4)
    rotated = run("rotate-key", "acme")
    assert rotated["apiKey"] != made["apiKey"] and rotated["keyExpiresAt"] is None
    store = Store.open(Settings(data_dir=Path(data)))
    try:
        assert store.tenant_by_api_key(made["apiKey"]) is None
        assert store.tenant_by_api_key(rotated["apiKey"]) is not None
    finally:
        store.close()
    assert run("rm", "acme")["deleting"] is True
    bad = runner.invoke(cli, ["tenants", "set", "nobody", "--max-vms", "1", "--data-dir", data])
    assert bad.exit_code == 1 and "no tenant" in bad.stderr
