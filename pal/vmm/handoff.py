"""What a jailed QEMU gets: every file and socket it uses, opened by the manager (root) and
handed over as descriptors when QEMU is exec'd.

QEMU runs as its VM's own unprivileged uid from its first instruction (jail.py), so it
cannot open anything under the 0700 data dir by path, and must not need to. The one place
that decides how each thing crosses over:

- **Block devices** (:meth:`Handoff.block_device`): ``-add-fd fd=N,set=S,opaque=<path>``
  and ``file=/dev/fdset/S``. QEMU's block layer re-opens an image whenever its access mode
  changes (at the end of an outgoing migration it drops write access; ``cont`` takes it
  back), and ``qemu_open`` then dups a descriptor of the matching mode from the set instead
  of opening a path. So a writable disk's set holds a read-write and a read-only
  descriptor, and image locking is off (the two are separate open files; each disk belongs
  to exactly one QEMU anyway).
- **Files QEMU 7.2 opens with a plain open()** (the guest RAM file of a
  ``memory-backend-file``, kernel, initrd; :meth:`Handoff.file`): ``/proc/self/fd/N``.
  Opening that magic link skips the directory walk, but the inode's own permissions still
  apply, so a RAM file must be readable and writable by the QEMU (jail.py says by whom).
- **QMP and the guest agent's chardev** (:meth:`Handoff.listener`): unix sockets bound and
  listening here, passed as ``-chardev socket,fd=N,server=on,wait=off``. The manager (or a
  restarted one) connects to their paths, which QEMU never sees.
- **Anything already open** (:meth:`Handoff.fd`), e.g. a tap opened in the VM's network
  namespace: ``-netdev tap,id=n0,fd=<h.fd(tap)>,vhost=off``.

Migration streams are the one exception: they go over QMP later (``getfd``, qemu.py).

Use: build one per exec, let :func:`pal.vmm.cmdline.build_argv` call its methods, pass
:attr:`Handoff.pass_fds` to the exec, close it right after (QEMU holds its own copies).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from types import TracebackType

from pal.vmm.errors import VmmError


def qemu_opt(value: str | Path) -> str:
    """Quote a value for a QEMU ``key=value,...`` option string (a comma is doubled)."""
    return str(value).replace(",", ",,")


class Handoff:
    """The descriptors one QEMU exec receives. Every ``pass_fds`` entry is owned here."""

    def __init__(self) -> None:
        self._fds: list[int] = []  # plain descriptors we opened (closed by close())
        self._listeners: list[socket.socket] = []  # closed by close() through their objects
        self._add_fd: list[str] = []
        self._next_set = 1

    # ---------------------------------------------------------------- what QEMU gets

    def file(self, path: Path) -> str:
        """A file QEMU opens itself by name: ``/proc/self/fd/N`` (its inode's modes apply)."""
        return f"/proc/self/fd/{self._open(path, os.O_RDONLY)}"

    def block_device(self, path: Path, *, readonly: bool) -> str:
        """A ``-drive file=`` value: an fd set holding the image (rw and ro, or ro only)."""
        fdset = self._next_set
        self._next_set += 1
        modes = [os.O_RDONLY] if readonly else [os.O_RDWR, os.O_RDONLY]
        for mode in modes:
            fd = self._open(path, mode)
            self._add_fd += ["-add-fd", f"fd={fd},set={fdset},opaque={qemu_opt(path)}"]
        return f"/dev/fdset/{fdset}"

    def listener(self, path: Path) -> int:
        """A unix socket listening at ``path`` (root-only), for ``-chardev socket,fd=N``."""
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            os.chmod(path, 0o600)
            sock.listen(8)
        except OSError as exc:
            sock.close()
            raise VmmError(f"cannot listen on {path}: {exc}") from exc
        self._listeners.append(sock)
        return sock.fileno()

    def fd(self, fd: int) -> int:
        """Pass an already open descriptor (a dup of it; the caller keeps its own)."""
        dup = os.dup(fd)
        self._fds.append(dup)
        return dup

    # ---------------------------------------------------------------- for the exec

    @property
    def add_fd_args(self) -> list[str]:
        """The ``-add-fd`` options; they must precede the ``-drive`` that names their set."""
        return list(self._add_fd)

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (*self._fds, *(s.fileno() for s in self._listeners))

    def close(self) -> None:
        for sock in self._listeners:
            sock.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._listeners.clear()

    def __enter__(self) -> Handoff:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _open(self, path: Path, flags: int) -> int:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)  # pass_fds clears CLOEXEC in the child only
        except OSError as exc:
            raise VmmError(f"cannot open {path} for QEMU: {exc.strerror}") from exc
        self._fds.append(fd)
        return fd
