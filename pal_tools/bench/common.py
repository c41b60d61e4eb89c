"""What every `pal bench` report shares: percentiles, a small API client, timing, host
memory of a VM's QEMU, the machine and the data dir it ran on."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Api:
    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {r.status_code} {r.text[:300]}")
        return r.json() if r.content else None

    def exec_ok(self, vm: str) -> None:
        out = self.call("POST", f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/true"})
        if out["exitCode"] != 0:
            raise RuntimeError(f"exec in {vm} failed: {out}")


def timed(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    res = fn(*args, **kw)
    return (time.perf_counter() - t) * 1000, res


def poll_until(what: str, fn: Callable[..., Any], timeout: float, every: float = 0.05) -> Any:
    """``fn()``'s first true answer, asked every ``every`` s; TimeoutError naming ``what``
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def qemu_pids() -> dict[str, int]:
    """Each VM's QEMU, by the vm id its VM dir (a slot, pal/manager/slots.py) names in its
    state.json: one walk of /proc for any number of VMs."""
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            cmd = (d / "cmdline").read_bytes()
            m = re.search(rb"(/[^\0,]*/vms/[^/\0,]+)/", cmd) if b"qemu-system" in cmd else None
            if m:
                out[json.loads((Path(m.group(1).decode()) / "state.json").read_text())["vmId"]] = int(d.name)
    return out


def qemu_pid_of(vm_id: str) -> int | None:
    return qemu_pids().get(vm_id)


def vm_pss_kib(vm_id: str) -> int | None:
    pid = qemu_pid_of(vm_id)
    return pss_kib(pid) if pid else None


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.split(
        "\n"
    )[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memGiB": round(mem_gib, 1),
        "kernel": platform.release(),
        "qemu": qemu,
        "python": platform.python_version(),
    }


def load_average() -> float | None:
    with contextlib.suppress(OSError):
        return round(os.getloadavg()[0], 1)
    return None


def data_dir_info(path: Path | None) -> dict[str, str] | None:
    """Where the measured server kept its data, and the modes users vary (a 0700 data dir
    under a 0700 parent, as `mktemp -d` makes, is where a jail bug once hid)."""
    if path is None:
        return None
    info = {"path": str(path)}
    with contextlib.suppress(OSError):
        info["mode"] = oct(path.stat().st_mode & 0o777)
        info["parentMode"] = oct(path.parent.stat().st_mode & 0o777)
    return info


def data_dir_lines(report: dict[str, Any]) -> list[str]:
    """The report's line naming its data dir and modes (none for a remote server)."""
    d = report.get("data_dir")
    if not d:
        return []
    return [f"- Data dir: `{d['path']}` (mode {d.get('mode', '?')}, its parent {d.get('parentMode', '?')})"]


def report_of(
    body: dict[str, Any], *, accel: str, load_start: float, data_dir: Path | None
) -> dict[str, Any]:
    """A benchmark's report: when, on what (machine, accelerator, load before and after,
    data dir), and ``body``, what it measured."""
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "accel": accel,
        "machine": machine(),
        "load_start": round(load_start, 1),
        "load_end": round(os.getloadavg()[0], 1),
        "data_dir": data_dir_info(data_dir),
        **body,
    }


def write_report(
    out_dir: Path, name: str, report: dict[str, Any], markdown: str, log: Callable[[str], None]
) -> None:
    """``name``.json and ``name``.md in ``out_dir`` (docs/benchmarks/)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out_dir / f"{name}.md").write_text(markdown)
    log(f"wrote {out_dir / (name + '.md')}")
