"""From a root file system tree to a published image: the steps every image shares.

Whatever the tree came from (Debian packages, a container image, a Dockerfile), Pal adds
the same things to it: the guest bundle at ``/.pal`` (harness, its own interpreter, init),
the image's exec defaults in ``/.pal/config.json``, the workload user when the image names
none, ``/workspace`` owned by the workload user, and /etc/hosts and /etc/hostname when
missing. The tree is then packed into a sparse ext4 (``mkfs.ext4 -d``), and the image
directory is swapped into place in one step: readers never see half an image.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.guest.protocol import GATEWAY_IP
from pal.images import bundle, initramfs, rootfs
from pal.images.boot import MODULES, BootSet
from pal.images.config import ImageConfig, OciRunConfig, resolve
from pal.images.paths import META, ROOTFS, ImagePaths, image_dir
from pal.images.tree import in_root, make_public_dirs, write_public
from pal.pids import pid_alive

# Bump when the assembly recipe changes in a way the input hashes do not capture.
# 3: /etc/resolv.conf names the egress gateway; 4: system files 0644 under umask 077;
# 5: /.pal readable by the workload user (code contexts run its python); 6: /.pal/modules
# (the NFS client, docs/volumes.md); 7: /etc/profile without `id -u` for bash
# (rootfs.cheap_login_profile)
BUILDER_VERSION = 7
CONFIG_FILE = "config.json"  # /.pal/config.json
HOSTNAME = "pal"

Progress = Callable[[str, float], None]


def quiet(_step: str, _fraction: float) -> None:
    pass


def finish_tree(
    root: Path, bundle_dir: Path, run: OciRunConfig, boot_set: BootSet | None = None
) -> ImageConfig:
    """Add Pal's part to the tree at ``root``; returns the image's resolved exec defaults.
    With ``boot_set``, its volume modules go to ``/.pal/modules`` (the harness loads them
    at a VM's first volume mount)."""
    cfg = resolve(root, run)
    bundle.install(bundle_dir, root)
    if boot_set is not None and (boot_set.dir / MODULES).is_dir():
        shutil.copytree(boot_set.dir / MODULES, root / bundle.PAL_DIR / MODULES)
    write_public(root / bundle.PAL_DIR / CONFIG_FILE, json.dumps(cfg.to_json(), sort_keys=True) + "\n")
    # Not followed if it is a link: Pal gives the workload user this directory, not
    # whatever it points to (/etc, say).
    workspace = in_root(root, "workspace", follow_last=False)
    if workspace.is_symlink() or (workspace.exists() and not workspace.is_dir()):
        raise InvalidRequest("the image's /workspace is not a directory; Pal serves files there")
    make_public_dirs(workspace)
    os.chown(workspace, cfg.uid, cfg.gid)
    workspace.chmod(0o755)
    if cfg.home != "/":
        home = in_root(root, cfg.home)
        if not home.exists():
            make_public_dirs(home)
            home.chmod(0o750)
            os.chown(home, cfg.uid, cfg.gid)
    if cfg.workdir:
        make_public_dirs(in_root(root, cfg.workdir))
    make_public_dirs(in_root(root, "etc"))
    hostname = in_root(root, "etc/hostname")
    if not hostname.exists():
        write_public(hostname, HOSTNAME + "\n")
    hosts = in_root(root, "etc/hosts")
    if not hosts.exists():
        write_public(hosts, f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n::1 localhost\n")
    # The guest's one DNS server is the host side of its NIC (the egress gateway), whatever
    # the image shipped (often a symlink to a resolver stub that does not run here).
    resolv = in_root(root, "etc/resolv.conf", follow_last=False)
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    write_public(resolv, f"nameserver {GATEWAY_IP}\noptions timeout:2 attempts:2\n")
    return cfg


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in (str(BUILDER_VERSION), *parts):
        h.update(part.encode() + b"\n")
    return h.hexdigest()


def pack(root: Path, staging: Path, max_bytes: int | None = None) -> dict[str, int]:
    """The tree as ``staging/rootfs.ext4``; refuses a tree larger than ``max_bytes``."""
    need = rootfs.tree_bytes(root)
    if max_bytes is not None and need > max_bytes:
        raise InvalidRequest(
            f"image is too big: {need / 1024**3:.1f} GiB unpacked, over the "
            f"{max_bytes / 1024**3:.0f} GiB limit (PAL_IMAGE_MAX_GIB)"
        )
    image = staging / ROOTFS
    rootfs.make_ext4(root, image, rootfs.ext4_size_for(need))
    st = image.stat()
    return {"treeBytes": need, "rootfsBytes": st.st_size, "rootfsAllocatedBytes": st.st_blocks * 512}


WORK_PREFIXES = (".build-", ".buildah-", ".rm-")  # work dirs: <prefix><name>-<pid of the builder>


def remove_stale_work(images_dir: Path) -> list[str]:
    """Work dirs left by builds that died (killed, crashed); a live build's are kept."""
    removed = []
    for d in images_dir.iterdir() if images_dir.is_dir() else []:
        pid = d.name.rsplit("-", 1)[-1]
        if d.name.startswith(WORK_PREFIXES) and pid.isdigit() and not pid_alive(int(pid)):
            if d.name.startswith(".buildah-"):
                unmount_under(d)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def unmount_under(path: Path) -> None:
    """Lazily unmount whatever is mounted below ``path`` (buildah's overlay mounts)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mnt in sorted((m for m in mounts if m.startswith(f"{path}/")), reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)


def new_staging(settings: Settings, name: str) -> Path:
    settings.images_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_work(settings.images_dir)
    staging = settings.images_dir / f".build-{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def base_meta(name: str, boot_set: BootSet, cfg: ImageConfig, kind: str) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "boot": boot_set.id,
        "kernelVersion": boot_set.kernel_version,
        "builtAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "builderVersion": BUILDER_VERSION,
        "harnessHash": bundle.guest_files_hash(),
        "initramfsHash": initramfs.recipe_hash(),  # its boot set's (builder.is_current)
        "config": cfg.to_json(),
    }


def publish(
    settings: Settings, name: str, staging: Path, meta: dict[str, Any], tenants: list[str] | None = None
) -> ImagePaths:
    """Write meta.json and swap ``staging`` in as image ``name``.

    ``tenants``: the tenant ids that may use it; None keeps the replaced image's list (every
    tenant for a new image). Written into meta.json before the swap, so an image meant for
    some tenants is never visible to the others, not even for a moment.
    """
    final = image_dir(settings, name)
    old = _read_json(final / META)
    if tenants is not None:
        meta["tenants"] = list(tenants)
    elif "tenants" not in meta and isinstance(old, dict) and old.get("tenants") is not None:
        meta["tenants"] = old["tenants"]  # a rebuild keeps who may use the image
    (staging / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for p in staging.iterdir():
        if p.is_dir() and p.name != "source":
            shutil.rmtree(p)
    swap_into_place(staging, final)
    return ImagePaths.at(name, final, meta)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def swap_into_place(staging: Path, final: Path) -> None:
    """Make ``staging`` visible as ``final`` in one step; readers never see a half image."""
    if not final.exists():
        os.rename(staging, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    rename_exchange = 2  # RENAME_EXCHANGE: atomically swap two paths (Linux >= 3.15)
    at_fdcwd = -100
    rc = libc.renameat2(at_fdcwd, bytes(staging), at_fdcwd, bytes(final), rename_exchange)
    if rc != 0:  # file system without RENAME_EXCHANGE: brief window with no image
        old = final.with_name(f".old-{final.name}")  # dot-dirs are never images
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(staging, final)
        staging = old
    shutil.rmtree(staging, ignore_errors=True)
