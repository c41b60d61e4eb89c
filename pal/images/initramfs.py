"""The initramfs: static busybox, the virtio modules, mount /dev/vda, switch_root into it.

The cloud kernel has ext4 built in but virtio as modules, so this tiny stage exists only to
load them; it is kept small because every byte is decompressed on each cold boot. It is the
same for every image: it hands PID 1 to ``/.pal/init`` on the root disk (see bundle.py).
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import shutil
import subprocess
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
# Load order matters: each module's dependencies are resolved with modinfo and go first.
WANTED_MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_pci",
    "virtio_console",
    "virtio_blk",
    "virtio_rng",
    # The NIC (virtio_net needs failover and net_failover; resolved from modinfo), and
    # sock_diag for TCP so the harness can reset connections a snapshot froze open.
    "virtio_net",
    "inet_diag",
    "tcp_diag",
    # Free page reporting (docs/lifecycle.md, "Memory a guest frees"): the kernel hands
    # the host the pages it frees, so they leave the host and its snapshots.
    "virtio_balloon",
)
OPTIONAL_MODULES = frozenset({"virtio_pci", "virtio_rng"})
# Not in the initramfs (every cold boot decompresses it): the NFS client a volume mount
# needs (docs/volumes.md). The boot set keeps them decompressed; each image carries them at
# /.pal/modules, and the harness loads them at its first mount.
VOLUME_MODULES = ("nfsv3",)
REPORTING_ORDER = 7  # free page reporting's smallest block: 2^7 pages, 512 KiB

INIT_TEMPLATE = """#!/bin/busybox sh
# Pal initramfs: load virtio, mount the root disk, hand PID 1 to /.pal/init (every image).
B=/bin/busybox
$B mount -t devtmpfs devtmpfs /dev
$B mount -t proc proc /proc
die() {{
    echo "<2>pal-initramfs: $*" > /dev/kmsg
    $B poweroff -f
}}
for m in {modules}; do
    $B insmod /lib/modules/$m.ko || echo "<3>pal-initramfs: insmod $m failed" > /dev/kmsg
done
# Free page reporting (virtio_balloon, just registered) from free blocks of 512 KiB instead
# of 2 MiB: it reports only while 32 blocks of its size are free above the low watermark,
# 64 MiB at 2 MiB, which a 256 MiB guest holding 64 MiB never has (measured: nothing went
# back; at 512 KiB its freed 32 MiB did). docs/lifecycle.md, "What a copy shares".
$B mount -t sysfs sysfs /sys
PRO=/sys/module/page_reporting/parameters/page_reporting_order
[ -w $PRO ] && echo {reporting_order} > $PRO
$B umount /sys
i=0
while [ ! -b /dev/vda ]; do
    i=$((i + 1))
    [ $i -gt 1000 ] && die "root disk /dev/vda did not appear"
    $B usleep 5000
done
$B mkdir -p /newroot
$B mount -t ext4 -o rw,noatime /dev/vda /newroot || die "cannot mount /dev/vda as ext4"
[ -x /newroot/.pal/init ] || die "/.pal/init missing on the root disk"
$B mkdir -p /newroot/dev
$B mount --move /dev /newroot/dev || die "cannot move /dev"
$B umount /proc
exec $B switch_root /newroot /.pal/init
"""


def recipe_hash(busybox: Path = BUSYBOX) -> str:
    """What decides the initramfs besides the kernel's modules: script, module list, busybox."""
    h = hashlib.sha256(INIT_TEMPLATE.encode() + str(REPORTING_ORDER).encode())
    h.update(" ".join(WANTED_MODULES).encode() + b"\n" + " ".join(sorted(OPTIONAL_MODULES)).encode())
    h.update(hashlib.sha256(busybox.read_bytes()).hexdigest().encode())
    return h.hexdigest()


def _module_index(modules_dir: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in modules_dir.rglob("*.ko*"):
        name = path.name.split(".ko", 1)[0].replace("-", "_")
        index[name] = path
    return index


def _depends(path: Path) -> list[str]:
    out = subprocess.run(
        ["modinfo", "-F", "depends", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    return [d.replace("-", "_") for d in out.split(",") if d]


def module_load_order(
    modules_dir: Path, wanted: tuple[str, ...] = WANTED_MODULES, skip: frozenset[str] = frozenset()
) -> list[tuple[str, Path]]:
    """Wanted modules plus their dependencies, dependencies first (none of ``skip``)."""
    index = _module_index(modules_dir)
    order: list[tuple[str, Path]] = []
    seen: set[str] = set(skip)

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = index[name]
        for dep in _depends(path):
            if dep not in index:
                raise RuntimeError(f"module {name} needs {dep}, which the kernel package lacks")
            visit(dep)
        order.append((name, path))

    for name in wanted:
        if name not in index:
            if name in OPTIONAL_MODULES:
                continue
            raise RuntimeError(f"kernel module {name} not found in {modules_dir}")
        visit(name)
    return order


def _copy_module(src: Path, dst: Path) -> None:
    # busybox insmod cannot read compressed modules: decompress at build time.
    if src.name.endswith(".ko.xz"):
        dst.write_bytes(lzma.decompress(src.read_bytes()))
    elif src.name.endswith(".ko.zst"):
        with dst.open("wb") as f:
            subprocess.run(["zstd", "-dc", str(src)], stdout=f, check=True)
    elif src.name.endswith(".ko.gz"):
        dst.write_bytes(gzip.decompress(src.read_bytes()))
    else:
        shutil.copyfile(src, dst)


def save_volume_modules(modules_dir: Path, out: Path, loaded: list[str]) -> list[str]:
    """The NFS client's modules (and what they need beyond ``loaded``, the initramfs's),
    decompressed into ``out`` with ``order`` naming them in load order; their names."""
    out.mkdir(parents=True, exist_ok=True)
    order = module_load_order(modules_dir, VOLUME_MODULES, frozenset(loaded))
    for name, path in order:
        _copy_module(path, out / f"{name}.ko")
    names = [n for n, _ in order]
    (out / "order").write_text("\n".join(names) + "\n")
    return names


def build_initramfs(modules_dir: Path, work: Path, out: Path, busybox: Path = BUSYBOX) -> list[str]:
    """Write a gzip'd newc cpio to ``out``; returns the module names it loads, in order."""
    if not busybox.is_file():
        raise RuntimeError(f"{busybox} missing: install busybox-static")
    root = work / "initramfs"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
        (root / d).mkdir(parents=True)
    shutil.copyfile(busybox, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    (root / "bin/sh").symlink_to("busybox")
    order = module_load_order(modules_dir)
    for name, path in order:
        _copy_module(path, root / "lib/modules" / f"{name}.ko")
    init = root / "init"
    init.write_text(
        INIT_TEMPLATE.format(modules=" ".join(n for n, _ in order), reporting_order=REPORTING_ORDER)
    )
    init.chmod(0o755)
    # Sorted, fixed-owner archive so identical inputs give an identical initrd.
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cpio = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet", "--owner=0:0", "--reproducible"],
        input=("\n".join(files) + "\n").encode(),
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    out.write_bytes(gzip.compress(cpio, compresslevel=6, mtime=0))
    return [n for n, _ in order]
