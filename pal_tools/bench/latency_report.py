"""`pal bench`'s report: the Markdown table with ratios to the same run's warm exec,
and the restore broken down step by step."""

from __future__ import annotations

from typing import Any

from pal_tools.bench import steady as bench_steady
from pal_tools.bench.common import data_dir_lines, pct
from pal_tools.bench.latency_rows import (
    BASELINES,
    BOUNDS_NOTES,
    CYCLE_DRIFT_TARGET,
    MAIN_ROWS,
    RATIO_TARGETS,
    REFERENCE_MS,
    ROWS,
    STEPS,
    TARGETS_MS,
)


def is_steady(key: str) -> bool:
    """A row of the steady-state section (every cycle, not only the marked ones)."""
    return key.startswith(("cycle_", "busy_cycle_")) or key in dict(bench_steady.STEADY_ROWS)


def warm_base(s: dict[str, list[float]], key: str) -> float | None:
    """The warm exec p50 that ``key``'s ratio divides by: measured in the same run under
    the same load (the busy cycles' own, the steady rows' own, the main rows'); another
    of them only when that one was not measured."""
    if key.startswith("busy_"):
        order: tuple[str, ...] = ("busy_warm_exec_steady", "warm_exec_steady", "warm_exec")
    elif is_steady(key):
        order = ("warm_exec_steady", "warm_exec")
    else:
        order = ("warm_exec", "warm_exec_steady")
    for k in order:
        if s.get(k):
            return pct(s[k], 0.5)
    return None


def _x(v: float, base: float | None) -> str:
    return f"{v / base:.1f}×" if base and v == v else "–"


def _timing_cells(label: str, v: list[float], base: float | None) -> str:
    """A row's first cells: its label, p50 and p90 ms, how many samples, the p50 × warm exec."""
    return f"| {label} | {pct(v, 0.5):.0f} | {pct(v, 0.9):.0f} | {len(v)} | {_x(pct(v, 0.5), base)} |"


def restore_breakdown(s: dict[str, list[float]]) -> list[str]:
    """The restore path's steps (STEPS) and what the same guest work costs on a warm QEMU."""
    if not any(s.get(k) for k, _ in STEPS):
        return []
    base = warm_base(s, "warm_exec")
    lines = [
        "",
        "## The restore path, step by step",
        "",
        "Each resume into a new QEMU (the rows so marked above), split by the timings its status",
        "event carries (the node's clock for its steps, the guest's own for the guest's), p50",
        "over the iterations. A resume that continues its parked QEMU skips the QEMU steps, and",
        "its guest runs warm code.",
        "",
        "| Step | p50 ms | p90 ms | × warm exec |",
        "|---|---:|---:|---:|",
    ]
    for key, label in STEPS:
        v = s.get(key) or []
        if v:
            lines.append(f"| {label} | {pct(v, 0.5):.1f} | {pct(v, 0.9):.1f} | {_x(pct(v, 0.5), base)} |")
    snap, live = s.get("resume_to_first_exec_new_qemu") or [], s.get("live_resume_to_first_exec") or []
    if snap and live:
        a, b = pct(snap, 0.5), pct(live, 0.5)
        qemu = sum(
            pct(s[k], 0.5)
            for k in ("step_qemu_spawn_ms", "step_qemu_load_ms", "step_qemu_cont_ms")
            if s.get(k)
        )
        guest = sum(
            pct(s[k], 0.5)
            for k in ("step_guest_wake_ms", "step_guest_decode_ms", "step_first_exec_cold_ms")
            if s.get(k)
        )
        lines += [
            "",
            f"**What is TCG's.** Resume → first exec takes {a:.0f} ms from a snapshot (a new QEMU) and"
            f" {b:.0f} ms from a live pause of the same VM (the same QEMU, whose translation cache is warm;"
            f" its resume sets the clock but takes no new identity): {_x(a, base)} against {_x(b, base)}"
            f" the warm exec. Of the {a - b:.0f} ms between them, {qemu:.0f} ms are QEMU's own start, load"
            f" and cont; the guest's wake-up, decode and first exec alone take {guest:.0f} ms more than"
            " the same work warm: that is the guest re-running code that TCG must translate again in a"
            " new process (the translation cache belongs to the process). On a KVM host nothing is"
            " translated: that part goes away, and the guest's own steps run at native speed.",
        ]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    s = report["samples_ms"]
    lines = [
        "# Runtime latency",
        "",
        f"Measured {report['date']} by `pal bench` through the public REST API,"
        f" {report['iterations']} iterations (fork N=10/N=50: {report['fork_iterations']};"
        f" steady state: {report.get('steady_runs', 0)} VM(s) × {bench_steady.CYCLES} cycles each).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, Linux {m['kernel']}",
        f"- Load average (1 min) before / after the run: {report.get('load', {}).get('before', '?')}"
        f" / {report.get('load', {}).get('after', '?')}",
        f"- VMM: {m['qemu']}, machine `microvm`, accelerator **{report['accel'].upper()}**",
        *data_dir_lines(report),
        f"- Guest: {report['memory_mib']} MiB RAM, 1 vCPU, Debian 12 cloud kernel, Python harness",
        "- Reference: Firecracker, Lima nested virtualization on an Apple M4 Max, 128 MiB VM (spec's table).",
        "",
        "The `× warm exec` column divides each p50 by the same run's warm exec p50 (a second",
        "`/bin/true` right after the first): it tracks how fast this machine and accelerator run",
        "guest code, so the ratios compare across machines where absolute times do not.",
        "",
    ]
    lines += main_table(s)
    lines += restore_breakdown(s)
    lines += steady_table(s)
    lines += targets_lines(s)
    lines += memory_lines(report["memory"])
    lines += ["", "## What bounds the restore rows", "", *BOUNDS_NOTES]
    return "\n".join(lines) + "\n"


def main_table(s: dict[str, list[float]]) -> list[str]:
    """The main table: each row's p50/p90, its ratio to warm exec, the reference, the target."""
    lines: list[str] = []
    main_rows = [(k, label) for k, label in MAIN_ROWS if s.get(k)]
    if main_rows:
        base = warm_base(s, "warm_exec")
        lines += [
            "| Step | p50 ms | p90 ms | n | × warm exec | Reference p50 ms | Target p50 ms"
            " | p50 vs baseline (same run) |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        labels = dict(ROWS)
        for key, label in main_rows:
            v = s[key]
            ref = REFERENCE_MS.get(key)
            tgt = TARGETS_MS.get(key)
            bkey = BASELINES.get(key)
            ratio = "–"
            if bkey and s.get(bkey):
                ratio = f"{pct(v, 0.5) / pct(s[bkey], 0.5):.2f}× {labels[bkey].split(' →')[0].lower()}"
            target = ("≤" + str(tgt)) if tgt else "–"
            lines.append(
                _timing_cells(label, v, base) + f" {ref if ref is not None else '–'} | {target} | {ratio} |"
            )
    return lines


def steady_table(s: dict[str, list[float]]) -> list[str]:
    """One VM's pause/resume cycles, alone and beside busy VMs."""
    lines: list[str] = []
    if any(s.get(k) for k, _ in bench_steady.STEADY_ROWS):
        base = warm_base(s, "cycle_1")
        busy_base = warm_base(s, "busy_cycle_1")
        c1 = s.get("cycle_1") or []
        lines += [
            "",
            "## Steady state: what users live through",
            "",
            f"One VM paused and resumed {bench_steady.CYCLES} times (its workload writes"
            f" {bench_steady.DIRTY_MIB} MiB of tmpfs before each pause), then the same beside"
            f" {bench_steady.BUSY_VMS} VMs spinning a CPU loop while each snapshot seals in the background."
            f" Warm exec of these runs: {base or float('nan'):.0f} ms p50 (beside the busy VMs:"
            f" {busy_base or float('nan'):.0f} ms); each row's ratio divides by the one measured"
            " under its own load.",
            "",
            "| Step | p50 ms | p90 ms | n | × warm exec (p50) | × warm exec (p90) | vs cycle 1 (p50) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, label in bench_steady.STEADY_ROWS:
            v = s.get(key) or []
            if not v:
                continue
            drift = "–"
            if key.startswith("cycle_") and c1:
                drift = f"{100 * (pct(v, 0.5) / pct(c1, 0.5) - 1):+.0f} %"
            elif key.startswith("busy_cycle_") and s.get("busy_cycle_1"):
                drift = f"{100 * (pct(v, 0.5) / pct(s['busy_cycle_1'], 0.5) - 1):+.0f} %"
            b = warm_base(s, key)
            lines.append(_timing_cells(label, v, b) + f" {_x(pct(v, 0.9), b)} | {drift} |")
    return lines


def targets_lines(s: dict[str, list[float]]) -> list[str]:
    """Each ratio target and the cycles' drift, met or not."""
    lines: list[str] = []
    lines += ["", "## Targets (issue 17, p50 ratios to the same run's warm exec)", ""]
    for key, limit in RATIO_TARGETS.items():
        v = s.get(key) or []
        base = warm_base(s, key)
        if not v or not base:
            continue
        got = pct(v, 0.5) / base
        verdict = "met" if got <= limit else "not met"
        lines.append(f"- {dict(ROWS)[key]}: {got:.1f}× (target ≤ {limit:g}×): {verdict}")
    for prefix, what in (("", "alone"), ("busy_", f"beside {bench_steady.BUSY_VMS} busy VMs")):
        cycles = [
            (c, s[f"{prefix}cycle_{c}"])
            for c in range(1, bench_steady.CYCLES + 1)
            if s.get(f"{prefix}cycle_{c}")
        ]
        if len(cycles) > 1:
            first = pct(cycles[0][1], 0.5)
            # Either way: a cycle far faster than the first says as much about noise as a slower one.
            worst_c, worst = max(((c, pct(v, 0.5)) for c, v in cycles), key=lambda t: abs(t[1] / first - 1))
            worst_drift = worst / first - 1
            verdict = "met" if abs(worst_drift) <= CYCLE_DRIFT_TARGET else "not met"
            lines.append(
                f"- Every cycle up to the {cycles[-1][0]}th within {CYCLE_DRIFT_TARGET:.0%} of cycle 1"
                f" ({what}): the farthest p50 is cycle {worst_c} at {worst_drift:+.0%}: {verdict}"
            )
    return lines


def memory_lines(memory: dict[str, Any]) -> list[str]:
    """Host memory (PSS) per forked child and after the cycles."""
    lines: list[str] = []
    lines += ["", "## Host memory", ""]
    for n, d in memory.items():
        if not d.get("pss_kib_mean"):
            continue
        share = 100 * d["pss_kib_mean"] / d["guest_ram_kib"]
        if n == "after_cycles":
            lines.append(
                f"- One VM after {bench_steady.FORK_AFTER_CYCLE} pause/resume cycles ({d['vms']} VMs):"
                f" PSS mean {d['pss_kib_mean'] / 1024:.1f} MiB (max {d['pss_kib_max'] / 1024:.1f} MiB)"
                f" = {share:.0f} % of {d['guest_ram_kib'] // 1024} MiB guest RAM."
            )
        elif d.get("state_mib"):
            lines.append(
                f"- Fork N10 of a guest holding {d['state_mib']} MiB of random state: {d['children']}"
                f" children, PSS mean {d['pss_kib_mean'] / 1024:.1f} MiB"
                f" (max {d['pss_kib_max'] / 1024:.1f} MiB) per child"
                " (issue 39's target ≤ 80 MiB; docs/benchmarks/memory.md)."
            )
        else:
            lines.append(
                f"- Fork {n.upper()}: {d['children']} children, PSS mean {d['pss_kib_mean'] / 1024:.1f} MiB"
                f" (max {d['pss_kib_max'] / 1024:.1f} MiB) per child = {share:.0f} % of"
                f" {d['guest_ram_kib'] // 1024} MiB guest RAM (target ≤25 %)."
            )
    return lines
