"""Named crash points for crash-safety tests.

``PAL_FAILPOINT=<name>`` makes the process SIGKILL itself when it reaches ``hit(name)``,
exactly like a power cut or an OOM kill at that step; ``<name>@<n>`` at its n-th hit (a
step every spawn passes, in the middle of a fork rather than at the VM made before it).
Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

from pal.config import armed_failpoint

_NAME, _, _NTH = armed_failpoint().partition("@")
_LEFT = [int(_NTH) if _NTH.isascii() and _NTH.isdigit() else 1]  # hits until it fires


def hit(name: str) -> None:
    if _NAME and _NAME == name:
        _LEFT[0] -= 1
        if _LEFT[0] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
