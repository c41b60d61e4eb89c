"""`pal bench images`: what a user's own image costs at schedule time, in one run.

Starts its own `pal up` on the data dir and measures through the public API, beside the
default image's rows of the same run (each custom row is also given as a ratio to its
baseline):
- the default image: schedule from its warm template → first exec, and a cold boot →
  first exec (the baselines);
- a custom image (pal/images/sample.py: a static-busybox OCI archive, no libc, no Python):
  `pal image import` (skopeo, umoci, mkfs.ext4), its first schedule (cold: no template yet)
  → first exec, and schedules from its own template → first exec.
These are the same rows `pal bench` measures (pal_tools/bench/latency.py), without the pause/fork/floor
rows, so they can be measured on their own. Writes JSON and docs/benchmarks/images.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pal.sizes import DEFAULT_MEMORY_MIB
from pal_tools.bench.common import Api, pct, timed, write_report
from pal_tools.bench.latency import cold_boot_rows, custom_image_rows
from pal_tools.bench.latency_rows import BASELINES, ROWS
from pal_tools.bench.server import measure_on_local_server, wait_template

KEYS = (
    "template_to_first_exec",
    "cold_boot_to_first_exec",
    "custom_import",
    "custom_first_schedule",
    "custom_template_to_first_exec",
)
NOTES = [
    "The custom image's first schedule is a cold boot of that image (its template is built",
    "in the background after it), so its baseline is the default image's cold boot; the",
    "bench waits for that template before the next import, so no VM or template build of the",
    "bench runs beside a first schedule. Cold boots vary most with the machine's load (under",
    "TCG the guest's boot is CPU-bound). From its own template a custom image schedules like",
    "the default one: the harness, kernel and initrd are the same for every image (the",
    "harness brings its own interpreter under /.pal), and the restore reads the image's",
    "template, not the image. The import row includes assembling the image (the /.pal bundle",
    "copied in, mkfs.ext4 -d of a 2 GiB sparse root fs); the bundle itself is cached from the",
    "default image's build.",
]


def run(
    api: Api, data_dir: Path, iterations: int, memory_mib: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {k: [] for k in KEYS}
    spec = {"limits": {"memoryMib": memory_mib}}
    log("warm template of the default image")
    wait_template(api, memory_mib)
    log(f"default image: template schedule → first exec ×{iterations}")
    for _ in range(iterations):
        ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json=spec)
        ms2, _ = timed(api.exec_ok, vm["vmId"])
        if vm.get("bootMethod") != "template":
            raise RuntimeError(f"schedule of the default image was {vm.get('bootMethod')}, not template")
        res["template_to_first_exec"].append(ms + ms2)
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
    cold_boot_rows(api, max(3, iterations // 4), memory_mib, res, log)
    custom_image_rows(api, data_dir, iterations, memory_mib, res, log)
    return res


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    s = report["samples_ms"]
    labels = dict(ROWS)
    lines = [
        "# Custom images: schedule → first exec",
        "",
        f"Measured {report['date']} by `pal bench images` through the public REST API,"
        f" {report['iterations']} iterations (cold boots, imports and first schedules:"
        f" {len(s['custom_first_schedule'])}).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, Linux {m['kernel']}",
        f"- VMM: {m['qemu']}, machine `microvm`, accelerator **{report['accel'].upper()}**",
        f"- Guest: {report['memory_mib']} MiB RAM, 1 vCPU, Debian 12 cloud kernel",
        f"- Load average (1 min) at start {report['load_start']}, at end {report['load_end']}"
        " (the machine is shared: other work ran beside this measurement when these are above ~1)",
        "",
        "| Step | p50 ms | p90 ms | n | p50 vs baseline (same run) |",
        "|---|---:|---:|---:|---|",
    ]
    for key in KEYS:
        v = s.get(key) or []
        base = BASELINES.get(key)
        ratio = "–"
        if base and s.get(base) and v:
            ratio = f"{pct(v, 0.5) / pct(s[base], 0.5):.2f}× {labels[base].split(' →')[0].lower()}"
        lines.append(f"| {labels[key]} | {pct(v, 0.5):.0f} | {pct(v, 0.9):.0f} | {len(v)} | {ratio} |")
    lines += ["", *NOTES]
    return "\n".join(lines) + "\n"


def main(
    iterations: int = 10,
    memory_mib: int = DEFAULT_MEMORY_MIB,
    data_dir: Path | None = None,
    out_dir: Path = Path("docs/benchmarks"),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:

    def measure(api: Api, data: Path) -> dict[str, Any]:
        samples = run(api, data, iterations, memory_mib, log)
        return {
            "iterations": iterations,
            "memory_mib": memory_mib,
            "samples_ms": samples,
            "p50_ms": {k: round(pct(v, 0.5), 1) for k, v in samples.items()},
            "p90_ms": {k: round(pct(v, 0.9), 1) for k, v in samples.items()},
        }

    report = measure_on_local_server(data_dir, measure)
    write_report(out_dir, "images", report, render(report), log)
    return report
