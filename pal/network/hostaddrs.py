"""This host's own addresses, read over rtnetlink (RTM_GETADDR dump): every IPv4 address
of every interface, secondary ones included (SIOCGIFADDR gives only each interface's
first), and every IPv6 address. Standard library only: the gateway reads them after it
dropped its privileges (a dump needs none) and imports nothing new then.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

from pal.network.internal import Address

NETLINK_ROUTE = 0
RTM_NEWADDR, RTM_GETADDR = 20, 22
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFA_ADDRESS, IFA_LOCAL = 1, 2
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
_RTATTR = struct.Struct("=HH")  # length, type


def _align(n: int) -> int:
    return (n + 3) & ~3


def parse_addr_messages(data: bytes) -> tuple[list[Address], bool]:
    """The addresses in a batch of netlink messages, and whether the dump is done."""
    out: list[Address] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            break
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", data, off + _NLMSGHDR.size)[0]
            raise OSError(errno, f"RTM_GETADDR failed: {errno}")
        if kind == RTM_NEWADDR:
            out += _addresses(data[off + _NLMSGHDR.size : off + length])
        off += _align(length)
    return out, False


def _addresses(msg: bytes) -> list[Address]:
    family = _IFADDRMSG.unpack_from(msg)[0]
    size = {socket.AF_INET: 4, socket.AF_INET6: 16}.get(family)
    found: list[Address] = []
    off = _IFADDRMSG.size
    while size and off + _RTATTR.size <= len(msg):
        alen, atype = _RTATTR.unpack_from(msg, off)
        if alen < _RTATTR.size:
            break
        payload = msg[off + _RTATTR.size : off + alen]
        # IFA_LOCAL is the interface's address; IFA_ADDRESS is the same, or the peer on a
        # point-to-point link: both are kept (refusing a peer too is the safe side).
        if atype in (IFA_ADDRESS, IFA_LOCAL) and len(payload) == size:
            a = ipaddress.ip_address(payload)
            if a not in found:
                found.append(a)
        off += _align(alen)
    return found


def host_addresses() -> list[Address]:
    """Every address of every interface in this process's network namespace."""
    out: list[Address] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE) as s:
        s.bind((0, 0))
        req = _NLMSGHDR.pack(_NLMSGHDR.size + _IFADDRMSG.size, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        s.send(req + _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0))
        done = False
        while not done:
            batch, done = parse_addr_messages(s.recv(1 << 16))
            out += [a for a in batch if a not in out]
    return out
