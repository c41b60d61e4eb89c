"""A tiny container image made from a directory tree: static busybox, no libc, no Python.

What `pal bench` and the tests import as "a user's own image": the smallest thing Pal must
run (its harness brings its own interpreter), built the way a user without Docker would,
with umoci (a layer per tree, whiteouts as their own layer) and skopeo (the archive).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from pal.images import oci
from pal.images.initramfs import BUSYBOX


def busybox_tree(root: Path, files: dict[str, str] | None = None, *, shell: bool = True) -> Path:
    """A root tree with busybox and its applets in /bin (``/bin/sh`` unless ``shell`` is
    False), plus ``files`` (path -> text)."""
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(BUSYBOX, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout
    for name in applets.split():
        if name in ("busybox", "init", "linuxrc") or (name == "sh" and not shell):
            continue
        link = root / "bin" / name
        if not link.exists():
            link.symlink_to("busybox")
    for path, text in (files or {}).items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def archive(
    work: Path,
    layers: list[Path | str],
    out: Path,
    config: dict[str, Any] | None = None,
    tag: str = "sample",
) -> Path:
    """An OCI archive at ``out`` whose layers are, in order, each tree in ``layers``
    (a Path) or a whiteout deleting that path (a str); ``config`` as ``oci.configure``."""
    first, *rest = layers
    if not isinstance(first, Path):
        raise ValueError("the first layer must be a tree")
    layout = work / "layout"
    shutil.rmtree(layout, ignore_errors=True)
    oci.pack_tree(first, layout, tag, config)
    for layer in rest:
        if isinstance(layer, Path):
            oci.insert(layout, tag, layer, "/")
        else:
            oci.whiteout(layout, tag, layer)
    oci.to_archive(layout, tag, out)
    shutil.rmtree(layout, ignore_errors=True)
    return out
