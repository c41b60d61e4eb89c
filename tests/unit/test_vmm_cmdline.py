"""The QEMU command line a VM gets: the machine, memory mapping and devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.errors import InvalidRequest
from pal.vmm.cmdline import ImageFiles, VmSpec, build_argv, host_tsc_khz, kernel_args


def _spec(tmp_path: Path, **kw: object) -> VmSpec:
    args: dict = dict(
        vm_id="vm1",
        vm_dir=tmp_path,
        image=ImageFiles.from_dir(tmp_path / "img"),
        vcpus=2,
        memory_mib=256,
        disk_path=tmp_path / "disk",
        accel="tcg",
    )
    args.update(kw)
    return VmSpec(**args)


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_boot_maps_own_ram_file_shared(tmp_path: Path) -> None:
    argv = build_argv(_spec(tmp_path), mem_path=tmp_path / "mem", mem_share=True)
    assert f"memory-backend-file,id=mem,size=256M,mem-path={tmp_path / 'mem'},share=on" in _opt(
        argv, "-object"
    )
    assert "-incoming" not in argv
    machine = _opt(argv, "-M")[0]
    assert machine.startswith("microvm,") and "rtc=on" in machine and "memory-backend=mem" in machine
    assert _opt(argv, "-m") == ["256M"] and _opt(argv, "-smp") == ["2"]
    assert _opt(argv, "-qmp") == [f"unix:{tmp_path / 'qmp.sock'},server=on,wait=off"]
    assert "-no-reboot" in argv and "-nodefaults" in argv


def test_private_restore_maps_snapshot_copy_on_write_and_waits(tmp_path: Path) -> None:
    argv = build_argv(_spec(tmp_path), mem_path=Path("/snap/mem"), mem_share=False, incoming=True)
    assert any("mem-path=/snap/mem,share=off" in o for o in _opt(argv, "-object"))
    assert _opt(argv, "-incoming") == ["defer"]


def test_accelerator_args(tmp_path: Path) -> None:
    tcg = build_argv(_spec(tmp_path), mem_path=tmp_path / "mem", mem_share=True)
    assert _opt(tcg, "-accel") == ["tcg,tb-size=64"] and _opt(tcg, "-cpu") == ["max"]
    kvm = build_argv(_spec(tmp_path, accel="kvm"), mem_path=tmp_path / "mem", mem_share=True)
    assert _opt(kvm, "-accel") == ["kvm"] and _opt(kvm, "-cpu") == ["host,-arch-capabilities"]
    with pytest.raises(InvalidRequest):
        build_argv(_spec(tmp_path, accel="hvf"), mem_path=tmp_path / "mem", mem_share=True)


def test_disks_root_first_then_read_only_config(tmp_path: Path) -> None:
    spec = _spec(tmp_path, disk_format="qcow2", config_drive=tmp_path / "config.img")
    drives = _opt(build_argv(spec, mem_path=tmp_path / "mem", mem_share=True), "-drive")
    assert drives[0].startswith(f"id=root,if=none,file={tmp_path / 'disk'},format=qcow2")
    assert "cache=unsafe" in drives[0]
    assert drives[1] == f"id=cfg,if=none,file={tmp_path / 'config.img'},format=raw,readonly=on"
    without = _opt(build_argv(_spec(tmp_path), mem_path=tmp_path / "mem", mem_share=True), "-drive")
    assert len(without) == 1


def test_agent_port_on_unix_socket_in_vm_dir(tmp_path: Path) -> None:
    argv = build_argv(_spec(tmp_path), mem_path=tmp_path / "mem", mem_share=True)
    assert f"socket,id=agent,path={tmp_path / 'agent.sock'},server=on,wait=off" in _opt(argv, "-chardev")
    assert "virtserialport,chardev=agent,name=agent" in _opt(argv, "-device")


def test_kernel_args_carry_host_tsc_rate() -> None:
    khz = host_tsc_khz()
    assert khz > 100_000  # a real CPU, not the fallback of a parse failure on x86 hosts
    args = kernel_args("pal.extra=1").split()
    assert f"tsc_early_khz={khz}" in args and f"lpj={4 * khz}" in args
    assert args[-1] == "pal.extra=1" and "panic=-1" in args
