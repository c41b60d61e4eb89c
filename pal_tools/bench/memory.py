"""`pal bench memory`: the host memory a sandbox costs when its guest holds state, and the
memory a guest gives back (issue 39; docs/lifecycle.md, "What a copy shares").

Measured through the public API, PSS read from /proc on this host (the server must run
here: its own `pal up`, or one given by --url of any Pal version, so "before" and "after"
are taken by the same protocol):

- **copies**: a VM whose guest holds ``state_mib`` of random bytes in its RAM (a tmpfs
  file) forks ``copies`` children at once; each checks the state (md5, which reads every
  page), then each child's PSS (its QEMU: the only process of a copy) is read, with how it
  came up (a pre-started QEMU or a new one) and the time until every child answered. The
  same for a guest holding nothing.
- **long-lived**: a VM (holding nothing, and one holding the state) through ``cycles`` of:
  allocate and free ``cycle_mib`` in the guest, pause, resume. Its PSS after each cycle,
  the RAM its snapshots allocate on disk, the pause and resume times; at the end, after
  the guest had ``SETTLE_S`` to report what it freed, the PSS that stays.

Writes ``memory.json`` and ``memory.md`` under ``out_dir``; each run is kept under its
``label`` (``before`` / ``after``), so the page shows them side by side.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pal.snapshots.hashing import data_extents
from pal_tools.bench.common import Api, load_average, pct, pss_kib, qemu_pids, report_of, timed
from pal_tools.bench.server import local_server, server_accel

MIB = 1024 * 1024
STATE_MIB = 64  # the random state a guest holds (issue 39's protocol)
SETTLE_S = 5.0  # free page reporting runs 2 s after the guest frees
STATE = "/dev/shm/pal-bench-state"
MAKE_STATE = f"head -c {{mib}}M /dev/urandom > {STATE} && md5sum {STATE}"
CHECK_STATE = f"md5sum {STATE}"
# Anonymous memory written page by page, freed when the process exits.
CHURN = (
    "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * (len(b) // 4096); print(len(b))"
)


def sh(api: Api, vm: str, cmd: str) -> str:
    out = api.call(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "/bin/sh", "argv": ["-c", cmd], "timeoutSecs": 300, "user": "root"},
    )
    if out["exitCode"] != 0:
        raise RuntimeError(f"{cmd!r} in {vm}: {out}")
    return str(out["stdout"])


def churn(api: Api, vm: str, mib: int) -> None:
    out = api.call(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "python3", "argv": ["-c", CHURN, str(mib)], "timeoutSecs": 300},
    )
    if out["exitCode"] != 0:
        raise RuntimeError(f"allocating {mib} MiB in {vm}: {out}")


def came_up_how(api: Api, vm: str) -> str:
    """How the VM's last incarnation started (its status event's timings)."""
    events = api.call("GET", f"/v1/runtime/vms/{vm}/events")["events"]
    up = [e for e in events if e.get("toState") == "running" and isinstance(e.get("details"), dict)]
    timings = up[-1]["details"].get("timings", {}) if up else {}
    if timings.get("prestarted"):
        return "pre-started QEMU"
    return "parked QEMU" if up and up[-1]["details"].get("warm") else "new QEMU"


def data_mib(data_dir: Path | None, vm: str, snapshot_id: str) -> float | None:
    """The RAM file of a snapshot: MiB of data in it (holes, what the guest gave back, cost
    nothing). Counted by SEEK_DATA, not st_blocks: XFS counts speculative copy-on-write
    preallocations of reflinked files in st_blocks for a while."""
    if data_dir is None:
        return None
    for mem in (data_dir / "snapshots").glob(f"*/{vm}/{snapshot_id}/mem"):
        fd = os.open(mem, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return round(sum(end - start for start, end in data_extents(fd, size)) / MIB, 1)
        finally:
            os.close(fd)
    return None


def guest_ram_pss_mib(pid: int, memory_mib: int) -> float:
    """PSS of the guest RAM mapping alone (the rest of a QEMU's is its own: heap, devices,
    and under TCG its translation buffer)."""
    total, cur = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = hi - lo == memory_mib * MIB and len(line.split()) > 5  # file-backed
            elif cur and head == "Pss:":
                total += int(line.split()[1])
    return round(total / 1024, 1)


def copies_run(api: Api, memory_mib: int, copies: int, state_mib: int) -> dict[str, Any]:
    """One fork of ``copies`` children from a VM holding ``state_mib`` (0: nothing)."""
    src = api.call("POST", "/v1/runtime/schedule", json={"limits": {"memoryMib": memory_mib}})["vmId"]
    kids: list[str] = []
    try:
        digest = sh(api, src, MAKE_STATE.format(mib=state_mib)).split()[0] if state_mib else ""
        t0 = time.perf_counter()
        out = api.call("POST", f"/v1/runtime/vms/{src}/fork", json={"count": copies})
        kids = [f["vmId"] for f in out["forks"] if f["state"] == "running"]
        if len(kids) != copies:
            raise RuntimeError(f"{len(kids)}/{copies} children running: {out['forks']}")
        check = (lambda k: sh(api, k, CHECK_STATE).split()[0]) if state_mib else (lambda k: api.exec_ok(k))
        with ThreadPoolExecutor(copies) as pool:
            seen = list(pool.map(check, kids))
        all_ms = (time.perf_counter() - t0) * 1000
        if state_mib and set(seen) != {digest}:
            raise RuntimeError(f"a child's state differs from its parent's: {seen} != {digest}")
        pids = qemu_pids()
        per: list[dict[str, Any]] = [
            {
                "how": came_up_how(api, k),
                "pssMiB": round(pss_kib(pids[k]) / 1024, 1),
                "ramPssMiB": guest_ram_pss_mib(pids[k], memory_mib),
            }
            for k in kids
        ]
        pss = [c["pssMiB"] for c in per]
        how: dict[str, list[float]] = {}
        for c in per:
            how.setdefault(c["how"], []).append(c["pssMiB"])
        return {
            "stateMiB": state_mib,
            "copies": copies,
            "allAnsweredMs": round(all_ms),
            "pssMeanMiB": round(statistics.mean(pss), 1),
            "pssMaxMiB": max(pss),
            "ramPssMeanMiB": round(statistics.mean(c["ramPssMiB"] for c in per), 1),
            "sourcePssMiB": round(pss_kib(pids[src]) / 1024, 1),
            "byHow": {k: {"n": len(v), "pssMeanMiB": round(statistics.mean(v), 1)} for k, v in how.items()},
            "load": load_average(),
        }
    finally:
        for vm in (*kids, src):
            api.call("DELETE", f"/v1/runtime/vms/{vm}")


def cycles_run(
    api: Api,
    memory_mib: int,
    cycles: int,
    cycle_mib: int,
    state_mib: int,
    data_dir: Path | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One VM through ``cycles`` of churn, pause, resume; its memory after each."""
    vm = api.call("POST", "/v1/runtime/schedule", json={"limits": {"memoryMib": memory_mib}})["vmId"]
    try:
        digest = sh(api, vm, MAKE_STATE.format(mib=state_mib)).split()[0] if state_mib else ""
        pss, ram_pss, snap_mib, pause_ms, resume_ms, hows = [], [], [], [], [], []
        for i in range(cycles):
            churn(api, vm, cycle_mib)
            ms_p, paused = timed(api.call, "POST", f"/v1/runtime/vms/{vm}/pause")
            ms_r, _ = timed(api.call, "POST", f"/v1/runtime/vms/{vm}/resume")
            pause_ms.append(ms_p)
            resume_ms.append(ms_r)
            if state_mib and sh(api, vm, CHECK_STATE).split()[0] != digest:
                raise RuntimeError(f"cycle {i + 1}: the guest's state changed")
            api.exec_ok(vm)
            hows.append(came_up_how(api, vm))
            pid = qemu_pids()[vm]
            pss.append(round(pss_kib(pid) / 1024, 1))
            ram_pss.append(guest_ram_pss_mib(pid, memory_mib))
            if (mib := data_mib(data_dir, vm, paused["snapshotId"])) is not None:
                snap_mib.append(mib)
            if (i + 1) % 10 == 0:
                log(f"  cycle {i + 1}/{cycles}: PSS {pss[-1]} MiB")
        time.sleep(SETTLE_S)
        api.exec_ok(vm)
        pid = qemu_pids()[vm]
        settled = round(pss_kib(pid) / 1024, 1)
        ram_settled = guest_ram_pss_mib(pid, memory_mib)
        # A pause now, once the guest had the time to report what it freed.
        paused = api.call("POST", f"/v1/runtime/vms/{vm}/pause")
        snap_settled = data_mib(data_dir, vm, paused["snapshotId"])
        api.call("POST", f"/v1/runtime/vms/{vm}/resume")
        return {
            "stateMiB": state_mib,
            "cycles": cycles,
            "cycleMiB": cycle_mib,
            "pssMiB": pss,
            "pssSettledMiB": settled,
            "pssSettledShare": round(settled / memory_mib, 3),
            "ramPssMiB": ram_pss,
            "ramPssSettledMiB": ram_settled,
            "snapshotSettledMiB": snap_settled,
            "snapshotMemMiB": snap_mib,
            "pauseP50Ms": round(pct(pause_ms, 0.5)),
            "resumeP50Ms": round(pct(resume_ms, 0.5)),
            "resumedBy": {h: hows.count(h) for h in sorted(set(hows))},
            "load": load_average(),
        }
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")


def measure(
    api: Api,
    data_dir: Path | None,
    *,
    memory_mib: int,
    copies: int,
    state_mib: int,
    cycles: int,
    cycle_mib: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    out: dict[str, Any] = {"memoryMib": memory_mib, "copies": [], "cycles": []}
    for st in (0, state_mib):
        log(f"copies: fork ×{copies} of a guest holding {st} MiB")
        out["copies"].append(copies_run(api, memory_mib, copies, st))
    for st in (0, state_mib):
        log(
            f"long-lived: {cycles} cycles of {cycle_mib} MiB allocated and freed, pause, resume"
            f" ({st} MiB held)"
        )
        out["cycles"].append(cycles_run(api, memory_mib, cycles, cycle_mib, st, data_dir, log))
    return out


def _copies_cells(c: dict[str, Any]) -> dict[str, str]:
    what = "empty guest" if not c["stateMiB"] else f"guest holding {c['stateMiB']} MiB"
    how = ", ".join(f"{k} ×{v['n']}: {v['pssMeanMiB']}" for k, v in sorted(c["byHow"].items()))
    return {
        f"{what}: PSS per copy, mean (max)": f"**{c['pssMeanMiB']}** ({c['pssMaxMiB']})",
        f"{what}: of which guest RAM, mean": str(c.get("ramPssMeanMiB", "–")),
        f"{what}: PSS by how a copy came up": how,
        f"{what}: fork ×{c['copies']} → every copy answered, ms": str(c["allAnsweredMs"]),
        f"{what}: the source's PSS": str(c["sourcePssMiB"]),
    }


def _cycles_cells(c: dict[str, Any]) -> dict[str, str]:
    what = "empty guest" if not c["stateMiB"] else f"guest holding {c['stateMiB']} MiB"
    series = c["pssMiB"]
    snap = c["snapshotMemMiB"]
    return {
        f"{what}: PSS after cycle 1, 10, 20, 30": ", ".join(
            str(series[k]) for k in (0, 9, 19, 29) if k < len(series)
        ),
        f"{what}: PSS settled ({SETTLE_S:.0f} s later), share of RAM": (
            f"**{c['pssSettledMiB']}** ({100 * c['pssSettledShare']:.0f} %)"
        ),
        f"{what}: of which guest RAM, settled": str(c.get("ramPssSettledMiB", "–")),
        f"{what}: snapshot RAM data (MiB), first → last": f"{snap[0]} → {snap[-1]}" if snap else "–",
        f"{what}: snapshot RAM data (MiB), paused once settled": str(c.get("snapshotSettledMiB") or "–"),
        f"{what}: pause, resume p50 ms": f"{c['pauseP50Ms']}, {c['resumeP50Ms']}",
        f"{what}: resumed by": ", ".join(f"{k} ×{v}" for k, v in c["resumedBy"].items()),
    }


def _table(runs: dict[str, dict[str, Any]], cells: list[dict[str, str]]) -> list[str]:
    """Rows (in first-seen order) × one column per run; ``cells``: per run, row -> cell."""
    names: list[str] = []
    for c in cells:
        names += [n for n in c if n not in names]
    out = ["| | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    out += [f"| {n} | " + " | ".join(c.get(n, "–") for c in cells) + " |" for n in names]
    return out


def render_markdown(runs: dict[str, dict[str, Any]]) -> str:
    """The page: one column per run label (before, after)."""
    lines = [
        "# Memory per sandbox (`pal bench memory`)",
        "",
        "Host PSS (MiB) of each sandbox's QEMU (a copy's only process), read from",
        "`/proc/<pid>/smaps_rollup` after its guest touched its state. Issue 39's targets: ≤ 80 MiB",
        "per copy of a guest holding 64 MiB (pre-started QEMUs on), and a 256 MiB guest under",
        "40 % of its RAM after 30 pause/resume cycles that allocate and free 32 MiB each.",
        "What a copy shares and what a guest gives back: docs/lifecycle.md.",
        "",
        "Re-take it (root, a built image in the data dir, nothing else running):",
        "",
        "```",
        "# after: this checkout",
        "pal bench memory --label after --data-dir /var/lib/pal-bench",
        "# before: the older checkout (M, set up by its install.sh) runs `pal up`, this one measures",
        "M=/path/to/pal-main B=/var/lib/pal-before",
        "$M/.venv/bin/pal image build default --data-dir $B",
        "$M/.venv/bin/pal up --data-dir $B --port 18500 &",
        "until curl -sf http://127.0.0.1:18500/readyz; do sleep 2; done",
        "KEY=$($M/.venv/bin/pal tenants create bench --max-vms 40 --data-dir $B \\",
        "  | python3 -c 'import json, sys; print(json.load(sys.stdin)[\"apiKey\"])')",
        "pal bench memory --label before --url http://127.0.0.1:18500 --api-key $KEY --data-dir $B",
        "```",
        "",
        "## Runs",
        "",
    ]
    for label, r in runs.items():
        m = r["machine"]
        lines.append(
            f"- **{label}**: {r['date']}, {r.get('server', 'own pal up')}, {m['cpu']} ({m['cores']} cores),"
            f" {r['accel']}, load {r['load_start']} → {r['load_end']}"
        )
    lines += ["", "## Copies of one snapshot (a fork, all at once)", ""]
    lines += _table(
        runs, [{k: v for c in r["copies"] for k, v in _copies_cells(c).items()} for r in runs.values()]
    )
    lines += ["", "## A long-lived VM: allocate and free, pause, resume", ""]
    lines += _table(
        runs, [{k: v for c in r["cycles"] for k, v in _cycles_cells(c).items()} for r in runs.values()]
    )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """`` (<commit>)`` of the checkout this runs from, when it is one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f" ({out.stdout.strip()})" if out.returncode == 0 else ""


def main(
    *,
    data_dir: Path,
    out_dir: Path,
    label: str,
    url: str | None = None,
    api_key: str | None = None,
    memory_mib: int = 256,
    copies: int = 10,
    state_mib: int = STATE_MIB,
    cycles: int = 30,
    cycle_mib: int = 32,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    load_start = os.getloadavg()[0]
    version = _commit()

    def run(api: Api, accel: str) -> dict[str, Any]:
        body = measure(
            api,
            data_dir,
            memory_mib=memory_mib,
            copies=copies,
            state_mib=state_mib,
            cycles=cycles,
            cycle_mib=cycle_mib,
            log=log,
        )
        body["server"] = url or f"own pal up{version}"
        return report_of(body, accel=accel, load_start=load_start, data_dir=data_dir)

    if url is not None:
        if api_key is None:
            raise ValueError("--url needs --api-key")
        report = run(Api(url, api_key), server_accel(url))
    else:
        with local_server(data_dir) as (u, k):
            report = run(Api(u, k), server_accel(u))
    path = out_dir / "memory.json"
    runs: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    runs[label] = report
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=2) + "\n")
    (out_dir / "memory.md").write_text(render_markdown(runs))
    log(f"wrote {out_dir / 'memory.md'} ({label})")
    return report
