"""A volume's files without a sandbox (docs/volumes.md, "Files"): the node's code against a
hostile volume (symlinks in the middle and at the end, ``..``, absolute paths, fifos,
devices, hard links, huge files, huge directories), each test reaching something outside
the volume or a special file that an unguarded open would; then the API's shapes, codes
and the other tenant's 404 on the real Scheduler (tests/fakes.py binds the node's real
volume code)."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pal.errors import Conflict, InsufficientStorage, InvalidRequest, NotFound, PathEscape, TooLarge
from pal.manager.volume_content import VolumeContent
from pal.manager.volumes import VolumeFiles
from pal.wire.volumes import (
    VolumeAttrs,
    VolumeCreate,
    VolumeList,
    VolumeMkdir,
    VolumePath,
    VolumeRemove,
    VolumeWrite,
)
from tests.apienv import ApiEnv, make_api

ROOT = os.geteuid() == 0
V = "vol-a"


@pytest.fixture
async def vc(tmp_path: Path) -> VolumeContent:
    files = VolumeFiles(tmp_path / "volumes")
    await files.create(VolumeCreate(volume_id=V, tenant_id="t-1", size_mib=4))
    ids = (1000, 1000) if ROOT else (os.geteuid(), os.getegid())
    return VolumeContent(files, *ids)


def data(vc: VolumeContent) -> Path:
    return vc.volumes.data_dir(V)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the volumes (same file system), with a secret in it."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_text("host secret")
    return d


async def test_write_read_list_stat_mkdir_remove(vc: VolumeContent) -> None:
    wrote = await vc.write(VolumeWrite(volume_id=V, path="a/b/c.txt", data=b"hello"))
    assert (wrote.path, wrote.bytes_written) == ("a/b/c.txt", 5)
    got = await vc.read(VolumePath(volume_id=V, path="a/b/c.txt"))
    assert (got.data, got.truncated, got.size) == (b"hello", False, 5)
    f = data(vc) / "a/b/c.txt"
    if ROOT:  # the workload user's, as the NFS export squashes guests' writes
        for p in (f, f.parent, f.parent.parent):
            assert (p.stat().st_uid, p.stat().st_gid) == (1000, 1000)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert not [p for p in f.parent.iterdir() if p.name.startswith(".pal-write-")]

    top = await vc.list_dir(VolumeList(volume_id=V))
    assert [(e.name, e.type, e.path) for e in top.entries] == [("a", "dir", "a")]
    deep = await vc.list_dir(VolumeList(volume_id=V, depth=3))
    assert [e.path for e in deep.entries] == ["a", "a/b", "a/b/c.txt"]
    st = await vc.stat(VolumePath(volume_id=V, path="a/b/c.txt"))
    assert (st.type, st.size, st.name) == ("file", 5, "c.txt")
    assert (await vc.stat(VolumePath(volume_id=V))).type == "dir"
    with pytest.raises(NotFound) as nf:
        await vc.stat(VolumePath(volume_id=V, path="nope"))
    assert nf.value.code == "FILE_NOT_FOUND"

    assert (await vc.mkdir(VolumeMkdir(volume_id=V, path="x/y", parents=True))).created is True
    assert (await vc.mkdir(VolumeMkdir(volume_id=V, path="x/y", parents=True))).created is False
    with pytest.raises(Conflict):
        await vc.mkdir(VolumeMkdir(volume_id=V, path="x/y"))
    with pytest.raises(NotFound):
        await vc.mkdir(VolumeMkdir(volume_id=V, path="q/r"))
    with pytest.raises(InvalidRequest):  # a directory, without recursive
        await vc.remove(VolumeRemove(volume_id=V, path="a"))
    with pytest.raises(InvalidRequest):
        await vc.write(VolumeWrite(volume_id=V, path="a/b", data=b"x"))
    with pytest.raises(InvalidRequest):
        await vc.read(VolumePath(volume_id=V, path="a"))
    assert (await vc.remove(VolumeRemove(volume_id=V, path="a/b/c.txt"))).deleted
    assert (await vc.remove(VolumeRemove(volume_id=V, path="a", recursive=True))).deleted
    assert sorted(p.name for p in data(vc).iterdir()) == ["x"]
    with pytest.raises(NotFound):
        await vc.read(VolumePath(volume_id="vol-none", path="f"))


async def test_absolute_and_dotdot_paths_are_refused(vc: VolumeContent, outside: Path) -> None:
    escapes = [str(outside / "secret"), "../../outside/secret", "a/../../x", "/etc/passwd"]
    for path in escapes:
        with pytest.raises(PathEscape):
            await vc.read(VolumePath(volume_id=V, path=path))
        with pytest.raises(PathEscape):
            await vc.write(VolumeWrite(volume_id=V, path=path, data=b"pwned"))
        with pytest.raises(PathEscape):
            await vc.list_dir(VolumeList(volume_id=V, path=path))
    assert (outside / "secret").read_text() == "host secret"
    with pytest.raises(InvalidRequest):
        await vc.read(VolumePath(volume_id=V, path="a\0b"))


async def test_a_symlink_in_the_middle_is_never_followed(vc: VolumeContent, outside: Path) -> None:
    os.symlink(outside, data(vc) / "link")  # what a guest can make: a link to anywhere
    os.symlink(".", data(vc) / "here")  # even one that stays inside is not walked
    for path in ("link/secret", "here/link/secret"):
        with pytest.raises(PathEscape):
            await vc.read(VolumePath(volume_id=V, path=path))
        with pytest.raises(PathEscape):
            await vc.stat(VolumePath(volume_id=V, path=path))
        with pytest.raises(PathEscape):
            await vc.write(VolumeWrite(volume_id=V, path=path, data=b"pwned"))
        with pytest.raises(PathEscape):
            await vc.write(VolumeWrite(volume_id=V, path="link/new/deeper", data=b"pwned"))
        with pytest.raises(PathEscape):
            await vc.remove(VolumeRemove(volume_id=V, path=path))
        with pytest.raises(PathEscape):
            await vc.mkdir(VolumeMkdir(volume_id=V, path="link/made", parents=True))
    with pytest.raises(PathEscape):
        await vc.list_dir(VolumeList(volume_id=V, path="link"))
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "host secret"
    # A listing shows the links as links, and never descends through one.
    listed = await vc.list_dir(VolumeList(volume_id=V, depth=4))
    assert {(e.path, e.type, e.target) for e in listed.entries} == {
        ("link", "symlink", str(outside)),
        ("here", "symlink", "."),
    }


async def test_a_symlink_at_the_end_is_never_followed(vc: VolumeContent, outside: Path) -> None:
    os.symlink(outside / "secret", data(vc) / "s")
    with pytest.raises(PathEscape):
        await vc.read(VolumePath(volume_id=V, path="s"))
    st = await vc.stat(VolumePath(volume_id=V, path="s"))
    assert (st.type, st.target) == ("symlink", str(outside / "secret"))
    # A write replaces the link itself; the file it named is as it was.
    await vc.write(VolumeWrite(volume_id=V, path="s", data=b"mine"))
    assert (outside / "secret").read_text() == "host secret"
    assert not (data(vc) / "s").is_symlink() and (data(vc) / "s").read_bytes() == b"mine"
    # A remove takes the link, not its target; a recursive one does not descend through one.
    os.symlink(outside / "secret", data(vc) / "s2")
    os.mkdir(data(vc) / "d")
    os.symlink(outside, data(vc) / "d" / "to-outside")
    await vc.remove(VolumeRemove(volume_id=V, path="s2"))
    await vc.remove(VolumeRemove(volume_id=V, path="d", recursive=True))
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert not (data(vc) / "d").exists() and not (data(vc) / "s2").is_symlink()


async def test_attrs_change_the_inode_never_a_symlinks_target(vc: VolumeContent, outside: Path) -> None:
    (data(vc) / "f").write_text("x")
    owner = 1234 if ROOT else os.geteuid()  # only root gives a file away
    got = await vc.set_attrs(VolumeAttrs(volume_id=V, path="f", mode=0o600, uid=owner, gid=None))
    assert (got.mode, got.uid) == (0o600, owner)
    assert stat.S_IMODE((data(vc) / "f").stat().st_mode) == 0o600
    os.symlink(outside / "secret", data(vc) / "s")
    before = (outside / "secret").stat()
    with pytest.raises(PathEscape):
        await vc.set_attrs(VolumeAttrs(volume_id=V, path="s", mode=0o777, uid=0))
    os.symlink(outside, data(vc) / "d")
    with pytest.raises(PathEscape):
        await vc.set_attrs(VolumeAttrs(volume_id=V, path="d/secret", mode=0o777))
    after = (outside / "secret").stat()
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)


async def test_a_hard_link_is_replaced_never_written_through(vc: VolumeContent, outside: Path) -> None:
    os.link(outside / "secret", data(vc) / "hard")
    await vc.write(VolumeWrite(volume_id=V, path="hard", data=b"overwritten"))
    assert (outside / "secret").read_text() == "host secret"
    assert (data(vc) / "hard").read_bytes() == b"overwritten"


async def test_a_fifo_is_never_opened(vc: VolumeContent) -> None:
    fifo = data(vc) / "fifo"
    os.mkfifo(fifo)
    # A writer holds it open with bytes in it: an unguarded read would take them (and with
    # no writer, would wait forever).
    wfd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(wfd, b"in the pipe")
        with pytest.raises(InvalidRequest):
            await vc.read(VolumePath(volume_id=V, path="fifo"))
        assert os.read(wfd, 64) == b"in the pipe"  # still there: nobody read it
        await vc.write(VolumeWrite(volume_id=V, path="fifo", data=b"file now"))  # replaced
        assert (data(vc) / "fifo").read_bytes() == b"file now"
    finally:
        os.close(wfd)
    st = await vc.stat(VolumePath(volume_id=V, path="fifo"))
    assert st.type == "file"


@pytest.mark.skipif(not ROOT, reason="making a device node needs root")
async def test_a_device_node_is_never_opened(vc: VolumeContent) -> None:
    os.mknod(data(vc) / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    with pytest.raises(InvalidRequest):
        await vc.read(VolumePath(volume_id=V, path="zero"))
    assert (await vc.stat(VolumePath(volume_id=V, path="zero"))).type == "other"


async def test_reads_and_listings_are_bounded(vc: VolumeContent) -> None:
    with open(data(vc) / "huge", "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB to a reader, nothing on disk
    got = await vc.read(VolumePath(volume_id=V, path="huge"))
    assert (len(got.data), got.truncated, got.size) == (1 << 20, True, 8 << 30)
    many = data(vc) / "many"
    many.mkdir()
    for i in range(1005):
        (many / f"f{i:04}").touch()
    listed = await vc.list_dir(VolumeList(volume_id=V, path="many"))
    assert len(listed.entries) == 1000 and listed.truncated
    assert listed.entries[0].name == "f0000"
    deep = await vc.list_dir(VolumeList(volume_id=V, depth=2))
    assert len(deep.entries) == 1000 and deep.truncated
    with pytest.raises(TooLarge):
        await vc.write(VolumeWrite(volume_id=V, path="big", data=b"x" * ((1 << 20) + 1)))


async def test_writes_count_against_the_size(vc: VolumeContent) -> None:
    mib = b"x" * (1 << 20)
    for i in range(4):  # a volume of 4 MiB holds 4
        await vc.write(VolumeWrite(volume_id=V, path=f"f{i}", data=mib))
    with pytest.raises(InsufficientStorage):
        await vc.write(VolumeWrite(volume_id=V, path="f4", data=b"x"))
    assert not (data(vc) / "f4").exists()
    # Replacing a file counts only the difference; a removed one frees its room.
    await vc.write(VolumeWrite(volume_id=V, path="f0", data=mib))
    await vc.remove(VolumeRemove(volume_id=V, path="f1"))
    await vc.write(VolumeWrite(volume_id=V, path="f4", data=b"y" * (1 << 19)))
    # A guest's writes count once measured again.
    (data(vc) / "guest").write_bytes(b"z" * (1 << 19))
    vc.forget(V)
    with pytest.raises(InsufficientStorage):
        await vc.write(VolumeWrite(volume_id=V, path="f5", data=b"x" * 8192))


# -- through the API -------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    return make_api(tmp_path)


def _client(env: ApiEnv, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://localhost",
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(env, env.key_a) as c:
        yield c


async def test_the_files_api_of_a_volume(env: ApiEnv, client: httpx.AsyncClient) -> None:
    vol = (await client.post("/v1/volumes", json={"name": "data", "sizeMib": 8})).json()
    base = "/v1/volumes/data/files"
    resp = await client.put(f"{base}/content", params={"path": "dir/a.txt"}, content=b"hi there")
    assert resp.status_code == 200 and resp.json() == {"path": "dir/a.txt", "bytesWritten": 8}
    resp = await client.get(f"{base}/content", params={"path": "dir/a.txt"})
    assert resp.content == b"hi there" and resp.headers["content-type"].startswith("text/plain")
    await client.put(f"{base}/content", params={"path": "bin"}, content=b"\xff\xfe")
    resp = await client.get(f"/v1/volumes/{vol['volumeId']}/files/content", params={"path": "bin"})
    assert resp.headers["content-type"] == "application/octet-stream"

    listed = (await client.get(base)).json()
    assert [(e["name"], e["type"]) for e in listed["entries"]] == [("bin", "file"), ("dir", "dir")]
    assert listed["truncated"] is False and listed["path"] == ""
    assert set(listed["entries"][0]) == {"name", "type", "size", "path", "mode", "uid", "gid", "modifiedAt"}
    deep = (await client.get(base, params={"depth": 2})).json()
    assert [e["path"] for e in deep["entries"]] == ["bin", "dir", "dir/a.txt"]
    st = (await client.get(f"{base}/stat", params={"path": "dir/a.txt"})).json()
    assert st["type"] == "file" and st["size"] == 8
    resp = await client.get(f"{base}/stat", params={"path": "nope"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "FILE_NOT_FOUND"

    resp = await client.post(f"{base}/dir", params={"path": "p/q", "parents": "true"})
    assert resp.json() == {"path": "p/q", "created": True}
    resp = await client.delete(f"{base}/content", params={"path": "p"})
    assert resp.status_code == 400
    resp = await client.delete(f"{base}/content", params={"path": "p", "recursive": "true"})
    assert resp.json() == {"path": "p", "deleted": True}
    resp = await client.delete(f"{base}/content", params={"path": "dir/a.txt"})
    assert resp.json() == {"path": "dir/a.txt", "deleted": True}

    for path in ("../x", "/etc/passwd"):
        resp = await client.get(f"{base}/content", params={"path": path})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "PATH_ESCAPE"
    resp = await client.put(f"{base}/content", params={"path": "big"}, content=b"x" * ((1 << 20) + 1))
    assert resp.status_code == 413
    assert (await client.get(f"{base}/content")).status_code == 400  # path is required
    assert (await client.get("/v1/volumes/nope/files")).status_code == 404

    # The other tenant sees nothing of it, by name or by id.
    async with _client(env, env.key_b) as bob:
        for ref in ("data", vol["volumeId"]):
            for resp in (
                await bob.get(f"/v1/volumes/{ref}/files"),
                await bob.get(f"/v1/volumes/{ref}/files/content", params={"path": "bin"}),
                await bob.put(f"/v1/volumes/{ref}/files/content", params={"path": "x"}, content=b"x"),
                await bob.delete(f"/v1/volumes/{ref}/files/content", params={"path": "bin"}),
            ):
                assert resp.status_code == 404, resp.text
    assert (await client.get(f"{base}/content", params={"path": "bin"})).content == b"\xff\xfe"


async def test_a_full_volume_is_507(client: httpx.AsyncClient) -> None:
    await client.post("/v1/volumes", json={"name": "tiny", "sizeMib": 1})
    base = "/v1/volumes/tiny/files/content"
    assert (await client.put(base, params={"path": "a"}, content=b"x" * (600 << 10))).status_code == 200
    resp = await client.put(base, params={"path": "b"}, content=b"x" * (600 << 10))
    assert resp.status_code == 507 and resp.json()["error"]["code"] == "INSUFFICIENT_STORAGE"
