"""The guest's network: its static address, its MAC per incarnation, and the reset of
connections a snapshot froze open (their host side is gone)."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Iterator

from pal.guest import protocol as P

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCSIFHWADDR, _SIOCADDRT = 0x8916, 0x891C, 0x8924, 0x890B
_RTF_UP, _RTF_GATEWAY = 0x1, 0x2


def _if_up(s: socket.socket, name: str) -> None:
    ifreq = struct.pack("16sh14x", name.encode(), 0)
    flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, ifreq))[1]
    fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh14x", name.encode(), flags | _IFF_UP))


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        _if_up(s, "lo")


def _sockaddr_in(addr: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(addr))


def nic_name(sys_dir: str = "/sys/class/net") -> str | None:
    """The guest's one NIC (eth0 on these kernels), or None if the VM has none."""
    try:
        names = sorted(n for n in os.listdir(sys_dir) if n != "lo")
    except OSError:
        return None
    return names[0] if names else None


def network_up() -> None:
    """Static address, the host side as default gateway (every packet goes to the egress
    gateway, which decides). No DHCP: it costs ~1 s of boot and there is nothing to learn."""
    nic = nic_name()
    if nic is None:
        return
    mask = socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - P.NET_PREFIX)) & 0xFFFFFFFF))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = nic.encode()
        fcntl.ioctl(s.fileno(), _SIOCSIFADDR, struct.pack("16s16s8x", name, _sockaddr_in(P.GUEST_IP)))
        fcntl.ioctl(s.fileno(), _SIOCSIFNETMASK, struct.pack("16s16s8x", name, _sockaddr_in(mask)))
        _if_up(s, nic)
        # struct rtentry (x86-64): pad, dst, gateway, genmask, flags, pad, pad, pad, metric,
        # dev, mtu, window, irtt; native alignment does the padding.
        rt = struct.pack(
            "@L16s16s16sHhLPhPLLH6x",
            0,
            _sockaddr_in("0.0.0.0"),
            _sockaddr_in(P.GATEWAY_IP),
            _sockaddr_in("0.0.0.0"),
            _RTF_UP | _RTF_GATEWAY,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        )
        try:
            fcntl.ioctl(s.fileno(), _SIOCADDRT, rt)
        except FileExistsError:
            pass


def set_mac(mac: str) -> None:
    """Give the NIC this incarnation's MAC (the old one came with the snapshot's device state)."""
    nic = nic_name()
    if nic is None:
        return
    raw = bytes.fromhex(mac.replace(":", ""))
    if len(raw) != 6:
        raise ValueError(f"bad MAC {mac!r}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFHWADDR, struct.pack("16sH6s8x", nic.encode(), 1, raw))


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY, _SOCK_DESTROY = 20, 21
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN, _TCP_TIME_WAIT = 10, 6
_SOCKID_LEN = 48  # struct inet_diag_sockid


def _diag_msg(kind: int, flags: int, seq: int, states: int, sockid: bytes) -> bytes:
    body = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, states) + sockid
    return struct.pack("=LHHLL", 16 + len(body), kind, flags, seq, 0) + body


def _netlink_replies(sock: socket.socket) -> Iterator[tuple[int, bytes]]:
    while True:
        data = sock.recv(65536)
        off = 0
        while off + 16 <= len(data):
            length, kind, _flags, _seq, _pid = struct.unpack_from("=LHHLL", data, off)
            if length < 16:
                return
            yield kind, data[off + 16 : off + length]
            if kind in (_NLMSG_DONE, _NLMSG_ERROR):
                return
            off += (length + 3) & ~3


def reset_tcp_connections() -> int:
    """Abort every TCP connection to a non-local peer (SOCK_DESTROY); returns how many.

    After a restore or fork the host side of each such connection is gone: a client
    blocked reading would otherwise wait forever, since it sends nothing that could draw a
    reset. The application sees ECONNABORTED.
    """
    local_prefix = socket.inet_aton(P.GUEST_IP)
    states = (0xFFF & ~(1 << _TCP_LISTEN) & ~(1 << _TCP_TIME_WAIT)) & ~1
    victims: list[bytes] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.send(_diag_msg(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, states, b"\0" * _SOCKID_LEN))
        for kind, body in _netlink_replies(nl):
            if kind != _SOCK_DIAG_BY_FAMILY or len(body) < 4 + _SOCKID_LEN:
                continue
            sockid = body[4 : 4 + _SOCKID_LEN]
            dst = sockid[20:24]  # sport(2) dport(2) src(16) dst(16)...
            if dst[0] == 127 or dst == local_prefix:
                continue
            victims.append(sockid)
        done = 0
        for i, sockid in enumerate(victims):
            nl.send(_diag_msg(_SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, 2 + i, 0xFFFFFFFF, sockid))
            for kind, body in _netlink_replies(nl):
                if kind == _NLMSG_ERROR and struct.unpack_from("=i", body)[0] == 0:
                    done += 1
    return done
