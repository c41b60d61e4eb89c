"""A seccomp filter that keeps a QEMU whose guest RAM is a private (copy-on-write) mapping
of a shared file from punching holes in that file.

QEMU 7.2 discards guest RAM (virtio-balloon free page reporting and inflation) with
``ram_block_discard_range``: for a file-backed RAM block it punches a hole in the file
(``fallocate(PUNCH_HOLE)``) and then ``madvise(MADV_DONTNEED)`` on its mapping. Right for a
``share=on`` file of the VM's own; for a fork child, whose RAM maps its snapshot's fork
memory file ``share=off``, the hole is punched in the file its siblings map too, and their
pages read back as zeros (measured: a sibling's 64 MiB of state changed checksum after
another child freed its copy; docs/lifecycle.md, "Memory a guest frees").

So a QEMU that maps its RAM private runs under this filter, stacked under QEMU's own
``-sandbox``: ``fallocate`` with ``FALLOC_FL_PUNCH_HOLE`` returns 0 without doing anything.
QEMU then goes on to the ``madvise``, which drops the child's own copied pages (its
mapping falls back to the shared file's pages): the child gives its freed memory back and
the file stays whole. QEMU punches holes for nothing else with Pal's drives (their
``discard`` stays ``ignore``, and write-zeroes uses ``FALLOC_FL_ZERO_RANGE`` on the XFS
or btrfs data dir).

Installed between fork and exec (:func:`preexec`, a subprocess ``preexec_fn``), after the
drop to the VM's uid; the filter survives the exec and cannot be removed.
"""

from __future__ import annotations

import ctypes
import platform
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000  # | 0: the call returns 0, skipped
FALLOC_FL_PUNCH_HOLE = 0x02
# Offsets in struct seccomp_data: nr (u32), arch (u32), ip (u64), args[6] (u64 each).
_NR, _ARCH, _ARG1 = 0, 4, 24  # args[1] (fallocate's mode): its low word, little-endian
# (audit arch, fallocate's number) per machine.
_ARCHES = {"x86_64": (0xC000003E, 285), "aarch64": (0xC00000B7, 47)}

_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The BPF program (struct sock_filter[]) for ``machine`` (default this one's)."""
    arch, nr = _ARCHES[machine or platform.machine()]
    return b"".join(
        (
            _insn(_LD_W_ABS, 0, 0, _ARCH),
            _insn(_JEQ_K, 0, 4, arch),  # another ABI: allow
            _insn(_LD_W_ABS, 0, 0, _NR),
            _insn(_JEQ_K, 0, 2, nr),  # not fallocate: allow
            _insn(_LD_W_ABS, 0, 0, _ARG1),
            _insn(_JSET_K, 1, 0, FALLOC_FL_PUNCH_HOLE),
            _insn(_RET_K, 0, 0, SECCOMP_RET_ALLOW),
            _insn(_RET_K, 0, 0, SECCOMP_RET_ERRNO | 0),
        )
    )


def supported() -> bool:
    return platform.machine() in _ARCHES


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


# Built before any fork: the child only calls prctl (no allocation, import or lock there).
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
_PROG = ctypes.create_string_buffer(program(), len(program())) if supported() else None
_FPROG = _Fprog(len(program()) // 8, ctypes.addressof(_PROG)) if _PROG is not None else None
_FPROG_PTR = ctypes.cast(ctypes.pointer(_FPROG), ctypes.c_void_p) if _FPROG is not None else None


def preexec() -> None:
    """Install the filter in this (forked, about to exec) process; raises OSError, which
    fails the exec (fail closed)."""
    if _FPROG_PTR is None:
        raise OSError(f"no hole filter for {platform.machine()}")
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, _FPROG_PTR, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
