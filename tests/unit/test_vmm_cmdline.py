"""The QEMU command line a VM gets: the machine, memory mapping and devices."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.errors import InvalidRequest, Unavailable
from pal.vmm import cmdline
from pal.vmm.cmdline import ImageFiles, VmSpec, build_argv, host_tsc_khz, kernel_args
from pal.vmm.handoff import Handoff


def _spec(tmp_path: Path, **kw: object) -> VmSpec:
    img = tmp_path / "img"
    img.mkdir(exist_ok=True)
    for name in ("vmlinux", "initrd.img", "rootfs.ext4"):
        (img / name).touch()
    for name in ("disk", "mem", "config.img"):
        (tmp_path / name).touch()
    args: dict = dict(
        vm_id="vm1",
        vm_dir=tmp_path,
        image=ImageFiles.from_dir(img),
        vcpus=2,
        memory_mib=256,
        disk_path=tmp_path / "disk",
        accel="tcg",
    )
    args.update(kw)
    return VmSpec(**args)


@pytest.fixture
def h() -> Iterator[Handoff]:
    with Handoff() as handoff:
        yield handoff


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def _fd_target(arg: str) -> str:
    """The file a /proc/self/fd/N argument names (N is open in this process too)."""
    assert arg.startswith("/proc/self/fd/"), arg
    return os.readlink(arg)


def test_boot_maps_own_ram_file_shared_through_a_descriptor(tmp_path: Path, h: Handoff) -> None:
    argv = build_argv(_spec(tmp_path), h, mem_path=tmp_path / "mem", mem_share=True)
    (mem,) = [o for o in _opt(argv, "-object") if o.startswith("memory-backend-file")]
    path = mem.split("mem-path=")[1].split(",")[0]
    assert _fd_target(path) == str(tmp_path / "mem") and mem.endswith(",share=on")
    assert "-incoming" not in argv
    machine = _opt(argv, "-M")[0]
    assert machine.startswith("microvm,") and "rtc=on" in machine and "memory-backend=mem" in machine
    assert _opt(argv, "-m") == ["256M"] and _opt(argv, "-smp") == ["2"]
    assert "-no-reboot" in argv and "-nodefaults" in argv


def test_private_restore_maps_snapshot_copy_on_write_and_waits(tmp_path: Path, h: Handoff) -> None:
    snap = tmp_path / "snapmem"
    snap.touch()
    argv = build_argv(_spec(tmp_path), h, mem_path=snap, mem_share=False, incoming=True)
    (mem,) = [o for o in _opt(argv, "-object") if o.startswith("memory-backend-file")]
    assert _fd_target(mem.split("mem-path=")[1].split(",")[0]) == str(snap) and mem.endswith(",share=off")
    assert _opt(argv, "-incoming") == ["defer"]


def test_every_vm_has_a_balloon_for_free_page_reporting_last_unless_its_snapshot_had_none(
    tmp_path: Path, h: Handoff
) -> None:
    argv = build_argv(
        _spec(tmp_path, config_drive=tmp_path / "config.img"), h, mem_path=tmp_path / "mem", mem_share=True
    )
    devices = _opt(argv, "-device")
    assert devices[-1] == "virtio-balloon-device,free-page-reporting=on"  # the others keep their slots
    old = build_argv(_spec(tmp_path, balloon=False), h, mem_path=tmp_path / "mem", mem_share=True)
    assert not [d for d in _opt(old, "-device") if "balloon" in d]


def test_accelerator_args(tmp_path: Path, h: Handoff) -> None:
    tcg = build_argv(_spec(tmp_path), h, mem_path=tmp_path / "mem", mem_share=True)
    assert _opt(tcg, "-accel") == ["tcg,tb-size=64"] and _opt(tcg, "-cpu") == ["max"]
    kvm = build_argv(_spec(tmp_path, accel="kvm"), h, mem_path=tmp_path / "mem", mem_share=True)
    assert _opt(kvm, "-accel") == ["kvm"] and _opt(kvm, "-cpu") == ["host,-arch-capabilities"]
    with pytest.raises(InvalidRequest):
        build_argv(_spec(tmp_path, accel="hvf"), h, mem_path=tmp_path / "mem", mem_share=True)


def test_disks_are_fd_sets_root_first_then_read_only_config(tmp_path: Path, h: Handoff) -> None:
    spec = _spec(tmp_path, disk_format="qcow2", config_drive=tmp_path / "config.img")
    argv = build_argv(spec, h, mem_path=tmp_path / "mem", mem_share=True)
    drives = _opt(argv, "-drive")
    assert drives[0].startswith("id=root,if=none,file=/dev/fdset/1,format=qcow2")
    assert "cache=unsafe" in drives[0] and "file.locking=off" in drives[0]
    assert drives[1].startswith("id=cfg,if=none,file=/dev/fdset/2,format=raw,readonly=on")
    sets: dict[str, list[int]] = {}
    for opt in _opt(argv, "-add-fd"):
        kv = dict(x.split("=", 1) for x in opt.split(","))
        fd = int(kv["fd"])
        assert fd in h.pass_fds
        sets.setdefault(kv["set"], []).append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        assert os.readlink(f"/proc/self/fd/{fd}") == kv["opaque"]
    # the writable disk can be re-opened read-only and read-write; the config drive only read
    assert sorted(sets["1"]) == sorted([os.O_RDWR, os.O_RDONLY]) and sets["2"] == [os.O_RDONLY]
    assert argv.index("-add-fd") < argv.index("-drive")
    without = _opt(build_argv(_spec(tmp_path), h, mem_path=tmp_path / "mem", mem_share=True), "-drive")
    assert len(without) == 1


def test_qmp_and_agent_are_sockets_listening_before_qemu_starts(tmp_path: Path, h: Handoff) -> None:
    argv = build_argv(_spec(tmp_path), h, mem_path=tmp_path / "mem", mem_share=True)
    chardevs = {c.split(",")[1]: c for c in _opt(argv, "-chardev")}
    for name, path in (("id=agent", tmp_path / "agent.sock"), ("id=qmp", tmp_path / "qmp.sock")):
        fd = int(chardevs[name].split("fd=")[1].split(",")[0])
        assert fd in h.pass_fds and "server=on,wait=off" in chardevs[name]
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))  # already listening: a client may connect before QEMU runs
    assert "virtserialport,chardev=agent,name=agent" in _opt(argv, "-device")
    assert _opt(argv, "-mon") == ["chardev=qmp,mode=control"]
    assert "-qmp" not in argv and "-pidfile" not in argv and "-runas" not in argv


def test_full_seccomp_sandbox(tmp_path: Path, h: Handoff) -> None:
    argv = build_argv(_spec(tmp_path, run_as=(200000, 200000)), h, mem_path=tmp_path / "mem", mem_share=True)
    assert _opt(argv, "-sandbox") == [
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    ]


def test_a_qemu_without_seccomp_runs_no_vm_unless_the_operator_opts_out(
    tmp_path: Path, h: Handoff, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: no -sandbox in this QEMU (its capability probe faked) is a 503 naming the
    opt-out; PAL_SECCOMP=off runs it without the filter."""
    monkeypatch.setattr(cmdline, "qemu_supports_sandbox", lambda binary: False)
    with pytest.raises(Unavailable, match="PAL_SECCOMP=off") as refused:
        build_argv(_spec(tmp_path), h, mem_path=tmp_path / "mem", mem_share=True)
    assert refused.value.status == 503
    argv = build_argv(_spec(tmp_path, seccomp=False), h, mem_path=tmp_path / "mem", mem_share=True)
    assert "-sandbox" not in argv


def test_seccomp_off_means_no_filter_even_where_qemu_has_one(tmp_path: Path, h: Handoff) -> None:
    argv = build_argv(_spec(tmp_path, seccomp=False), h, mem_path=tmp_path / "mem", mem_share=True)
    assert "-sandbox" not in argv


def test_pal_seccomp_is_required_unless_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pal.config import Settings

    monkeypatch.delenv("PAL_SECCOMP", raising=False)
    assert Settings.from_env().seccomp is True
    monkeypatch.setenv("PAL_SECCOMP", "off")
    assert Settings.from_env().seccomp is False
    monkeypatch.setenv("PAL_SECCOMP", "maybe")
    with pytest.raises(ValueError, match="PAL_SECCOMP"):
        Settings.from_env()


def test_handoff_closes_everything_and_quotes_commas(tmp_path: Path) -> None:
    odd = tmp_path / "a,b"
    odd.mkdir()
    (odd / "disk").touch()
    with Handoff() as h:
        dev = h.block_device(odd / "disk", readonly=True)
        fds = h.pass_fds
        assert dev == "/dev/fdset/1" and h.add_fd_args[1].endswith(f"opaque={tmp_path}/a,,b/disk")
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_kernel_args_carry_host_tsc_rate() -> None:
    khz = host_tsc_khz()
    assert khz > 100_000  # a real CPU, not the fallback of a parse failure on x86 hosts
    args = kernel_args("pal.extra=1").split()
    assert f"tsc_early_khz={khz}" in args and f"lpj={4 * khz}" in args
    assert args[-1] == "pal.extra=1" and "panic=-1" in args
