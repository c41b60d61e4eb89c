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
    md = bench.render_markdown(report(samples))
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
    md = bench.render_markdown(report(samples))
    assert "(alone): the farthest p50 is cycle 7 at -20%: not met" in md


def test_busy_rows_divide_by_the_warm_exec_measured_beside_the_busy_vms() -> None:
    samples = {
        "warm_exec_steady": [50.0],
        "busy_warm_exec_steady": [100.0],
        "cycle_1": [200.0],
        "busy_cycle_1": [400.0],
    }
    md = bench.render_markdown(report(samples))
    assert "| Repeated cycles of one VM: cycle 1, resume → first exec | 200 | 200 | 1 | 4.0× |" in md
    assert "busy VMs and background sealing: cycle 1 | 400 | 400 | 1 | 4.0× |" in md


def test_the_restore_breakdown_and_what_is_tcgs() -> None:
    samples = {
        "warm_exec": [50.0],
        "resume_to_first_exec": [500.0],
        "live_resume_to_first_exec": [80.0],
        "step_qemu_spawn_ms": [40.0],
        "step_qemu_load_ms": [10.0],
        "step_qemu_cont_ms": [1.0],
        "step_guest_wake_ms": [200.0],
        "step_guest_decode_ms": [20.0],
        "step_first_exec_cold_ms": [100.0],
    }
    md = bench.render_markdown(report(samples))
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
