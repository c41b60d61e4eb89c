"""The floors `pal bench` compares against: a bare QEMU reaching QMP, and the guest's
own path without Pal in it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def qemu_floor_ms(iterations: int) -> list[float]:
    """A bare QEMU microvm process, no guest: spawn until its QMP socket accepts."""
    out = []
    for _ in range(iterations):
        with tempfile.TemporaryDirectory() as td:
            sock = Path(td) / "qmp.sock"
            t = time.perf_counter()
            proc = subprocess.Popen(
                ["qemu-system-x86_64", "-nodefaults", "-no-user-config", "-nographic", "-S",
                 "-M", "microvm,x-option-roms=off,isa-serial=off", "-m", "256M", "-accel", "tcg",
                 "-qmp", f"unix:{sock},server=on,wait=off"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                while True:
                    with contextlib.suppress(OSError):
                        s = socket.socket(socket.AF_UNIX)
                        s.connect(str(sock))
                        s.close()
                        break
                    time.sleep(0.0005)
                out.append((time.perf_counter() - t) * 1000)
            finally:
                proc.kill()
                proc.wait()
    return out


NATIVE_HARNESS = """
import os, sys, tempfile
from pal_tools.bench.common import pct, timed
from pal.guest.harness import Harness
ws = tempfile.mkdtemp()
Harness(int(sys.argv[1]), workspace=ws, workload_user=None, heartbeat_interval=60).serve()
"""


def native_guest_path_ms(iterations: int) -> list[float]:
    """The guest's restore-path work (answer an identify, then run the first command) by
    Pal's own harness in a new process on the host's CPU: no emulation, nothing to
    translate; what a KVM guest's share of the restore approaches (it adds VM exits)."""
    from pal.guest import protocol as gp

    out = []
    for _ in range(iterations):
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-c", NATIVE_HARNESS, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        try:
            f = ours.makefile("rb")
            f.readline()  # its first heartbeat: it is up, as a restored guest is at cont
            t = time.perf_counter()
            ours.sendall(gp.encode({"id": 1, "k": gp.K_IDENTIFY, "vm_id": "vm-n", "incarnation": 2,
                                    "token": "tok", "seed": os.urandom(32).hex()}))  # fmt: skip
            ours.sendall(gp.encode({"id": 2, "k": gp.K_EXEC, "tok": "tok", "argv": ["/bin/true"]}))
            while True:
                msg = gp.decode(f.readline().rstrip(b"\n")) or {}
                if msg.get("id") == 2 and msg.get("k") in (gp.K_EXIT, gp.K_ERR):
                    break
            out.append((time.perf_counter() - t) * 1000)
        finally:
            ours.close()
            proc.kill()
            proc.wait()
    return out
