"""What a spawn answers (``SpawnResult``) and the disk bounds its request names: node-side
readings of the wire's spawn models (pal/wire/models.py), which know nothing of QEMU."""

from __future__ import annotations

from typing import Any

from pal.vmm.disk_limits import DiskLimits
from pal.vmm.qemu import QemuVm
from pal.wire.models import LimitsApplied, SpawnRequest, SpawnResult


def disk_limits(req: SpawnRequest) -> DiskLimits:
    """The disk bounds the control plane resolved at schedule (None: unbounded)."""
    return DiskLimits(req.disk_read_mibps, req.disk_write_mibps, req.disk_iops)


def spawn_result(
    req: SpawnRequest, qemu: QemuVm, boot_ms: float, method: str, agent_version_id: str, **more: Any
) -> SpawnResult:
    """The answer to ``req``: its VM is up in ``qemu`` after ``boot_ms``."""
    applied, skipped = qemu.limits_report()
    return SpawnResult.model_validate(
        {
            "vm_id": req.vm_id,
            "pid": qemu.pid or 0,
            "incarnation": req.incarnation,
            "boot_ms": boot_ms,
            "method": method,
            "agent_version_id": agent_version_id,
            "limits": LimitsApplied(applied=applied, skipped=skipped),
            **more,
        }
    )
