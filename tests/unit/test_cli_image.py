"""`pal image` as an operator runs it, on a data dir with real image directories (the
Debian build step faked, everything after it real): who may use a new image is settled
before it is published, `--warm` that builds nothing fails, `ls` shows each column, and
`rm` is refused while a VM needs the image unless `--force`."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import pal.images.dockerfile
import pal.images.importer
from pal.cli.main import app
from pal.config import Settings
from pal.errors import Unavailable
from pal.images import assemble, builder, bundle, initramfs
from pal.manager.templates import COMPLETE, RECIPE
from pal.scheduler.node_client import HttpNode
from pal.store import Store, VmRecord
from pal.wire import verbs
from pal.wire.models import WarmRequest, WarmResult

runner = CliRunner()


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data dir a server has used (its store exists), with tenants acme and other."""
    import pal.server
    import pal.vmm.datadir

    # The real ones would loop-mount an XFS image on this non-reflink tmp dir.
    monkeypatch.setattr(pal.vmm.datadir, "ensure_reflink_datadir", lambda s, log: "native")
    monkeypatch.setattr(pal.server, "prepare_data_dir", lambda s: "native")
    store = Store.open(Settings(data_dir=tmp_path))
    try:
        store.create_tenant("acme", 5)
        store.create_tenant("other", 5)
    finally:
        store.close()
    return tmp_path


def _tenant_id(data: Path, name: str) -> str:
    store = Store.open(Settings(data_dir=data))
    try:
        return next(t.id for t in store.list_tenants() if t.name == name)
    finally:
        store.close()


def _fake_debian(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Fake only the Debian build step; publish (meta.json, the swap) is the real one.
    Returns what meta.json said at the moment each image became visible."""
    visible: dict[str, Any] = {}

    def build_into(settings: Settings, staging: Path, name: str, report: Any) -> dict[str, object]:
        calls.append(name)
        for f in ("vmlinux", "initrd.img", "rootfs.ext4"):
            (staging / f).write_bytes(b"x")
        h = bundle.guest_files_hash()
        return {
            "name": name,
            "kind": "debian",
            "harnessHash": h,
            "builderVersion": builder.BUILDER_VERSION,
            "initramfsHash": initramfs.recipe_hash(),
            "contentHash": f"{len(calls):02d}" + h[2:],
            "treeBytes": 300 * 1024**2,
            "builtAt": "2026-01-02T03:04:05Z",
        }

    swap = assemble.swap_into_place

    def watched_swap(staging: Path, final: Path) -> None:
        visible[final.name] = json.loads((staging / "meta.json").read_text())
        swap(staging, final)

    monkeypatch.setattr(builder, "_build_into", build_into)
    monkeypatch.setattr(assemble, "swap_into_place", watched_swap)
    return visible


def _pal(*args: str, data: Path, code: int = 0) -> Any:
    res = runner.invoke(app, ["--json", "image", *args, "--data-dir", str(data)])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout) if code == 0 else json.loads(res.stderr.strip().splitlines()[-1])["error"]


def _vm(data: Path, vm_id: str, image: str, state: str) -> None:
    store = Store.open(Settings(data_dir=data))
    now = datetime.now(UTC)
    try:
        with store.write() as tx:
            tx.insert_vm(
                VmRecord(
                    vm_id=vm_id,
                    tenant_id=_tenant_id(data, "acme"),
                    state=state,
                    image=image,
                    limits={"vcpus": 1, "memory_mib": 256, "disk_mib": 2048},
                    created_at=now,
                    updated_at=now,
                    token="tok",
                )
            )
    finally:
        store.close()


def test_tenants_are_in_the_image_before_it_is_published(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    visible = _fake_debian(calls, monkeypatch)
    acme = _tenant_id(data, "acme")
    _pal("build", "mini", "--tenant", "acme", data=data)
    assert visible["mini"]["tenants"] == [acme], "visible to acme only from its first moment"
    (row,) = _pal("ls", data=data)
    assert row["tenants"] == [acme]

    # A rebuild without --tenant keeps the list; with one, the new list is published with it.
    _pal("build", "mini", "--force", data=data)
    assert visible["mini"]["tenants"] == [acme]
    other = _tenant_id(data, "other")
    _pal("build", "mini", "--force", "--tenant", other, data=data)  # an id works as well as a name
    assert visible["mini"]["tenants"] == [other]
    assert len(calls) == 3


def test_an_unknown_tenant_fails_before_anything_is_built_or_imported(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _fake_debian(calls, monkeypatch)
    _pal("build", "mini", "--tenant", "acme", data=data)
    before = (data / "images" / "mini" / "meta.json").read_text()

    err = _pal("build", "mini", "--force", "--tenant", "nosuch", data=data, code=1)
    assert err["code"] == "NOT_FOUND" and "no tenant named 'nosuch'" in err["message"]
    assert calls == ["mini"], "nothing was built"
    assert (data / "images" / "mini" / "meta.json").read_text() == before, "the image is untouched"
    err = _pal("build", "fresh", "--tenant", "nosuch", data=data, code=1)
    assert not (data / "images" / "fresh").exists(), "and no image open to every tenant appeared"

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(pal.images.importer, "import_image", lambda *a, **kw: started.append(kw))
    monkeypatch.setattr(pal.images.dockerfile, "build_dockerfile", lambda *a, **kw: started.append(kw))
    (data / "Dockerfile").write_text("FROM scratch\n")
    for args in (["import", "imp", str(data / "x.tar")], ["build", "df", "-f", str(data / "Dockerfile")]):
        err = _pal(*args, "--tenant", "acme", "--tenant", "nosuch", data=data, code=1)
        assert err["code"] == "NOT_FOUND" and "nosuch" in err["message"]
    assert started == [], "no import or buildah build was started"


def test_import_and_dockerfile_builds_get_the_tenant_ids(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_debian(calls, monkeypatch)
    _pal("build", "base", data=data)  # an image to stand in for what an import returns
    image = pal.images.load_image(Settings(data_dir=data), "base")
    got: list[Any] = []

    def fake(*_: object, **kw: object) -> Any:
        got.append(kw["tenants"])
        return image

    monkeypatch.setattr(pal.images.importer, "import_image", fake)
    monkeypatch.setattr(pal.images.dockerfile, "build_dockerfile", fake)
    (data / "Dockerfile").write_text("FROM scratch\n")
    _pal("import", "imp", str(data / "x.tar"), "--tenant", "acme", data=data)
    _pal("build", "df", "-f", str(data / "Dockerfile"), "--tenant", "other", data=data)
    _pal("import", "all", str(data / "x.tar"), data=data)
    assert got == [[_tenant_id(data, "acme")], [_tenant_id(data, "other")], None]


def test_warm_that_builds_no_template_exits_non_zero_saying_why(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_debian([], monkeypatch)
    err = _pal("build", "mini", "--warm", data=data, code=1)
    assert err["code"] == "UNAVAILABLE" and "no server is running" in err["message"], err
    assert "mini is installed" in err["message"] and "built on the first schedule" in err["message"]

    settings = Settings(data_dir=data)
    settings.manager_socket.parent.mkdir(parents=True, exist_ok=True)
    settings.manager_socket.touch()  # a server's socket (its answers are faked below)
    answers: list[Any] = [
        Unavailable("warm templates are disabled on this node (PAL_TEMPLATES=0)"),
        WarmResult(key="k-256m-1c-2048d", ready=False),
        WarmResult(key="k-256m-1c-2048d", ready=True),
    ]
    asked: list[WarmRequest] = []

    async def warm(self: HttpNode, verb: Any, req: WarmRequest) -> WarmResult:
        assert verb is verbs.WARM
        asked.append(req)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    monkeypatch.setattr(HttpNode, "call", warm)
    err = _pal("build", "mini", "--force", "--warm", data=data, code=1)
    assert err["code"] == "UNAVAILABLE" and "PAL_TEMPLATES=0" in err["message"], err
    err = _pal("build", "mini", "--force", "--warm", data=data, code=1)
    assert err["code"] == "TEMPLATE_FAILED" and "k-256m-1c-2048d failed" in err["message"], err
    res = runner.invoke(app, ["image", "build", "mini", "--force", "--warm", "--data-dir", str(data)])
    assert res.exit_code == 0 and "template k-256m-1c-2048d: ready" in res.stderr, res.output
    assert [(r.image, r.memory_mib, r.vcpus, r.disk_mib) for r in asked] == [("mini", 256, 1, 2048)] * 3


def test_ls_shows_each_column(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_debian([], monkeypatch)
    _pal("build", "mini", "--tenant", "acme", data=data)
    _pal("build", "open", data=data)
    images = {i.name: i for i in pal.images.paths.list_images(Settings(data_dir=data))}
    digest = images["mini"].agent_version_id
    for size, complete in (("256m-1c-2048d", True), ("512m-1c-2048d", True), ("1024m-1c-4096d", False)):
        d = data / "templates" / f"{digest}-{size}"
        d.mkdir(parents=True)
        if complete:  # a template still being built is not listed
            (d / COMPLETE).write_text(json.dumps({"recipe": RECIPE}))
    _vm(data, "vm-run", "mini", "running")
    _vm(data, "vm-paused", "mini", "paused")  # its snapshot needs the image
    _vm(data, "vm-gone", "mini", "terminated")
    _vm(data, "vm-failed", "mini", "failed")

    rows = {r["name"]: r for r in _pal("ls", data=data)}
    mini = rows["mini"]
    assert mini["kind"] == "debian" and mini["digest"] == digest and digest.startswith("sha256-")
    assert (mini["size"], mini["createdAt"]) == (300 * 1024**2, "2026-01-02T03:04:05Z")
    assert mini["templates"] == ["256m-1c-2048d", "512m-1c-2048d"]
    assert mini["vms"] == 2, "running and paused VMs count; terminated and failed ones do not"
    assert mini["tenants"] == [_tenant_id(data, "acme")] and mini["current"] is True
    assert (rows["open"]["templates"], rows["open"]["vms"], rows["open"]["tenants"]) == ([], 0, None)

    res = runner.invoke(app, ["image", "ls", "--table", "--data-dir", str(data)], terminal_width=200)
    assert res.exit_code == 0, res.output
    header, *lines = [line.split() for line in res.stdout.strip().splitlines() if line.strip()]
    assert header == [
        "name",
        "kind",
        "digest",
        "sourceDigest",
        "size",
        "createdAt",
        "templates",
        "vms",
        "tenants",
    ]
    table = "\n".join(" ".join(line) for line in lines)
    assert "300 MiB" in table and "256m-1c-2048d 512m-1c-2048d" in table and digest[:19] in table
    assert " all" in table, "an image open to every tenant says so"


def test_rm_is_refused_while_a_vm_needs_the_image_and_force_removes_it(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_debian([], monkeypatch)
    _pal("build", "mini", data=data)
    _pal("build", "spare", data=data)
    digest = pal.images.load_image(Settings(data_dir=data), "mini").agent_version_id
    tpl = data / "templates" / f"{digest}-256m-1c-2048d"
    tpl.mkdir(parents=True)
    (tpl / COMPLETE).write_text("{}")
    _vm(data, "vm-paused", "mini", "paused")
    _vm(data, "vm-gone", "spare", "terminated")

    err = _pal("rm", "mini", data=data, code=1)
    assert (
        err["code"] == "FAILED_PRECONDITION" and "vm-paused" in err["message"] and "--force" in err["message"]
    )
    assert (data / "images" / "mini" / "meta.json").is_file() and tpl.is_dir(), "nothing removed"

    done = _pal("rm", "mini", "--force", data=data)
    assert done == {"name": "mini", "removed": True, "vmsStillUsingIt": ["vm-paused"]}
    assert not (data / "images" / "mini").exists() and not tpl.exists(), "the image and its templates"
    assert [r["name"] for r in _pal("ls", data=data)] == ["spare"]

    assert _pal("rm", "spare", data=data)["removed"] is True, "a terminated VM needs nothing"
    err = _pal("rm", "spare", data=data, code=1)
    assert err["code"] == "IMAGE_NOT_FOUND", err
