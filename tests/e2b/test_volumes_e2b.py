"""E2B's volumes against Pal (docs/e2b.md, "Volumes"): the pinned SDK's own ``Volume`` and
``AsyncVolume`` (e2b 2.45.1) against the real API with its /e2b surface, served on loopback
over the real Scheduler and the node's real volume code (tests/fakes.py): no VM. The REST
calls (create, list, get, connect, destroy) by the tenant's key, the content API by the
volume's token; another tenant's key and another volume's token reach nothing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import AsyncVolume, Volume
from e2b.exceptions import AuthenticationException, NotFoundException

from pal.e2b.keys import new_key
from pal.server import install_e2b
from pal.store import e2b_keys
from tests.apienv import ApiEnv, make_api, serve

SECRET = b"s" * 32


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ApiEnv, str, str]]:
    env = make_api(tmp_path)
    install_e2b(env.app, env.sched.sched, env.sched.store, SECRET)
    store = env.sched.store
    key, other = new_key(), new_key()
    e2b_keys.add_key(store, store.tenant_by_name("acme").id, key, "test")  # type: ignore[union-attr]
    e2b_keys.add_key(store, store.tenant_by_name("bob").id, other, "test")  # type: ignore[union-attr]
    with serve(env.app) as url:
        for name, value in {
            "E2B_API_URL": url + "/e2b",
            "E2B_VOLUME_API_URL": url + "/e2b",
            "E2B_API_KEY": key,
        }.items():
            monkeypatch.setenv(name, value)
        yield env, key, other


def test_the_sdks_volume_class(server: tuple[ApiEnv, str, str]) -> None:
    env, _, other = server
    vol = Volume.create("e2b-data")
    assert vol.volume_id.startswith("vol-") and vol.name == "e2b-data" and vol.token
    # The REST side: list, get (by id), connect.
    assert [(v.volume_id, v.name) for v in Volume.list()] == [(vol.volume_id, "e2b-data")]
    info = Volume.get_info(vol.volume_id)
    assert (info.name, info.token) == ("e2b-data", vol.token)
    again = Volume.connect(vol.volume_id)

    # The content side, with the volume's token.
    wrote = vol.write_file("/notes/a.txt", "hello")
    assert (wrote.name, wrote.path, wrote.size, str(wrote.type.value)) == ("a.txt", "/notes/a.txt", 5, "file")
    assert again.read_file("/notes/a.txt") == "hello"
    vol.write_file("bin", b"\x00\xff", mode=0o600)
    assert vol.read_file("bin", format="bytes") == b"\x00\xff"
    st = vol.get_info("/bin")
    assert (st.mode, st.size) == (0o600, 2)
    assert vol.exists("/notes/a.txt") and not vol.exists("/nope")
    made = vol.make_dir("/x/y", force=True)
    assert str(made.type.value) == "directory" and made.path == "/x/y"
    with pytest.raises(Exception) as exists:
        vol.make_dir("/x/y")
    assert "409" in str(exists.value) or "exists" in str(exists.value)
    listed = vol.list("/", depth=2)
    assert [e.path for e in listed] == ["/bin", "/notes", "/x", "/notes/a.txt", "/x/y"]
    changed = vol.update_metadata("/notes/a.txt", mode=0o640)
    assert changed.mode == 0o640
    vol.remove("/x")  # a directory and what is in it
    assert not vol.exists("/x/y")
    with pytest.raises(NotFoundException):
        vol.read_file("/x/y")
    with pytest.raises(Exception) as escape:
        vol.read_file("/../../etc/passwd")
    assert "400" in str(escape.value) or "leaves" in str(escape.value)
    # A file that guests left as a symlink is not followed.
    data = env.manager.volume_files.data_dir(vol.volume_id)
    os.symlink("/etc/passwd", data / "link")
    assert vol.get_info("/link").target == "/etc/passwd"
    with pytest.raises(Exception) as link:
        vol.read_file("/link")
    assert "root:" not in str(link.value)

    # Another tenant's key sees none of it; a wrong token reads nothing.
    assert Volume.list(api_key=other) == []
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id, api_key=other)
    assert Volume.destroy(vol.volume_id, api_key=other) is False
    forged = Volume(volume_id=vol.volume_id, name="e2b-data", token="0" * 64)
    with pytest.raises(AuthenticationException):
        forged.read_file("/notes/a.txt")
    theirs = Volume.create("theirs", api_key=other)
    with pytest.raises(AuthenticationException):  # a token opens its own volume only
        Volume(volume_id=theirs.volume_id, name="theirs", token=vol.token).list("/")

    assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id)


def test_the_async_volume_class(server: tuple[ApiEnv, str, str]) -> None:
    async def run() -> Any:
        vol = await AsyncVolume.create("async-data")
        await vol.write_file("f.txt", "async")
        assert await vol.read_file("f.txt") == "async"
        assert [e.name for e in await vol.list("/")] == ["f.txt"]
        assert await vol.exists("f.txt")
        await vol.remove("f.txt")
        assert not await vol.exists("f.txt")
        assert await AsyncVolume.destroy(vol.volume_id) is True

    asyncio.run(run())
