"""The node's phases of a VM: what one QEMU is on its node, as the node agent knows it
(pal/manager/vm_states.py reads them from a VM's fields and holds the moves between them).

Part of the contract because the control plane reasons about them: pal/scheduler/
vocabulary.py maps each scheduler state and marker to the phases its VM may be in on its
node (and the QEMU runstates of those), next to the transition table.
"""

from __future__ import annotations

import enum


class VmPhase(enum.StrEnum):
    RUNNING = "running"
    LIVE_PAUSED = "live-paused"  # vCPUs stopped, RAM resident (live.py)
    OFFLOADED = "offloaded"  # live-paused, RAM handed back to the host (live.py)
    PARKED = "parked"  # snapshot-paused, QEMU kept stopped for a fast resume (parked.py)
    POOLED = "pooled"  # in the warm pool: stopped, offloaded, no tenant's yet (pool.py)
    GONE = "gone"  # its QEMU exited
