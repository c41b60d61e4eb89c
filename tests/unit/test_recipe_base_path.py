"""A recipe's base image is read by buildah from an ``oci:DIR`` path, which buildah (1.28)
parses as an image reference: lowercase only. A data dir from ``mktemp -d`` or under a home
directory has capitals, so the base is mounted at a path of Pal's own while the build reads it."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

from pal.images import recipes

# A docker reference's name (github.com/distribution/reference): components of lowercase
# letters and digits joined by ".", "_", "__" or dashes, separated by "/".
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


def test_a_staging_dir_with_capitals_is_read_from_a_reference_path(tmp_path: Path) -> None:
    staging = tmp_path / "Data.Dir-aB3xY" / f"recipe-base-{os.getpid()}"
    staging.mkdir(parents=True)
    assert not _NAME.fullmatch("localhost" + str(staging / "base"))  # buildah refuses this one
    (staging / "base").mkdir()
    (staging / "base" / "oci-layout").write_text("{}")
    with recipes._at_a_reference_path(staging) as at:
        assert _NAME.fullmatch("localhost" + str(at / "base")), at
        assert (at / "base" / "oci-layout").read_text() == "{}"
        (at / "base" / "index.json").write_text("[]")  # what the export writes lands in staging
        assert _mounted(at)
    assert (staging / "base" / "index.json").read_text() == "[]"
    assert not _mounted(at) and not at.exists()


def test_a_mount_left_by_a_killed_build_is_swept_by_the_next(tmp_path: Path) -> None:
    staging = tmp_path / "Staging"
    staging.mkdir()
    dead = recipes.BASE_MOUNTS / "999999999"  # above pid_max: no such process
    dead.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(staging), str(dead)], check=True)
    try:
        with recipes._at_a_reference_path(staging):
            assert not _mounted(dead) and not dead.exists()
    finally:
        subprocess.run(["umount", "--lazy", str(dead)], capture_output=True, check=False)
        with contextlib.suppress(FileNotFoundError):
            dead.rmdir()
