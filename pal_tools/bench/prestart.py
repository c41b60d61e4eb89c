"""`pal bench prestart`: resume into a new QEMU and fork ×10 with and without pre-started
QEMUs (PAL_PRESTART, pal/manager/prestart.py), each as a ratio to its own run's warm exec.

Both servers park no QEMU (PAL_PARKED_MAX=0), so every resume restores into a new
process. The two modes run one after the other on the same data dir, in rounds that
alternate (off, on, off, on, ...), so a change of the host's load hits both alike.
Writes docs/benchmarks/prestart.md and .json.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pal_tools.bench.common import Api, pct, report_of, timed, write_report
from pal_tools.bench.latency import restore_steps
from pal_tools.bench.server import local_server, server_accel, wait_template

FORK_N = 10
STEP_KEYS = (
    ("step_prepare_ms", "Node: snapshot checks, disk, network namespace, gateway"),
    ("step_qemu_spawn_ms", "QEMU process start → QMP ready (jailed, seccomp, cgroup)"),
    ("step_qemu_load_ms", "Device state loaded (migrate-incoming)"),
    ("step_qemu_cont_ms", "cont"),
    ("step_guest_wake_ms", "Guest: wakes and reads the identify request"),
    ("step_first_exec_cold_ms", "First exec's extra cost over a warm exec"),
)


def fork_all_answered_ms(api: Api, src: str, n: int) -> tuple[float, dict[str, int]]:
    """Fork ``n`` children and run one exec in each as soon as the fork answers: the time
    until the last child answered, and how the children came up (their boot methods)."""
    t0 = time.perf_counter()
    out = api.call("POST", f"/v1/runtime/vms/{src}/fork", json={"count": n})
    kids = [f["vmId"] for f in out["forks"] if f["state"] == "running"]
    if len(kids) != n:
        raise RuntimeError(f"only {len(kids)}/{n} forks running: {[f.get('error') for f in out['forks']]}")
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(api.exec_ok, kids))
    ms = (time.perf_counter() - t0) * 1000
    how: dict[str, int] = {}
    for k in kids:
        events = api.call("GET", f"/v1/runtime/vms/{k}/events")["events"]
        up = [e for e in events if e.get("toState") == "running" and isinstance(e.get("details"), dict)]
        timings = up[-1]["details"].get("timings", {}) if up else {}
        name = "prestarted" if timings.get("prestarted") else "new QEMU"
        how[name] = how.get(name, 0) + 1
    for k in kids:
        api.call("DELETE", f"/v1/runtime/vms/{k}")
    return ms, how


def one_round(api: Api, iterations: int, memory_mib: int, res: dict[str, Any]) -> None:
    """Warm execs, resumes into a new QEMU (with their steps) and one fork ×N of one VM."""
    spec = {"limits": {"memoryMib": memory_mib}}
    vid = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    try:
        api.exec_ok(vid)
        res["warm_exec"] += [timed(api.exec_ok, vid)[0] for _ in range(iterations)]
        for _ in range(iterations):
            api.call("POST", f"/v1/runtime/vms/{vid}/pause")
            ms_r, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/resume")
            ms_e, _ = timed(api.exec_ok, vid)
            ms_w, _ = timed(api.exec_ok, vid)
            res["resume_to_first_exec_new_qemu"].append(ms_r + ms_e)
            # Against the warm exec of that moment: the host's load changes by the minute.
            res["resume_x_warm_then"].append((ms_r + ms_e) / ms_w)
            restore_steps(api, vid, ms_r, ms_e - ms_w, res["steps"])
        before = [timed(api.exec_ok, vid)[0] for _ in range(3)]
        ms, how = fork_all_answered_ms(api, vid, FORK_N)
        warm = statistics.median(before + [timed(api.exec_ok, vid)[0] for _ in range(3)])
        res["fork_all_answered"].append(ms)
        res["fork_x_warm_then"].append(ms / warm)
        for k, v in how.items():
            res["fork_how"][k] = res["fork_how"].get(k, 0) + v
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vid}")


def main(
    data_dir: Path,
    out_dir: Path,
    iterations: int = 10,
    rounds: int = 3,
    memory_mib: int = 256,
    prestart: str = "256m-1c-2048d:2",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    import os

    load_start = os.getloadavg()[0]
    modes: dict[str, dict[str, Any]] = {}
    envs = {"off": {"PAL_PRESTART": "0"}, "on": {"PAL_PRESTART": prestart}}
    accel = "?"
    for r in range(rounds):
        for mode, env in envs.items():
            res = modes.setdefault(
                mode,
                {
                    "warm_exec": [],
                    "resume_to_first_exec_new_qemu": [],
                    "fork_all_answered": [],
                    "resume_x_warm_then": [],
                    "fork_x_warm_then": [],
                    "steps": {},
                    "fork_how": {},
                    "load": [],
                    "errors": [],
                },
            )
            log(f"round {r + 1}/{rounds}: PAL_PRESTART={env['PAL_PRESTART']}")
            with local_server(data_dir, {"PAL_PARKED_MAX": "0", "PAL_POOL": "0", **env}) as (u, k):
                api = Api(u, k)
                accel = server_accel(u)
                res["load"].append(round(os.getloadavg()[0], 1))
                try:
                    wait_template(api, memory_mib)
                    one_round(api, iterations, memory_mib, res)
                except RuntimeError as exc:  # reported, not hidden: the round's rows stop there
                    log(f"  round failed: {exc}")
                    res["errors"].append(str(exc)[:300])
    body = {"iterations": iterations, "rounds": rounds, "fork_n": FORK_N, "prestart": prestart}
    body["modes"] = modes
    report = report_of(body, accel=accel, load_start=load_start, data_dir=data_dir)
    write_report(out_dir, "prestart", report, render_markdown(report), log)
    return report


def _ratio(values: list[float], base: list[float]) -> str:
    if not values or not base:
        return "–"
    return f"{pct(values, 0.5) / pct(base, 0.5):.1f}×"


def render_markdown(r: dict[str, Any]) -> str:
    modes = r["modes"]
    lines = [
        "# Pre-started restores (`pal bench prestart`, issue 27 item 2)",
        "",
        f"Measured {r['date']} on {r['machine'].get('cpu', '?')}, accelerator **{r['accel'].upper()}**; "
        f"load average (1 min) {r['load_start']} at the start, {r['load_end']} at the end "
        f"(per round: off {modes.get('off', {}).get('load')}, on {modes.get('on', {}).get('load')}). "
        f"{r['rounds']} rounds alternating PAL_PRESTART=0 and PAL_PRESTART={r['prestart']}, each a "
        f"fresh server parking no QEMU (PAL_PARKED_MAX=0): {r['iterations']} warm execs, "
        f"{r['iterations']} resumes into a new QEMU, one fork ×{r['fork_n']} per round.",
        "",
        "`× warm exec` divides a p50 by the p50 warm exec of the same mode's rounds; `× warm "
        "exec then` is the p50 of each measurement over the warm exec of the same VM at that "
        "moment (right after a resume's first exec; around a fork), which follows the host's "
        "load from minute to minute.",
        "",
        "| Row | off p50 ms | off × warm exec | off × warm exec then | on p50 ms | on × warm exec "
        "| on × warm exec then | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = (
        ("warm_exec", "", "Warm exec (`/bin/true`, the ratios' base)", ""),
        (
            "resume_to_first_exec_new_qemu",
            "resume_x_warm_then",
            "Resume → first exec answered, new QEMU",
            "≤ 4×",
        ),
        ("fork_all_answered", "fork_x_warm_then", f"Fork ×{r['fork_n']} → all answered an exec", "≤ 12×"),
    )
    for key, then, label, target in rows:
        cells = []
        for mode in ("off", "on"):
            m = modes.get(mode, {})
            v, t = m.get(key, []), m.get(then, [])
            cells += [f"{pct(v, 0.5):.0f}" if v else "–", _ratio(v, m.get("warm_exec", []))]
            cells.append(f"{pct(t, 0.5):.1f}×" if t else "–")
        lines.append(f"| {label} | {' | '.join(cells)} | {target} |")
    lines += [
        "",
        "## The resume into a new QEMU, step by step (p50 ms)",
        "",
        "| Step | off | on |",
        "|---|---:|---:|",
    ]
    for key, label in STEP_KEYS:
        cells = []
        for mode in ("off", "on"):
            v = modes.get(mode, {}).get("steps", {}).get(key, [])
            cells.append(f"{pct(v, 0.5):.1f}" if v else "–")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        "Failed rounds: "
        + ("; ".join(f"{mode}: {e}" for mode in modes for e in modes[mode].get("errors", [])) or "none")
        + ".",
        "",
        "How the fork children came up: "
        + "; ".join(f"{mode}: {modes[mode].get('fork_how')}" for mode in modes)
        + ".",
        "",
    ]
    return "\n".join(lines)
