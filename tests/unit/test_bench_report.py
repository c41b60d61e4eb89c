"""`pal bench`'s report: every latency also as a ratio to the same run's warm exec, the
steady-state section, and issue 17's targets judged on those ratios."""

from __future__ import annotations

from typing import Any

from pal_tools.bench import latency as bench
from pal_tools.bench import latency_report as bench_report


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
        "data_dir": {"path": "/tmp/tmp.x/d", "mode": "0o700", "parentMode": "0o700"},
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
    md = bench_report.render_markdown(report(samples))
    assert "Some CPU model" in md
    assert "- Data dir: `/tmp/tmp.x/d` (mode 0o700, its parent 0o700)" in md
    assert "| Resume → first exec answered | 300 | 300 | 3 | 3.0× |" in md
    assert "Resume → first exec answered: 3.0× (target ≤ 4×): met" in md
    assert "from a VM resumed 10 times: 20.0× (target ≤ 12×): not met" in md
    assert "within 15% of cycle 1 (alone): the farthest p50 is cycle 30 at +29%: not met" in md
    # Only what was measured is shown: no main table rows without samples.
    assert "Cold boot" not in md


def test_a_cycle_far_faster_than_the_first_fails_the_drift_target_too() -> None:
    samples = {
        "warm_exec_steady": [50.0],
        **{f"cycle_{c}": [100.0 - (20 if c == 7 else 0)] for c in range(1, 31)},
    }
    md = bench_report.render_markdown(report(samples))
    assert "(alone): the farthest p50 is cycle 7 at -20%: not met" in md


def test_busy_rows_divide_by_the_warm_exec_measured_beside_the_busy_vms() -> None:
    samples = {
        "warm_exec_steady": [50.0],
        "busy_warm_exec_steady": [100.0],
        "cycle_1": [200.0],
        "busy_cycle_1": [400.0],
    }
    md = bench_report.render_markdown(report(samples))
    assert "| Repeated cycles of one VM: cycle 1, resume → first exec | 200 | 200 | 1 | 4.0× |" in md
    assert "busy VMs and background sealing: cycle 1 | 400 | 400 | 1 | 4.0× |" in md


def test_the_restore_breakdown_and_what_is_tcgs() -> None:
    samples = {
        "warm_exec": [50.0],
        "resume_to_first_exec_new_qemu": [500.0],
        "live_resume_to_first_exec": [80.0],
        "step_qemu_spawn_ms": [40.0],
        "step_qemu_load_ms": [10.0],
        "step_qemu_cont_ms": [1.0],
        "step_guest_wake_ms": [200.0],
        "step_guest_decode_ms": [20.0],
        "step_first_exec_cold_ms": [100.0],
    }
    md = bench_report.render_markdown(report(samples))
    assert "## The restore path, step by step" in md
    assert "| Guest: wakes and reads the identify request (cold under TCG) | 200.0 | 200.0 | 4.0× |" in md
    assert "takes 500 ms from a snapshot (a new QEMU) and 80 ms from a live pause" in md
    assert "Of the 420 ms between them, 51 ms are QEMU's own start" in md
    assert "take 320 ms more than the same work warm" in md


def test_restore_steps_come_from_the_resumes_status_event() -> None:
    class FakeApi:
        def call(self, method: str, path: str, **kw: Any) -> Any:
            assert (method, path) == ("GET", "/v1/runtime/vms/vm-1/events")
            timings = {
                "prepare_ms": 8.0,
                "qemu_spawn_ms": 50.0,
                "qemu_load_ms": 9.0,
                "qemu_cont_ms": 1.0,
                "identify_reply_ms": 400.0,
                "identify_guest_decode_us": 20000,
                "identify_guest_clock_rng_us": 30000,
                "identify_guest_net_host_ca_us": 50000,
            }
            return {
                "events": [
                    {"toState": "running", "details": {"bootMs": 999.0, "timings": {"prepare_ms": 1.0}}},
                    {"toState": "paused"},
                    {"toState": "running", "details": {"bootMs": 480.0, "timings": timings}},
                ]
            }

    res: dict[str, list[float]] = {}
    bench.restore_steps(FakeApi(), "vm-1", 500.0, 90.0, res)  # type: ignore[arg-type]
    assert res["step_rpc_ms"] == [20.0]
    assert res["step_prepare_ms"] == [8.0]
    assert res["step_guest_wake_ms"] == [300.0]  # the answer at 400 ms minus 100 ms of guest steps
    assert res["step_guest_clock_rng_ms"] == [30.0]
    assert res["step_first_exec_cold_ms"] == [90.0]


def wait_report(wait_pauses: int) -> dict[str, Any]:
    """`pal bench wait`'s report as run() and main() build it, with round numbers."""
    scenario = {
        "upstreamS": 10.2,
        "clientS": 10.35,
        "requestS": 0.01,
        "headersS": 0.1,
        "readS": 0.04,
        "shaOk": True,
        "residentBeforeMiB": 200,
        "rssPausedMiB": 260.0,
        "rssOffloadedMiB": 70.0,  # a 190 MiB drop: 95 % of what was resident
        "residentAfterMiB": 3,
        "qemuCpuPctPaused": 0.4,
        "wait_pause": {"pauseMs": 4.0},
        "wait_offload": {"offloadMs": 150.0, "freedMib": 190},
        "wait_resume": {"resumeMs": 12.0, "pausedMs": 9000},
    }
    baseline = {**{k: scenario[k] for k in ("upstreamS", "requestS", "headersS", "readS", "shaOk")}}
    baseline["clientS"] = 10.3
    return {
        "date": "today",
        "accel": "tcg",
        "machine": {"cpu": "Some CPU model", "cores": 2, "memGiB": 4, "kernel": "6.1", "qemu": "QEMU 7.2"},
        "load_start": 1.0,
        "load_end": 2.0,
        "samples_ms": {
            "warm_exec": [100.0, 100.0],
            "live_pause_api": [10.0, 12.0],
            "live_resume_api": [25.0, 25.0],  # over 20 ms: not met
            "first_exec_after_live_resume": [110.0],
            "offload": [200.0, 220.0, 240.0],
            "first_exec_after_offload": [130.0],
            "warm_exec_tier_vm": [80.0],
            "idle_tier_wake_to_first_exec": [100.0],  # 1.25× its warm exec: met
        },
        "offload_mib": [{"residentBefore": 200, "freedMib": 190}],
        "scenario": [scenario],
        "baseline": [baseline],
        "repetition": {
            "waits": 100,
            "bad": 0,
            "seconds": 250.0,
            "stateAfter": "running",
            "liveStats": {"waitPauses": wait_pauses, "offloads": 90, "livePausedMs": 120000},
        },
        "forks": {
            "private": {"fork3Ms": [900.0], "pssMiB": [20.0, 22.0]},
            "shared": {"fork3Ms": [], "pssMiB": []},
        },
    }


def _target(md: str, start: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {start}"))


def test_wait_report_judges_each_target_and_a_wait_counts_only_if_it_was_paused() -> None:
    from pal_tools.bench import wait as bench_wait

    md = bench_wait.render(wait_report(wait_pauses=100))
    assert "Some CPU model" in md and "accelerator **TCG**" in md
    assert _target(md, "live pause ≤ 20 ms").endswith("| yes |")
    assert _target(md, "live resume ≤ 20 ms").endswith("| **no** |")
    assert _target(md, "offload of a 256 MiB guest").startswith(
        "| offload of a 256 MiB guest ≤ 300 ms p50 | 220 ms"
    )
    assert "1.25× its warm exec" in _target(md, "idle live tier")
    assert "95 %" in _target(md, "wait: QEMU RSS drops") and _target(md, "wait: QEMU RSS").endswith("yes |")
    assert _target(md, "wait: client total").startswith(
        "| wait: client total ≤ upstream time + 300 ms | +150 ms"
    )
    assert _target(md, "100 waits in a row").endswith("| yes |")
    assert "Repetition: 100 waits in a row" in md and "100 wait pauses" in md
    assert "`private`: fork of 3 p50 900 ms" in md and "`shared`" not in md  # nothing measured
    # 100 answers right but only 40 of them paused: wait management did not do its job
    md = bench_wait.render(wait_report(wait_pauses=40))
    row = _target(md, "100 waits in a row")
    assert "40 wait pauses" in row and row.endswith("| **no** |")
    # a run without the scenario or the repetition renders what it has
    bare = wait_report(100)
    bare.update(scenario=[], baseline=[], repetition=None)
    assert "wait: body byte-exact" not in bench_wait.render(bare)


def test_memory_report_puts_runs_side_by_side_and_reads_what_each_measured() -> None:
    from pal_tools.bench.memory import render_markdown

    def run(pss: float, settled: float) -> dict:
        copies = {
            "stateMiB": 64,
            "copies": 10,
            "allAnsweredMs": 8000,
            "pssMeanMiB": pss,
            "pssMaxMiB": pss,
            "ramPssMeanMiB": 20.0,
            "sourcePssMiB": 160.0,
            "byHow": {"new QEMU": {"n": 10, "pssMeanMiB": pss}},
        }
        cycles = {
            "stateMiB": 0,
            "cycles": 30,
            "cycleMiB": 32,
            "pssMiB": [150.0] * 30,
            "pssSettledMiB": settled,
            "pssSettledShare": settled / 256,
            "ramPssSettledMiB": 60.0,
            "snapshotMemMiB": [120.0, 118.0],
            "pauseP50Ms": 200,
            "resumeP50Ms": 80,
            "resumedBy": {"parked QEMU": 30},
        }
        machine = {"cpu": "cpu", "cores": 2}
        return {"date": "d", "machine": machine, "accel": "tcg", "load_start": 1.0, "load_end": 2.0,
                "copies": [copies], "cycles": [cycles]}  # fmt: skip

    page = render_markdown({"before": run(103.2, 180.7), "after": run(63.4, 157.5)})
    assert "| | before | after |" in page
    assert "| guest holding 64 MiB: PSS per copy, mean (max) | **103.2** (103.2) | **63.4** (63.4) |" in page
    assert "**157.5** (62 %)" in page and "120.0 → 118.0" in page and "parked QEMU ×30" in page


def test_the_latency_tables_memory_names_the_fork_of_a_guest_holding_state() -> None:
    from pal_tools.bench.latency_report import memory_lines

    held = {"children": 10, "pss_kib_mean": 63.4 * 1024, "pss_kib_max": 70 * 1024, "guest_ram_kib": 262144}
    text = "\n".join(memory_lines({"n10_held": {**held, "state_mib": 64}}))
    assert "Fork N10 of a guest holding 64 MiB of random state: 10 children, PSS mean 63.4 MiB" in text
