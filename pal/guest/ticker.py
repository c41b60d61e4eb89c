"""A sleep the host's idle probe does not mistake for a workload's deadline."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading

from pal.guest.oslib import libc


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


CLOCK_MONOTONIC = 1
TFD_CLOEXEC = 0o2000000


class Ticker:
    """``wait(interval)``: sleep until the interval passes (False) or :meth:`poke` (True).

    Sleeps on a timerfd, not a timed futex or poll: a timerfd is no sleeping task's timer
    (``hrtimer_wakeup`` in /proc/timer_list), so the harness's own period never shows up
    as a workload deadline in :func:`probe`. Falls back to an Event where timerfd is
    missing."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._efd: int | None = None
        self._tfd: int | None = None
        try:
            tfd = libc().timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)
            if tfd >= 0:
                self._tfd = tfd
                self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except (OSError, AttributeError):
            self._tfd = self._efd = None

    def poke(self) -> None:
        if self._efd is not None:
            os.eventfd_write(self._efd, 1)
        else:
            self._event.set()

    def wait(self, interval: float) -> bool:
        if self._tfd is None or self._efd is None:
            woke = self._event.wait(interval)
            self._event.clear()
            return woke
        sec = max(interval, 0.001)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(sec), int((sec % 1) * 1e9)))
        libc().timerfd_settime(self._tfd, 0, ctypes.byref(spec), None)
        poller = select.poll()
        poller.register(self._tfd, select.POLLIN)
        poller.register(self._efd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll()}
        if self._efd in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._efd)
            return True
        with contextlib.suppress(BlockingIOError, OSError):
            os.set_blocking(self._tfd, False)
            os.read(self._tfd, 8)
        return False


# --------------------------------------------------------------------------- children
