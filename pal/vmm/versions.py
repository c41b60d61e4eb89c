"""Versions of the pieces a VM is made of, for `pal doctor`, snapshot meta and caches."""

from __future__ import annotations

import functools
import json
import platform
import re
import subprocess
from pathlib import Path

QEMU_BINARY = "qemu-system-x86_64"


@functools.cache
def qemu_version(binary: str = QEMU_BINARY) -> str:
    """E.g. "7.2.22"; "unknown" when the binary is missing or says something unexpected."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    m = re.search(r"version (\S+)", out)
    return m.group(1) if m else "unknown"


@functools.cache
def qemu_help(binary: str = QEMU_BINARY) -> str:
    try:
        return subprocess.run([binary, "-help"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def qemu_supports_sandbox(binary: str = QEMU_BINARY) -> bool:
    # -sandbox is only listed when QEMU was built with seccomp; passing it otherwise fails.
    return "-sandbox on" in qemu_help(binary)


def host_kernel_version() -> str:
    return platform.release()


def image_kernel_version(image_dir: Path) -> str | None:
    """The guest kernel version recorded in an image's meta.json (``kernelVersion``)."""
    try:
        meta = json.loads((Path(image_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    v = meta.get("kernelVersion") if isinstance(meta, dict) else None
    return str(v) if v else None
