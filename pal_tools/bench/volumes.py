"""`pal bench volumes` (issue 34): a volume against the sandbox's own disk, and the mount's
cost at schedule.

Starts its own `pal up` on the data dir (no warm pool, no pre-started QEMUs), makes one
volume, mounts it once (the node's volume server starts at its first mount), and for
``rounds`` rounds:

1. schedules a sandbox with the volume at /vol (timed) and one without (timed): the
   mount's cost is the difference (the issue's target: at most one warm exec);
2. in the sandbox with the volume: sequential write (1 MiB blocks, ``size_mib``, fsync'd)
   and read (the guest's page cache dropped first), then 4 KiB random writes (fsync'd at
   the end) and reads over that file, once on /vol and once on /workspace (its own disk);
3. two sandboxes writing ``size_mib`` each into the volume at once: their sum in MiB/s.

Reports each as p50 over the rounds, the volume's throughput as a share of the disk's
(target: sequential at least 50 %), and writes volumes.md and .json to ``out_dir``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pal.ops.progress import Steps
from pal_tools.bench.common import Api, data_dir_lines, pct, write_report
from pal_tools.bench.server import measure_on_local_server

SERVER_ENV = {"PAL_POOL": "0", "PAL_PRESTART": "0"}
VOLUME = "bench-volume"
IO = r"""
import json, os, random, sys, time
path, mib, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def drop():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass
blk, out = b"\xa5" * (1 << 20), {}
t = time.perf_counter()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(mib):
    os.write(fd, blk)
os.fsync(fd); os.close(fd)
out["seq_write_mibps"] = mib / (time.perf_counter() - t)
drop()
t = time.perf_counter()
fd = os.open(path, os.O_RDONLY)
while os.read(fd, 1 << 20):
    pass
os.close(fd)
out["seq_read_mibps"] = mib / (time.perf_counter() - t)
pages, page = mib * 256, b"\x5a" * 4096
fd = os.open(path, os.O_RDWR)
t = time.perf_counter()
for _ in range(ops):
    os.pwrite(fd, page, random.randrange(pages) * 4096)
os.fsync(fd)
out["rand_write_iops"] = ops / (time.perf_counter() - t)
drop()
t = time.perf_counter()
for _ in range(ops):
    os.pread(fd, 4096, random.randrange(pages) * 4096)
out["rand_read_iops"] = ops / (time.perf_counter() - t)
os.close(fd); os.unlink(path)
print(json.dumps(out))
"""
WRITE = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(int(sys.argv[2])):
    os.write(fd, b"x" * (1 << 20))
os.fsync(fd)
"""
KEYS = ("seq_write_mibps", "seq_read_mibps", "rand_write_iops", "rand_read_iops")


def run_py(api: Api, vm: str, code: str, *args: str) -> str:
    body = {"command": "python3", "argv": ["-c", code, *args], "user": "root"}
    out = api.call("POST", f"/v1/runtime/vms/{vm}/exec", json=body)
    if out["exitCode"] != 0:
        raise RuntimeError(f"python in {vm} failed: {out['stderr'][-500:]}")
    return str(out["stdout"])


def schedule_ms(api: Api, spec: dict[str, Any]) -> tuple[float, str]:
    t = time.perf_counter()
    vm = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    return (time.perf_counter() - t) * 1000, str(vm)


def one_round(api: Api, size_mib: int, ops: int, res: dict[str, Any], log: Callable[[str], None]) -> None:
    mount = {"volumes": [{"name": VOLUME, "path": "/vol"}]}
    vms: list[str] = []
    try:
        ms_vol, a = schedule_ms(api, mount)
        vms.append(a)
        ms_plain, plain = schedule_ms(api, {})
        vms.append(plain)
        t = time.perf_counter()
        api.exec_ok(a)
        res["warm_exec_ms"].append((time.perf_counter() - t) * 1000)
        res["schedule_volume_ms"].append(ms_vol)
        res["schedule_plain_ms"].append(ms_plain)
        for where, path in (("volume", "/vol/bench.io"), ("disk", "/workspace/bench.io")):
            got = json.loads(run_py(api, a, IO, path, str(size_mib), str(ops)))
            for k in KEYS:
                res[where][k].append(got[k])
        _, b = schedule_ms(api, mount)
        vms.append(b)
        t = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda v: run_py(api, v, WRITE, f"/vol/{v}.w", str(size_mib)), (a, b)))
        res["two_writers_mibps"].append(2 * size_mib / (time.perf_counter() - t))
        log(f"schedule {ms_plain:.0f} ms, with a volume {ms_vol:.0f} ms")
    finally:
        for vm in vms:
            api.call("DELETE", f"/v1/runtime/vms/{vm}")


def measure(api: Api, rounds: int, size_mib: int, ops: int) -> dict[str, Any]:
    res: dict[str, Any] = {w: {k: [] for k in KEYS} for w in ("volume", "disk")}
    for k in ("schedule_volume_ms", "schedule_plain_ms", "warm_exec_ms", "two_writers_mibps"):
        res[k] = []
    res["failed"] = []
    api.call("POST", "/v1/volumes", json={"name": VOLUME, "sizeMib": max(1024, 4 * size_mib)})
    try:
        # The node's volume server starts at its first mount: not a mount's cost.
        first = api.call("POST", "/v1/runtime/schedule", json={"volumes": [{"name": VOLUME, "path": "/vol"}]})
        api.call("DELETE", f"/v1/runtime/vms/{first['vmId']}")
        with Steps("pal bench volumes") as steps:
            for r in range(rounds):
                steps(f"round {r + 1}/{rounds}", r / rounds)
                try:
                    one_round(api, size_mib, ops, res, steps.log)
                except Exception as exc:  # a round that fails is reported, the others still count
                    res["failed"].append(f"round {r + 1}: {exc}")
                    steps.log(f"round {r + 1} failed: {exc}")
    finally:
        api.call("DELETE", f"/v1/volumes/{VOLUME}", params={"force": "true"})
    res["rounds"], res["size_mib"], res["ops"] = rounds, size_mib, ops
    return res


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in KEYS:
        if res["volume"][k] and res["disk"][k]:
            v, d = pct(res["volume"][k], 0.5), pct(res["disk"][k], 0.5)
            out[k] = {"volume": round(v, 1), "disk": round(d, 1), "share": round(v / d, 2) if d else None}
    for k in ("schedule_volume_ms", "schedule_plain_ms", "warm_exec_ms", "two_writers_mibps"):
        if res[k]:
            out[k] = round(pct(res[k], 0.5), 1)
    if res["schedule_volume_ms"] and res["schedule_plain_ms"]:
        out["mount_ms"] = round(out["schedule_volume_ms"] - out["schedule_plain_ms"], 1)
    return out


def render(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        "# Volumes (`pal bench volumes`, issue 34)",
        "",
        f"Measured {report['date']} on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
        f"accelerator **{report['accel'].upper()}**; load average (1 min) {report['load_start']} at the "
        f"start, {report['load_end']} at the end.",
        *data_dir_lines(report),
        f"- {report['rounds']} round(s); {report['size_mib']} MiB sequential, {report['ops']} random 4 KiB "
        "operations; p50 over the rounds. Targets: sequential on a volume at least 50 % of the disk; "
        "mounting adds at most one warm exec to a schedule.",
        "",
        "| | volume | own disk | volume / disk |",
        "|---|---:|---:|---:|",
    ]
    for k in KEYS:
        if k in s:
            lines.append(f"| {k} | {s[k]['volume']} | {s[k]['disk']} | {s[k]['share']} |")
    lines += [
        "",
        f"- schedule without a volume: {s.get('schedule_plain_ms')} ms; with one: "
        f"{s.get('schedule_volume_ms')} ms (the mount: {s.get('mount_ms')} ms); a warm exec: "
        f"{s.get('warm_exec_ms')} ms",
        f"- two sandboxes writing the volume at once: {s.get('two_writers_mibps')} MiB/s together",
        "",
        f"Failed rounds: {'; '.join(report['failed']) or 'none'}.",
        "",
    ]
    return "\n".join(lines)


def main(
    rounds: int,
    size_mib: int,
    ops: int,
    data_dir: Path | None,
    out_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    report = measure_on_local_server(
        data_dir, lambda api, _d: measure(api, rounds, size_mib, ops), extra_env=SERVER_ENV, max_vms=4
    )
    report["summary"] = summary(report)
    write_report(out_dir, "volumes", report, render(report), log)
    return report
