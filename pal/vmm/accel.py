"""Choose the accelerator: KVM when a tiny VM really boots under it, else TCG.

A present and openable /dev/kvm is not enough: on nested hosts (kvm_pvm) a stock kernel
is instruction-emulated for minutes and then dies with "KVM internal error". So we boot
the guest kernel with no root fs under KVM and a short timeout; reaching the
"Unable to mount root fs" panic on its serial console proves KVM runs a real kernel.
The answer is cached in ``<data dir>/images/accel.json`` per host kernel + QEMU version (so
data dirs sharing an images dir share the answer).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.vmm.versions import QEMU_BINARY, host_kernel_version, qemu_version

log = logging.getLogger(__name__)
KVM_DEVICE = Path("/dev/kvm")
PROBE_TIMEOUT_S = 8.0
# Serial console lines that only a kernel which ran its whole init can print.
_BOOT_MARKERS = ("Unable to mount root", "Kernel panic", "Run /init")


@dataclass(frozen=True)
class AccelInfo:
    name: str  # "kvm" | "tcg"
    reason: str  # why this one, for logs and `pal doctor`
    cpu_args: tuple[str, ...] = field(default=())  # -accel/-cpu argv

    def __post_init__(self) -> None:
        if not self.cpu_args:
            object.__setattr__(self, "cpu_args", tuple(accel_args(self.name)))


def accel_args(name: str) -> list[str]:
    if name == "kvm":
        # QEMU 7.2 aborts on MSR 0x10a with plain `-cpu host` under nested KVM.
        return ["-accel", "kvm", "-cpu", "host,-arch-capabilities"]
    if name == "tcg":
        return ["-accel", "tcg,tb-size=64", "-cpu", "max"]
    raise InvalidRequest(f"unknown accelerator {name!r} (expected kvm or tcg)")


def _cache_key() -> dict[str, str]:
    return {"hostKernel": host_kernel_version(), "qemu": qemu_version()}


def _kvm_openable(dev: Path) -> str | None:
    """None when the device opens read-write, else why not."""
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"{dev} is absent"
    except OSError as exc:
        return f"{dev} cannot be opened: {exc.strerror}"
    os.close(fd)
    return None


def boot_probe(kernel: Path, timeout_s: float = PROBE_TIMEOUT_S, binary: str = QEMU_BINARY) -> str | None:
    """Boot ``kernel`` under KVM; None on success, else the reason it failed."""
    with tempfile.TemporaryDirectory(prefix="pal-accel-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [
            binary,
            *("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"),
            *("-monitor", "none", "-parallel", "none"),
            *("-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on", "-m", "128M", "-smp", "1"),
            *accel_args("kvm"),
            *("-kernel", str(kernel), "-serial", f"file:{console}"),
            *("-append", "console=ttyS0 panic=-1 nokaslr mitigations=off"),
        ]
        t0 = time.monotonic()
        # start_new_session + kill of the group: the probe never outlives this call.
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return f"KVM probe VM did not boot within {timeout_s:.0f} s (nested or emulated KVM?)"
        text = console.read_text(errors="replace") if console.exists() else ""
        stderr = err.decode(errors="replace").strip()
        if any(m in text for m in _BOOT_MARKERS):
            return None
        if "KVM internal error" in stderr:
            return "KVM internal error while booting the probe VM"
        tail = (stderr.splitlines() or ["no output"])[-1]
        return f"KVM probe VM exited (rc {proc.returncode}) after {time.monotonic() - t0:.1f} s: {tail}"


def _find_kernel(settings: Settings) -> Path | None:
    images = settings.images_dir
    # Kernels live in shared boot sets (images/.boot/<id>/); older images had their own.
    boot_sets = sorted(images.glob(".boot/*/vmlinux"))
    for cand in [*boot_sets, images / "default" / "vmlinux", *sorted(images.glob("*/vmlinux"))]:
        if cand.is_file():
            return cand
    return None


def probe(settings: Settings, force: str | None = None, kernel: Path | None = None) -> AccelInfo:
    """The accelerator to use. ``force`` (or ``settings.accel`` other than "auto") wins."""
    forced = force or (settings.accel if settings.accel != "auto" else None)
    if forced:
        accel_args(forced)  # validates the name
        return AccelInfo(forced, f"forced by configuration (PAL_ACCEL/--accel={forced})")
    why_not = _kvm_openable(KVM_DEVICE)
    if why_not:
        return AccelInfo("tcg", f"{why_not}; using TCG (software emulation)")
    cache_path = settings.images_dir / "accel.json"
    key = _cache_key()
    try:
        cached = json.loads(cache_path.read_text())
        if cached.get("key") == key:
            return AccelInfo(cached["name"], cached["reason"] + " (cached)")
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    kernel = kernel or _find_kernel(settings)
    if kernel is None:
        # Not cached: the next call, once an image exists, probes for real.
        return AccelInfo("tcg", "no guest kernel yet to probe KVM with; using TCG for now")
    # Only the first start on a host pays this; say why it waits.
    log.info(
        "probing KVM: booting a tiny VM under KVM (up to %.0f s, once per host kernel and QEMU; "
        "the answer is cached in %s)",
        PROBE_TIMEOUT_S,
        cache_path,
    )
    failure = boot_probe(kernel)
    info = (
        AccelInfo("kvm", "a probe VM booted under KVM")
        if failure is None
        else AccelInfo("tcg", f"{failure}; using TCG (software emulation)")
    )
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        body = {"key": key, "name": info.name, "reason": info.reason, "probedAt": time.time()}
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(cache_path)
    except OSError:
        pass  # a read-only data dir only costs a re-probe next time
    return info


def describe(info: AccelInfo) -> dict[str, str]:
    return {k: v for k, v in asdict(info).items() if k != "cpu_args"}
