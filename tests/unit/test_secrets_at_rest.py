"""Secrets at rest (issue 9, item 2): a VM's secrets are sealed in the store under the host's
secrets key (0600), bound to the tenant; the guest still gets the values; rows an older Pal
wrote in clear are sealed when a server takes the lead."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.scheduler.brokering import SecretBroker
from pal.secretbox import SecretBox, SecretUnreadable
from pal.spec import AgentSpec
from tests.fakes import make_env


def _db_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.rglob("*.db*") if p.is_file())


async def test_plain_secrets_are_sealed_in_the_store_and_reach_the_guest(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    spec = AgentSpec.model_validate({"secrets": {"API_TOKEN": "tok-very-secret-123", "B": "b-value-xyz"}})
    vm, _ = await env.sched.scheduling.schedule(env.tenant_id, spec)
    row = env.store.get_vm(vm.vm_id)
    assert row is not None and "tok-very-secret-123" not in repr(row.secrets)
    assert b"tok-very-secret-123" not in _db_bytes(tmp_path) and b"b-value-xyz" not in _db_bytes(tmp_path)
    assert env.manager.spawn_requests[-1].env["API_TOKEN"] == "tok-very-secret-123"
    key = env.settings.secrets_key_path
    assert key.stat().st_mode & 0o777 == 0o600
    # A fork child's guest gets the same values (the row is copied, bound to the same tenant).
    forks = await env.sched.forking.fork(env.tenant_id, vm.vm_id, 1)
    assert env.manager.spawn_requests[-1].env["B"] == "b-value-xyz", forks


async def test_clear_rows_of_an_older_pal_are_sealed_by_the_leader(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    vm, _ = await env.sched.scheduling.schedule(env.tenant_id, AgentSpec.model_validate({}))
    env.store.update_vm(vm.vm_id, secrets={"OLD": "legacy-clear-value"})  # as Pal 0.x stored it
    assert env.sched.egress_secrets.reseal_secrets() == 1
    row = env.store.get_vm(vm.vm_id)
    assert row is not None and "legacy-clear-value" not in repr(row.secrets)
    assert env.sched.brokering.env(env.tenant_id, row.secrets) == {"OLD": "legacy-clear-value"}
    assert env.sched.egress_secrets.reseal_secrets() == 0


def test_the_box_binds_tenant_and_key(tmp_path: Path) -> None:
    box = SecretBox(b"k" * 32)
    sealed = box.seal("v", "t-1")
    assert box.open(sealed, "t-1") == "v" and sealed != box.seal("v", "t-1")  # fresh nonce
    with pytest.raises(SecretUnreadable):
        box.open(sealed, "t-2")
    with pytest.raises(SecretUnreadable):
        SecretBox(b"o" * 32).open(sealed, "t-1")
    with pytest.raises(SecretUnreadable):
        box.open(sealed[:-4] + "AAAA", "t-1")
    # Brokered values use the same box: one key file, one format.
    b = SecretBroker.__new__(SecretBroker)
    b._box = box
    spec = AgentSpec.model_validate({"secrets": {"K": {"value": "bv", "brokered": {"hosts": ["a.test"]}}}})
    stored = b.store_form("t-1", spec.secrets)
    assert box.open(stored["K"]["sealed"], "t-1") == "bv"
