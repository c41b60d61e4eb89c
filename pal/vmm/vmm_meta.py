"""What a snapshot's ``vmm.json`` says about the machine it was taken on, and which
machine it loads into (a migration stream only loads into an identical one): read by
restore (qemu.py) and by the node when it picks a pre-started QEMU (pal/manager/prestart.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.vmm.cmdline import VmSpec
from pal.vmm.errors import VmmError

MEMORY_FILE = "file"
MEMORY_STREAM = "stream"
VMM_META = "vmm.json"  # written next to the artifacts: what restore needs to rebuild the machine


@dataclass
class SnapshotArtifacts:
    dir: Path
    paths: dict[str, Path]  # "snapshot", "rootfs", "vmm", and "mem" when memory_kind == "file"
    sizes: dict[str, int]  # apparent sizes in bytes
    memory_kind: str  # "file" | "stream"
    methods: dict[str, str]  # how each file was captured: reflink | copy | convert
    durations_ms: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # contents of vmm.json


def read_vmm_meta(snapshot_dir: Path) -> dict[str, Any]:
    """vmm.json of a snapshot (inferred for a snapshot without one)."""
    path = Path(snapshot_dir) / VMM_META
    if path.exists():
        try:
            meta = json.loads(path.read_text())
        except ValueError as exc:
            raise VmmError(f"corrupt {path}: {exc}") from exc
        if isinstance(meta, dict):
            return meta
    if not (Path(snapshot_dir) / "snapshot").exists():
        raise VmmError(f"{snapshot_dir} holds no snapshot (no device state file)")
    kind = MEMORY_FILE if (Path(snapshot_dir) / "mem").exists() else MEMORY_STREAM
    return {"memoryKind": kind}


def misfit(meta: dict[str, Any], spec: VmSpec, rootfs_bytes: int, disk: Path) -> str | None:
    """Why a snapshot (its vmm.json, its rootfs size) cannot load into a QEMU started
    for ``spec`` with a config drive, a NIC and the disk file ``disk``; None when it can.
    A migration stream only loads into an identical machine (the caller also checks that
    its kernel and initrd are the snapshot's boot files)."""
    if meta.get("memoryMib") is not None and int(meta["memoryMib"]) != spec.memory_mib:
        return f"{meta['memoryMib']} MiB of RAM, not {spec.memory_mib}"
    if meta.get("vcpus") is not None and int(meta["vcpus"]) != spec.vcpus:
        return f"{meta['vcpus']} vCPUs, not {spec.vcpus}"
    if meta.get("configDrive") is False or meta.get("nic") is None or spec.config_drive is None:
        return "another device set (config drive, NIC)"
    if bool(meta.get("balloon")) != spec.balloon:
        return "another device set (balloon)"
    if rootfs_bytes > disk.stat().st_size:
        return f"a disk of {rootfs_bytes} bytes, larger than {disk.stat().st_size}"
    return None
