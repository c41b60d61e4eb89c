"""`pal bench density`: how many sandboxes one node holds, what each costs per tier, and
what a wake costs when the node is full.

Starts its own `pal up` and, through the public API, schedules VMs of 256 MiB (each runs a
small workload, then idles into the live tier: ``idleLivePauseSecs``) until the node refuses
one (its memory or disk admission, the tenant's quota) or ``--cap`` is reached. At 10, 50
and the final count it measures:
- how many sandboxes are in each tier (running, live-paused/offloaded, snapshot-paused
  with a parked QEMU) and the resident host memory (QEMU PSS) per sandbox per tier;
- wake -> first exec of idle (live-paused, offloaded) sandboxes, p50 and p99;
- the control plane: GET of one VM and the list, p50 and p99;
- the server process's descriptors and threads, the host's available memory and load.
A warm exec on a running VM is the baseline every latency is also given against. Writes
JSON and docs/benchmarks/density.md.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any

from pal_tools.bench.common import (
    Api,
    data_dir_lines,
    pct,
    pss_kib,
    qemu_pids,
    timed,
    write_report,
)
from pal_tools.bench.server import measure_on_local_server

MEMORY_MIB = 256
IDLE_LIVE_S = 5  # idle seconds before the live tier (the shortest that lets the workload end)
CHECKPOINTS = (10, 50)
SAMPLES = 20  # wakes, GETs and lists timed at each checkpoint
SETTLE_S = 300  # a hang guard: how long the VMs get to reach the live tier
PARKED_SAMPLE = 3  # VMs snapshot-paused at the end to measure the parked tier
# The idle sweeper at its default period (10 s): its tick reads every VM, and a node of
# hundreds is measured as users run it. A slow guest hello on a busy host is no failure.
SERVER_ENV = {"PAL_HARNESS_READY_TIMEOUT_MS": "60000"}
WORKLOAD = "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; echo $i > /tmp/work; cat /tmp/work"


def _tier(vm: dict[str, Any]) -> str:
    if vm.get("state") == "running":
        return "running"
    if vm.get("state") == "paused":
        return "live" if (vm.get("pause") or {}).get("kind") == "live" else "parked"
    return str(vm.get("state"))


def _server_pid(port: int) -> int | None:
    want = f"--port\0{port}\0".encode()
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if d.name.isdigit() and want in (d / "cmdline").read_bytes():
                return int(d.name)
    return None


def _process_figures(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def _mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def _list(api: Api) -> list[dict[str, Any]]:
    return list(api.call("GET", "/v1/runtime/vms")["vms"])


def _vms(api: Api, vm_ids: list[str]) -> list[dict[str, Any]]:
    """Each VM as its GET shows it (the list leaves out the kind of pause)."""
    return [api.call("GET", f"/v1/runtime/vms/{vm}") for vm in vm_ids]


def _settle(api: Api, vm_ids: list[str]) -> list[dict[str, Any]]:
    """Wait until every VM is in the live tier (or the guard runs out)."""
    deadline = time.time() + SETTLE_S
    vms = _vms(api, vm_ids)
    while sum(_tier(v) == "live" for v in vms) < len(vm_ids) and time.time() < deadline:
        time.sleep(1)
        vms = _vms(api, vm_ids)
    return vms


def _tiers(vms: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tier: sandboxes, and QEMU PSS per sandbox (MiB: mean, max)."""
    out: dict[str, dict[str, Any]] = {}
    pids = qemu_pids()
    for vm in vms:
        pid = pids.get(vm["vmId"])
        tier = _tier(vm)
        if tier == "parked" and pid is None:
            tier = "snapshot"  # snapshot-paused, its QEMU not kept (PAL_PARKED_MAX, its age)
        row = out.setdefault(tier, {"count": 0, "pssMiB": []})
        row["count"] += 1
        if pid is not None:
            with contextlib.suppress(OSError):
                row["pssMiB"].append(pss_kib(pid) / 1024)
    for row in out.values():
        pss = row.pop("pssMiB")
        row["pssMeanMiB"] = round(sum(pss) / len(pss), 1) if pss else None
        row["pssMaxMiB"] = round(max(pss), 1) if pss else None
    return out


def _checkpoint(api: Api, vm_ids: list[str], server_pid: int | None, warm_ms: float) -> dict[str, Any]:
    vms = _settle(api, vm_ids)
    tiers = _tiers(vms)
    live = [v["vmId"] for v in vms if _tier(v) == "live"]
    wakes = []
    for vm in random.sample(live, min(SAMPLES, len(live))):
        ms, _ = timed(api.exec_ok, vm)
        wakes.append(ms)
    gets = [timed(api.call, "GET", f"/v1/runtime/vms/{random.choice(vm_ids)}")[0] for _ in range(SAMPLES)]
    lists = [timed(_list, api)[0] for _ in range(SAMPLES)]

    def p(xs: list[float]) -> dict[str, float | None]:
        if not xs:
            return {"p50": None, "p99": None, "p50x": None, "p99x": None}
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        return {
            "p50": round(p50, 1),
            "p99": round(p99, 1),
            "p50x": round(p50 / warm_ms, 2),
            "p99x": round(p99 / warm_ms, 2),
        }

    return {
        "count": len(vm_ids),
        "tiers": tiers,
        "wakeMs": p(wakes),
        "getMs": p(gets),
        "listMs": p(lists),
        "server": _process_figures(server_pid),
        "memAvailableMiB": _mem_available_mib(),
        "load": round(os.getloadavg()[0], 1),
    }


def run(api: Api, cap: int, server_pid: int | None, log: Any) -> dict[str, Any]:
    spec = {"limits": {"memoryMib": MEMORY_MIB}, "idleLivePauseSecs": IDLE_LIVE_S}
    vm_ids: list[str] = []
    first = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    vm_ids.append(first)
    for _ in range(3):
        api.exec_ok(first)
    warm = [timed(api.exec_ok, first)[0] for _ in range(SAMPLES)]
    warm_ms = pct(warm, 0.5)
    log(f"warm exec p50 {warm_ms:.1f} ms")
    refused: str | None = None
    checkpoints: list[dict[str, Any]] = []
    schedule_ms: list[float] = []
    while len(vm_ids) < cap:
        t0 = time.perf_counter()
        r = api.http.post("/v1/runtime/schedule", json=spec)
        if r.status_code >= 400:
            refused = f"{r.status_code} {r.text[:200]}"
            log(f"schedule #{len(vm_ids) + 1} refused: {refused}")
            break
        vm = r.json()["vmId"]
        api.call("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", WORKLOAD]})
        schedule_ms.append((time.perf_counter() - t0) * 1000)
        vm_ids.append(vm)
        if len(vm_ids) in CHECKPOINTS:
            log(f"{len(vm_ids)} sandboxes: measuring")
            checkpoints.append(_checkpoint(api, vm_ids, server_pid, warm_ms))
    if not checkpoints or checkpoints[-1]["count"] != len(vm_ids):
        checkpoints.append(_checkpoint(api, vm_ids, server_pid, warm_ms))
    parked = vm_ids[-PARKED_SAMPLE:]
    for vm in parked:
        with contextlib.suppress(RuntimeError):
            # Woken first: a snapshot pause parks the QEMU of a running VM only (a live-paused
            # one's QEMU stops with it; manager/snapshot.py _may_park).
            api.exec_ok(vm)
            api.call("POST", f"/v1/runtime/vms/{vm}/pause")
    parked_tier = _tiers(_vms(api, parked))
    for vm in vm_ids:
        with contextlib.suppress(RuntimeError):
            api.call("DELETE", f"/v1/runtime/vms/{vm}")
    return {
        "warmExecMs": round(warm_ms, 1),
        "cap": cap,
        "held": len(vm_ids),
        "refused": refused,
        "scheduleAndWorkloadMs": {
            "p50": round(pct(schedule_ms, 0.5), 1),
            "p99": round(pct(schedule_ms, 0.99), 1),
        },
        "checkpoints": checkpoints,
        "parkedTier": parked_tier,
    }


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# `pal bench density`: sandboxes per node",
        "",
        f"- Date: {report['date']}; accelerator: {report['accel']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, Linux {m['kernel']}",
        f"- Load average at start {report['load_start']}, at end {report['load_end']} (a shared machine)",
        *data_dir_lines(report),
        f"- VMs of {MEMORY_MIB} MiB, idle into the live tier after {IDLE_LIVE_S} s (the idle sweeper"
        f" at its default period); cap {report['cap']}",
        f"- Held: **{report['held']}** sandboxes; stopped by: {report['refused'] or 'the cap'}",
        f"- Warm exec p50: {report['warmExecMs']} ms (ratios below are to it)",
        "",
        "| sandboxes | tiers (count, PSS MiB mean/max) | wake → first exec p50 / p99 ms (×) |"
        " GET p50 / p99 ms | list p50 / p99 ms | server fds / threads | MemAvailable MiB | load |",
        "|---:|---|---|---|---|---|---:|---:|",
    ]
    for c in report["checkpoints"]:
        tiers = "; ".join(
            f"{name} {t['count']} ({t['pssMeanMiB']}/{t['pssMaxMiB']})"
            for name, t in sorted(c["tiers"].items())
        )
        w, g, li, s = c["wakeMs"], c["getMs"], c["listMs"], c["server"]
        lines.append(
            f"| {c['count']} | {tiers} | {w['p50']} / {w['p99']} ({w['p50x']}× / {w['p99x']}×) | "
            f"{g['p50']} / {g['p99']} | {li['p50']} / {li['p99']} | "
            f"{s.get('fds', '?')} / {s.get('threads', '?')} | {c['memAvailableMiB']} | {c['load']} |"
        )
    for name, t in sorted((report.get("parkedTier") or {}).items()):
        lines += [
            "",
            f"Snapshot-paused at the end, tier `{name}`: {t['count']}, PSS {t['pssMeanMiB']} MiB mean.",
        ]
    return "\n".join(lines) + "\n"


def main(
    cap: int = 30,
    data_dir: Path | None = None,
    out_dir: Path = Path("docs/benchmarks"),
    log: Any = print,
) -> dict[str, Any]:
    def measure(api: Api, _data: Path) -> dict[str, Any]:
        return run(api, cap, _server_pid(api.http.base_url.port or 0), log)

    report = measure_on_local_server(data_dir, measure, SERVER_ENV, max_vms=cap + 1)  # + the warm exec's VM
    write_report(out_dir, "density", report, render(report), log)
    return report
