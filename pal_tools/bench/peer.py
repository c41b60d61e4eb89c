"""`pal bench peer`: gVisor (`runsc`) measured by the protocol of Pal's pause/resume rows.

Pal's `pal bench` times, per iteration: pause (snapshot), resume (restore), the first exec
after it, the resume → first exec sum and a second (warm) exec, and divides every p50 by
that warm exec. Here the same steps are timed on a gVisor container, with the same
userland (a copy of Pal's default image tree: Debian + python3) and the same command
(`/bin/true`), so the two reports can be put side by side:

- start: `runsc run -detach` → first `runsc exec /bin/true` (idle workload only);
- snapshot: `runsc checkpoint --image-path DIR` (the container stops, as a pause does);
- restore: `runsc restore --image-path DIR -detach`, then the first exec, timed apart and
  together;
- warm exec: the second exec after the restore: the peer's own baseline for the ratios.

The workload is a python3 process that holds 0 or 64 MiB of memory it wrote (random bytes:
gVisor compresses its checkpoint image, so zeros would understate the cost of real state).
Bundle, runsc state and checkpoint images live under `<data dir>/runs/`, on the file
system Pal's snapshots use. Writes docs/benchmarks/peer-gvisor.{json,md}.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pal_tools.bench.common import machine, pct

SIZES_MIB = (0, 64)
PLATFORMS = ("ptrace", "systrap", "kvm")  # systrap exists only in runsc releases from 2023 on
RUNSC_TIMEOUT_S = 120.0  # one runsc call; a hung sandbox fails the run instead of hanging it
READY_TIMEOUT_S = 120.0  # the workload writing its memory (a loaded host is slow)
BASELINE = "warm_exec"
# (key, label, Pal's row in runtime-latency.json measured by the same protocol)
ROWS = [
    ("start_to_first_exec", "Start (`runsc run -detach`) → first exec", "template_to_first_exec"),
    ("snapshot", "Snapshot (`runsc checkpoint`; the container stops)", "snapshot"),
    # Pal's restores into a new QEMU: a new sandbox process from the checkpoint, as runsc's
    # (a Pal resume that continues its parked QEMU has no runsc counterpart).
    ("restore", "Restore (`runsc restore -detach`)", "restore_new_qemu"),
    (
        "first_exec_after_restore",
        "First exec after restore (exec call alone)",
        "first_exec_after_restore_new_qemu",
    ),
    ("resume_to_first_exec", "Restore → first exec answered", "resume_to_first_exec_new_qemu"),
    ("warm_exec", "Second exec after restore (warm: the baseline)", "warm_exec"),
]
# The workload: write `mib` MiB the process keeps, say so on stdout, then wait forever.
WORKLOAD = (
    "import os, time\nheld = os.urandom({mib} << 20)\nprint('ready', flush=True)\ntime.sleep(1 << 30)\n"
)


class Runsc:
    """One runsc state root (its own `--root`, so nothing is shared with other runsc users)."""

    def __init__(self, root: Path, platform: str) -> None:
        self.cmd = ["runsc", f"--root={root}", f"--platform={platform}", "--network=none"]

    def __call__(self, *args: str, stdout: Any = subprocess.DEVNULL, capture: bool = False) -> str:
        # stderr to a file, not a pipe: a detached sandbox keeps the descriptor it was given,
        # and a pipe would then never reach EOF.
        with tempfile.TemporaryFile() as err:
            try:
                r = subprocess.run(
                    [*self.cmd, *args],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if capture else stdout,
                    stderr=err,
                    text=True,
                    timeout=RUNSC_TIMEOUT_S,
                )
            except FileNotFoundError:
                raise RuntimeError(
                    "runsc is not installed (Debian package `runsc`: scripts/install.sh)"
                ) from None
            if r.returncode != 0:
                err.seek(0)
                why = err.read().decode(errors="replace").strip()
                raise RuntimeError(f"{' '.join([*self.cmd, *args])}: exit {r.returncode}: {why}")
        return r.stdout or ""

    def exec_ok(self, cid: str) -> None:
        self("exec", cid, "/bin/true")

    def ids(self) -> list[str]:
        return self("list", "-quiet", capture=True).split()

    def delete_all(self) -> None:
        for cid in self.ids():
            self("delete", "-force", cid)


def runsc_version() -> str:
    out = subprocess.run(["runsc", "--version"], capture_output=True, text=True, timeout=30).stdout
    return out.splitlines()[0].removeprefix("runsc version ").strip() if out else "unknown"


def fs_type(path: Path) -> str:
    r = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(path)], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def copy_tree(ext4: Path, dest: Path) -> None:
    """The image's tree out of its ext4, without mounting it (nothing to unmount on a crash)."""
    dest.mkdir(parents=True)
    r = subprocess.run(["debugfs", "-R", f"rdump / {dest}", str(ext4)], capture_output=True, text=True)
    if r.returncode != 0 or not (dest / "usr" / "bin" / "python3").exists():
        raise RuntimeError(f"copying {ext4} with debugfs failed: {r.stderr.strip()}")


def write_bundle(bundle: Path, rootfs: Path, mib: int, uid: int, gid: int) -> None:
    """config.json from `runsc spec`, the workload as its process, run as the image's user
    (Pal's exec runs as that user too)."""
    bundle.mkdir(parents=True)
    subprocess.run(["runsc", "spec"], cwd=bundle, check=True, capture_output=True, timeout=30)
    path = bundle / "config.json"
    spec = json.loads(path.read_text())
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["process"].update(
        terminal=False,
        args=["/usr/bin/python3", "-c", WORKLOAD.format(mib=mib)],
        user={"uid": uid, "gid": gid},
        cwd="/",
    )
    path.write_text(json.dumps(spec, indent=2))


def _ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1000


def _wait_ready(out: Path, cid: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while b"ready" not in out.read_bytes():
        if time.monotonic() > deadline:
            raise TimeoutError(f"workload of {cid} not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def cycle(
    rs: Runsc, base: Path, bundle: Path, cid: str, res: dict[str, list[float]], time_start: bool
) -> int:
    """One iteration: start, first exec, snapshot, restore, first and warm exec. Returns the
    checkpoint image's size. ``time_start``: keep the start → first exec sample (not while the
    workload is still writing a large memory)."""
    out = base / f"{cid}.out"
    with out.open("wb") as f:
        t = time.perf_counter()
        rs("run", "-detach", f"-bundle={bundle}", cid, stdout=f)
        rs.exec_ok(cid)
        if time_start:
            res["start_to_first_exec"].append(_ms_since(t))
    _wait_ready(out, cid)
    image = base / f"{cid}.img"
    image.mkdir()
    t = time.perf_counter()
    rs("checkpoint", f"-image-path={image}", cid)
    res["snapshot"].append(_ms_since(t))
    size = sum(p.stat().st_size for p in image.iterdir())
    rs("delete", cid)  # stopped by the checkpoint; its restore is a new container
    rid = f"{cid}r"
    t = time.perf_counter()
    rs("restore", f"-image-path={image}", f"-bundle={bundle}", "-detach", rid)
    restore_ms = _ms_since(t)
    t = time.perf_counter()
    rs.exec_ok(rid)
    first_ms = _ms_since(t)
    t = time.perf_counter()
    rs.exec_ok(rid)
    res["warm_exec"].append(_ms_since(t))
    res["restore"].append(restore_ms)
    res["first_exec_after_restore"].append(first_ms)
    res["resume_to_first_exec"].append(restore_ms + first_ms)
    rs("delete", "-force", rid)
    shutil.rmtree(image)
    out.unlink()
    return size


def summarize(samples: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """p50/p90 per size and row, and each p50 over the idle workload's warm exec p50 (the
    peer's own baseline, as Pal's rows use Pal's warm exec)."""
    warm = samples.get("0", {}).get(BASELINE) or []
    base = pct(warm, 0.5) if warm else None
    out: dict[str, Any] = {"p50_ms": {}, "p90_ms": {}, "p50_x_warm_exec": {}}
    for mib, rows in samples.items():
        for key in ("p50_ms", "p90_ms", "p50_x_warm_exec"):
            out[key][mib] = {}
        for row, v in rows.items():
            if not v:
                continue
            out["p50_ms"][mib][row] = round(pct(v, 0.5), 1)
            out["p90_ms"][mib][row] = round(pct(v, 0.9), 1)
            if base:
                out["p50_x_warm_exec"][mib][row] = round(pct(v, 0.5) / base, 2)
    return out


def pal_reference(path: Path) -> dict[str, Any] | None:
    """Pal's rows from the last `pal bench` report, to show beside these (another run)."""
    try:
        pal = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = {pal_key for _, _, pal_key in ROWS}
    return {
        "date": pal.get("date"),
        "accel": pal.get("accel"),
        "p50_ms": {k: v for k, v in (pal.get("p50_ms") or {}).items() if k in keys},
        "p50_x_warm_exec": {k: v for k, v in (pal.get("p50_x_warm_exec") or {}).items() if k in keys},
    }


def _x(v: float | None, base: float | None) -> str:
    return f"{v / base:.1f}×" if v is not None and base and v == v else "–"


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    s = r["samples_ms"]
    warm = s.get("0", {}).get(BASELINE) or []
    base = pct(warm, 0.5) if warm else None
    sizes = [mib for mib in (str(x) for x in r["sizes_mib"]) if mib in s]
    pal = r.get("pal")
    lines = [
        "# Peer: gVisor, by the protocol of Pal's pause/resume rows",
        "",
        f"Measured {r['date']} by `pal bench peer`, {r['iterations']} iterations per workload size.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memGiB']} GiB, Linux {m['kernel']}",
        f"- Load average (1 min) before / after the run: {r['load']['before']} / {r['load']['after']}",
        f"- Peer: gVisor `runsc` {r['runsc']['version']}, platform **{r['runsc']['platform']}**,"
        " `--network=none`, one container per iteration",
        f"- Userland: Pal's `{r['image']}` image tree (Debian + python3), read-only root; the workload is"
        " a python3 process holding N MiB it wrote (random bytes, as gVisor compresses its image)",
        f"- Checkpoint images, runsc state and bundle under the data dir's `runs/` ({r['fs']}), the file"
        " system Pal's snapshots are written to",
        "",
        "The `× warm exec` columns divide each p50 by the p50 of the peer's own warm exec (a second",
        "`runsc exec /bin/true` right after the first one after a restore, idle workload), as Pal's",
        "report divides by Pal's: ratios compare across machines and runtimes where absolute times",
        "do not.",
        "",
    ]
    head = "| Step |"
    rule = "|---|"
    for mib in sizes:
        head += f" {mib} MiB p50 ms | p90 ms | × warm exec |"
        rule += "---:|---:|---:|"
    if pal:
        head += " Pal p50 ms | Pal × warm exec |"
        rule += "---:|---:|"
    lines += [head, rule]
    for key, label, pal_key in ROWS:
        if not any(s[mib].get(key) for mib in sizes):
            continue
        line = f"| {label} |"
        for mib in sizes:
            v = s[mib].get(key) or []
            if v:
                line += f" {pct(v, 0.5):.0f} | {pct(v, 0.9):.0f} | {_x(pct(v, 0.5), base)} |"
            else:
                line += " – | – | – |"
        if pal:
            p50 = pal["p50_ms"].get(pal_key)
            ratio = pal["p50_x_warm_exec"].get(pal_key)
            line += f" {p50:.0f} |" if p50 is not None else " – |"
            line += f" {ratio:.1f}× |" if ratio is not None else " – |"
        lines.append(line)
    sizes_b = r.get("image_bytes") or {}
    lines += ["", "Notes:"]
    if sizes_b:
        shown = ", ".join(f"{mib} MiB: {pct(v, 0.5) / 2**20:.1f} MiB" for mib, v in sizes_b.items() if v)
        lines.append(
            f"- Checkpoint image size, p50 ({shown}): gVisor writes all the sandbox's memory, compressed."
        )
    lines += [
        "- Start → first exec is timed with the idle workload only (the 64 MiB one is still writing",
        "  its memory when it starts). Pal's counterpart is a schedule from a warm template.",
        "- The restore returns when the sandbox runs again; Pal's resume returns when the guest's",
        "  harness has re-identified. Both are followed by the same first `/bin/true`.",
        f"- gVisor's {r['runsc']['platform']} platform runs the workload's instructions natively and",
        "  intercepts its system calls; Pal's guests on a host without usable KVM run under TCG, so",
        "  each runtime's ratios are to its own warm exec.",
    ]
    if pal:
        lines.append(
            f"- Pal's columns: `runtime-latency.json` of {pal['date']} ({str(pal['accel']).upper()}, another"
            " run on this machine, guest holding no extra memory). Compare the ratios; the absolute"
            " times of two runs differ with the load."
        )
    lines += ["", "Raw samples: `peer-gvisor.json` beside this file."]
    return "\n".join(lines) + "\n"


def _load() -> float:
    return round(os.getloadavg()[0], 1)


def main(
    iterations: int = 20,
    platform: str = "ptrace",
    data_dir: Path | None = None,
    out_dir: Path = Path("docs/benchmarks"),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Needs runsc and a built default image in the data dir; runs as root."""
    from pal.config import Settings
    from pal.images.paths import load_image

    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}")
    settings = Settings.from_env(data_dir)
    image = load_image(settings, "default")
    uid, gid = int(image.meta["config"]["uid"]), int(image.meta["config"]["gid"])
    base = settings.data_dir / "runs" / f"peer-{uuid.uuid4().hex[:6]}"
    base.mkdir(parents=True)
    rs = Runsc(base / "state", platform)
    load_before = _load()
    samples: dict[str, dict[str, list[float]]] = {str(mib): {k: [] for k, _, _ in ROWS} for mib in SIZES_MIB}
    image_bytes: dict[str, list[int]] = {str(mib): [] for mib in SIZES_MIB}
    try:
        log(f"copying the {image.name} image tree out of {image.rootfs}")
        copy_tree(image.rootfs, base / "rootfs")
        bundles = {mib: base / f"bundle-{mib}" for mib in SIZES_MIB}
        for mib, bundle in bundles.items():
            write_bundle(bundle, base / "rootfs", mib, uid, gid)
        for i in range(iterations):
            for mib in SIZES_MIB:  # interleaved, so load changes hit both sizes alike
                row = samples[str(mib)]
                image_bytes[str(mib)].append(cycle(rs, base, bundles[mib], f"p{mib}-{i}", row, mib == 0))
            log(
                f"{i + 1}/{iterations}: "
                + "; ".join(
                    f"{mib} MiB: snapshot {samples[str(mib)]['snapshot'][-1]:.0f} ms, restore → first exec"
                    f" {samples[str(mib)]['resume_to_first_exec'][-1]:.0f} ms"
                    for mib in SIZES_MIB
                )
            )
    finally:
        rs.delete_all()
        fs = fs_type(base)
        shutil.rmtree(base, ignore_errors=True)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "iterations": iterations,
        "sizes_mib": list(SIZES_MIB),
        "machine": machine(),
        "load": {"before": load_before, "after": _load()},
        "runsc": {"version": runsc_version(), "platform": platform, "network": "none"},
        "image": image.name,
        "fs": fs,
        "samples_ms": {
            mib: {k: [round(x, 1) for x in v] for k, v in rows.items()} for mib, rows in samples.items()
        },
        "image_bytes": image_bytes,
        **summarize(samples),
    }
    if (pal := pal_reference(out_dir / "runtime-latency.json")) is not None:
        report["pal"] = pal
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "peer-gvisor.json").write_text(json.dumps(report, indent=2))
    (out_dir / "peer-gvisor.md").write_text(render(report))
    log(render(report))
    return report
