"""Whether a host process id is alive: the one check for the work dirs and pid files that a
dead process may leave behind (image builds, the local PostgreSQL). Imports nothing from ``pal``."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Signal 0 probes without touching the process; EPERM means it exists as another user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
