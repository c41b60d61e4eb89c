"""Versions of the pieces a VM is made of, for `pal doctor`, snapshot meta and caches."""

from __future__ import annotations

import functools
import platform
import re
import subprocess

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
