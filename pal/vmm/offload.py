"""The memory side of a live pause: hand a stopped guest's RAM back to the host (offload)
and bring its working set back ahead of need (prefetch). Blocking calls: run them in a
thread.

The recipe (measured on this project's Debian 12 hosts; docs/live-pause.md), for RAM that
is a ``share=on`` file mapping (``memory-backend-file``):

1. ``fsync`` the RAM file: ``MADV_PAGEOUT`` skips dirty file pages, and without swap a
   page can only leave memory once its data is in the file;
2. ``process_madvise(pidfd, [RAM mapping], MADV_PAGEOUT)``: QEMU's page tables let go of
   the pages and reclaim frees them (Python has no wrapper: syscall 440 through ctypes);
3. ``posix_fadvise(DONTNEED)`` on the file: drops what is still cached.

A ``share=off`` mapping (a fork child mapping its snapshot copy-on-write) is handled as
far as it can be: the pages the child wrote are anonymous and stay (no swap), clean ones
it alone maps are reclaimed by step 2, and steps 1 and 3 are skipped (the file is the
snapshot, and dropping its cache would cost the other forks that share it).

Which pages were resident comes from ``/proc/<pid>/pagemap`` (present bit), read before
the offload: the ranges are the working set to prefetch on the next wake.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from pal.vmm.errors import VmmError

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_PAGEOUT = 21
SYS_PROCESS_MADVISE = 440  # x86_64 and the generic syscall table alike
# Resident runs closer than this are prefetched as one range (fewer, larger reads).
PREFETCH_GAP = 64 * 1024
_PRESENT_RUN = re.compile(rb"[\x80-\xff]+")  # pagemap entries' top byte with bit 63 set


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True)
class RamMapping:
    """Where QEMU maps the guest RAM file: [start, end), file offset of ``start``."""

    start: int
    end: int
    offset: int
    shared: bool

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class OffloadResult:
    resident_before: int  # bytes of guest RAM QEMU had mapped in
    resident_after: int
    ms: float
    phases_ms: dict[str, float] = field(default_factory=dict)
    # File ranges (offset, length) resident before: what to prefetch on the next wake.
    working_set: list[tuple[int, int]] = field(default_factory=list)
    shared: bool = True

    @property
    def freed(self) -> int:
        return max(0, self.resident_before - self.resident_after)


def find_mapping(pid: int, mem_path: Path) -> RamMapping:
    """QEMU's mapping of the RAM file, found by the file's device and inode (QEMU may have
    opened it through a passed descriptor, so its path in ``maps`` is not ours to match)."""
    try:
        st = os.stat(mem_path)
    except OSError as exc:
        raise VmmError(f"RAM file {mem_path}: {exc}") from exc
    best: RamMapping | None = None
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 5:
                    continue
                inode = int(parts[4])
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if inode != st.st_ino or os.makedev(major, minor) != st.st_dev:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                m = RamMapping(lo, hi, int(parts[2], 16), parts[1].endswith("s"))
                if best is None or m.size > best.size:
                    best = m
    except OSError as exc:
        raise VmmError(f"cannot read the mappings of QEMU {pid}: {exc}") from exc
    if best is None:
        raise VmmError(f"QEMU {pid} does not map {mem_path}")
    return best


def resident_runs(pid: int, m: RamMapping) -> list[tuple[int, int]]:
    """Runs of resident pages of the mapping as (file offset, length), from pagemap."""
    first = m.start // PAGE
    n = m.size // PAGE
    try:
        with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), n * 8, first * 8)
    except OSError as exc:
        raise VmmError(f"cannot read the page map of QEMU {pid}: {exc}") from exc
    tops = raw[7::8]  # little-endian: the byte holding bit 63 (present) of each entry
    return [(m.offset + r.start() * PAGE, (r.end() - r.start()) * PAGE) for r in _PRESENT_RUN.finditer(tops)]


def resident_bytes(pid: int, mem_path: Path) -> int:
    m = find_mapping(pid, mem_path)
    return sum(length for _, length in resident_runs(pid, m))


def _pageout(pid: int, m: RamMapping) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        done = 0
        while done < m.size:
            iov = _IoVec(m.start + done, m.size - done)
            n = libc.syscall(SYS_PROCESS_MADVISE, pidfd, ctypes.byref(iov), 1, MADV_PAGEOUT, 0)
            if n < 0:
                err = ctypes.get_errno()
                raise VmmError(f"process_madvise(MADV_PAGEOUT) on QEMU {pid}: {os.strerror(err)}")
            if n == 0:
                break
            done += n
    finally:
        os.close(pidfd)


def offload(pid: int, mem_path: Path) -> OffloadResult:
    """Reclaim the guest RAM of a *stopped* QEMU (the caller stopped its vCPUs, and its
    devices are quiet: QMP ``stop`` drains block I/O; the NIC receives nothing while the
    VM is stopped). Touching the RAM later faults the pages back in from the file."""
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    m = find_mapping(pid, mem_path)
    runs = resident_runs(pid, m)
    before = sum(length for _, length in runs)
    t = time.perf_counter()
    phases["scan"] = (t - t0) * 1000
    fd = os.open(mem_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if m.shared:
            os.fsync(fd)
            phases["fsync"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        _pageout(pid, m)
        phases["pageout"] = (time.perf_counter() - t) * 1000
        if m.shared:
            t = time.perf_counter()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            phases["fadvise"] = (time.perf_counter() - t) * 1000
    finally:
        os.close(fd)
    after = sum(length for _, length in resident_runs(pid, m))
    return OffloadResult(
        resident_before=before,
        resident_after=after,
        ms=(time.perf_counter() - t0) * 1000,
        phases_ms={k: round(v, 2) for k, v in phases.items()},
        working_set=runs,
        shared=m.shared,
    )


def coalesce(runs: list[tuple[int, int]], gap: int = PREFETCH_GAP) -> list[tuple[int, int]]:
    """Join runs separated by less than ``gap`` bytes (sorted input)."""
    out: list[list[int]] = []
    for off, length in runs:
        if out and off - (out[-1][0] + out[-1][1]) < gap:
            out[-1][1] = off + length - out[-1][0]
        else:
            out.append([off, length])
    return [(a, b) for a, b in out]


def prefetch(mem_path: Path, runs: list[tuple[int, int]]) -> int:
    """Read ``runs`` of the RAM file back into the page cache and return once they are
    there (all ranges are queued as readahead first, so the reads overlap, then each is
    read through); QEMU's faults on them are then minor ones. Returns the bytes read."""
    ranges = coalesce(runs)
    done = 0
    buf = bytearray(1 << 20)
    fd = os.open(mem_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for off, length in ranges:
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
        for off, length in ranges:
            end = off + length
            while off < end:
                n = os.preadv(fd, [memoryview(buf)[: min(len(buf), end - off)]], off)
                if n <= 0:
                    break
                off += n
                done += n
    finally:
        os.close(fd)
    return done
