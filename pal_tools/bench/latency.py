"""`pal bench`: the spec's latency table, measured through the public REST API.

Starts its own `pal up` (unless given --url and --api-key), creates a tenant, and times
each lifecycle step over N iterations: pause (snapshot RPC), resume (restore RPC), first
exec after resume, fork N=1 spawn, first exec after fork, stop, cold boot -> first exec,
template schedule -> first exec, fork N=10/N=50 to all running, host memory (PSS) per
fork, and the floor: a bare QEMU process reaching its QMP socket. Writes JSON and
docs/benchmarks/runtime-latency.md.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pal.sizes import DEFAULT_MEMORY_MIB
from pal_tools.bench import memory as bench_memory
from pal_tools.bench import steady as bench_steady
from pal_tools.bench.common import (
    Api,
    data_dir_info,
    load_average,
    machine,
    pct,
    pss_kib,
    qemu_pid_of,
    timed,
    vm_pss_kib,
    write_report,
)
from pal_tools.bench.floors import native_guest_path_ms, qemu_floor_ms
from pal_tools.bench.latency_report import render_markdown, warm_base
from pal_tools.bench.latency_rows import (
    ROWS,
    SECTIONS,
)
from pal_tools.bench.server import (
    drop_default_template,
    local_server,
    server_accel,
    wait_image_template,
    wait_template,
)


def first_schedule_ms(api: Api, memory_mib: int) -> float:
    """Schedule → first exec answered, on a server that just became ready."""
    ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json={"limits": {"memoryMib": memory_mib}})
    ms2, _ = timed(api.exec_ok, vm["vmId"])
    api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
    return ms + ms2


def custom_image_rows(
    api: Api,
    data_dir: Path,
    iterations: int,
    memory_mib: int,
    res: dict[str, list[float]],
    log: Callable[[str], None],
) -> None:
    """A user's own image: imported (pal/images/sample.py: static busybox, no Python), then
    scheduled the first time (cold boot; its template is built in the background) and then
    from its own template. Each first schedule needs a new image, hence a new import."""
    from pal.config import Settings
    from pal.images import sample
    from pal.images.importer import import_image
    from pal.server import remove_image

    settings = Settings.from_env(data_dir)
    spec = {"limits": {"memoryMib": memory_mib}}
    names: list[str] = []
    first_n = max(3, iterations // 4)
    log(
        f"custom image: import + first schedule → first exec ×{first_n}, then from its template ×{iterations}"
    )
    try:
        with tempfile.TemporaryDirectory(dir=data_dir) as td:
            for i in range(first_n):
                name = f"bench-custom-{os.getpid()}-{i}"
                tree = sample.busybox_tree(
                    Path(td) / f"tree{i}", {"etc/bench-id": f"{name}-{time.time_ns()}"}
                )
                archive = sample.archive(Path(td), [tree], Path(td) / f"{i}.tar")
                ms_import, _ = timed(import_image, settings, name, str(archive))
                res["custom_import"].append(ms_import)
                names.append(name)
                ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json={**spec, "image": name})
                ms2, _ = timed(api.exec_ok, vm["vmId"])
                if vm.get("bootMethod") != "cold":
                    raise RuntimeError(f"first schedule of {name} was {vm.get('bootMethod')}, not cold")
                res["custom_first_schedule"].append(ms + ms2)
                api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
                # Measure the next one on an idle node, not beside this one's template build.
                wait_image_template(api, name, memory_mib)
        for _ in range(iterations):
            ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json={**spec, "image": names[-1]})
            ms2, _ = timed(api.exec_ok, vm["vmId"])
            if vm.get("bootMethod") != "template":
                raise RuntimeError(f"schedule of {names[-1]} was {vm.get('bootMethod')}, not template")
            res["custom_template_to_first_exec"].append(ms + ms2)
            api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                remove_image(settings, name)


def cold_boot_rows(
    api: Api, n: int, memory_mib: int, res: dict[str, list[float]], log: Callable[[str], None]
) -> None:
    """The default image, booted cold (no template): schedule → first exec answered."""
    log(f"cold boot → first exec ×{n}")
    for _ in range(n):
        spec = {"limits": {"memoryMib": memory_mib}, "boot": "cold"}
        ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json=spec)
        ms2, _ = timed(api.exec_ok, vm["vmId"])
        res["cold_boot_to_first_exec"].append(ms + ms2)
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")


def run_bench(
    api: Api,
    iterations: int,
    memory_mib: int,
    fork_iterations: int,
    log: Callable[[str], None],
    data_dir: Path | None = None,
    sections: tuple[str, ...] = SECTIONS,
    steady_runs: int = 5,
    res: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    res = res if res is not None else {}
    for k, _ in ROWS:
        res.setdefault(k, [])
    mem: dict[str, Any] = {}
    spec = {"limits": {"memoryMib": memory_mib}}

    log("warm template")
    wait_template(api, memory_mib)

    if "steady" in sections:
        bench_steady.run_steady(api, steady_runs, memory_mib, res, mem, log, timed, vm_pss_kib)
        if (after := bench_steady.pss_summary(mem, memory_mib)) is not None:
            mem["after_cycles"] = after
        else:
            mem.pop("after_cycles", None)
    if "main" not in sections:
        return {"samples_ms": res, "memory": mem}

    log("floor: bare QEMU; the harness's restore-path work natively")
    res["qemu_floor"] = qemu_floor_ms(iterations)
    res["native_identify_first_exec"] = native_guest_path_ms(iterations)

    log(f"template schedule → first exec ×{iterations}, pause/resume ×{iterations}, stop ×{iterations}")
    lifecycle_rows(api, iterations, spec, res)
    fork_rows(api, iterations, fork_iterations, spec, res, mem, log)

    cold_boot_rows(api, max(3, iterations // 4), memory_mib, res, log)

    if data_dir is not None:
        custom_image_rows(api, data_dir, iterations, memory_mib, res, log)
    else:
        log("custom image rows skipped: they import an image into the server's data dir (no --url)")

    return {"samples_ms": res, "memory": mem}


def lifecycle_rows(api: Api, iterations: int, spec: dict[str, Any], res: dict[str, list[float]]) -> None:
    """Schedule → first exec, pause/resume (snapshot and live), warm exec, stop: per VM."""
    for _ in range(iterations):
        ms, vm = timed(api.call, "POST", "/v1/runtime/schedule", json=spec)
        vid = vm["vmId"]
        ms2, _ = timed(api.exec_ok, vid)
        res["template_to_first_exec"].append(ms + ms2)
        ms, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/pause")
        res["snapshot"].append(ms)
        ms_r, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/resume")
        ms_e, _ = timed(api.exec_ok, vid)
        res["restore"].append(ms_r)
        res["first_exec_after_restore"].append(ms_e)
        res["resume_to_first_exec"].append(ms_r + ms_e)
        ms_w, _ = timed(api.exec_ok, vid)
        res["warm_exec"].append(ms_w)
        # The same guest work on the same QEMU (no new process, translation cache warm).
        api.call("POST", f"/v1/runtime/vms/{vid}/pause", json={"mode": "live"})
        ms_lr, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/resume")
        ms_le, _ = timed(api.exec_ok, vid)
        res["live_resume_to_first_exec"].append(ms_lr + ms_le)
        ms, _ = timed(api.call, "DELETE", f"/v1/runtime/vms/{vid}")
        res["stop"].append(ms)


def fork_rows(
    api: Api,
    iterations: int,
    fork_iterations: int,
    spec: dict[str, Any],
    res: dict[str, list[float]],
    mem: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """Fork N=1 (spawn and first exec), then N=10 and N=50 to all running, with the
    children's host memory (PSS) after each has answered once."""
    memory_mib = spec["limits"]["memoryMib"]
    log(f"fork N=1 ×{iterations}")
    src = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    api.exec_ok(src)
    for _ in range(iterations):
        ms, out = timed(api.call, "POST", f"/v1/runtime/vms/{src}/fork", json={"count": 1})
        child = out["forks"][0]["vmId"]
        ms2, _ = timed(api.exec_ok, child)
        res["fork_n1"].append(ms)
        res["first_exec_after_fork"].append(ms2)
        api.call("DELETE", f"/v1/runtime/vms/{child}")

    for n, key in ((10, "fork_n10_all_running"), (50, "fork_n50_all_running")):
        log(f"fork N={n} ×{fork_iterations}")
        for i in range(fork_iterations):
            ms, out = timed(api.call, "POST", f"/v1/runtime/vms/{src}/fork", json={"count": n})
            kids = [f["vmId"] for f in out["forks"] if f["state"] == "running"]
            if len(kids) != n:
                log(f"  only {len(kids)}/{n} forks running: {[f.get('error') for f in out['forks']]}")
            res[key].append(ms)
            if i == 0:
                for k in kids:
                    api.exec_ok(k)  # touch each child once, as a user would
                pids = [p for p in (qemu_pid_of(k) for k in kids) if p]
                pss = [pss_kib(p) for p in pids]
                mem[f"n{n}"] = {
                    "children": len(pids),
                    "pss_kib_mean": statistics.mean(pss) if pss else None,
                    "pss_kib_max": max(pss) if pss else None,
                    "guest_ram_kib": memory_mib * 1024,
                }
            for k in kids:
                api.call("DELETE", f"/v1/runtime/vms/{k}")
    api.call("DELETE", f"/v1/runtime/vms/{src}")
    # The same with state: an empty guest shares little, which hid children that shared
    # nothing (issue 39; `pal bench memory` has the whole memory report).
    log(f"fork N=10 of a guest holding {bench_memory.STATE_MIB} MiB of random state")
    held = bench_memory.copies_run(api, memory_mib, 10, bench_memory.STATE_MIB)
    mem["n10_held"] = {
        "children": held["copies"],
        "pss_kib_mean": held["pssMeanMiB"] * 1024,
        "pss_kib_max": held["pssMaxMiB"] * 1024,
        "guest_ram_kib": memory_mib * 1024,
        "state_mib": held["stateMiB"],
    }


def new_qemu_rows(api: Api, iterations: int, memory_mib: int, res: dict[str, list[float]]) -> None:
    """Pause/resume cycles on a server that parks no QEMU: every resume restores its
    snapshot into a new process (as on another node, after a restart, or when its parked
    one was evicted), split into its steps."""
    spec = {"limits": {"memoryMib": memory_mib}}
    wait_template(api, memory_mib)
    vid = api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"]
    try:
        api.exec_ok(vid)
        for _ in range(iterations):
            api.call("POST", f"/v1/runtime/vms/{vid}/pause")
            ms_r, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vid}/resume")
            ms_e, _ = timed(api.exec_ok, vid)
            ms_w, _ = timed(api.exec_ok, vid)
            res["restore_new_qemu"].append(ms_r)
            res["first_exec_after_restore_new_qemu"].append(ms_e)
            res["resume_to_first_exec_new_qemu"].append(ms_r + ms_e)
            restore_steps(api, vid, ms_r, ms_e - ms_w, res)
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vid}")


def restore_steps(
    api: Api, vm: str, resume_ms: float, first_exec_extra_ms: float, res: dict[str, list[float]]
) -> None:
    """Split the resume just measured into its steps (STEPS) from its status event."""
    events = api.call("GET", f"/v1/runtime/vms/{vm}/events")["events"]
    up = [e for e in events if e.get("toState") == "running" and (e.get("details") or {}).get("timings")]
    if not up:
        return
    d = up[-1]["details"]
    t = d["timings"]
    guest_us = {k: t.get(f"identify_guest_{k}_us") for k in ("decode", "clock_rng", "net_host_ca")}
    got = {
        "step_rpc_ms": resume_ms - float(d.get("bootMs") or 0),
        "step_prepare_ms": t.get("prepare_ms"),
        "step_qemu_spawn_ms": t.get("qemu_spawn_ms"),
        "step_qemu_load_ms": t.get("qemu_load_ms"),
        "step_qemu_cont_ms": t.get("qemu_cont_ms"),
        "step_first_exec_cold_ms": first_exec_extra_ms,
    }
    for k, us in guest_us.items():
        got[f"step_guest_{k}_ms"] = us / 1000 if isinstance(us, int | float) else None
    reply = t.get("identify_reply_ms")
    if isinstance(reply, int | float) and all(isinstance(v, int | float) for v in guest_us.values()):
        got["step_guest_wake_ms"] = reply - sum(guest_us.values()) / 1000  # type: ignore[arg-type]
    for k, v in got.items():
        if isinstance(v, int | float):
            res.setdefault(k, []).append(float(v))


def main(
    iterations: int = 20,
    fork_iterations: int = 3,
    memory_mib: int = DEFAULT_MEMORY_MIB,
    url: str | None = None,
    api_key: str | None = None,
    data_dir: Path | None = None,
    out_dir: Path = Path("docs/benchmarks"),
    log: Callable[[str], None] = print,
    sections: tuple[str, ...] = SECTIONS,
    steady_runs: int = 5,
    ready_runs: int = 3,
) -> dict[str, Any]:
    local_dir: Path | None = None
    if url and api_key:
        ctx: contextlib.AbstractContextManager[tuple[str, str]] = contextlib.nullcontext((url, api_key))
    else:
        from pal.config import Settings

        local_dir = data_dir or Settings.from_env().data_dir
        ctx = local_server(local_dir)
    load_before = load_average()
    res: dict[str, list[float]] = {"ready_to_first_exec": []}
    with ctx as (u, k):
        api = Api(u, k)
        if local_dir is not None and "steady" in sections:
            # local_server returned the moment /readyz said 200: this is the first schedule.
            res["ready_to_first_exec"].append(first_schedule_ms(api, memory_mib))
        accel = server_accel(u)
        body = run_bench(
            api, iterations, memory_mib, fork_iterations, log, local_dir, sections, steady_runs, res
        )
    if local_dir is not None and "main" in sections:
        log(f"resume into a new QEMU ×{iterations} (a server that parks none)")
        with local_server(local_dir, {"PAL_PARKED_MAX": "0"}) as (u, k):
            new_qemu_rows(Api(u, k), iterations, memory_mib, res)
    if local_dir is not None and "steady" in sections:
        log(
            f"readiness → first exec: {ready_runs - 1} more `pal up` start(s),"
            " the last one building its template"
        )
        for i in range(ready_runs - 1):
            if i == ready_runs - 2:
                # Readiness that waited for the template build: the first schedules must not
                # race it (issue 17), so this start begins without the default template.
                drop_default_template(local_dir, memory_mib)
            with local_server(local_dir) as (u, k):
                res["ready_to_first_exec"].append(first_schedule_ms(Api(u, k), memory_mib))
    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "iterations": iterations,
        "fork_iterations": fork_iterations,
        "steady_runs": steady_runs if "steady" in sections else 0,
        "sections": list(sections),
        "memory_mib": memory_mib,
        "accel": accel,
        "machine": machine(),
        "load": {"before": load_before, "after": load_average()},
        "data_dir": data_dir_info(local_dir),
        **body,
    }
    report["p50_ms"] = {k: round(pct(v, 0.5), 1) for k, v in report["samples_ms"].items() if v}
    report["p90_ms"] = {k: round(pct(v, 0.9), 1) for k, v in report["samples_ms"].items() if v}
    report["p50_x_warm_exec"] = {}
    for key, v in report["samples_ms"].items():
        base = warm_base(report["samples_ms"], key)
        if v and base:
            report["p50_x_warm_exec"][key] = round(pct(v, 0.5) / base, 2)
    # A partial run (--only) never overwrites the published full report.
    stem = "runtime-latency" if set(sections) == set(SECTIONS) else f"runtime-latency-{'-'.join(sections)}"
    write_report(out_dir, stem, report, render_markdown(report), log)
    return report
