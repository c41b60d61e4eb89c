"""Image builder logic that needs no network: sources, loading, rebuild decisions, atomicity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pal.config import Settings
from pal.errors import BackendError, InvalidRequest
from pal.images import ImageNotFound, assemble, build_image, builder, bundle, initramfs, load_image, rootfs
from pal.images.apt_sources import host_sources


def test_host_sources_reads_one_line_and_deb822_and_drops_third_party(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib\n"
        "deb-src http://mirror.example/debian bookworm main\n"
    )
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\nComponents: main\n"
    )
    (d / "old.list.disabled").write_text("deb http://elsewhere.example/debian bookworm main\n")
    lines = [s.line() for s in host_sources(tmp_path, codename="bookworm")]
    assert lines == [
        "deb http://mirror.example/debian bookworm main contrib",
        "deb http://mirror.example/debian-security bookworm-security main",
    ]


def test_host_sources_without_the_release_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://mirror.example/debian trixie main\n")
    with pytest.raises(RuntimeError, match="no apt source for bookworm"):
        host_sources(tmp_path, codename="bookworm")


def test_load_image_missing_names_the_build_command(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(ImageNotFound) as err:
        load_image(settings, "x")
    assert err.value.message == "unknown image 'x': GET /v1/images lists the images you may use"
    assert isinstance(err.value, InvalidRequest) and err.value.status == 400


def test_load_image_rejects_incomplete_images_and_bad_names(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    d = settings.images_dir / "half"
    d.mkdir(parents=True)
    (d / "vmlinux").write_bytes(b"k")
    (d / "meta.json").write_text(json.dumps({"contentHash": "ab" * 32}))
    with pytest.raises(ImageNotFound):
        load_image(settings, "half")
    with pytest.raises(InvalidRequest):
        load_image(settings, "../etc")


def _fake_build(calls: list[str], fail: bool = False) -> Any:
    def build_into(settings: Settings, staging: Path, name: str, report: Any) -> dict[str, object]:
        calls.append(name)
        report("fake step", 0.5)
        if fail:
            (staging / "vmlinux").write_bytes(b"partial")
            raise RuntimeError("mirror unreachable")
        for f in ("vmlinux", "initrd.img", "rootfs.ext4"):
            (staging / f).write_bytes(f"{f}-{len(calls)}".encode())
        (staging / "root").mkdir()  # work dirs must not end up in the image
        h = bundle.guest_files_hash()
        return {
            "name": name,
            "harnessHash": h,
            "builderVersion": builder.BUILDER_VERSION,
            "initramfsHash": initramfs.recipe_hash(),
            "contentHash": f"{len(calls):02d}" + h[2:],
        }

    return build_into


def test_build_reuses_a_current_image_and_rebuilds_on_harness_or_initramfs_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(builder, "_build_into", _fake_build(calls))
    steps: list[tuple[str, float]] = []
    first = build_image(settings, "default", progress=lambda s, f: steps.append((s, f)))
    assert steps[-1] == ("done", 1.0) and ("fake step", 0.5) in steps
    assert sorted(p.name for p in first.dir.iterdir()) == [
        "initrd.img",
        "meta.json",
        "rootfs.ext4",
        "vmlinux",
    ]
    assert first.agent_version_id == "sha256-" + first.meta["contentHash"]
    assert load_image(settings, "default").agent_version_id == first.agent_version_id

    again = build_image(settings, "default")
    assert calls == ["default"] and again.agent_version_id == first.agent_version_id

    monkeypatch.setattr(bundle, "guest_files_hash", lambda: "f" * 64)  # the harness changed
    rebuilt = build_image(settings, "default")
    assert calls == ["default", "default"]
    assert rebuilt.agent_version_id != first.agent_version_id
    assert rebuilt.vmlinux.read_bytes() == b"vmlinux-2"

    # A new initramfs (one more module: its boot set changes) rebuilds it too.
    monkeypatch.setattr(initramfs, "recipe_hash", lambda: "e" * 64)
    build_image(settings, "default")
    assert calls == ["default"] * 3
    build_image(settings, "default")
    assert calls == ["default"] * 3

    build_image(settings, "default", force=True)
    assert len(calls) == 4
    assert [p.name for p in settings.images_dir.iterdir() if p.name.startswith(".build")] == []


def test_failed_build_keeps_the_previous_image_and_leaves_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(data_dir=tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(builder, "_build_into", _fake_build(calls))
    good = build_image(settings)
    monkeypatch.setattr(builder, "_build_into", _fake_build(calls, fail=True))
    with pytest.raises(BackendError, match="mirror unreachable"):
        build_image(settings, force=True)
    assert load_image(settings).agent_version_id == good.agent_version_id
    assert load_image(settings).vmlinux.read_bytes() == b"vmlinux-1"
    assert sorted(p.name for p in settings.images_dir.iterdir()) == ["default"]


def test_guest_files_hash_covers_harness_and_protocol(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = bundle.guest_files_hash()
    for path in bundle.guest_files():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(bundle, "GUEST_DIR", tmp_path)
    assert bundle.guest_files_hash() == base
    (tmp_path / "protocol.py").write_bytes(b"# changed\n")
    assert bundle.guest_files_hash() != base


def test_customise_and_finish_tree_add_workload_user_workspace_and_bundle(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    rootfs.customise(root)
    rootfs.customise(root)  # idempotent
    assert (root / "etc/passwd").read_text().count("pal:x:1000:1000:") == 1
    fake_bundle = tmp_path / "bundle"
    (fake_bundle / "harness").mkdir(parents=True)
    (fake_bundle / "init").write_text("#!/.pal/bin/busybox sh\n")
    cfg = assemble.finish_tree(root, fake_bundle, assemble.OciRunConfig())
    assert (cfg.user, cfg.uid, cfg.gid, cfg.home) == ("pal", 1000, 1000, "/home/pal")
    assert (root / "workspace").stat().st_uid == 1000
    assert (root / ".pal/init").read_text().startswith("#!/.pal/bin/busybox sh")
    assert json.loads((root / ".pal/config.json").read_text())["user"] == "pal"
    assert "127.0.0.1 localhost" in (root / "etc/hosts").read_text()
