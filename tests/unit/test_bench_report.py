"""`pal bench`'s report: every latency also as a ratio to the same run's warm exec, the
steady-state section, and issue 17's targets judged on those ratios."""

from __future__ import annotations

from typing import Any

from pal import bench


def report(samples: dict[str, list[float]]) -> dict[str, Any]:
    return {
        "date": "today",
        "iterations": 3,
        "fork_iterations": 1,
        "steady_runs": 1,
        "memory_mib": 256,
        "accel": "tcg",
        "machine": {"cpu": "Some CPU model", "cores": 2, "memGiB": 4, "kernel": "6.1", "qemu": "QEMU 7.2"},
        "load": {"before": 1.0, "after": 2.0},
        "samples_ms": samples,
        "memory": {},
    }


def test_ratios_use_the_same_runs_warm_exec_and_the_targets_follow_them() -> None:
    samples = {
        "warm_exec": [100.0, 100.0, 100.0],
        "resume_to_first_exec": [300.0, 300.0, 300.0],  # 3× ≤ 4×: met
        "warm_exec_steady": [50.0],
        "fork_n10_after_cycles": [1000.0],  # 20× the steady warm exec: not met
        **{f"cycle_{c}": [100.0 + c] for c in range(1, 31)},  # cycle 30 is +29 %: not met
    }
    md = bench.render_markdown(report(samples))
    assert "Some CPU model" in md
    assert "| Resume → first exec answered | 300 | 300 | 3 | 3.0× |" in md
    assert "Resume → first exec answered: 3.0× (target ≤ 4×): met" in md
    assert "from a VM resumed 10 times: 20.0× (target ≤ 12×): not met" in md
    assert "slowest p50 is cycle 30 at +29%: not met" in md
    # Only what was measured is shown: no main table rows without samples.
    assert "Cold boot" not in md
