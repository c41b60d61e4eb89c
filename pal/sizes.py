"""A VM's size: the defaults and bounds of ``AgentSpec.limits`` and how a size is named
(``256m-1c-2048d``: warm templates' keys, ``warmSizes`` of GET /v1/images). The one
definition of each; plain values, so the CLI shows them without importing the API models."""

from __future__ import annotations

DEFAULT_VCPUS = 1
DEFAULT_MEMORY_MIB = 256
DEFAULT_DISK_MIB = 2048
VCPUS_RANGE = (1, 16)
MEMORY_MIB_RANGE = (128, 16384)
DISK_MIB_RANGE = (512, 65536)


def size_name(memory_mib: int, vcpus: int = DEFAULT_VCPUS, disk_mib: int = DEFAULT_DISK_MIB) -> str:
    """``<mem>m-<vcpus>c-<disk>d``. The disk size is part of it: the guest grows its file
    system at boot, so a template of one disk size does not serve another."""
    return f"{memory_mib}m-{vcpus}c-{disk_mib}d"
