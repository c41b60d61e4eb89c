"""A VM's size: the defaults and bounds of ``AgentSpec.limits`` and how a size is named
(``256m-1c-2048d``: warm templates' keys, ``warmSizes`` of GET /v1/images). The one
definition of each; plain values, so the CLI shows them without importing the API models."""

from __future__ import annotations

import re

DEFAULT_VCPUS = 1
DEFAULT_MEMORY_MIB = 256
DEFAULT_DISK_MIB = 2048
VCPUS_RANGE = (1, 16)
MEMORY_MIB_RANGE = (128, 16384)
DISK_MIB_RANGE = (512, 65536)
# A volume's size (docs/volumes.md): 1 MiB to 1 TiB, 1 GiB unless the request names one.
DEFAULT_VOLUME_MIB = 1024
VOLUME_MIB_RANGE = (1, 1 << 20)
# Sizes that get a warm template when first scheduled (PAL_TEMPLATE_SIZES): the default and
# a few common ones. Any other size boots cold, so tenants cannot make a node build (and
# keep) a template per size they invent.
DEFAULT_TEMPLATE_SIZES = ("256m-1c-2048d", "512m-1c-2048d", "1024m-1c-4096d", "2048m-2c-8192d")
# The claimable warm pool (PAL_POOL, pal/manager/pool.py): two VMs of the default size.
# An entry is keyed by its size for the default image and by ``<image>@<size>`` for another
# (``code-interpreter@256m-1c-2048d``).
DEFAULT_POOL = (("256m-1c-2048d", 2),)
DEFAULT_PRESTART = (("256m-1c-2048d", 4),)  # pre-started QEMUs (pal/manager/prestart.py)
POOL_COUNT_MAX = 64
POOL_DEFAULT_IMAGE = "default"


def pool_entry(image: str, size: str) -> str:
    """A pool entry's key: the size alone for the default image, else ``<image>@<size>``."""
    return size if image == POOL_DEFAULT_IMAGE else f"{image}@{size}"


def split_pool_entry(key: str) -> tuple[str, str]:
    """``code-interpreter@256m-1c-2048d`` -> (``code-interpreter``, ``256m-1c-2048d``); a
    bare size is the default image's."""
    image, _, size = key.rpartition("@")
    return image or POOL_DEFAULT_IMAGE, size


def size_name(memory_mib: int, vcpus: int = DEFAULT_VCPUS, disk_mib: int = DEFAULT_DISK_MIB) -> str:
    """``<mem>m-<vcpus>c-<disk>d``. The disk size is part of it: the guest grows its file
    system at boot, so a template of one disk size does not serve another."""
    return f"{memory_mib}m-{vcpus}c-{disk_mib}d"


def parse_size_name(text: str) -> tuple[int, int, int]:
    """``256m-1c-2048d`` -> (256, 1, 2048); ValueError when it is not a size in bounds."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a size like 256m-1c-2048d")
    mem, cpus, disk = (int(g) for g in m.groups())
    for value, (lo, hi), what in (
        (mem, MEMORY_MIB_RANGE, "memory"),
        (cpus, VCPUS_RANGE, "vCPUs"),
        (disk, DISK_MIB_RANGE, "disk"),
    ):
        if not lo <= value <= hi:
            raise ValueError(f"{text!r}: {what} {value} is outside {lo}..{hi}")
    return mem, cpus, disk


_SIZE = re.compile(r"(\d+)m-(\d+)c-(\d+)d")
