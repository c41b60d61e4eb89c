"""`pal bench peer`'s report: gVisor's rows by Pal's protocol, every p50 also as a ratio to
the peer's own warm exec, Pal's rows beside them when a `pal bench` report is at hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pal_tools.bench import peer as bench_peer


def report(samples: dict[str, dict[str, list[float]]], pal: dict[str, Any] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {
        "date": "today",
        "iterations": 3,
        "sizes_mib": [0, 64],
        "machine": {"cpu": "Some CPU model", "cores": 2, "memGiB": 4, "kernel": "6.1", "qemu": "QEMU 7.2"},
        "load": {"before": 1.0, "after": 2.0},
        "runsc": {"version": "0.0~20221219.0", "platform": "ptrace", "network": "none"},
        "image": "default",
        "fs": "xfs",
        "samples_ms": samples,
        "image_bytes": {"0": [2**20], "64": [65 * 2**20]},
        **bench_peer.summarize(samples),
    }
    if pal is not None:
        r["pal"] = pal
    return r


SAMPLES = {
    "0": {
        "warm_exec": [40.0, 50.0, 60.0],
        "snapshot": [100.0, 100.0, 200.0],
        "resume_to_first_exec": [200.0, 200.0, 200.0],
    },
    "64": {
        "warm_exec": [80.0, 80.0, 80.0],  # not the baseline: the idle workload's is
        "snapshot": [300.0, 300.0, 300.0],
        "resume_to_first_exec": [400.0, 400.0, 400.0],
    },
}


def test_every_p50_is_a_ratio_to_the_idle_workloads_warm_exec() -> None:
    s = bench_peer.summarize(SAMPLES)
    assert s["p50_ms"]["0"]["warm_exec"] == 50.0
    assert s["p90_ms"]["0"]["snapshot"] == 180.0
    assert s["p50_x_warm_exec"]["0"]["resume_to_first_exec"] == 4.0
    assert s["p50_x_warm_exec"]["64"]["resume_to_first_exec"] == 8.0
    assert s["p50_x_warm_exec"]["64"]["warm_exec"] == 1.6


def test_the_report_names_the_machine_and_runsc_and_shows_both_sizes() -> None:
    md = bench_peer.render(report(SAMPLES))
    assert "Some CPU model" in md
    assert "`runsc` 0.0~20221219.0, platform **ptrace**" in md
    assert "Load average (1 min) before / after the run: 1.0 / 2.0" in md
    assert "| Restore → first exec answered | 200 | 200 | 4.0× | 400 | 400 | 8.0× |" in md
    assert (
        "| Snapshot (`runsc checkpoint`; the container stops) | 100 | 180 | 2.0× | 300 | 300 | 6.0× |" in md
    )
    # Only what was measured: no restore-alone row, no Pal columns without a Pal report.
    assert "Restore (`runsc restore -detach`)" not in md
    assert "Pal p50" not in md


def test_pals_rows_of_the_protocol_are_put_beside_the_peers(tmp_path: Path) -> None:
    assert bench_peer.pal_reference(tmp_path / "runtime-latency.json") is None
    (tmp_path / "runtime-latency.json").write_text(
        json.dumps(
            {
                "date": "yesterday",
                "accel": "tcg",
                # Pal's restore into a new QEMU is the protocol's counterpart (not its parked resume)
                "p50_ms": {"snapshot": 116.5, "resume_to_first_exec_new_qemu": 467.6, "fork_n1": 469.5},
                "p50_x_warm_exec": {"snapshot": 1.93, "resume_to_first_exec_new_qemu": 7.76, "fork_n1": 7.79},
            }
        )
    )
    pal = bench_peer.pal_reference(tmp_path / "runtime-latency.json")
    assert pal is not None
    assert "fork_n1" not in pal["p50_ms"]  # not a row of this protocol
    md = bench_peer.render(report(SAMPLES, pal))
    assert "| Restore → first exec answered | 200 | 200 | 4.0× | 400 | 400 | 8.0× | 468 | 7.8× |" in md
    assert (
        "| Second exec after restore (warm: the baseline) | 50 | 58 | 1.0× | 80 | 80 | 1.6× | – | – |" in md
    )
    assert "`runtime-latency.json` of yesterday (TCG" in md


def test_the_workload_is_valid_python_for_every_size() -> None:
    for mib in bench_peer.SIZES_MIB:
        compile(bench_peer.WORKLOAD.format(mib=mib), "workload", "exec")
