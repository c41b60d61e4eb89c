"""Errors raised by the VMM layer (HTTP status/code inherited from BackendError)."""

from __future__ import annotations

from pal.errors import BackendError, Conflict


class VmmError(BackendError):
    """QEMU, QMP or a disk operation failed doing something that should have worked."""


class VmExited(VmmError):
    """The QEMU process exited while we were waiting on it (boot, restore, snapshot)."""


class RunstateError(VmmError):
    """A QemuVm operation was asked for in a runstate it is not valid in (qemu.py)."""

    status, code = Conflict.status, Conflict.code
