"""pal/config.py's declarations: what the environment gives, the bounds, the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.config import FORK_COUNT_CEILING, Settings


def test_the_environment_is_read_by_from_env_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAL_HOSTS", "a.example, b.example,")
    monkeypatch.setenv("PAL_NODE_LABELS", "gpu=1, zone=b")
    monkeypatch.setenv("PAL_LOG_LEVEL", "debug")
    read = Settings.from_env(tmp_path)
    assert read.data_dir == tmp_path
    assert read.hosts == ["a.example", "b.example"]
    assert read.node_labels == {"gpu": "1", "zone": "b"}
    assert read.log_level == "DEBUG"
    built = Settings(data_dir=tmp_path)
    assert built.hosts == [] and built.node_labels == {} and built.log_level == "INFO"


def test_blank_means_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("PAL_FORK_CONCURRENCY", "S3_ENDPOINT", "PAL_SECCOMP", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, " ")
    read = Settings.from_env(tmp_path)
    assert (read.fork_concurrency, read.s3_endpoint, read.seccomp, read.s3_region) == (
        16,
        None,
        True,
        "us-east-1",
    )


@pytest.mark.parametrize(
    ("name", "raw", "field", "want"),
    [
        ("PAL_MAX_FORK_COUNT", "5000", "max_fork_count", FORK_COUNT_CEILING),
        ("PAL_FORK_CONCURRENCY", "0", "fork_concurrency", 1),
        ("PAL_PARKED_SECS", "0.1", "parked_secs", 1.0),
        ("PAL_METRICS_INTERVAL", "0", "metrics_interval_s", 0.5),
        ("PAL_NODE_LOST_AFTER", "1", "node_lost_after_s", 2.0),
        ("PAL_NODE_MEMORY_MIB", "-5", "node_memory_mib", 0),
        ("PAL_PARKED_MAX", "3", "parked_max", 3),
    ],
)
def test_values_are_held_within_their_bounds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, raw: str, field: str, want: float
) -> None:
    monkeypatch.setenv(name, raw)
    assert getattr(Settings.from_env(tmp_path), field) == want
    assert getattr(Settings(**{field: float(raw) if isinstance(want, float) else int(raw)}), field) == want


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("PAL_FORK_CONCURRENCY", "many", "PAL_FORK_CONCURRENCY must be an integer, got 'many'"),
        ("PAL_PARKED_SECS", "long", "PAL_PARKED_SECS must be a number, got 'long'"),
        ("PAL_MAX_FORK_COUNT", "0", "PAL_MAX_FORK_COUNT must be at least 1"),
        ("PAL_PORTS_PORT", "70000", r"PAL_PORTS_PORT must be a TCP port \(1-65535\), got 70000"),
        ("PAL_CGROUPS", "maybe", "PAL_CGROUPS must be 'required' or 'off', got 'maybe'"),
        ("PAL_SNAPSHOT_ENCRYPTION", "required", "PAL_SNAPSHOT_ENCRYPTION must be 'on' or 'off'"),
        ("PAL_EGRESS_DNS", "dns", "PAL_EGRESS_DNS must be 'host' or 'static', got 'dns'"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, raw: str, message: str
) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"^{message}"):
        Settings.from_env(tmp_path)
