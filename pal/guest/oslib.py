"""The small OS helpers every guest module uses: libc, the kernel log, the wall clock in ms.

Stdlib only, like the whole guest package (it runs inside the VM under Pal's own Python).
"""

from __future__ import annotations

import ctypes
import sys
import time

# --------------------------------------------------------------------------- workspace
_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def log(text: str) -> None:
    # No console in the VM: the kernel log is the one place a host can read it (dmesg).
    try:
        with open("/dev/kmsg", "w") as f:
            f.write(f"pal-harness: {text}\n")
    except OSError:
        print(f"pal-harness: {text}", file=sys.stderr)
