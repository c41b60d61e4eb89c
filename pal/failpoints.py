"""Named crash points for crash-safety tests.

``PAL_FAILPOINT=<name>`` makes the process SIGKILL itself when it reaches ``hit(name)``,
exactly like a power cut or an OOM kill at that step. Unset (always, outside tests) it
costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

from pal.config import armed_failpoint

_ARMED = armed_failpoint()


def hit(name: str) -> None:
    if _ARMED and _ARMED == name:
        os.kill(os.getpid(), signal.SIGKILL)
