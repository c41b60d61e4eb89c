"""Child processes: reaping (the harness is PID 1), exit statuses, killing, PATH lookup."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from pal.guest import protocol as P
from pal.guest.errors import ExecError

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ChildTracker:
    """Waits for exec children without losing their exit statuses.

    As PID 1 (``reap_all``) every orphan in the VM is re-parented to us and must be reaped,
    so one thread reaps all children and hands our own children's statuses to their
    waiters. It peeks with WNOWAIT and reaps under ``spawn_lock``, which is held from fork
    to :meth:`register`: a child that dies at once is still recognised as ours.
    Without ``reap_all`` (tests) each child is waited for by pid only.
    """

    def __init__(self, reap_all: bool) -> None:
        self.reap_all = reap_all
        self.spawn_lock = threading.Lock()
        self._cond = threading.Condition()
        self._owned: set[int] = set()
        self._statuses: dict[int, int] = {}
        self._have_children = threading.Event()
        if reap_all:
            threading.Thread(target=self._reaper, name="reaper", daemon=True).start()

    def register(self, pid: int) -> None:
        with self._cond:
            self._owned.add(pid)
        self._have_children.set()

    def release(self, pid: int) -> None:
        with self._cond:
            self._owned.discard(pid)
            self._statuses.pop(pid, None)

    def poll(self, pid: int) -> int | None:
        """The wait status of ``pid`` once it has exited, else None."""
        if not self.reap_all:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return self._statuses.get(pid)
            if got == pid:
                self._statuses[pid] = status
            return self._statuses.get(pid)
        with self._cond:
            return self._statuses.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.poll(pid)
            left = deadline - time.monotonic()
            if status is not None or left <= 0:
                return status
            if self.reap_all:
                with self._cond:
                    if pid not in self._statuses:
                        self._cond.wait(left)
            else:
                time.sleep(min(left, 0.01))

    def _reaper(self) -> None:
        while True:
            # Cleared before looking: a child registered after waitid found none sets it
            # again, so waiting without a timeout cannot miss it (orphans appear only via
            # our children).
            self._have_children.clear()
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                self._have_children.wait()
                continue
            except InterruptedError:
                continue
            if info is None:
                continue
            with self.spawn_lock:
                try:
                    pid, status = os.waitpid(info.si_pid, os.WNOHANG)
                except ChildProcessError:
                    continue  # subprocess reaped its own failed exec
            if pid == 0:
                continue
            with self._cond:
                if pid in self._owned:
                    self._statuses[pid] = status
                    self._cond.notify_all()


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when ``pid`` exits (None where unsupported)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def resolve_executable(name: str, path: str, cwd: str) -> str:
    """execvp's lookup, with errors the caller can tell apart (ENOENT vs EPERM)."""
    if "/" in name:
        full = os.path.join(cwd, name)
        if not os.path.exists(full):
            raise ExecError(P.ERR_NOENT, f"executable not found: {name}")
        if os.path.isdir(full) or not os.access(full, os.X_OK):
            raise ExecError(P.ERR_PERM, f"not executable: {name}")
        return full
    found_unusable = False
    for d in (path or DEFAULT_PATH).split(":"):
        full = os.path.join(d or ".", name)
        if os.path.isfile(full):
            if os.access(full, os.X_OK):
                return full
            found_unusable = True
    if found_unusable:
        raise ExecError(P.ERR_PERM, f"not executable: {name}")
    raise ExecError(P.ERR_NOENT, f"executable not found: {name}")
