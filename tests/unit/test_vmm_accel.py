"""Accelerator choice: forced, no /dev/kvm, cached probe, fresh probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.vmm import accel


def _settings(tmp_path: Path, mode: str = "auto") -> Settings:
    return Settings(data_dir=tmp_path, accel=mode)


def _no_probe(*_a: object, **_k: object) -> str | None:
    raise AssertionError("must not boot a probe VM")


def test_forced_accelerator_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "boot_probe", _no_probe)
    info = accel.probe(_settings(tmp_path, "kvm"))
    assert info.name == "kvm" and "forced" in info.reason
    assert info.cpu_args == ("-accel", "kvm", "-cpu", "host,-arch-capabilities")
    assert accel.probe(_settings(tmp_path), force="tcg").name == "tcg"
    with pytest.raises(InvalidRequest):
        accel.probe(_settings(tmp_path), force="xen")


def test_missing_kvm_device_means_tcg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "KVM_DEVICE", tmp_path / "no-kvm")
    monkeypatch.setattr(accel, "boot_probe", _no_probe)
    info = accel.probe(_settings(tmp_path))
    assert info.name == "tcg" and "absent" in info.reason


def _fake_kvm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    dev = tmp_path / "kvm"
    dev.write_bytes(b"")
    monkeypatch.setattr(accel, "KVM_DEVICE", dev)
    kernel = tmp_path / "images" / "default" / "vmlinux"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"")
    return kernel


def test_probe_result_is_cached_per_host_and_qemu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_kvm(tmp_path, monkeypatch)
    calls: list[Path] = []

    def failing_probe(kernel: Path, *_a: object) -> str:
        calls.append(kernel)
        return "KVM internal error while booting the probe VM"

    monkeypatch.setattr(accel, "boot_probe", failing_probe)
    first = accel.probe(_settings(tmp_path))
    assert first.name == "tcg" and "KVM internal error" in first.reason
    second = accel.probe(_settings(tmp_path))
    assert second.name == "tcg" and "(cached)" in second.reason
    assert len(calls) == 1
    # A different QEMU (or host kernel) invalidates the cache.
    cache_file = _settings(tmp_path).images_dir / "accel.json"
    cache = json.loads(cache_file.read_text())
    cache["key"]["qemu"] = "0.0.1"
    cache_file.write_text(json.dumps(cache))
    accel.probe(_settings(tmp_path))
    assert len(calls) == 2


def test_successful_probe_selects_kvm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_kvm(tmp_path, monkeypatch)
    monkeypatch.setattr(accel, "boot_probe", lambda *_a, **_k: None)
    info = accel.probe(_settings(tmp_path))
    assert info.name == "kvm" and info.cpu_args[:2] == ("-accel", "kvm")
