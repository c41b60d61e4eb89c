"""PID 1's system work: mounts, clock, kernel RNG, the brokered-secrets CA, growing the
root file system, and finding the host (virtio port, config drive, image config)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import time

from pal.guest import netsetup
from pal.guest import protocol as P
from pal.guest.children import DEFAULT_PATH
from pal.guest.oslib import libc, log

CONFIG_DRIVE = "/dev/vdb"
# Pal's own files in every image (pal/images/bundle.py): its loader, libraries and tools.
PAL_DIR = "/.pal"
PAL_LOADER = PAL_DIR + "/lib/ld-linux-x86-64.so.2"
IMAGE_CONFIG = PAL_DIR + "/config.json"  # the image's exec defaults (pal/images/config.py)
# Brokered secrets: the tenant CA the egress gateway signs with, trusted system-wide.
PAL_CA_FILE = "/etc/ssl/certs/pal-brokered-ca.pem"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/cert.pem",
)
CA_BEGIN = "# pal brokered-secrets CA (begin)\n"
CA_END = "# pal brokered-secrets CA (end)\n"


def set_wall_clock(now_ns: int) -> None:
    """After a restore the guest clock lags by the paused time: take the host's."""
    try:
        time.clock_settime_ns(time.CLOCK_REALTIME, now_ns)
    except OSError as exc:
        log(f"clock_settime failed: {exc}")


RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_kernel_rng(seed: bytes) -> None:
    """Forks share the kernel RNG state of their snapshot: mix in and credit a fresh seed."""
    try:
        with open("/dev/urandom", "wb") as f:
            f.write(seed)  # mixes in, credits nothing
            # rand_pool_info {int entropy_count (bits); int buf_size; u32 buf[]}
            fcntl.ioctl(f.fileno(), RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            # Credited entropy only reaches the CRNG at its next scheduled reseed (up to a
            # minute later on 6.1): force it now, so the next read already differs per fork.
            fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)
    except OSError as exc:
        log(f"RNG reseed failed: {exc}")


def _mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    if os.path.ismount(target):
        return
    rc = libc().mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None)
    if rc != 0:
        log(f"mount {fstype} on {target} failed: errno {ctypes.get_errno()}")


def install_ca(
    pem: str, bundles: tuple[str, ...] = SYSTEM_BUNDLES, ca_file: str = PAL_CA_FILE
) -> dict[str, str]:
    """Trust ``pem`` system-wide: its own file, and a marked block in the system bundle
    (replaced, not repeated, on the next identify). Returns the env vars that point
    OpenSSL, Python's requests and Node at it."""
    os.makedirs(os.path.dirname(ca_file), exist_ok=True)
    block = pem if pem.endswith("\n") else pem + "\n"
    _write_atomic(ca_file, block)
    bundle = next((b for b in bundles if os.path.exists(b)), bundles[0])
    real = os.path.realpath(bundle)
    try:
        with open(real) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if CA_BEGIN in text and CA_END in text:
        head, rest = text.split(CA_BEGIN, 1)
        text = head + rest.split(CA_END, 1)[1]
    if text and not text.endswith("\n"):
        text += "\n"
    os.makedirs(os.path.dirname(real), exist_ok=True)
    _write_atomic(real, text + CA_BEGIN + block + CA_END)
    return {"SSL_CERT_FILE": bundle, "REQUESTS_CA_BUNDLE": bundle, "NODE_EXTRA_CA_CERTS": ca_file}


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".pal-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def system_setup() -> None:
    nosuid, nodev, noexec = 2, 4, 8
    _mount("proc", "/proc", "proc", nosuid | nodev | noexec)
    _mount("sysfs", "/sys", "sysfs", nosuid | nodev | noexec)
    _mount("devtmpfs", "/dev", "devtmpfs", nosuid, "mode=0755")
    _mount("devpts", "/dev/pts", "devpts", nosuid | noexec, "gid=5,mode=0620,ptmxmode=0666")
    _mount("tmpfs", "/dev/shm", "tmpfs", nosuid | nodev, "mode=1777")
    _mount("tmpfs", "/tmp", "tmpfs", nosuid | nodev, "mode=1777")
    _mount("tmpfs", "/run", "tmpfs", nosuid | nodev, "mode=0755")
    for link, target in (("/dev/fd", "/proc/self/fd"), ("/dev/ptmx", "pts/ptmx")):
        if not os.path.lexists(link):
            with contextlib.suppress(OSError):
                os.symlink(target, link)
    try:
        netsetup.loopback_up()
    except OSError as exc:
        log(f"cannot bring up lo: {exc}")
    try:
        netsetup.network_up()
    except OSError as exc:
        log(f"cannot configure the NIC: {exc}")
    with contextlib.suppress(OSError):
        socket.sethostname("pal")
    os.environ.update({"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
    os.umask(0o022)
    # A stray SIGTERM/SIGINT to PID 1 must not stop the VM; SIGCHLD stays default so
    # children can be waited for (the reaper thread collects them).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    grow_root_fs()


def grow_root_fs(device: str = "/dev/vda") -> None:
    """Grow / to fill its disk when the host made the disk larger than the image (diskMib).

    Only at boot: a restored VM's disk comes from its snapshot, already grown.
    """
    try:
        with open(f"/sys/block/{os.path.basename(device)}/size") as f:
            disk_bytes = int(f.read()) * 512
        st = os.statvfs("/")
    except (OSError, ValueError):
        return
    if disk_bytes <= st.f_blocks * st.f_frsize + 128 * 1024 * 1024:
        return  # same size as the image, give or take the file system's own overhead
    try:
        subprocess.run(pal_tool("resize2fs", device), check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        log(f"could not grow the root file system: {exc}")


def pal_tool(name: str, *args: str) -> list[str]:
    """argv running one of Pal's bundled tools with Pal's own loader and libraries (any
    image, whatever its libc); the plain name where there is no bundle (host tests)."""
    if os.path.exists(PAL_LOADER):
        lib = PAL_DIR + "/lib"
        return [PAL_LOADER, "--library-path", lib, "--inhibit-cache", f"{PAL_DIR}/bin/{name}", *args]
    return [name, *args]


def read_image_config(path: str = IMAGE_CONFIG) -> P.Message | None:
    """The image's exec defaults, or None (an image without Pal's config: legacy defaults)."""
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read(1024 * 1024))
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def find_port(name: str = P.PORT_NAME, sys_dir: str = "/sys/class/virtio-ports") -> str | None:
    """/dev path of the virtio-serial port called ``name``, creating its node if missing."""
    try:
        ports = sorted(os.listdir(sys_dir))
    except FileNotFoundError:
        return None
    for port in ports:
        try:
            with open(os.path.join(sys_dir, port, "name")) as f:
                if f.read().strip() != name:
                    continue
            dev = f"/dev/{port}"
            if not os.path.exists(dev):
                with open(os.path.join(sys_dir, port, "dev")) as f:
                    major, minor = (int(x) for x in f.read().strip().split(":"))
                os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
            return dev
        except OSError:
            continue
    return None


def read_config_drive(path: str = CONFIG_DRIVE) -> P.Message | None:
    try:
        with open(path, "rb") as f:
            return P.decode_config(f.read(64 * 1024))
    except OSError:
        return None
