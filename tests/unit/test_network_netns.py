"""A VM's network namespace as made for real (root, no VM): frames written into its tap as
the guest would, answers read back. The guest side is played by raw Ethernet frames."""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.network import netns

GUEST_MAC = bytes.fromhex("020000000015")
HOST_MAC = bytes.fromhex(netns.HOST_MAC.replace(":", ""))
VNET_HDR = b"\0" * 10  # struct virtio_net_hdr: no offloads
SIOCSARP = 0x8955


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _frame(src: str, dst: str, proto: int, l4: bytes) -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))  # fmt: skip
    ip = ip[:10] + struct.pack("!H", _csum(ip)) + ip[12:]
    return HOST_MAC + GUEST_MAC + b"\x08\x00" + ip + l4


def _tcp(src: str, dst: str, sport: int, dport: int, flags: int, seq: int = 1000, ack: int = 5000) -> bytes:
    hdr = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 65535, 0, 0)
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(hdr))
    hdr = hdr[:16] + struct.pack("!H", _csum(pseudo + hdr)) + hdr[18:]
    return _frame(src, dst, 6, hdr)


def _udp(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    hdr = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload  # checksum 0: none
    return _frame(src, dst, 17, hdr)


def _tcp_replies(tap: int, deadline_s: float = 20.0) -> Iterator[tuple[str, int, str, int, int, int]]:
    """(src, sport, dst, dport, flags, seq) of TCP segments the namespace sends to the guest."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ready, _, _ = select.select([tap], [], [], 0.2)
        if not ready:
            continue
        pkt = os.read(tap, 65536)[len(VNET_HDR) :]
        if pkt[12:14] != b"\x08\x00" or pkt[23] != 6:
            continue
        ip = pkt[14:]
        ihl = (ip[0] & 0x0F) * 4
        sport, dport, seq, _ack, _off, flags = struct.unpack("!HHIIBB", ip[ihl : ihl + 14])
        yield socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport, flags, seq


@pytest.fixture
def ns() -> Iterator[netns.VmNetns]:
    name = netns.ns_name(f"ut{os.getpid() % 100000}", "vm-rules")
    made = netns.create(name)

    def neighbour() -> None:  # the guest's MAC, so replies need no ARP round trip
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            pa = struct.pack("!H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(netns.GUEST_IP))
            pa = struct.pack("=H", socket.AF_INET) + pa[2:]
            ha = struct.pack("=H", 1) + GUEST_MAC + b"\0" * 8
            req = pa + ha + struct.pack("=i", 0x02 | 0x04) + b"\0" * 16 + netns.TAP.encode().ljust(16, b"\0")
            fcntl.ioctl(s.fileno(), SIOCSARP, req)

    netns.in_namespace(neighbour, enter=name)
    os.set_blocking(made.tap_fd, False)
    try:
        yield made
    finally:
        made.close_fds()
        netns.delete(name)
    assert not netns.exists(name)


def test_a_segment_of_an_unknown_connection_is_reset(ns: netns.VmNetns) -> None:
    # What a restored guest sends on a connection its old namespace had: an ACK, no SYN.
    ack = 0x10
    os.write(ns.tap_fd, VNET_HDR + _tcp(netns.GUEST_IP, "198.18.0.9", 40000, 80, ack))
    for src, sport, dst, dport, flags, _seq in _tcp_replies(ns.tap_fd):
        if (dst, dport) == (netns.GUEST_IP, 40000):
            assert flags & 0x04, "a reset"
            assert (src, sport) == ("198.18.0.9", 80), "from the address the guest talked to"
            return
    raise AssertionError("no reset: the guest would wait forever")


def test_a_syn_reaches_the_gateway_listener_with_its_original_destination(ns: netns.VmNetns) -> None:
    syn = 0x02
    os.write(ns.tap_fd, VNET_HDR + _tcp(netns.GUEST_IP, "203.0.113.5", 40001, 443, syn))
    for _src, _sport, dst, dport, flags, seq in _tcp_replies(ns.tap_fd):
        if (dst, dport) == (netns.GUEST_IP, 40001):
            assert flags & 0x12 == 0x12, "SYN-ACK from the listener"
            isn = seq
            break
    else:
        raise AssertionError("no SYN-ACK")
    # Complete the handshake; the accepted socket knows where the guest meant to go.
    os.write(
        ns.tap_fd, VNET_HDR + _tcp(netns.GUEST_IP, "203.0.113.5", 40001, 443, 0x10, seq=1001, ack=isn + 1)
    )
    ns.listener.settimeout(10)
    conn, _ = ns.listener.accept()
    raw = conn.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST
    assert socket.inet_ntoa(raw[4:8]) == "203.0.113.5" and struct.unpack("!H", raw[2:4])[0] == 443
    conn.close()


def test_other_udp_is_dropped_and_dns_goes_to_the_gateway_socket(ns: netns.VmNetns) -> None:
    os.write(ns.tap_fd, VNET_HDR + _udp(netns.GUEST_IP, "203.0.113.5", 5000, 123, b"ntp?"))
    os.write(ns.tap_fd, VNET_HDR + _udp(netns.GUEST_IP, "8.8.8.8", 5001, 53, b"dns?"))
    ns.dns.settimeout(10)
    data, addr = ns.dns.recvfrom(100)
    assert data == b"dns?" and addr == (netns.GUEST_IP, 5001), "any DNS server: the gateway's socket"
    ns.dns.settimeout(0.5)
    with pytest.raises(TimeoutError):
        ns.dns.recvfrom(100)  # the other datagram went nowhere


def test_namespaces_of_a_deleted_data_dir_are_swept_by_another_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node records its tag's data dir; a node's start removes the namespaces of tags
    whose data dir is gone, and keeps those of live data dirs and of unrecorded tags."""
    monkeypatch.setattr(netns, "OWNERS_DIR", tmp_path / "owners")
    gone_dir, live_dir = tmp_path / "gone", tmp_path / "live"
    gone_dir.mkdir()
    live_dir.mkdir()
    gone_tag, live_tag = netns.node_tag(gone_dir), netns.node_tag(live_dir)
    stray_tag = f"{os.getpid() % 100000:05d}abc"[:8]  # no record: not ours to judge
    names = [netns.ns_name(t, "vm-orphan") for t in (gone_tag, live_tag, stray_tag)]
    made = [netns.create(n) for n in names]
    try:
        for m in made:
            m.close_fds()
        netns.claim(gone_tag, gone_dir)
        netns.claim(live_tag, live_dir)
        assert netns.sweep_orphans() == []  # both data dirs exist
        gone_dir.rmdir()
        assert netns.sweep_orphans() == [names[0]]
        assert not netns.exists(names[0]) and netns.exists(names[1]) and netns.exists(names[2])
        assert sorted(p.name for p in (tmp_path / "owners").iterdir()) == [live_tag]
    finally:
        for n in names:
            netns.delete(n)


# Run in a mount namespace of its own (private: nothing it mounts reaches the host), from a
# /run/netns that is not a mount point yet, as on a freshly booted host.
_FIRST_IP_NETNS_ADD = """
import ctypes, json, subprocess, sys
from pal.network import netns
libc = ctypes.CDLL(None, use_errno=True)
while libc.umount2(b"/run/netns", 0) == 0:
    pass
pal_ns, ip_ns = sys.argv[1], sys.argv[2]
netns.create(pal_ns).close_fds()
subprocess.run(["ip", "netns", "add", ip_ns], check=True)
subprocess.run(["ip", "netns", "delete", ip_ns], check=True)
try:
    netns.delete(pal_ns)
    error = None
except OSError as exc:
    error = str(exc)
mounts = open("/proc/self/mountinfo").read()
print(json.dumps({"error": error, "file_left": netns.exists(pal_ns), "mount_left": pal_ns in mounts}))
"""


def test_an_ip_netns_add_after_ours_leaves_our_namespaces_removable() -> None:
    """The first `ip netns add` on a host bind-mounts /run/netns over itself unless it is a
    mount point already; a namespace Pal had bound there before would be hidden under that
    mount and could never be removed. Pal makes the directory a mount point first."""
    pal_ns, ip_ns = netns.ns_name("0000beef", f"vm-{os.getpid()}"), f"paltest-ip-{os.getpid()}"
    try:
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _FIRST_IP_NETNS_ADD,
             pal_ns, ip_ns],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(out.stdout) == {"error": None, "file_left": False, "mount_left": False}, out.stderr
    finally:
        for name in (pal_ns, ip_ns):  # the files are on the host's filesystem
            (netns.NETNS_DIR / name).unlink(missing_ok=True)
