"""Put the data dir on a reflink-capable file system.

Snapshot capture is a few ms with reflinks and seconds without, so when the host's file
system cannot reflink (ext4) the data dir becomes a loop-mounted XFS image
(``<parent>/<name>.xfs.img``, sparse, ``mkfs.xfs -m reflink=1``). Idempotent: run at every
start; an existing image is mounted again, a mounted one is left alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from pal.config import Settings
from pal.errors import Unavailable
from pal.vmm.disks import reflink_supported
from pal.vmm.errors import VmmError

Log = Callable[[str], object]

NATIVE = "native"  # the data dir's own file system reflinks
ALREADY_MOUNTED = "already-mounted"  # our XFS image is mounted there already
MOUNTED = "mounted"  # mounted an existing XFS image
CREATED = "created"  # created, formatted and mounted a new XFS image


def xfs_image_path(data_dir: Path) -> Path:
    return data_dir.parent / f"{data_dir.name}.xfs.img"


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise VmmError(f"{' '.join(argv)} failed: {(res.stderr or res.stdout).strip()}")


def _mount_source(target: Path) -> str | None:
    """The backing file of the loop device mounted at ``target``, or the device itself."""
    res = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", "--mountpoint", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    src = res.stdout.strip()
    if not src:
        return None
    if src.startswith("/dev/loop"):
        back = Path("/sys/block") / Path(src).name / "loop" / "backing_file"
        if back.exists():
            return back.read_text().strip()
    return src


def ensure_reflink_datadir(settings: Settings, log: Log = print) -> str:
    """Make ``settings.data_dir`` reflink-capable; return what was done (see constants)."""
    data_dir = settings.data_dir.resolve() if settings.data_dir.exists() else settings.data_dir
    image = xfs_image_path(data_dir)
    if os.path.ismount(data_dir) and _mount_source(data_dir) == str(image):
        log(f"data dir {data_dir}: XFS image {image} already mounted")
        return ALREADY_MOUNTED
    data_dir.mkdir(parents=True, exist_ok=True)
    if reflink_supported(data_dir):
        log(f"data dir {data_dir}: file system supports reflink")
        return NATIVE
    if os.geteuid() != 0:
        raise Unavailable(
            f"data dir {data_dir} cannot reflink and creating a loop-mounted XFS image needs root; "
            f"run setup as root or put the data dir on XFS (reflink=1) or btrfs"
        )
    if any(data_dir.iterdir()):
        raise Unavailable(
            f"data dir {data_dir} cannot reflink and is not empty; move its contents away so a "
            f"reflink XFS image can be mounted there, or choose another --data-dir"
        )
    action = MOUNTED
    if not image.exists():
        size = settings.xfs_image_size_gib * 1024**3
        log(f"data dir {data_dir}: creating {settings.xfs_image_size_gib} GiB sparse XFS image {image}")
        with open(image, "wb") as f:
            f.truncate(size)
        try:
            _run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)])
        except VmmError:
            image.unlink(missing_ok=True)
            raise
        action = CREATED
    _run(["mount", "-o", "loop", str(image), str(data_dir)])
    if not reflink_supported(data_dir):
        raise VmmError(f"{image} mounted at {data_dir} but reflink still fails")
    log(f"data dir {data_dir}: loop-mounted reflink XFS image {image}")
    return action
