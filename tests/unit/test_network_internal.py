"""Which addresses the gateway treats as internal: IPv6 forms judged by the IPv4 address
they carry, and the host's addresses read over netlink (secondary IPv4 addresses and every
IPv6 one), checked in a network namespace made for the test."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest

from pal.network.hostaddrs import host_addresses, parse_addr_messages
from pal.network.internal import embedded_ipv4, is_internal
from pal.network.policy import InternalGuard

ip = ipaddress.ip_address


@pytest.mark.parametrize(
    ("addr", "carries"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),  # IPv4-mapped
        ("::169.254.169.254", "169.254.169.254"),  # IPv4-compatible
        ("64:ff9b::10.0.0.1", "10.0.0.1"),  # NAT64, well-known prefix
        ("64:ff9b:1::a9fe:a9fe", "169.254.169.254"),  # NAT64, local-use prefix (RFC 8215)
        ("2002:c0a8:0101::1", "192.168.1.1"),  # 6to4
    ],
)
def test_embedded_ipv4_forms_are_judged_by_their_ipv4_address(addr: str, carries: str) -> None:
    a = ip(addr)
    assert ip(carries) in embedded_ipv4(a)
    assert is_internal(a), f"{addr} reaches {carries}"
    assert not InternalGuard().permits(a, 443)
    # The operator opening the IPv4 address opens its IPv6 forms too (and nothing more);
    # the NAT64 local-use prefix must be opened itself as well.
    local_use = addr.startswith("64:ff9b:1:")
    assert InternalGuard([carries]).permits(a, 443) is not local_use
    assert InternalGuard([carries, "64:ff9b:1::/48"]).permits(a, 443)
    assert not InternalGuard(["10.9.9.9"]).permits(a, 443)


def test_teredo_carries_server_and_client() -> None:
    # 2001:0:4136:e378:8000:63bf:3fff:fdd2: server 65.54.227.120, client 192.0.2.45
    a = ip("2001:0:4136:e378:8000:63bf:3fff:fdd2")
    assert embedded_ipv4(a) == (ip("65.54.227.120"), ip("192.0.2.45"))
    assert is_internal(a)


def test_public_forms_stay_public() -> None:
    for addr in ("64:ff9b::8.8.8.8", "2002:0808:0808::1", "::8.8.8.8", "2606:4700::1111", "8.8.8.8"):
        assert not is_internal(ip(addr)), addr
    # ... unless they are the host's own (or carry a host address)
    assert is_internal(ip("64:ff9b::203.0.113.50"), {ip("203.0.113.50")})
    assert is_internal(ip("2606:4700::1111"), {ip("2606:4700::1111")})


def test_the_nat64_local_use_prefix_is_internal_whatever_it_carries() -> None:
    assert is_internal(ip("64:ff9b:1::8.8.8.8"))
    assert is_internal(ip("64:ff9b:1:ff::1"))


def test_netlink_parser_takes_every_address_and_the_end() -> None:
    def msg(kind: int, body: bytes) -> bytes:
        import struct

        return struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body

    def addr(family: int, raw: bytes, atype: int = 2) -> bytes:
        import struct

        attr = struct.pack("=HH", 4 + len(raw), atype) + raw
        return struct.pack("=BBBBI", family, 24, 0x80, 0, 2) + attr + b"\0" * (-len(attr) % 4)

    batch = (
        msg(20, addr(2, bytes([10, 0, 0, 1])))
        + msg(20, addr(2, bytes([10, 0, 0, 9])))  # a secondary address: a message of its own
        + msg(20, addr(10, ip("2001:db8::5").packed, 1))
    )
    got, done = parse_addr_messages(batch)
    assert got == [ip("10.0.0.1"), ip("10.0.0.9"), ip("2001:db8::5")] and not done
    assert parse_addr_messages(msg(3, b"\0" * 4)) == ([], True)


@contextlib.contextmanager
def _namespace() -> Iterator[str]:
    name = f"paltest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def _in_namespace(name: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """host_addresses() as a process in namespace ``name`` would see them (setns applies to
    the calling thread only, so a thread of its own does the reading)."""
    out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            out.extend(host_addresses())
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace")
def test_host_addresses_include_secondary_ipv4_and_every_ipv6() -> None:
    with _namespace() as ns:
        run = ["ip", "-n", ns]
        subprocess.run([*run, "link", "add", "pa0", "type", "veth", "peer", "name", "pa1"], check=True)
        for cmd in (
            ["addr", "add", "11.22.33.1/24", "dev", "pa0"],
            ["addr", "add", "11.22.33.44/24", "dev", "pa0"],  # secondary: same subnet
            ["addr", "add", "2a00:1450::44/64", "dev", "pa0", "nodad"],
            ["addr", "add", "2a00:1450::45/64", "dev", "pa0", "nodad"],
            ["link", "set", "pa0", "up"],
        ):
            subprocess.run([*run, *cmd], check=True)
        got = _in_namespace(ns)
        for want in ("11.22.33.1", "11.22.33.44", "2a00:1450::44", "2a00:1450::45"):
            assert ip(want) in got, (want, got)
        guard = InternalGuard(host_addresses=got)
        assert not guard.permits(ip("11.22.33.44"), 80) and not guard.permits(ip("64:ff9b::b16:212c"), 80)
        assert guard.permits(ip("11.22.33.99"), 80), "a global address the host does not have"
