"""Put the data dir on a reflink-capable file system.

Snapshot capture is a few ms with reflinks and seconds without, so when the host's file
system cannot reflink (ext4) the data dir becomes a loop-mounted XFS image
(``<parent>/<name>.xfs.img``, sparse, ``mkfs.xfs -m reflink=1``). Idempotent: run at every
start; an existing image is mounted again, a mounted one is left alone.

Pal does not unmount it when `pal up` stops: the store and images live there, and other
commands (`pal tenants`, `pal image build`) use them between runs. `pal data-dir umount`
takes it down explicitly.
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
        os.chmod(image, 0o600)  # an image an older Pal left readable to all
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
        # Root's alone, whatever the umask: the image holds every snapshot (guest memory).
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(size)
        try:
            _run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)])
        except VmmError:
            image.unlink(missing_ok=True)
            raise
        action = CREATED
    os.chmod(image, 0o600)  # also an image an older Pal left readable to all
    _run(["mount", "-o", "loop", str(image), str(data_dir)])
    if not reflink_supported(data_dir):
        raise VmmError(f"{image} mounted at {data_dir} but reflink still fails")
    log(f"data dir {data_dir}: loop-mounted reflink XFS image {image}")
    return action


NOT_MOUNTED = "not-mounted"  # nothing of ours is mounted there
UNMOUNTED = "unmounted"


def umount_reflink_datadir(settings: Settings, log: Log = print) -> str:
    """Unmount the loop XFS image that :func:`ensure_reflink_datadir` mounted on the data
    dir (the image file stays; the next start mounts it again). Refuses a mount Pal did not
    make, and a busy one (a server still running on it)."""
    data_dir = settings.data_dir.resolve() if settings.data_dir.exists() else settings.data_dir
    if not os.path.ismount(data_dir):
        log(f"data dir {data_dir}: nothing mounted")
        return NOT_MOUNTED
    image = xfs_image_path(data_dir)
    source = _mount_source(data_dir)
    if source != str(image):
        raise Unavailable(f"{data_dir} is a mount of {source}, not Pal's XFS image {image}; leaving it alone")
    res = subprocess.run(["umount", str(data_dir)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise Unavailable(
            f"cannot unmount {data_dir}: {(res.stderr or res.stdout).strip()} (stop `pal up` on it first)"
        )
    log(f"data dir {data_dir}: unmounted {image} (kept; `pal up` mounts it again)")
    return UNMOUNTED
