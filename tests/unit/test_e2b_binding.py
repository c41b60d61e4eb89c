"""The E2B surface's own pieces of the binding to Pal (pal/e2b/binding.py and what it
binds) that need no VM: the tenant's E2B keys in the store, the key check, E2B's
conventions, the file entries the guest prints, the network options as egress."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from pal.e2b import conventions as conv
from pal.e2b import ops
from pal.e2b.binding import TenantKeys
from pal.e2b.files import parse_entries
from pal.e2b.keys import is_e2b_key
from pal.e2b.sandboxes import _egress, _token, _untoken
from pal.errors import InvalidRequest, NotFound
from pal.store import Store, e2b_keys


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'pal.db'}")
    yield s  # type: ignore[misc]
    s.close()


async def _pal_check(key: str) -> tuple[str | None, str | None]:
    return ("t-pal", None) if key == "pal_good" else (None, "invalid API key")


async def test_e2b_keys_are_the_tenants_until_revoked(store: Store) -> None:
    tenant, _pal_key = store.create_tenant("acme", 2)
    other, _ = store.create_tenant("other", 2)
    keys = TenantKeys(store, _pal_check)
    made = await keys.create_key(tenant.id, "app")
    assert made.key is not None and is_e2b_key(made.key)
    assert await keys.check(made.key) == (tenant.id, None)
    assert (await keys.check("e2b_" + "0" * 40))[0] is None
    assert await keys.check("pal_good") == ("t-pal", None)  # a Pal key goes to the API's check
    second = await keys.create_key(tenant.id, "")
    assert [k.key_id for k in await keys.list_keys(tenant.id)] == [made.key_id, second.key_id]
    assert all(k.key is None for k in await keys.list_keys(tenant.id))  # never shown again
    with pytest.raises(NotFound):
        await keys.revoke_key(other.id, made.key_id)  # another tenant's key: none of its own
    await keys.revoke_key(tenant.id, made.key_id)
    assert (await keys.check(made.key))[0] is None
    assert second.key is not None and (await keys.check(second.key))[0] == tenant.id
    store.mark_tenant_deleting(tenant.id)
    assert (await keys.check(second.key))[0] is None  # a tenant being removed: refused
    assert store.delete_tenant(tenant.id)
    assert e2b_keys.list_keys(store, tenant.id) == []
    with pytest.raises(NotFound):
        e2b_keys.add_key(store, "t-none", "e2b_" + "1" * 40)


def test_conventions() -> None:
    assert (conv.pal_user(None), conv.pal_user("user"), conv.pal_user("root")) == (None, None, "root")
    with pytest.raises(InvalidRequest):
        conv.pal_user("postgres")
    assert conv.absolute(None, "a/../b.txt") == "/home/user/b.txt"
    assert conv.absolute("root", "x") == "/root/x" and conv.absolute(None, "/tmp/y") == "/tmp/y"
    env = conv.process_env("vm-1", None, {"HOME": "/elsewhere"})
    assert env["E2B_SANDBOX"] == "true" and env["E2B_SANDBOX_ID"] == "vm-1" and env["USER"] == "user"
    assert env["HOME"] == "/elsewhere"  # the command's own envs last
    token = conv.access_token(b"k" * 32, "vm-1")
    assert token == conv.access_token(b"k" * 32, "vm-1") != conv.access_token(b"k" * 32, "vm-2")
    meta = {"a": "1", conv.OPEN_KEY: "true", conv.TEMPLATE_KEY: "base"}
    assert conv.public_metadata(meta) == {"a": "1"} and not conv.is_secure(meta)


def test_entries_as_find_prints_them() -> None:
    out = (
        "d\t4096\t755\tdrwxr-xr-x\tuser\tuser\t1700000000.5\t\t/home/user/notes\0"
        "f\t3\t644\t-rw-r--r--\tuser\tuser\t1700000001.0\t\t/home/user/notes/a\tb.txt\0"
        "l\t9\t777\tlrwxrwxrwx\troot\troot\t1700000002.0\t/etc/hosts\t/tmp/h\0"
    )
    d, f, link = parse_entries(out)
    assert (d.type, d.name, d.mode) == (ops.FileType.DIRECTORY, "notes", 0o755)
    assert (f.name, f.path, f.size) == ("a\tb.txt", "/home/user/notes/a\tb.txt", 3)  # a tab in a name
    assert (link.type, link.symlink_target, link.owner) == (ops.FileType.SYMLINK, "/etc/hosts", "root")
    assert f.modified_time is not None and f.modified_time.timestamp() == 1700000001.0


def test_network_options_as_egress() -> None:
    assert _egress(ops.NetworkPolicy()) is None
    assert _egress(ops.NetworkPolicy(allow_internet=False)) == "none"
    assert _egress(ops.NetworkPolicy(allow_internet=False, allow_out=("pypi.org",))) == {
        "allow": ["pypi.org"]
    }
    assert _egress(ops.NetworkPolicy(deny_out=("0.0.0.0/0",), allow_out=("1.1.1.1",))) == {
        "allow": ["1.1.1.1"]
    }
    assert _egress(ops.NetworkPolicy(deny_out=("10.0.0.0/8",))) == {"deny": ["10.0.0.0/8"]}


def test_page_tokens_round_trip() -> None:
    from datetime import UTC, datetime

    at = datetime(2026, 1, 2, tzinfo=UTC) + timedelta(microseconds=5)
    assert _untoken(_token(at, "vm-x")) == (at.isoformat(), "vm-x")
    with pytest.raises(InvalidRequest):
        _untoken("garbage!")
