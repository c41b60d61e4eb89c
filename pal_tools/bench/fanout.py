"""`pal bench fanout`: fork fan-out, the snapshot pause with live state, and the steady
pause/resume cycles of one VM (issue 27 items 3-5), each as a ratio to a warm exec of the
same run (the warm exec measures how fast this machine and TCG run guest code).

- fork N=1, 10, 50 (and 100 with ``--n100``): the call until every child runs, how many
  came up, and per child its wait for free CPU (``admit_wait_ms``), its restore, its
  identify, its first exec, and its share of the CPUs while it restored (its QEMU's CPU
  time over its restore's wall time);
- a snapshot pause of a VM holding 64 MiB of live state (written to tmpfs before each
  pause), with the node's breakdown of the pause;
- one VM paused and resumed ``CYCLES`` times: resume → first exec per cycle, as a ratio to
  the first (a cycle that flushed QEMU's translation buffer stands out as ~2x).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pal_tools.bench.common import Api, load_average, machine, pct, qemu_pid_of, timed
from pal_tools.bench.server import local_server

LIVE_MIB = 64
# Fresh pages each time (a new file): what the pause must capture and the host write back.
LIVE = f"rm -f /dev/shm/pal-live; dd if=/dev/zero of=/dev/shm/pal-live bs=1M count={LIVE_MIB} status=none"
EXEC_TIMEOUT_S = 600  # a loaded TCG host writes 64 MiB slowly: never cut short by the default
CYCLES = 21
FORK_NS = (1, 10, 50)
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def sh(api: Api, vm: str, line: str) -> dict[str, Any]:
    out: dict[str, Any] = api.call(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "/bin/sh", "argv": ["-c", line], "timeoutSecs": EXEC_TIMEOUT_S},
    )
    if out["exitCode"] != 0:
        raise RuntimeError(f"{line!r} in {vm} failed: {out}")
    return out


def warm_exec_ms(api: Api, vm: str, n: int) -> list[float]:
    api.exec_ok(vm)
    return [timed(api.exec_ok, vm)[0] for _ in range(n)]


def up_timings(api: Api, vm: str) -> dict[str, Any]:
    """The node's timings of the child's coming up (its `running` status event)."""
    events = api.call("GET", f"/v1/runtime/vms/{vm}/events")["events"]
    for e in reversed(events):
        if e.get("toState") == "running" and isinstance(e.get("details"), dict):
            return dict(e["details"])
    return {}


def fork_row(api: Api, src: str, n: int, log: Callable[[str], None]) -> dict[str, Any]:
    ms, out = timed(api.call, "POST", f"/v1/runtime/vms/{src}/fork", json={"count": n})
    kids = [f["vmId"] for f in out["forks"] if f["state"] == "running"]
    errors = [f.get("error") for f in out["forks"] if f["state"] != "running"]
    log(f"  fork N={n}: {len(kids)}/{n} running in {ms:.0f} ms {errors[:2] if errors else ''}")
    children: list[dict[str, Any]] = []
    for k in kids:
        d = up_timings(api, k)
        t = d.get("timings", {})
        pid = qemu_pid_of(k)
        cpu = cpu_seconds(pid) if pid else None
        restore_ms = float(d.get("bootMs") or 0)
        children.append(
            {
                "admit_wait_ms": t.get("admit_wait_ms"),
                "restore_ms": restore_ms,
                "identify_ms": t.get("identify_ms"),
                "cpu_share": round(cpu / (restore_ms / 1000), 3) if cpu and restore_ms else None,
            }
        )

    def first_exec(k: str) -> float:
        return timed(api.exec_ok, k)[0]

    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(first_exec, kids))
    for c, f in zip(children, firsts, strict=True):
        c["first_exec_ms"] = round(f, 1)
    for k in kids:
        api.call("DELETE", f"/v1/runtime/vms/{k}")
    return {"n": n, "all_running_ms": round(ms, 1), "up": len(kids), "errors": errors, "children": children}


def pause_rows(api: Api, vm: str, iterations: int, log: Callable[[str], None]) -> list[float]:
    """Snapshot pause of ``vm`` holding LIVE_MIB of fresh tmpfs data, ``iterations`` times."""
    out = []
    for _ in range(iterations):
        sh(api, vm, LIVE)
        ms, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vm}/pause")
        out.append(ms)
        api.call("POST", f"/v1/runtime/vms/{vm}/resume")
        api.exec_ok(vm)
    log(f"  snapshot pause with {LIVE_MIB} MiB live: p50 {pct(out, 0.5):.0f} ms")
    return out


def cycle_rows(api: Api, vm: str, cycles: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    out = []
    for i in range(1, cycles + 1):
        sh(api, vm, "dd if=/dev/zero of=/dev/shm/pal-cycle bs=1M count=32 conv=notrunc status=none")
        api.call("POST", f"/v1/runtime/vms/{vm}/pause")
        t = time.perf_counter()
        api.call("POST", f"/v1/runtime/vms/{vm}/resume")
        api.exec_ok(vm)
        ms = (time.perf_counter() - t) * 1000
        out.append({"cycle": i, "resume_first_exec_ms": round(ms, 1)})
    first = out[0]["resume_first_exec_ms"]
    worst = max(c["resume_first_exec_ms"] for c in out[1:]) if len(out) > 1 else first
    log(f"  cycles: first {first:.0f} ms, worst after it {worst:.0f} ms ({worst / first:.2f}x)")
    return out


def run(api: Api, args: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    spec = {"limits": {"memoryMib": args["memory_mib"]}}
    src = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    report: dict[str, Any] = {"load_before": load_average()}
    warm = warm_exec_ms(api, src, args["iterations"])
    if "fork" in args["sections"]:
        report["fork"] = [fork_row(api, src, n, log) for n in args["fork_ns"]]
    if "pause" in args["sections"]:
        report["pause_ms"] = pause_rows(api, src, args["iterations"], log)
    if "cycles" in args["sections"]:
        report["cycles"] = cycle_rows(api, src, args["cycles"], log)
    warm += warm_exec_ms(api, src, args["iterations"])  # before and after: the same conditions
    api.call("DELETE", f"/v1/runtime/vms/{src}")
    report["warm_exec_ms"] = warm
    report["warm_exec_p50_ms"] = statistics.median(warm)
    report["load_after"] = load_average()
    return report


def main(
    *,
    data_dir: Path,
    out_json: Path,
    iterations: int = 5,
    memory_mib: int = 256,
    fork_ns: tuple[int, ...] = FORK_NS,
    cycles: int = CYCLES,
    sections: tuple[str, ...] = ("fork", "pause", "cycles"),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    def log(msg: str) -> None:
        print(f"[bench fanout] {msg}", flush=True)

    args = {
        "iterations": iterations,
        "memory_mib": memory_mib,
        "fork_ns": fork_ns,
        "cycles": cycles,
        "sections": sections,
    }
    # The node's own breakdown of each step (snapshot durations, restore timings) in the log.
    with local_server(data_dir, {"PAL_LOG_LEVEL": "INFO", **(env or {})}) as (url, key):
        api = Api(url, key)
        api.http.timeout = httpx.Timeout(3600.0)  # a fork of 50 on a loaded host takes minutes
        report = run(api, args, log)
    report.update({"machine": machine(), "settings": env or {}, "args": {**args, "fork_ns": list(fork_ns)}})
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1))
    log(f"wrote {out_json}")
    return report


def _p(values: list[float | None], q: float = 0.5) -> float:
    return pct([v for v in values if v is not None], q)


def render_markdown(r: dict[str, Any]) -> str:
    base = r["warm_exec_p50_ms"]
    m = r["machine"]

    def x(ms: float) -> str:
        return f"{ms:.0f} ms | {ms / base:.1f}×"

    lines = [
        "# Fork fan-out, the snapshot pause, the steady cycles (`pal bench fanout`)",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} CPUs, {m.get('memGiB')} GiB, {m.get('qemu')}, TCG."
        f" Load average {r['load_before']} before, {r['load_after']} after: the machine is shared"
        " with other engineers' builds and VMs, so every number is also a ratio to the warm exec"
        f" (`/bin/true`) of the same run: p50 **{base:.0f} ms**.",
        "",
    ]
    if "fork" in r:
        lines += [
            "## Fork fan-out",
            "",
            "| N | up | fork → all running | × warm exec | per child p50: wait for CPU | restore"
            " | identify | first exec | CPU share |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in r["fork"]:
            c = row["children"]

            def med(key: str, kids: list[dict[str, Any]] = c) -> float:
                return _p([k[key] for k in kids])

            lines.append(
                f"| {row['n']} | {row['up']}/{row['n']} | {x(row['all_running_ms'])}"
                f" | {med('admit_wait_ms'):.0f} ms | {med('restore_ms'):.0f} ms"
                f" | {med('identify_ms'):.0f} ms | {med('first_exec_ms'):.0f} ms | {med('cpu_share'):.2f} |"
            )
        lines += [
            "",
            "*Wait for CPU*: the child's time in the node's admission queue (restore_gate.py);"
            " *restore*: from admission to its identify answered; *CPU share*: its QEMU's CPU time"
            " over its restore's wall time (1.0 is one whole core).",
            "",
        ]
    if "pause_ms" in r:
        p50 = pct(r["pause_ms"], 0.5)
        lines += [
            "## Snapshot pause with 64 MiB of live state",
            "",
            "| row | p50 | × warm exec |",
            "|---|---:|---:|",
            f"| pause (64 MiB written to tmpfs before each) | {x(p50)} |",
            "",
        ]
    if "cycles" in r:
        cyc = r["cycles"]
        first = cyc[0]["resume_first_exec_ms"]
        lines += [
            "## Pause/resume cycles of one VM",
            "",
            "| cycle | resume → first exec | × warm exec | × cycle 1 |",
            "|---:|---:|---:|---:|",
        ]
        for c in cyc:
            ms = c["resume_first_exec_ms"]
            lines.append(f"| {c['cycle']} | {x(ms)} | {ms / first:.2f} |")
        lines.append("")
    lines.append(f"Settings: {r.get('settings') or 'defaults'}.")
    return "\n".join(lines) + "\n"
