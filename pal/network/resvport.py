"""Connections from a reserved source port (below 1024), as the egress gateway makes them
to the node's volume server (docs/volumes.md, "Only the gateway speaks to the server").

The server's exports name each VM by its loopback source address (127.77.x.y), which any
local process may bind; they also require a port below 1024 (ganesha's ``PrivilegedPort``),
which only a process with CAP_NET_BIND_SERVICE binds: the gateway keeps that one capability
when it drops root (gateway.drop_privileges). A host that lowered
``net.ipv4.ip_unprivileged_port_start`` below 1024 lets anyone bind such ports:
:func:`unprivileged_low_ports` says so, and the node then serves no volumes."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
from pathlib import Path

RESERVED = range(1023, 511, -1)  # bindresvport's range, as a kernel NFS client uses
CAP_NET_BIND_SERVICE = 10
SYSCTL = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")


def unprivileged_low_ports() -> int | None:
    """The host's ``ip_unprivileged_port_start`` when it lets anyone bind a port below 1024
    (None: only privileged processes can, the default)."""
    try:
        start = int(SYSCTL.read_text())
    except (OSError, ValueError):
        return None
    return start if start < 1024 else None


class _Cursor:
    """Where the next search for a free port starts, per source address (so that a port
    just closed, maybe in TIME_WAIT, is the last one tried again)."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}

    def order(self, source: str) -> list[int]:
        i = self.at.get(source, 0)
        ports = list(RESERVED)
        self.at[source] = (i + 1) % len(ports)
        return ports[i:] + ports[:i]


_cursor = _Cursor()


async def open_connection(source: str, host: str, port: int, timeout: float) -> socket.socket:
    """A connected, non-blocking TCP socket from ``source`` and a free port below 1024."""
    loop = asyncio.get_running_loop()
    last: OSError | None = None
    for local in _cursor.order(source):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((source, local))
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), timeout=timeout)
            return s
        except OSError as exc:
            s.close()
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                last = exc
                continue
            raise
        except BaseException:
            s.close()
            raise
    raise last or OSError(errno.EADDRINUSE, "no reserved port free")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def setuid_keeping_bind_service(uid: int) -> None:
    """setresuid/setresgid to ``uid`` (no groups) keeping CAP_NET_BIND_SERVICE alone, in the
    effective and permitted sets (nothing inheritable: no child gets it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_keepcaps = 8
    if libc.prctl(pr_set_keepcaps, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = 1 << CAP_NET_BIND_SERVICE
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    libc.prctl(pr_set_keepcaps, 0, 0, 0, 0)
