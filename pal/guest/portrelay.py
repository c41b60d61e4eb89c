"""The guest's port relay: lets the host reach servers that listen on 127.0.0.1 only.

Stdlib only (copied into the image next to the harness). The host reaches a guest server
through the VM's network namespace: it connects to ``GUEST_IP:port`` itself, which finds
every server bound to 0.0.0.0 (or the NIC's address) with no help from the guest. A server
bound to 127.0.0.1 cannot be reached that way, so the harness listens on
``GUEST_IP:RELAY_PORT`` and, for each connection from the host side of the NIC (and from
nowhere else), reads one line ``PORT <n>\\n``, connects to ``127.0.0.1:<n>`` and answers
``OK\\n`` (or ``ERR <errno name>\\n``), then moves the bytes both ways with ``splice`` (no
copy through Python) until both sides are done. Flow control is the kernel's: a reader that
does not read stops the writer through the socket buffers.

The listener is made once at boot; its socket lives in guest memory, so it survives
snapshots, restores and forks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading

from pal.guest import protocol as P

HEADER_MAX = 32
SPLICE_CHUNK = 256 * 1024
HEADER_TIMEOUT_S = 10.0


def _read_header(conn: socket.socket) -> int | None:
    conn.settimeout(HEADER_TIMEOUT_S)
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(HEADER_MAX - len(buf))
        if not chunk:
            return None
        buf += chunk
        if len(buf) >= HEADER_MAX and b"\n" not in buf:
            return None
    # Byte-exact: the first line only, nothing after it (the host waits for our answer
    # before it sends anything else).
    line, rest = buf.split(b"\n", 1)
    if rest:
        return None
    parts = line.split()
    if len(parts) != 2 or parts[0] != b"PORT" or not parts[1].isdigit():
        return None
    port = int(parts[1])
    return port if 1 <= port <= 65535 else None


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src -> dst until src ends; then end dst's write side."""
    try:
        r, w = os.pipe()
        try:
            while True:
                n = os.splice(src.fileno(), w, SPLICE_CHUNK)
                if n == 0:
                    break
                left = n
                while left:
                    left -= os.splice(r, dst.fileno(), left)
        finally:
            os.close(r)
            os.close(w)
    except OSError:
        # One side reset: reset the other too, so both peers learn at once.
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _serve(conn: socket.socket) -> None:
    target: socket.socket | None = None
    try:
        port = _read_header(conn)
        if port is None:
            return
        target = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target.settimeout(HEADER_TIMEOUT_S)
        try:
            target.connect(("127.0.0.1", port))
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, "EIO")
            conn.sendall(f"ERR {name}\n".encode())
            return
        target.settimeout(None)
        conn.settimeout(None)
        conn.sendall(b"OK\n")
        back = threading.Thread(target=_pump, args=(target, conn), daemon=True)
        back.start()
        _pump(conn, target)
        back.join()
    except OSError:
        pass
    finally:
        conn.close()
        if target is not None:
            target.close()


def _accept_loop(listener: socket.socket) -> None:
    while True:
        try:
            conn, peer = listener.accept()
        except OSError:
            continue
        if peer[0] != P.GATEWAY_IP:  # the host side of the NIC only
            conn.close()
            continue
        threading.Thread(target=_serve, args=(conn,), name="port-relay", daemon=True).start()


def start(log: object = None) -> socket.socket | None:
    """Listen on GUEST_IP:RELAY_PORT and serve in a thread; None if the NIC is not up."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((P.GUEST_IP, P.RELAY_PORT))
        listener.listen(64)
    except OSError as exc:
        listener.close()
        if callable(log):
            log(f"port relay not started: {exc}")
        return None
    threading.Thread(target=_accept_loop, args=(listener,), name="port-relay-accept", daemon=True).start()
    return listener
