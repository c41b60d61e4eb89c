"""The guest's volume mounts (docs/volumes.md): NFSv3 from the node's volume server, at
``10.0.2.2`` (the host side of every VM's network; the egress gateway hands ports 2049 and
20048 to the server from this VM's own source address), each export named by its volume id.

The NFS client's modules are not in the initramfs (every cold boot would decompress them):
the image carries them at ``/.pal/modules`` (with ``order``), loaded here at the first
mount. The mount is one mount(2) call with the NFS client's text options (the kernel
speaks MOUNT itself: no rpcbind, no mount.nfs, no mount process). A mount already there
(a resume, a fork child: the kernel's mount came with the memory) is kept: its client
reconnects to the server at its next request.

Stdlib only, like the whole guest package.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import subprocess
import threading
import time
from typing import Any

from pal.guest import oslib

MODULES_DIR = "/.pal/modules"
BUSYBOX = "/.pal/bin/busybox"
SERVER = "10.0.2.2"
# hard: a request waits for the server (a node restart) rather than failing the workload's
# write; timeo 5 s, then the client retries on a new connection.
NFS_OPTS = "vers=3,proto=tcp,port=2049,mountport=20048,mountproto=tcp,nolock,hard,timeo=50,retrans=3"
MOUNT_TIMEOUT_S = 60.0
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
READAHEAD_KIB = 16384  # 16 x rsize, about what NFS's readahead was before Linux 5.4
MAX_MOUNTS = 16
# finit_module(2) by number (no libc wrapper): one syscall per module instead of a busybox
# insmod process each, which under TCG costs a fork and exec per module at the first mount.
FINIT_MODULE = {"x86_64": 313, "aarch64": 273}.get(platform.machine())


def _unescape(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as \\ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounted() -> dict[str, str]:
    """Mount point -> source of the NFS mounts now in place."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] in ("nfs", "nfs4"):
                    out[_unescape(parts[1])] = parts[0]
    except OSError:
        pass
    return out


def load_modules(modules_dir: str = MODULES_DIR) -> None:
    """Load the NFS client's modules (those not loaded yet), in their order."""
    if os.path.isdir("/sys/module/nfsv3"):
        return
    try:
        with open(os.path.join(modules_dir, "order")) as f:
            names = [n.strip() for n in f if n.strip()]
    except OSError as exc:
        raise OSError(f"this image has no NFS client modules ({modules_dir}): rebuild it") from exc
    for name in names:
        if not os.path.isdir(f"/sys/module/{name}"):
            _insmod(name, os.path.join(modules_dir, f"{name}.ko"))


def _insmod(name: str, path: str) -> None:
    if FINIT_MODULE is not None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if oslib.libc().syscall(FINIT_MODULE, fd, b"", 0) == 0:
                return
            err = ctypes.get_errno()
        finally:
            os.close(fd)
        if err == errno.EEXIST or os.path.isdir(f"/sys/module/{name}"):
            return  # loaded meanwhile (another mount, or built in)
        raise OSError(err, f"insmod {name}: {os.strerror(err)}")
    r = subprocess.run([BUSYBOX, "insmod", path], capture_output=True, text=True, timeout=30)
    if r.returncode != 0 and not os.path.isdir(f"/sys/module/{name}"):
        raise OSError(f"insmod {name}: {(r.stderr or r.stdout).strip()[:200]}")


def parse(raw: Any) -> list[tuple[str, str, bool]]:
    """The identify message's ``mounts``: (export, path, read_only), checked."""
    if not isinstance(raw, list) or len(raw) > MAX_MOUNTS:
        return []
    out = []
    for m in raw:
        if not isinstance(m, dict):
            continue
        export, path, ro = m.get("export"), m.get("path"), m.get("ro") is True
        if not isinstance(export, str) or not export.replace("-", "").isalnum():
            continue
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            continue
        out.append((export, os.path.normpath(path), ro))
    return out


def ensure(mounts: list[tuple[str, str, bool]]) -> dict[str, int]:
    """Mount each volume at its path unless already there; OSError naming what failed.
    Answers the microseconds its steps took (identify's ``steps_us``)."""
    if not mounts:
        return {}
    have = mounted()
    todo = [(e, p, ro) for e, p, ro in mounts if have.get(p) != f"{SERVER}:{e}"]
    if not todo:
        return {}
    steps = {"nfs_modules": 0, "mount_dirs": 0, "mount_calls": 0, "mount_calls_cpu": 0, "mount_readahead": 0}
    t = time.monotonic_ns()
    load_modules()
    t = _lap(steps, "nfs_modules", t)
    for export, path, ro in todo:
        os.makedirs(path, mode=0o755, exist_ok=True)
        t = _lap(steps, "mount_dirs", t)
        steps["mount_calls_cpu"] += mount_nfs(export, path, ro)
        t = _lap(steps, "mount_calls", t)
        set_readahead(path)
        t = _lap(steps, "mount_readahead", t)
    steps["mounts"] = steps["mount_dirs"] + steps["mount_calls"] + steps["mount_readahead"]
    return steps


def mount_nfs(export: str, path: str, ro: bool, timeout: float = MOUNT_TIMEOUT_S) -> int:
    """One mount(2) with the NFS client's text options: the kernel asks MOUNT for the
    export's handle itself (``mountaddr``/``mountport``), as busybox's ``mount`` did in a
    process of its own (measured under TCG: that process was most of a mount's time).
    In a thread, so that a server which never answers (a ``hard`` mount's calls wait for
    it) leaves the harness answering: the error after ``timeout``. Answers the CPU time
    (µs) the call took in the guest: the rest of its time it waited for the server."""
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if ro else 0)
    data = f"{NFS_OPTS},addr={SERVER},mountaddr={SERVER}".encode()
    source, target = f"{SERVER}:{export}".encode(), path.encode()
    err: list[int] = []
    cpu_ns: list[int] = []

    def call() -> None:
        c0 = time.thread_time_ns()
        rc = oslib.libc().mount(source, target, b"nfs", flags, data)
        err.append(0 if rc == 0 else ctypes.get_errno())
        cpu_ns.append(time.thread_time_ns() - c0)

    worker = threading.Thread(target=call, name=f"mount {path}", daemon=True)
    worker.start()
    worker.join(timeout)
    if not err:
        raise OSError(errno.ETIMEDOUT, f"mounting volume {export} at {path}: no answer in {timeout:.0f} s")
    if err[0]:
        raise OSError(err[0], f"mounting volume {export} at {path}: {os.strerror(err[0])}")
    return cpu_ns[0] // 1000 if cpu_ns else 0


def _lap(steps: dict[str, int], key: str, since_ns: int) -> int:
    now = time.monotonic_ns()
    steps[key] += (now - since_ns) // 1000
    return now


def set_readahead(path: str, kib: int = READAHEAD_KIB) -> None:
    """The mount's readahead (its bdi, ``/sys/class/bdi/MAJ:MIN``): the NFS client's default
    is 128 KiB since Linux 5.4, an eighth of one 1 MiB READ, so a sequential read waits a
    round trip through the gateway for every 128 KiB. Best effort: a mount works without."""
    try:
        dev = os.stat(path).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except OSError:
        pass
