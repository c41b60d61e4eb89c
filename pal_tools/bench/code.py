"""`pal bench code`: the code interpreter (docs/agents.md) against the same run's warm exec.

Starts its own `pal up` on the data dir (the code-interpreter image must be built:
`pal image build code-interpreter`), twice, and measures through the public REST API:
- first without a warm pool (``PAL_POOL=0``): warm exec, `/bin/true` in a running VM of the
  image after a first exec (the baseline); a trivial cell's round trip (`1`) in a kernel
  that already ran one (target ≤ 1.5×); schedule of the image from its warm template (whose
  default kernel is started) → its first cell answered; fork ×5 of a VM whose kernel holds
  a 100 MiB DataFrame → every child has answered a cell about it (in parallel);
- then with one pooled VM of the image (``PAL_POOL=code-interpreter@256m-1c-2048d:1``):
  warm exec again (that server's baseline) and schedule (a claim from the pool, refilled
  between samples) → first cell answered (target ≤ 6×).
Each row's ratio is to the warm exec of its own server. Writes JSON and docs/benchmarks/code.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pal.sizes import DEFAULT_MEMORY_MIB, pool_entry, size_name
from pal_tools.bench.latency import Api, local_server, machine, pct, server_accel, timed
from pal_tools.bench.server import OPERATOR_TOKEN

IMAGE = "code-interpreter"
POOL = f"{pool_entry(IMAGE, size_name(DEFAULT_MEMORY_MIB))}:1"  # the second server's PAL_POOL
FORK_COUNT = 5
FRAME_MIB = 100
FORK_MEMORY_MIB = 1024  # the kernel, numpy/pandas and the frame
FRAME_CELL = (
    "import numpy as np, pandas as pd\n"
    f"df = pd.DataFrame(np.random.default_rng(1).random(({FRAME_MIB} * 1024 * 1024 // 80, 10)))\n"
    "int(df.memory_usage().sum() // 2**20)"
)
# (key, label, target, the warm exec it is a ratio of)
ROWS = (
    ("warm_exec", "Warm exec (`/bin/true`, second exec in the VM)", None, "warm_exec"),
    ("cell_round_trip", "Trivial cell round trip (`1`, kernel warm)", 1.5, "warm_exec"),
    ("schedule_to_first_cell", "Schedule (warm template, no pool) → first cell answered", None, "warm_exec"),
    (
        "fork5_all_answer",
        f"Fork ×{FORK_COUNT} of a VM holding a {FRAME_MIB} MiB DataFrame → every child answered",
        None,
        "warm_exec",
    ),
    ("warm_exec_pool", "Warm exec, server with the pool (its baseline)", None, "warm_exec_pool"),
    ("schedule_pool_to_first_cell", "Schedule (pool claim) → first cell answered", 6.0, "warm_exec_pool"),
)
PHASE_TEMPLATE = ("warm_exec", "cell_round_trip", "schedule_to_first_cell", "fork5_all_answer")


def cell(api: Api, vm: str, code: str) -> dict[str, Any]:
    out = api.call("POST", f"/v1/runtime/vms/{vm}/code", json={"code": code})
    if out["error"] is not None:
        raise RuntimeError(f"cell in {vm} failed: {out['error']}")
    return out  # type: ignore[no-any-return]


def wait_code_template(api: Api, timeout: float = 1200) -> None:
    """Schedule until the image's VM comes from its warm template (built in the background)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        vm = api.call("POST", "/v1/runtime/schedule", json={"image": IMAGE})
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
        if vm.get("bootMethod") == "template":
            return
        time.sleep(5)
    raise RuntimeError(f"no warm template of {IMAGE} after {timeout:.0f} s")


def wait_pool_ready(url: str, timeout: float = 1200) -> None:
    """Until the server's pool holds its VM (`pal_pool_ready` of /metrics, operator only)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=30)
        ready = [ln for ln in r.text.splitlines() if ln.startswith("pal_pool_ready{")]
        if ready and float(ready[0].rsplit(" ", 1)[1]) >= 1:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the pool had no VM of {IMAGE} ready after {timeout:.0f} s")


def run_pool(api: Api, url: str, iterations: int, log: Callable[[str], None]) -> dict[str, list[float]]:
    """On the server with the pool: schedule (a claim) → first cell, each from a full pool."""
    res: dict[str, list[float]] = {"warm_exec_pool": [], "schedule_pool_to_first_cell": []}
    log(f"pool of {POOL}: schedule (claim) → first cell ×{iterations}, warm exec")
    for i in range(iterations):
        wait_pool_ready(url)
        ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json={"image": IMAGE})
        ms2, _ = timed(cell, api, vm["vmId"], "1")
        if vm.get("bootMethod") != "pool":
            raise RuntimeError(f"a schedule from a full pool was not a claim: {vm.get('bootMethod')}")
        res["schedule_pool_to_first_cell"].append(ms + ms2)
        if i == 0:  # the baseline once the pool has refilled (no restore beside it)
            api.exec_ok(vm["vmId"])
            wait_pool_ready(url)
            res["warm_exec_pool"] = [timed(api.exec_ok, vm["vmId"])[0] for _ in range(iterations)]
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
    return res


def run(api: Api, iterations: int, log: Callable[[str], None]) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {key: [] for key in PHASE_TEMPLATE}
    log(f"warm template of {IMAGE}")
    wait_code_template(api)
    log(f"schedule → first cell ×{iterations}, then warm exec and cell round trips")
    for i in range(iterations):
        ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json={"image": IMAGE})
        ms2, _ = timed(cell, api, vm["vmId"], "1")
        res["schedule_to_first_cell"].append(ms + ms2)
        if i == 0:
            api.exec_ok(vm["vmId"])
            for _ in range(iterations):
                res["warm_exec"].append(timed(api.exec_ok, vm["vmId"])[0])
                res["cell_round_trip"].append(timed(cell, api, vm["vmId"], "1")[0])
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
    log(f"fork ×{FORK_COUNT} of a VM holding a {FRAME_MIB} MiB DataFrame")
    spec = {"image": IMAGE, "limits": {"memoryMib": FORK_MEMORY_MIB}}
    src = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    try:
        cell(api, src, FRAME_CELL)
        for _ in range(max(1, iterations // 4)):
            res["fork5_all_answer"].append(_fork_round(api, src))
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{src}")
    return res


def _fork_round(api: Api, src: str) -> float:
    t = time.perf_counter()
    kids = [
        f["vmId"]
        for f in api.call("POST", f"/v1/runtime/vms/{src}/fork", json={"count": FORK_COUNT})["forks"]
    ]
    try:
        with ThreadPoolExecutor(FORK_COUNT) as pool:
            rows = list(pool.map(lambda k: cell(api, k, "len(df)")["text"], kids))
        ms = (time.perf_counter() - t) * 1000
        if len(set(rows)) != 1 or len(rows) != FORK_COUNT:
            raise RuntimeError(f"the children disagree about df: {rows}")
        return ms
    finally:
        for k in kids:
            api.call("DELETE", f"/v1/runtime/vms/{k}")


def render(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["samples_ms"]
    lines = [
        "# Code interpreter: cells against a warm exec",
        "",
        f"Measured {report['date']} by `pal bench code` through the public REST API,"
        f" {report['iterations']} iterations per row (fork rounds: {len(s['fork5_all_answer'])}).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, Linux {m['kernel']}",
        f"- VMM: {m['qemu']}, machine `microvm`, accelerator **{report['accel'].upper()}**",
        f"- Guest: the `{IMAGE}` image (Debian 12, ipykernel, numpy, pandas, matplotlib),"
        f" default size; the fork source {FORK_MEMORY_MIB} MiB",
        f"- Servers: the first rows with `PAL_POOL=0`, the last two on a second server with"
        f" `PAL_POOL={POOL}` (its pool refilled before each sample); each ratio is to its server's warm exec",
        f"- Load average (1 min) at start {report['load_start']}, at end {report['load_end']}"
        " (the machine is shared: other work ran beside this measurement when these are above ~1)",
        "",
        "| Step | p50 ms | p90 ms | n | p50 × warm exec | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for key, label, target, of in ROWS:
        v, base = s.get(key, []), pct(s.get(of, []), 0.5)
        ratio = f"{pct(v, 0.5) / base:.2f}×" if v and base else "–"
        goal = f"≤ {target:g}×" if target else "–"
        lines.append(f"| {label} | {pct(v, 0.5):.0f} | {pct(v, 0.9):.0f} | {len(v)} | {ratio} | {goal} |")
    return "\n".join(lines) + "\n"


def main(
    iterations: int = 10,
    data_dir: Path | None = None,
    out_dir: Path = Path("docs/benchmarks"),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from pal.config import Settings

    data = data_dir or Settings.from_env().data_dir
    load_start = os.getloadavg()[0]
    with local_server(data, {"PAL_POOL": "0"}) as (url, key):
        api = Api(url, key)
        accel = server_accel(url)
        samples = run(api, iterations, log)
    with local_server(data, {"PAL_POOL": POOL}) as (url, key):
        samples |= run_pool(Api(url, key), url, iterations, log)
    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "iterations": iterations,
        "accel": accel,
        "machine": machine(),
        "load_start": round(load_start, 1),
        "load_end": round(os.getloadavg()[0], 1),
        "samples_ms": samples,
        "p50_ms": {k: round(pct(v, 0.5), 1) for k, v in samples.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "code.json").write_text(json.dumps(report, indent=2))
    (out_dir / "code.md").write_text(render(report))
    log(f"wrote {out_dir / 'code.md'}")
    return report
