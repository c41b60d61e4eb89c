"""A VM's disk bandwidth and IOPS limits, and how QEMU is told them.

Two layers hold them, because neither alone does on every host:

- **QEMU's own throttle** on the VM's root drive (``throttling.*`` on the command line,
  ``block_set_io_throttle`` over QMP for a QEMU that already runs: a claimed pooled VM, a
  taken pre-started one). It bounds every request of the guest, whatever the kernel, the
  cgroup version, the I/O scheduler or the loop device under the data dir, and it bounds
  buffered writes: QEMU writes the disk through the host page cache (``cache=unsafe``),
  whose writeback cgroup v1 never charges to the writer.
- **the kernel's per-cgroup throttle** on the device QEMU's I/O is submitted to
  (cgroups.py, blockdev.py): what still holds if the QEMU itself is taken over. It bounds
  what the QEMU process submits (reads, direct and synchronous writes) everywhere, and its
  buffered writeback too on cgroup v2.

``iops`` is a total (reads + writes) for QEMU; the kernel has separate read and write
IOPS knobs, each set to it, so there it is a bound per direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
DRIVE = "root"  # the -drive id of the VM's disk (cmdline.py)
DISK_QEMU = "diskQemu"  # its name in a VM's limitsApplied (cgroups.py: diskKernel)


@dataclass(frozen=True)
class DiskLimits:
    """MiB/s and IOPS; None: no bound of that kind."""

    read_mibps: int | None = None
    write_mibps: int | None = None
    iops: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.read_mibps, self.write_mibps, self.iops))

    @property
    def read_bps(self) -> int:
        return (self.read_mibps or 0) * MIB

    @property
    def write_bps(self) -> int:
        return (self.write_mibps or 0) * MIB

    def describe(self) -> str:
        parts = []
        if self.read_mibps is not None:
            parts.append(f"read {self.read_mibps} MiB/s")
        if self.write_mibps is not None:
            parts.append(f"write {self.write_mibps} MiB/s")
        if self.iops is not None:
            parts.append(f"{self.iops} IOPS")
        return ", ".join(parts) or "none"

    def drive_options(self) -> str:
        """What goes on the ``-drive`` of the root disk ("" when nothing is bounded)."""
        opts = {
            "throttling.bps-read": self.read_bps,
            "throttling.bps-write": self.write_bps,
            "throttling.iops-total": self.iops or 0,
        }
        return "".join(f",{k}={v}" for k, v in opts.items() if v)

    def qmp_throttle(self) -> dict[str, Any]:
        """``block_set_io_throttle``'s arguments: these limits, 0 (none) for the rest."""
        return {
            "device": DRIVE,
            "bps": 0,
            "bps_rd": self.read_bps,
            "bps_wr": self.write_bps,
            "iops": self.iops or 0,
            "iops_rd": 0,
            "iops_wr": 0,
        }
