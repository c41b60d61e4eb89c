"""The operator's ceilings on what a spec may ask of the network (PAL_MAX_CONNECTIONS,
PAL_MAX_BUFFER_BYTES, PAL_MAX_EGRESS_MBPS; pal/config.py NetBudgets) and of the disk
(PAL_MAX_DISK_*; DiskBounds, with the defaults PAL_DISK_*), checked at schedule.

A value the spec gives above its ceiling is a 400 that names the field and the setting; a
default the spec did not give (the spec's or the server's PAL_WAIT_PAUSE) is lowered to
the ceiling instead (a spec that asks nothing always schedules). With PAL_MAX_EGRESS_MBPS,
a VM that asks no rate gets that one. A disk limit the spec does not give is the server's
default, lowered to the ceiling; the stored spec holds what was resolved, so a resume or a
fork keeps the VM's bounds whatever the settings are then.
"""

from __future__ import annotations

from pal.config import DiskBounds, NetBudgets
from pal.errors import InvalidRequest
from pal.spec import AgentSpec, WaitPause


def _over(field: str, value: int, ceiling: int, setting: str) -> InvalidRequest:
    return InvalidRequest(f"{field} {value} is above this server's ceiling ({setting}={ceiling})")


DISK_FIELDS = (
    ("disk_read_mibps", "limits.diskReadMibps", "read_mibps", "PAL_MAX_DISK_READ_MIBPS"),
    ("disk_write_mibps", "limits.diskWriteMibps", "write_mibps", "PAL_MAX_DISK_WRITE_MIBPS"),
    ("disk_iops", "limits.diskIops", "iops", "PAL_MAX_DISK_IOPS"),
)


def apply(
    spec: AgentSpec,
    ceilings: NetBudgets,
    wait_default: WaitPause | None = None,
    disk: DiskBounds | None = None,
) -> AgentSpec:
    """``spec`` within the ceilings (InvalidRequest naming the first field over one).
    ``wait_default``: the server's PAL_WAIT_PAUSE, for a spec that gives no waitPause;
    ``disk``: the server's disk defaults and ceilings."""
    limits = spec.limits
    update: dict[str, object] = {}
    for name, public, bound, setting in DISK_FIELDS:
        default, top = getattr(disk or DiskBounds(), bound)
        asked = getattr(limits, name)
        if asked is None:
            resolved = default
            if top is not None:  # a ceiling bounds the default, and replaces none
                resolved = top if default is None else min(default, top)
            if resolved is not None:
                update[name] = resolved
        elif top is not None and asked > top:
            raise _over(public, asked, top, setting)
    if limits.max_connections > ceilings.max_connections:
        if "max_connections" in limits.model_fields_set:
            raise _over("limits.maxConnections", limits.max_connections, ceilings.max_connections,
                        "PAL_MAX_CONNECTIONS")  # fmt: skip
        update["max_connections"] = ceilings.max_connections
    top = ceilings.max_egress_mbps
    if top is not None:
        if limits.egress_mbps is None:
            update["egress_mbps"] = top
        elif limits.egress_mbps > top:
            raise _over("limits.egressMbps", limits.egress_mbps, top, "PAL_MAX_EGRESS_MBPS")
    wait = spec.wait_pause if spec.wait_pause is not None else wait_default
    if isinstance(wait, WaitPause) and wait.max_buffer_bytes > ceilings.max_buffer_bytes:
        if spec.wait_pause is wait and "max_buffer_bytes" in wait.model_fields_set:
            raise _over("waitPause.maxBufferBytes", wait.max_buffer_bytes, ceilings.max_buffer_bytes,
                        "PAL_MAX_BUFFER_BYTES")  # fmt: skip
        wait = wait.model_copy(update={"max_buffer_bytes": ceilings.max_buffer_bytes})
        spec = spec.model_copy(update={"wait_pause": wait})
    if update:
        spec = spec.model_copy(update={"limits": limits.model_copy(update=update)})
    return spec
