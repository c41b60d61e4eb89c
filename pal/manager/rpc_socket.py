"""The runtime manager's RPC socket: closed to everyone but root, by modes and by peer.

Whoever can talk to this socket is root in every VM (exec as root, files, restores), so:

- it lives in ``<data dir>/run/``, a root-owned 0700 directory, and is 0600 itself: we bind
  it here and hand uvicorn the bound socket (uvicorn makes the unix sockets it binds 0666);
- every connection's peer is checked with ``SO_PEERCRED`` before a byte is read: only root
  and the uid the server itself runs as get through. Anyone else (a local user who got hold
  of a descriptor, a QEMU under its jail uid) is disconnected and logged.

A remote node (`pal node`) serves the same RPC over TCP, authenticated by its node token
instead (pal/manager/auth.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from pathlib import Path

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def bind(path: Path) -> socket.socket:
    """A listening unix socket at ``path`` (0600) in a root-only directory (0700)."""
    run_dir = path.parent
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(run_dir, os.geteuid(), os.getegid())
    os.chmod(run_dir, 0o700)
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # born 0600: no window in which others could connect
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def allowed_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


class PeerCheckedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, refusing connections from any uid but root's and ours."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        try:
            pid, uid, _ = peer_credentials(sock)
        except (OSError, AttributeError, TypeError) as exc:
            log.warning("manager RPC: cannot identify a peer (%s); disconnected", exc)
            transport.close()
            return
        if uid not in allowed_uids():
            log.warning("manager RPC: refused a connection from uid %d (pid %d)", uid, pid)
            transport.close()
