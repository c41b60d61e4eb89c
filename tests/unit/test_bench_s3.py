"""`pal bench s3`'s report (pal_tools/bench/s3.py): every figure also as a multiple of its own
server's warm exec; encrypted against not as the ratio of the p50s (same load)."""

from __future__ import annotations

from pal_tools.bench import s3 as bench_s3


def test_the_report_divides_by_each_runs_warm_exec() -> None:
    def samples(scale: float) -> dict[str, list[float]]:
        return {
            "resume_s3": [3000 * scale] * 3,
            "resume_local": [1000 * scale] * 3,
            "upload": [2000 * scale] * 3,
            "warm_exec": [100 * scale] * 3,
        }

    # The plaintext server took twice as long for everything, its warm exec too.
    enc = samples(1.0)
    enc["resume_s3"] = [3300.0] * 3  # encryption costs 10 % on a resume from S3
    report = {
        "date": "today",
        "iterations": 3,
        "machine": {"cpu": "cpu", "cores": 2, "memGiB": 24, "kernel": "k", "qemu": "q"},
        "accel": "tcg",
        "load_start": "1",
        "load_end": "1",
        "modes": {
            "encrypted": {"samples_ms": enc, "bucket_bytes": 1010},
            "plaintext": {"samples_ms": samples(2.0), "bucket_bytes": 1000},
        },
    }
    md = bench_s3.render(report)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    s3_row = rows[bench_s3.ROWS[0][1]]
    assert "3300 (33.0×)" in s3_row and "6000 (30.0×)" in s3_row and s3_row.endswith("| 0.55 |")
    assert rows[bench_s3.ROWS[1][1]].endswith("| 0.50 |")
    assert "1.010" in rows["Bytes of one snapshot in the bucket"]
    assert (
        rows["Resume from S3 ÷ resume from the local snapshot"]
        == "| Resume from S3 ÷ resume from the local snapshot | 3.30 | 3.00 | 1.10 |"
    )
