"""`pal bench io`: does one VM writing as fast as it can hurt another VM's small synchronous
writes, without per-VM disk limits and with them (limits.disk*: QEMU's throttle and the
kernel's, pal/vmm/disk_limits.py)?

QEMU writes a VM's disk through the host's page cache (``cache=unsafe``), so a hog hurts its
neighbours once the host's dirty pages pass the kernel's thresholds (vm.dirty_ratio): from
then on every task writing to that file system is throttled in balance_dirty_pages, the
quiet VM's QEMU among them, and the disk is busy with writeback. So the hog writes more
distinct data than the thresholds (a 6 GiB file on a disk of 8 GiB, over and over), and the
quiet VM is timed long enough (``seconds``) to see that regime; the host's dirty and
writeback memory is sampled meanwhile.

Starts its own `pal up` on the data dir with PAL_DISK_*=off (so a VM can be unbounded), no
warm pool and no pre-started QEMUs (nothing refilling in the background), and runs rounds
that alternate the two modes (unbounded, bounded, ...) so a change of the host's load hits
both alike. Each round, after the host's dirty pages are flushed (sync):

1. schedules a quiet VM and a hog VM; in the bounded mode both ask the limits every VM gets
   by default (PAL_DISK_READ_MIBPS, PAL_DISK_WRITE_MIBPS, PAL_DISK_IOPS);
2. times 4 KiB O_DSYNC writes in the quiet VM for ``seconds`` by the guest's clock, the hog
   idle (the baseline of the round);
3. starts the hog: 1 MiB O_DIRECT writes in a loop (`dd`), as fast as the guest issues them;
4. times the quiet VM's writes again beside it, with the bytes the hog's QEMU wrote to the
   host meanwhile (``wchar`` of /proc/<pid>/io) and the host's peak dirty + writeback memory;
5. deletes both VMs.

Reports the quiet VM's p50/p99 write latency alone and beside the hog, as ratios to alone,
and the hog's MiB/s, per mode. Writes docs/benchmarks/io.md and .json.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pal.config import DEFAULT_DISK_IOPS, DEFAULT_DISK_READ_MIBPS, DEFAULT_DISK_WRITE_MIBPS
from pal.ops.progress import Steps
from pal.vmm.blockdev import BlockHost
from pal_tools.bench.common import Api, data_dir_lines, load_average, pct, qemu_pid_of, write_report
from pal_tools.bench.server import measure_on_local_server

MODES = ("unbounded", "bounded")
BOUNDED = {
    "diskReadMibps": DEFAULT_DISK_READ_MIBPS,
    "diskWriteMibps": DEFAULT_DISK_WRITE_MIBPS,
    "diskIops": DEFAULT_DISK_IOPS,
}
HOG_RAMP_S = 2.0  # the hog's first blocks are in flight before the quiet VM is timed
HOG_DISK_MIB = 8192  # room for more distinct data than a host's dirty thresholds
HOG = "while :; do dd if=/dev/zero of=/workspace/hog bs=1M count=6144 oflag=direct 2>/dev/null; done"
QUIET = """
import json, os, time
fd = os.open("/workspace/quiet", os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o600)
buf, out, i = os.urandom(4096), [], 0
end = time.monotonic() + {secs}
while time.monotonic() < end:
    t = time.perf_counter_ns()
    os.pwrite(fd, buf, (i % 1024) * 4096)
    out.append(round((time.perf_counter_ns() - t) / 1e6, 3))
    i += 1
print(json.dumps(out))
"""
SERVER_ENV = {
    "PAL_DISK_READ_MIBPS": "off",
    "PAL_DISK_WRITE_MIBPS": "off",
    "PAL_DISK_IOPS": "off",
    "PAL_POOL": "0",
    "PAL_PRESTART": "0",
}


def quiet_writes(api: Api, vm: str, secs: float) -> list[float]:
    """Small synchronous writes in ``vm`` for ``secs``, each in ms by the guest's clock."""
    argv = ["-c", QUIET.format(secs=secs)]
    out = api.call("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "python3", "argv": argv})
    if out["exitCode"] != 0:
        raise RuntimeError(f"the quiet writes failed in {vm}: {out['stderr'][-500:]}")
    return [float(x) for x in json.loads(out["stdout"])]


def qemu_written(vm: str) -> int:
    """Bytes the VM's QEMU has written to the host so far (its disk, mostly)."""
    pid = qemu_pid_of(vm)
    if pid is None:
        raise RuntimeError(f"no QEMU for {vm}")
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def host_dirty_mib() -> float:
    """The host's dirty and writeback page cache, MiB."""
    got = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Dirty", "Writeback"):
            got[name] = int(rest.split()[0])
    return sum(got.values()) / 1024


class DirtyPeak:
    """The host's peak dirty + writeback memory while it runs (sampled every 0.2 s)."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, host_dirty_mib())

    def __enter__(self) -> DirtyPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def one_round(api: Api, mode: str, secs: float, res: dict[str, Any], log: Callable[[str], None]) -> None:
    limits: dict[str, Any] = dict(BOUNDED) if mode == "bounded" else {}
    os.sync()  # the previous round's dirty pages are not this one's
    quiet = api.call("POST", "/v1/runtime/schedule", json={"limits": limits})["vmId"]
    hog = api.call("POST", "/v1/runtime/schedule", json={"limits": {**limits, "diskMib": HOG_DISK_MIB}})[
        "vmId"
    ]
    try:
        quiet_writes(api, quiet, 1)  # python3 and the file warm, out of the timing
        alone = quiet_writes(api, quiet, secs)
        proc = api.call(
            "POST", f"/v1/runtime/vms/{hog}/processes", json={"command": "/bin/sh", "argv": ["-c", HOG]}
        )
        time.sleep(HOG_RAMP_S)
        w0, t0 = qemu_written(hog), time.monotonic()
        with DirtyPeak() as dirty:
            beside = quiet_writes(api, quiet, secs)
        hog_mibps = (qemu_written(hog) - w0) / (time.monotonic() - t0) / 2**20
        api.call("DELETE", f"/v1/runtime/vms/{hog}/processes/{proc['processId']}")
        res[mode]["alone"] += alone
        res[mode]["beside"] += beside
        res[mode]["hog_mibps"].append(round(hog_mibps, 1))
        res[mode]["dirty_peak_mib"].append(round(dirty.peak))
        res[mode]["load"].append(load_average())
        if mode == "bounded":
            res["limits_applied"] = api.call("GET", f"/v1/runtime/vms/{hog}")["limitsApplied"]
        log(
            f"{mode}: quiet p50 {pct(alone, 0.5):.2f} -> {pct(beside, 0.5):.2f} ms, "
            f"p99 {pct(alone, 0.99):.2f} -> {pct(beside, 0.99):.2f} ms; hog {hog_mibps:.0f} MiB/s, "
            f"host dirty peak {dirty.peak:.0f} MiB"
        )
    finally:
        for vm in (hog, quiet):
            api.call("DELETE", f"/v1/runtime/vms/{vm}")


def measure(api: Api, data_dir: Path, rounds: int, secs: float) -> dict[str, Any]:
    keys = ("alone", "beside", "hog_mibps", "dirty_peak_mib", "load")
    res: dict[str, Any] = {m: {k: [] for k in keys} for m in MODES}
    res["failed"] = []
    with Steps("pal bench io") as steps:
        for r in range(rounds):
            for i, mode in enumerate(MODES):
                steps(f"round {r + 1}/{rounds}, {mode}", (r * len(MODES) + i) / (rounds * len(MODES)))
                try:
                    one_round(api, mode, secs, res, steps.log)
                except Exception as exc:  # a round that fails is reported, the others still count
                    res["failed"].append(f"round {r + 1} {mode}: {exc}")
                    steps.log(f"round {r + 1} {mode} failed: {exc}")
    device, why = BlockHost().device_of(data_dir)
    res["device"] = device.describe() if device else why
    res["rounds"], res["seconds"] = rounds, secs
    res["host_dirty"] = {
        k: Path(f"/proc/sys/vm/{k}").read_text().strip()
        for k in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes")
    }
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        m = res[mode]
        if not m["alone"]:
            continue
        row = {
            f"{k}_{q}": round(pct(m[k], p), 3)
            for k in ("alone", "beside")
            for q, p in (("p50", 0.5), ("p99", 0.99))
        }
        row["p50_x"] = round(row["beside_p50"] / row["alone_p50"], 2)
        row["p99_x"] = round(row["beside_p99"] / row["alone_p99"], 2)
        row["hog_mibps"] = round(pct(m["hog_mibps"], 0.5), 1)
        row["dirty_peak_mib"] = max(m["dirty_peak_mib"])
        row["writes_alone"], row["writes_beside"] = len(m["alone"]), len(m["beside"])
        out[mode] = row
    return out


def render(report: dict[str, Any]) -> str:
    s = report["summary"]
    lim = BOUNDED
    lines = [
        "# Disk isolation (`pal bench io`, issue 33)",
        "",
        f"Measured {report['date']} on {report['machine']['cpu']} ({report['machine']['cores']} cores, "
        f"kernel {report['machine']['kernel']}), accelerator **{report['accel'].upper()}**; load average "
        f"(1 min) {report['load_start']} at the start, {report['load_end']} at the end (per round: "
        + "; ".join(f"{m} {report[m]['load']}" for m in MODES)
        + ").",
        f"- Data dir device: {report['device']}",
        *data_dir_lines(report),
        f"- {report['rounds']} round(s) of each mode, alternating; each: a quiet VM times 4 KiB O_DSYNC"
        f" writes (guest clock) for {report['seconds']:.0f} s alone, then as long beside a hog VM writing"
        f" 1 MiB O_DIRECT blocks over a 6 GiB file in a loop. Host dirty thresholds: {report['host_dirty']}.",
        f"- bounded: both VMs ask the defaults every VM gets (read {lim['diskReadMibps']} MiB/s, write"
        f" {lim['diskWriteMibps']} MiB/s, {lim['diskIops']} IOPS); unbounded: the server runs with"
        " PAL_DISK_*=off.",
        "- `× alone`: beside the hog over alone, in the same rounds. Hog MiB/s: what its QEMU wrote to the"
        " host while the quiet VM was timed (p50 over rounds).",
        "",
        "| Mode | alone p50 ms | alone p99 ms | beside hog p50 ms | × alone | beside hog p99 ms | × alone"
        " | hog MiB/s | host dirty peak MiB | writes alone / beside |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        if mode in s:
            r = s[mode]
            lines.append(
                f"| {mode} | {r['alone_p50']:.2f} | {r['alone_p99']:.2f} | {r['beside_p50']:.2f} "
                f"| {r['p50_x']}× | {r['beside_p99']:.2f} | {r['p99_x']}× | {r['hog_mibps']} "
                f"| {r['dirty_peak_mib']} | {r['writes_alone']} / {r['writes_beside']} |"
            )
    applied = report.get("limits_applied") or {}
    lines += ["", "Host limits of a bounded VM here (its `limitsApplied`):", ""]
    lines += [f"- applied `{k}`: {v}" for k, v in applied.get("applied", {}).items()]
    lines += [f"- skipped `{k}`: {v}" for k, v in applied.get("skipped", {}).items()]
    lines += ["", f"Failed rounds: {'; '.join(report['failed']) or 'none'}.", ""]
    return "\n".join(lines)


def main(
    rounds: int, seconds: float, data_dir: Path | None, out_dir: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    report = measure_on_local_server(
        data_dir, lambda api, d: measure(api, d, rounds, seconds), extra_env=SERVER_ENV, max_vms=4
    )
    report["summary"] = summary(report)
    for mode in MODES:  # the report keeps the percentiles, not every write's latency
        report[mode] = {k: v for k, v in report[mode].items() if k not in ("alone", "beside")}
    write_report(out_dir, "io", report, render(report), log)
    return report
