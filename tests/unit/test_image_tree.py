"""Editing an untrusted image tree: symlinks resolve inside it, exec defaults from its config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import BackendError, InvalidRequest
from pal.images import assemble, boot
from pal.images.config import ImageConfig, OciRunConfig, add_user, resolve
from pal.images.paths import ImageNotFound, image_for_restore
from pal.images.tree import in_root, is_executable_file


def _tree(tmp_path: Path, passwd: str = "root:x:0:0:root:/root:/bin/sh\n") -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text(passwd)
    (root / "etc/group").write_text("root:x:0:\n")
    return root


def test_symlinks_resolve_inside_the_tree_never_to_the_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "etc").symlink_to("/usr/etc")  # absolute: the guest's /usr/etc, not the host's
    (root / "up").symlink_to("../../../..")
    (root / "loop").symlink_to("loop")
    (root / "w").symlink_to("real")
    assert in_root(root, "etc/passwd") == root.resolve() / "usr/etc/passwd"
    assert in_root(root, "up/etc/shadow") == root.resolve() / "usr/etc/shadow"
    assert in_root(root, "../../x") == root.resolve() / "x"
    assert in_root(root, "w/file") == root.resolve() / "real/file"
    assert in_root(root, "w", follow_last=False) == root.resolve() / "w"
    with pytest.raises(InvalidRequest, match="symbolic links"):
        in_root(root, "loop/x")


def test_add_user_writes_through_an_absolute_etc_symlink_into_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "data/etc").mkdir(parents=True)
    (root / "etc").symlink_to("/data/etc")
    host_passwd = Path("/etc/passwd").read_text()
    uid, gid, home = add_user(root, "pal")
    assert (uid, gid, home) == (1000, 1000, "/home/pal")
    assert "pal:x:1000:1000:" in (root / "data/etc/passwd").read_text()
    assert Path("/etc/passwd").read_text() == host_passwd


def test_workload_user_is_pal_when_user_is_unset_on_a_free_uid(tmp_path: Path) -> None:
    root = _tree(tmp_path, "root:x:0:0:root:/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n")
    (root / "bin").mkdir()
    cfg = resolve(root, OciRunConfig(env={"A": "1"}, workdir="/app/", cmd=["node"]))
    assert (cfg.user, cfg.uid, cfg.gid, cfg.home) == ("pal", 1001, 1001, "/home/pal")
    assert cfg.env == {"A": "1"} and cfg.workdir == "/app" and cfg.cmd == ["node"]
    assert "pal:x:1001:1001:Pal workload:/home/pal:/bin/sh" in (root / "etc/passwd").read_text()
    assert resolve(root, OciRunConfig()).uid == 1001  # idempotent: the user exists now


def test_image_user_by_name_uid_and_group(tmp_path: Path) -> None:
    root = _tree(tmp_path, "root:x:0:0:root:/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nnode:x:1000:\nstaff:x:50:\n")
    assert resolve(root, OciRunConfig(user="node")) == ImageConfig(
        user="node", uid=1000, gid=1000, home="/home/node"
    )
    assert resolve(root, OciRunConfig(user="1000:staff")).gid == 50
    numeric = resolve(root, OciRunConfig(user="4242"))
    assert (numeric.user, numeric.uid, numeric.gid, numeric.home) == ("4242", 4242, 0, "/")
    assert resolve(root, OciRunConfig(user="root")).uid == 0
    with pytest.raises(InvalidRequest, match="'ghost' is not in the image's /etc/passwd"):
        resolve(root, OciRunConfig(user="ghost"))
    with pytest.raises(InvalidRequest, match="not an absolute path"):
        resolve(root, OciRunConfig(workdir="rel"))
    assert "pal:" not in (root / "etc/passwd").read_text()  # USER set: no pal user added


def test_oci_config_parsing_keeps_what_pal_honours() -> None:
    blob = {
        "architecture": "amd64",
        "config": {
            "Env": ["PATH=/opt/bin:/usr/bin", "EMPTY=", "BAD", "K=v=w"],
            "WorkingDir": "/srv",
            "User": "app",
            "Cmd": ["run"],
            "Entrypoint": ["/entry"],
        },
    }
    run = OciRunConfig.parse(blob)
    assert run.env == {"PATH": "/opt/bin:/usr/bin", "EMPTY": "", "K": "v=w"}
    assert (run.workdir, run.user, run.cmd, run.entrypoint) == ("/srv", "app", ["run"], ["/entry"])
    assert OciRunConfig.parse({}) == OciRunConfig()


def test_executable_check_follows_in_tree_links(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/busybox").write_bytes(b"\x7fELF")
    (root / "usr/bin/busybox").chmod(0o755)
    (root / "bin").symlink_to("usr/bin")
    (root / "usr/bin/sh").symlink_to("/usr/bin/busybox")
    assert is_executable_file(root, "bin/sh")
    (root / "usr/bin/busybox").chmod(0o644)
    assert not is_executable_file(root, "bin/sh")
    assert not is_executable_file(root, "bin/bash")


def _boot_set(settings: Settings, boot_id: str) -> None:
    d = boot.boot_root(settings.images_dir) / boot_id
    d.mkdir(parents=True)
    for name in (boot.VMLINUX, boot.INITRD):
        (d / name).write_bytes(boot_id.encode())
    (d / boot.BOOT_META).write_text(json.dumps({"kernelVersion": "k-" + boot_id}))


def _image(settings: Settings, name: str, boot_id: str) -> None:
    d = settings.images_dir / name
    d.mkdir(parents=True)
    (d / "rootfs.ext4").write_bytes(b"fs")
    (d / "meta.json").write_text(json.dumps({"contentHash": "c" * 64, "boot": boot_id}))


def test_a_restore_boots_the_snapshots_boot_set_even_after_the_image_changed(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    _boot_set(settings, "0" * 16)
    _boot_set(settings, "1" * 16)
    _image(settings, "web", "1" * 16)
    img = image_for_restore(settings, "web", "0" * 16)  # snapshot taken before the kernel update
    assert img.vmlinux.read_bytes() == b"0" * 16 and img.boot_id == "0" * 16
    assert image_for_restore(settings, "web", None).vmlinux.read_bytes() == b"1" * 16
    os.rename(settings.images_dir / "web", tmp_path / "gone")  # image removed (rm --force)
    assert image_for_restore(settings, "web", "1" * 16).initrd.read_bytes() == b"1" * 16
    with pytest.raises(ImageNotFound):
        image_for_restore(settings, "web", None)  # a legacy snapshot needs its image
    with pytest.raises(BackendError, match="boot set 2222222222222222"):
        image_for_restore(settings, "web", "2" * 16)


def _fake_bundle(tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    (b / "harness").mkdir(parents=True)
    (b / "init").write_text("#!/.pal/bin/busybox sh\n")
    return b


def test_a_workspace_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "workspace").symlink_to("/etc")
    with pytest.raises(InvalidRequest, match="/workspace is not a directory"):
        assemble.finish_tree(root, _fake_bundle(tmp_path), OciRunConfig())
    assert (root / "etc").stat().st_uid == os.getuid()  # nothing chowned to the workload user


def test_an_image_over_the_size_limit_is_refused_before_mkfs(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "big").write_bytes(b"x" * 300_000)
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(InvalidRequest, match=r"image is too big: .* \(PAL_IMAGE_MAX_GIB\)"):
        assemble.pack(root, staging, max_bytes=100_000)
    assert not (staging / "rootfs.ext4").exists()


def test_work_dirs_of_dead_builds_are_removed_live_ones_kept(tmp_path: Path) -> None:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    images = tmp_path / "images"
    for name in (f".build-x-{dead.pid}", f".buildah-y-{dead.pid}", f".build-z-{os.getpid()}", "default"):
        (images / name).mkdir(parents=True)
    assert sorted(assemble.remove_stale_work(images)) == [f".build-x-{dead.pid}", f".buildah-y-{dead.pid}"]
    assert sorted(p.name for p in images.iterdir()) == [f".build-z-{os.getpid()}", "default"]


def test_the_guests_system_files_are_readable_by_its_users_under_pals_umask(tmp_path: Path) -> None:
    """Pal runs with umask 077; the files it adds to an image (passwd, group, hosts,
    resolv.conf, /workspace, WORKDIR) must still be what a Linux guest's users can read
    (an unreadable passwd made `id -un` fail for the workload user)."""
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    old = os.umask(0o077)
    try:
        assemble.finish_tree(root, _fake_bundle(tmp_path), OciRunConfig(workdir="/srv/app"))
    finally:
        os.umask(old)
    for path, mode in (
        ("etc", 0o755),
        ("etc/passwd", 0o644),
        ("etc/group", 0o644),
        ("etc/hosts", 0o644),
        ("etc/hostname", 0o644),
        ("etc/resolv.conf", 0o644),
        ("workspace", 0o755),
        ("srv", 0o755),
        ("srv/app", 0o755),
        ("home/pal", 0o750),
    ):
        assert (root / path).stat().st_mode & 0o777 == mode, path
    assert "pal:x:1000:1000:" in (root / "etc/passwd").read_text()
