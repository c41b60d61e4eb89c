"""`pal bench`'s steady-state section: what users live through, beside the one-shot rows.

- One long-lived VM paused and resumed over and over (the pattern idle suspend produces all
  day), its workload dirtying 32 MiB of guest RAM before each pause: resume → first exec at
  cycles 1, 2, 10 and 30 (p50/p90 over the runs);
- the same beside two VMs spinning a CPU loop, while each cycle's snapshot seals
  (checksums) in the background;
- fork ×10 from a VM that has been resumed 10 times, all running;
- host memory (PSS) of the VM's QEMU after 10 cycles;
- readiness → first exec of the first schedule after `pal up` (latency.py measures it as
  it starts its servers).

Every latency is also shown as a ratio to the same run's warm exec: the warm exec measures
how fast this machine (and TCG) runs guest code, so ratios compare across machines where
absolute times do not.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

CYCLES = 30
CYCLE_MARKS = (1, 2, 10, 30)
FORK_AFTER_CYCLE = 10
DIRTY_MIB = 32
# Overwrites the same 32 MiB of tmpfs each cycle: every page written again before the pause.
DIRTY = f"dd if=/dev/zero of=/dev/shm/pal-bench-dirty bs=1M count={DIRTY_MIB} conv=notrunc status=none"
# A background CPU hog that outlives its exec (no pipe held open: the exec returns at once).
SPIN = "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &"
BUSY_VMS = 2

STEADY_ROWS = [
    *((f"cycle_{c}", f"Repeated cycles of one VM: cycle {c}, resume → first exec") for c in CYCLE_MARKS),
    *(
        (f"busy_cycle_{c}", f"Same, beside {BUSY_VMS} busy VMs and background sealing: cycle {c}")
        for c in CYCLE_MARKS
    ),
    ("steady_snapshot", "Snapshot RPC of those cycles (32 MiB dirtied before each)"),
    ("fork_n10_after_cycles", f"Fork N=10 → all running, from a VM resumed {FORK_AFTER_CYCLE} times"),
    ("ready_to_first_exec", "`pal up` readiness (/readyz 200) → first schedule's first exec"),
]


def sh(api: Any, vm: str, line: str) -> None:
    out = api.call("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    if out["exitCode"] != 0:
        raise RuntimeError(f"{line!r} in {vm} failed: {out}")


def cycle_run(
    api: Any,
    spec: dict[str, Any],
    prefix: str,
    res: dict[str, list[float]],
    mem: dict[str, Any],
    timed: Callable[..., tuple[float, Any]],
    pss_of: Callable[[str], int | None],
) -> None:
    """One VM through CYCLES pause/resume cycles; samples go to ``res`` (``{prefix}cycle_N``),
    the warm exec after each resume to ``res['{prefix}warm_exec_steady']``. Unbusied runs also fork ×10 after
    cycle FORK_AFTER_CYCLE and read the VM's PSS there."""
    vid = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    try:
        api.exec_ok(vid)
        for c in range(1, CYCLES + 1):
            sh(api, vid, DIRTY)
            ms_p, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/pause")
            ms_r, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/resume")
            ms_e, _ = timed(api.exec_ok, vid)
            ms_w, _ = timed(api.exec_ok, vid)
            res.setdefault(f"{prefix}cycle_{c}", []).append(ms_r + ms_e)
            # The warm exec under the same load is the base of this run's ratios.
            res.setdefault(f"{prefix}warm_exec_steady", []).append(ms_w)
            if not prefix:
                res["steady_snapshot"].append(ms_p)
            if c == FORK_AFTER_CYCLE and not prefix:
                pss = pss_of(vid)
                if pss:
                    mem.setdefault("after_cycles", []).append(pss)
                ms_f, out = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/fork", json={"count": 10})
                kids = [f["vmId"] for f in out["forks"] if f["state"] == "running"]
                try:
                    if len(kids) == 10:
                        res["fork_n10_after_cycles"].append(ms_f)
                    for k in kids:
                        api.exec_ok(k)
                finally:
                    for k in kids:
                        api.call("DELETE", f"/v1/runtime/vms/{k}")
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vid}")


def run_steady(
    api: Any,
    runs: int,
    memory_mib: int,
    res: dict[str, list[float]],
    mem: dict[str, Any],
    log: Callable[[str], None],
    timed: Callable[..., tuple[float, Any]],
    pss_of: Callable[[str], int | None],
) -> None:
    spec = {"limits": {"memoryMib": memory_mib}}
    for key, _ in STEADY_ROWS:
        res.setdefault(key, [])
    res.setdefault("warm_exec_steady", [])
    log(f"steady state: {runs} VM(s) × {CYCLES} pause/resume cycles, {DIRTY_MIB} MiB dirtied per cycle")
    for _ in range(runs):
        cycle_run(api, spec, "", res, mem, timed, pss_of)
    log(f"steady state beside {BUSY_VMS} busy VMs: {runs} VM(s) × {CYCLES} cycles")
    busy = [api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"] for _ in range(BUSY_VMS)]
    try:
        for b in busy:
            sh(api, b, SPIN)
        for _ in range(runs):
            cycle_run(api, spec, "busy_", res, mem, timed, pss_of)
    finally:
        for b in busy:
            api.call("DELETE", f"/v1/runtime/vms/{b}")


def pss_summary(mem: dict[str, Any], memory_mib: int) -> dict[str, Any] | None:
    got = mem.get("after_cycles") or []
    if not got:
        return None
    return {
        "vms": len(got),
        "pss_kib_mean": statistics.mean(got),
        "pss_kib_max": max(got),
        "guest_ram_kib": memory_mib * 1024,
    }
