"""The filter a QEMU mapping its RAM file private runs under (pal/vmm/holefilter.py): a hole
punched in that file, which its siblings map too, becomes a no-op that reports success;
everything else a QEMU does to its files still happens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pal.vmm import holefilter

MIB = 1 << 20
# In the filtered process: punch a hole over the whole file, then zero a range (what QEMU's
# write-zeroes does), then write a byte; print each call's result.
CHILD = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDWR)
punch = libc.fallocate(fd, 0x02 | 0x01, 0, 1 << 20)  # PUNCH_HOLE | KEEP_SIZE
zero = libc.fallocate(fd, 0x10, 1 << 20, 4096)  # ZERO_RANGE
os.pwrite(fd, b"w", 2 << 20)
print(punch, zero)
"""


def data_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.skipif(not holefilter.supported(), reason="no hole filter for this machine")
@pytest.mark.parametrize("filtered", [False, True])
def test_a_hole_punched_under_the_filter_changes_nothing_and_reports_success(
    tmp_path: Path, filtered: bool
) -> None:
    f = tmp_path / "ram"
    f.write_bytes(os.urandom(3 * MIB))
    before = f.read_bytes()
    kw = {"preexec_fn": holefilter.preexec} if filtered else {}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(f)], capture_output=True, text=True, check=True, **kw
    ).stdout.split()
    after = f.read_bytes()
    assert out[0] == "0", "the punch reports success either way (QEMU then drops its own pages)"
    assert after[MIB : MIB + 4096] == bytes(4096) and after[2 * MIB : 2 * MIB + 1] == b"w"
    if filtered:
        assert after[:MIB] == before[:MIB], "the file its siblings map keeps its bytes"
        assert data_bytes(f) >= 3 * MIB
    else:
        assert after[:MIB] == bytes(MIB), "without the filter the hole is real"


def test_the_program_matches_only_fallocate_with_punch_hole_on_its_own_abi() -> None:
    prog = holefilter.program("x86_64")
    assert len(prog) == 8 * 8  # eight sock_filter instructions
    assert int.from_bytes(prog[-4:], "little") == holefilter.SECCOMP_RET_ERRNO  # errno 0: success
    assert holefilter.program("aarch64") != prog  # another syscall number and audit arch
