"""A minimal NFSv3/MOUNTv3 client over TCP (ONC RPC, AUTH_SYS), stdlib only, for the tests
that speak to the node's volume server from the host as a local process would
(docs/volumes.md, "Only the gateway speaks to the server").

Run as a script (``python3 -I -c <this file's text> SOURCE MNT_PORT NFS_PORT EXPORT
[--privileged] [--fh HEX]``, under any uid) it binds ``SOURCE`` (a VM's loopback address;
from a port below 1024 with ``--privileged``, which only root may bind), asks MOUNT for
``EXPORT``'s root handle and NFS for GETATTR of it (or of ``--fh``), and prints JSON:
``{"mnt": <status or "denied ...">, "fh": <hex or null>, "getattr": <status or "denied ...">}``
(status 0 is success)."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

MOUNT_PROG, NFS_PROG = 100005, 100003
MNT_PROC, GETATTR_PROC = 1, 1
AUTH_STATS = {1: "badcred", 2: "rejectedcred", 3: "badverf", 4: "rejectedverf", 5: "tooweak"}


def _opaque(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b + b"\0" * (-len(b) % 4)


def _connect(source: str, port: int, privileged: bool) -> socket.socket:
    for local in range(1023, 511, -1) if privileged else [0]:
        s = socket.socket()
        try:
            s.bind((source, local))
        except OSError:
            s.close()
            continue
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        return s
    raise OSError("no privileged port free")


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
    return buf


def call(s: socket.socket, prog: int, proc: int, args: bytes) -> tuple[int | str, bytes]:
    """One call (AUTH_SYS as root): (the accept status, the results) or ("denied ...", b"")."""
    xid = int.from_bytes(os.urandom(4), "big")
    cred = struct.pack(">I", 0) + _opaque(b"probe") + struct.pack(">III", 0, 0, 0)
    msg = struct.pack(">IIIIII", xid, 0, 2, prog, 3, proc) + struct.pack(">I", 1) + _opaque(cred)
    msg += struct.pack(">II", 0, 0) + args
    s.sendall(struct.pack(">I", 0x80000000 | len(msg)) + msg)
    reply = b""
    while True:
        (mark,) = struct.unpack(">I", _recv_exact(s, 4))
        reply += _recv_exact(s, mark & 0x7FFFFFFF)
        if mark & 0x80000000:
            break
    _xid, _mtype, reply_stat = struct.unpack(">III", reply[:12])
    if reply_stat != 0:  # MSG_DENIED: RPC_MISMATCH or AUTH_ERROR
        reject, detail = struct.unpack(">II", reply[12:20])
        return (
            f"denied {'auth ' + AUTH_STATS.get(detail, str(detail)) if reject == 1 else 'rpc mismatch'}",
            b"",
        )
    (verf_len,) = struct.unpack(">I", reply[16:20])
    off = 20 + verf_len + (-verf_len % 4)
    (accept,) = struct.unpack(">I", reply[off : off + 4])
    return (accept if accept != 0 else 0), reply[off + 4 :]


def probe(source: str, mnt_port: int, nfs_port: int, export: str, privileged: bool, fh: bytes | None) -> dict:
    out: dict = {"mnt": None, "fh": None, "getattr": None}
    try:
        with _connect(source, mnt_port, privileged) as s:
            accept, res = call(s, MOUNT_PROG, MNT_PROC, _opaque(export.encode()))
            if accept == 0:
                (status,) = struct.unpack(">I", res[:4])
                out["mnt"] = status
                if status == 0:
                    (n,) = struct.unpack(">I", res[4:8])
                    out["fh"] = res[8 : 8 + n].hex()
            else:
                out["mnt"] = accept if isinstance(accept, str) else f"rpc accept status {accept}"
    except OSError as exc:
        out["mnt"] = f"denied connection: {exc}"
    handle = fh if fh is not None else (bytes.fromhex(out["fh"]) if out["fh"] else None)
    if handle is None:
        return out
    try:
        with _connect(source, nfs_port, privileged) as s:
            accept, res = call(s, NFS_PROG, GETATTR_PROC, _opaque(handle))
            out["getattr"] = struct.unpack(">I", res[:4])[0] if accept == 0 else accept
    except OSError as exc:
        out["getattr"] = f"denied connection: {exc}"
    return out


def main(argv: list[str]) -> None:
    source, mnt_port, nfs_port, export = argv[0], int(argv[1]), int(argv[2]), argv[3]
    fh = bytes.fromhex(argv[argv.index("--fh") + 1]) if "--fh" in argv else None
    print(json.dumps(probe(source, mnt_port, nfs_port, export, "--privileged" in argv, fh)))


if __name__ == "__main__":
    main(sys.argv[1:])


def run(source: str, ports: tuple[int, int], export: str, *, as_root: bool, fh: str | None = None) -> dict:
    """The probe in a process of its own: root binding a port below 1024 (as the gateway
    does), or ``nobody`` (uid 65534, no groups), which any local user could be."""
    import subprocess
    from pathlib import Path

    nfs, mnt = ports
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # nobody can run it
    argv = [python, "-I", "-c", Path(__file__).read_text()]
    argv += [source, str(mnt), str(nfs), export] + (["--privileged"] if as_root else [])
    argv += ["--fh", fh] if fh else []
    drop = {} if as_root else {"user": 65534, "group": 65534, "extra_groups": []}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", check=True, **drop)  # type: ignore[call-overload]
    return dict(json.loads(out.stdout))
