"""What a spec asks of the host for one VM (``AgentSpec.limits``): its size, and its network
and disk bounds, each validated here once (a bad value is a 400 naming the field). The
server's defaults and ceilings for them are applied at schedule (pal/scheduler/ceilings.py);
the node holds them (pal/vmm/cgroups.py, disk_limits.py, the egress gateway).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pal import sizes

# strict: a JSON body means what it says ("256" is not 256, 0 is not false). The request
# models of pal/spec.py share it.
STRICT = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=True)
LAX = ConfigDict(
    alias_generator=to_camel, populate_by_name=True, extra="forbid"
)  # a body read as the node did
DEFAULT_MAX_CONNECTIONS = 256  # limits.maxConnections when a spec does not say
# limits.disk*: far above any device; what a server allows is its PAL_MAX_DISK_* ceiling
MAX_DISK_MIBPS = 100_000
MAX_DISK_IOPS = 10_000_000


def _disk_cap(what: str, hi: int, default: str) -> Any:
    return Field(None, ge=1, le=hi, description=f"{what} (null: the server's {default})")


class Limits(BaseModel):
    model_config = STRICT

    vcpus: int = Field(
        sizes.DEFAULT_VCPUS, ge=sizes.VCPUS_RANGE[0], le=sizes.VCPUS_RANGE[1], description="virtual CPUs"
    )
    memory_mib: int = Field(
        sizes.DEFAULT_MEMORY_MIB,
        ge=sizes.MEMORY_MIB_RANGE[0],
        le=sizes.MEMORY_MIB_RANGE[1],
        description="guest RAM in MiB",
    )
    disk_mib: int = Field(
        sizes.DEFAULT_DISK_MIB,
        ge=sizes.DISK_MIB_RANGE[0],
        le=sizes.DISK_MIB_RANGE[1],
        description="root disk size in MiB",
    )
    egress_mbps: int | None = Field(
        None, ge=1, le=100_000, description="network throughput cap per direction, Mbit/s (null: none)"
    )
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS, ge=1, le=65_536, description="concurrent outbound TCP connections"
    )
    disk_read_mibps: int | None = _disk_cap(
        "disk read bandwidth cap, MiB/s", MAX_DISK_MIBPS, "PAL_DISK_READ_MIBPS"
    )
    disk_write_mibps: int | None = _disk_cap(
        "disk write bandwidth cap, MiB/s", MAX_DISK_MIBPS, "PAL_DISK_WRITE_MIBPS"
    )
    disk_iops: int | None = _disk_cap(
        "disk operations per second, reads and writes together", MAX_DISK_IOPS, "PAL_DISK_IOPS"
    )
