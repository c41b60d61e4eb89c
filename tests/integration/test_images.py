"""Issue 15: sandboxes from the user's own images, each with its own warm template.

Images are made here the way a user without Docker would (umoci + skopeo, pal/images/
sample.py; a static-busybox tree: no libc, no Python) or with a Dockerfile FROM Pal's
exported default image (buildah), and imported with the `pal image` CLI into the session
server's data dir, as an operator would.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pal.images import oci, sample
from tests.conftest import PalServer, pal_cli

pytestmark = pytest.mark.vm


def cli(server: PalServer, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return pal_cli("image", *args, "--data-dir", str(server.data_dir), check=check)


def cli_error(server: PalServer, *args: str) -> dict[str, str]:
    """The error of a failed `pal --json image ...` (JSON on stderr, as a script reads it)."""
    res = pal_cli("--json", "image", *args, "--data-dir", str(server.data_dir), check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    return dict(json.loads(res.stderr.strip().splitlines()[-1])["error"])


def sh(api: httpx.Client, vm: str, line: str, **extra: object) -> str:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line], **extra})
    assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
    return str(r.json()["stdout"])


def schedule(api: httpx.Client, image: str) -> dict[str, str]:
    r = api.post("/v1/runtime/schedule", json={"image": image})
    assert r.status_code == 200, r.text
    return dict(r.json())


def post_ok(api: httpx.Client, path: str, **kw: object) -> dict[str, object]:
    r = api.post(path, **kw)  # type: ignore[arg-type]
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
    return dict(r.json())


def images_of(api: httpx.Client) -> dict[str, dict[str, object]]:
    r = api.get("/v1/images")
    assert r.status_code == 200, r.text
    return {i["name"]: i for i in r.json()["images"]}


def bbx_archive(work: Path, motd: str) -> Path:
    """Two layers: a busybox tree with /gone.txt and its own user `agent` (USER), then a
    whiteout deleting /gone.txt."""
    files = {
        "etc/motd": motd + "\n",
        "gone.txt": "lower\n",
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nagent:x:1234:1234::/home/agent:/bin/sh\n",
        "etc/group": "root:x:0:\nagent:x:1234:\n",
    }
    lower = sample.busybox_tree(work / f"lower-{motd}", files)
    cfg = {"env": ["FOO=bar", "PATH=/bin"], "workdir": "/srv", "user": "agent", "cmd": ["/bin/sh"]}
    return sample.archive(work, [lower, "/gone.txt"], work / f"bbx-{motd}.tar", cfg)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def bbx(pal_server: PalServer, work: Path) -> Iterator[str]:
    """A busybox image imported with --warm (its template is built before the import returns)."""
    name = f"it-bbx-{uuid.uuid4().hex[:6]}"
    res = cli(pal_server, "import", name, str(bbx_archive(work, "v1")), "--warm")
    assert json.loads(res.stdout)["config"]["workdir"] == "/srv"
    assert "ready" in res.stderr, res.stderr
    try:
        yield name
    finally:
        cli(pal_server, "rm", name, "--force", check=False)


def test_docker_archives_and_oci_layout_dirs_import_too(
    pal_server: PalServer, tenant_key: str, work: Path
) -> None:
    layout = work / "dir-layout"
    oci.pack_tree(sample.busybox_tree(work / "dir-tree"), layout, "t1", {"user": "0"})
    docker = work / "docker.tar"
    oci.copy_to_archive(layout, "t1", f"docker-archive:{docker}:example.com/app:1")
    with tarfile.open(docker) as tar:  # the image id `docker load` would show
        config_file = json.load(tar.extractfile("manifest.json"))[0]["Config"]  # type: ignore[arg-type]
    docker_id = "sha256:" + Path(config_file).name.removesuffix(".json")
    oci_id = oci.read_layout(layout, "t1").config_digest
    for name, source, image_id in (("it-dock", docker, docker_id), ("it-dir", layout, oci_id)):
        res = json.loads(cli(pal_server, "import", name, str(source), "--tenant", "it-main").stdout)
        assert res["sourceDigest"] == image_id and res["config"]["user"] == "0", res
        assert res["config"]["uid"] == 0  # USER 0: root is the workload user
        row = {r["name"]: r for r in json.loads(cli(pal_server, "ls").stdout)}[name]
        assert (row["kind"], row["sourceDigest"], row["vms"]) == ("import", image_id, 0), row
        assert len(row["tenants"]) == 1 and row["size"] > 0, row  # it-main's id, set at import
        cli(pal_server, "rm", name)


def test_bad_archives_wrong_arch_and_no_shell_are_refused_with_clear_errors(
    pal_server: PalServer, work: Path
) -> None:
    garbage = work / "garbage.tar"
    garbage.write_bytes(b"this is not a tar archive\n" * 100)
    err = cli_error(pal_server, "import", "it-bad", str(garbage))
    assert err["code"] == "INVALID_ARGUMENT" and "not a readable image archive" in err["message"]

    good = bbx_archive(work, "cut")
    cut = work / "cut.tar"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    err = cli_error(pal_server, "import", "it-bad", str(cut))
    assert err["code"] == "INVALID_ARGUMENT" and str(cut) in err["message"], err

    arm = sample.archive(
        work, [sample.busybox_tree(work / "arm")], work / "arm.tar", {"architecture": "arm64"}
    )
    err = cli_error(pal_server, "import", "it-bad", str(arm))
    assert "architecture arm64" in err["message"] and "amd64" in err["message"], err

    shell_less = sample.archive(work, [sample.busybox_tree(work / "nosh", shell=False)], work / "nosh.tar")
    err = cli_error(pal_server, "import", "it-bad", str(shell_less))
    assert "no /bin/sh" in err["message"], err

    listed = json.loads(cli(pal_server, "ls").stdout)
    assert "it-bad" not in [i["name"] for i in listed]
    leftovers = [p.name for p in (pal_server.data_dir / "images").iterdir() if p.name.startswith(".build")]
    assert leftovers == []


def test_a_custom_image_runs_beside_default_with_its_template_pause_resume_and_fork(
    pal_server: PalServer, api: httpx.Client, tenant_key: str, bbx: str, work: Path
) -> None:
    listed = images_of(api)
    assert {"default", bbx} <= set(listed)
    mine = listed[bbx]
    assert (mine["workdir"], mine["user"]) == ("/srv", "agent")
    assert mine["env"] == {"FOO": "bar", "PATH": "/bin"}
    assert str(mine["digest"]).startswith("sha256-") and "256m-1c-2048d" in mine["warmSizes"]  # type: ignore[operator]

    default_vm = schedule(api, "default")["vmId"]
    vm = schedule(api, bbx)
    assert vm["bootMethod"] == "template" and vm["image"] == bbx
    vm_id = vm["vmId"]
    try:
        # The whiteout deleted the lower layer's file; ENV, WORKDIR and USER apply.
        assert sh(api, vm_id, "test ! -e /gone.txt && cat /etc/motd; echo $FOO; pwd; id -un") == (
            "v1\nbar\n/srv\nagent\n"
        )
        assert sh(api, vm_id, "id -un", user="root") == "root\n"
        assert sh(api, vm_id, "id -un", user="pal") == "agent\n"  # "pal": the workload user
        bad_user = api.post(f"/v1/runtime/vms/{vm_id}/exec", json={"command": "true", "user": "nobody"})
        assert bad_user.status_code == 400, bad_user.text
        assert sh(api, default_vm, "python3 -c 'print(6*7)'") == "42\n"  # both run at once
        w = api.put(f"/v1/runtime/vms/{vm_id}/files/content", params={"path": "w.txt"}, content=b"hi")
        assert w.status_code == 200, w.text
        assert sh(api, vm_id, "stat -c %U /workspace/w.txt") == "agent\n"  # the files API's user too

        row = {r["name"]: r for r in json.loads(cli(pal_server, "ls").stdout)}[bbx]
        assert (row["digest"], row["vms"]) == (mine["digest"], 1) and "256m-1c-2048d" in row["templates"], row
        err = cli_error(pal_server, "rm", bbx)
        assert err["code"] == "FAILED_PRECONDITION" and vm_id in err["message"]

        # Pause, then replace the image: the paused VM resumes from its own snapshot.
        snap = post_ok(api, f"/v1/runtime/vms/{vm_id}/pause")
        assert snap["state"] == "paused"
        # The snapshot is filed under the image's content digest, not its name.
        snap_dir = pal_server.data_dir / "snapshots" / str(mine["digest"]) / vm_id / str(snap["snapshotId"])
        assert (snap_dir / "meta.json").is_file(), list((pal_server.data_dir / "snapshots").glob("*/*"))
        replaced = json.loads(cli(pal_server, "import", bbx, str(bbx_archive(work, "v2"))).stdout)
        assert replaced["digest"] != mine["digest"]
        assert post_ok(api, f"/v1/runtime/vms/{vm_id}/resume")["state"] == "running"
        assert sh(api, vm_id, "cat /etc/motd /workspace/w.txt") == "v1\nhi"
        fork = post_ok(api, f"/v1/runtime/vms/{vm_id}/fork", json={"count": 1})
        forks: list[dict[str, str]] = fork["forks"]  # type: ignore[assignment]
        assert forks[0]["state"] == "running", forks
        assert sh(api, forks[0]["vmId"], "cat /etc/motd; echo $FOO") == "v1\nbar\n"
        api.delete(f"/v1/runtime/vms/{forks[0]['vmId']}")

        fresh = schedule(api, bbx)  # a new VM gets the new image (no template yet: cold)
        assert fresh["bootMethod"] == "cold"
        assert sh(api, fresh["vmId"], "cat /etc/motd") == "v2\n"
        api.delete(f"/v1/runtime/vms/{fresh['vmId']}")

        # Per-tenant visibility: only it-main may use it now.
        cli(pal_server, "access", bbx, "--tenant", "it-main")
        with pal_server.client(pal_server.tenant(f"other-{uuid.uuid4().hex[:4]}")) as other:
            assert bbx not in images_of(other) and "default" in images_of(other)
            r = other.post("/v1/runtime/schedule", json={"image": bbx})
            assert r.status_code == 400 and r.json()["error"]["code"] == "IMAGE_NOT_FOUND", r.text
        assert bbx in images_of(api)
    finally:
        api.delete(f"/v1/runtime/vms/{vm_id}")
        api.delete(f"/v1/runtime/vms/{default_vm}")

    cli(pal_server, "rm", bbx)
    assert bbx not in images_of(api)
    r = api.post("/v1/runtime/schedule", json={"image": bbx})
    assert r.status_code == 400 and r.json()["error"]["code"] == "IMAGE_NOT_FOUND", r.text


def test_a_dockerfile_from_the_exported_default_image_builds_and_runs(
    pal_server: PalServer, api: httpx.Client, work: Path
) -> None:
    export = work / "pal-default-oci"
    ref = json.loads(cli(pal_server, "export", "default", "--oci", str(export)).stdout)["from"]
    assert ref == f"oci:{export}:default"
    ctx = work / "ctx"
    ctx.mkdir()
    (ctx / "greeting.txt").write_text("from the context\n")
    (ctx / "Dockerfile").write_text(
        f"FROM {ref}\n"
        "COPY greeting.txt /opt/greeting.txt\n"
        "RUN echo built-by-run > /opt/built && chmod 644 /opt/built\n"
        "ENV GREETING=hello\n"
        "WORKDIR /srv/app\n"
    )
    name = f"it-df-{uuid.uuid4().hex[:6]}"
    built = cli(pal_server, "build", name, "-f", str(ctx / "Dockerfile"))
    assert json.loads(built.stdout)["config"]["workdir"] == "/srv/app"
    vm = schedule(api, name)["vmId"]
    try:
        out = sh(
            api, vm, 'cat /opt/built /opt/greeting.txt; echo "$GREETING"; pwd; id -un; python3 -c "print(1)"'
        )
        assert out == "built-by-run\nfrom the context\nhello\n/srv/app\npal\n1\n"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")
        cli(pal_server, "rm", name, "--force", check=False)
