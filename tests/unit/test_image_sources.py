"""What `pal image import SOURCE` makes of SOURCE, before skopeo is involved."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from pal.errors import InvalidRequest
from pal.images.oci import check_platform, source_ref


def _tar(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w") as tar:
        for n in names:
            info = tarfile.TarInfo(n)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    return path


def test_archives_dirs_and_registry_references(tmp_path: Path) -> None:
    docker = _tar(tmp_path / "d.tar", ["manifest.json", "abc/layer.tar"])
    assert source_ref(str(docker)) == f"docker-archive:{docker}"
    oci = _tar(tmp_path / "o.tar", ["oci-layout", "index.json", "blobs/sha256/x"])
    assert source_ref(str(oci)) == f"oci-archive:{oci}"
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "oci-layout").write_text("{}")
    assert source_ref(str(layout)) == f"oci:{layout}"
    assert source_ref("docker.io/library/alpine:3.20") == "docker://docker.io/library/alpine:3.20"
    assert source_ref("oci:/somewhere:tag") == "oci:/somewhere:tag"  # explicit transports pass


def test_what_is_not_an_image_is_refused_with_the_reason(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x00garbage" * 200)
    with pytest.raises(InvalidRequest, match="not a readable image archive"):
        source_ref(str(junk))
    other = _tar(tmp_path / "other.tar", ["etc/passwd"])
    with pytest.raises(InvalidRequest, match="neither a Docker archive"):
        source_ref(str(other))
    (tmp_path / "plain").mkdir()
    with pytest.raises(InvalidRequest, match="not an OCI layout"):
        source_ref(str(tmp_path / "plain"))
    with pytest.raises(InvalidRequest, match="no such file"):
        source_ref(str(tmp_path / "missing.tar"))


def test_only_linux_amd64_images() -> None:
    check_platform({"architecture": "amd64", "os": "linux"}, "x")
    with pytest.raises(InvalidRequest, match="architecture arm64; Pal runs linux/amd64"):
        check_platform({"architecture": "arm64", "os": "linux"}, "x")
    with pytest.raises(InvalidRequest, match="is for windows/amd64"):
        check_platform({"architecture": "amd64", "os": "windows"}, "x")
