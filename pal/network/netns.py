"""One network namespace per VM: a tap for its NIC, the gateway's sockets, nftables rules.

Layout inside the namespace ``pal-<node tag>-<vm id>`` (bind-mounted at /run/netns/, so
`ip netns` lists it and it outlives the process that made it):

    guest eth0 10.0.2.15/24 ──virtio-net── QEMU ──fd── tap0 10.0.2.2/24 (fixed MAC)
                                                        │ nftables (nft.py): TCP -> :GATEWAY_PORT,
                                                        │ UDP 53 -> :DNS_PORT, the rest dropped
                                                        ▼
                                     listener 10.0.2.2:GATEWAY_PORT, DNS socket 10.0.2.2:DNS_PORT
                                     (created here, handed to the gateway process as descriptors)

No uplink, no default route, nothing on the host's real interfaces: the only way out is the
gateway, which opens upstream connections from the host's namespace.

The tap is not persistent: it exists while its descriptor is open (QEMU holds it), so a
dead QEMU leaves no interface behind. The host side's MAC is fixed, so a guest restored
from a snapshot keeps a valid ARP entry for its gateway.

Everything here is blocking and must run in a thread that may change namespaces:
:func:`in_namespace` runs a function in a fresh thread (never a pool thread, which could be
left in the wrong namespace by an error) and returns its result.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import ipaddress
import os
import re
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pal.errors import InvalidRequest, Unavailable
from pal.guest.protocol import GATEWAY_IP, GUEST_IP, NET_PREFIX
from pal.network import nft

NETNS_DIR = Path("/run/netns")
# Which data dir each tag belongs to (tmpfs, like the namespaces: both end with a reboot).
OWNERS_DIR = Path("/run/pal/netns-owners")
NETNS_DIR_LOCK = Path("/run/pal/netns-dir.lock")  # Pal processes making NETNS_DIR a mount
_TAG = re.compile(r"^[0-9a-f]{8}$")
TAP = "tap0"
HOST_IP = GATEWAY_IP  # the guest's gateway and DNS server: the host side of its NIC
PREFIX = NET_PREFIX
GUEST_NET = str(ipaddress.ip_network(f"{GUEST_IP}/{NET_PREFIX}", strict=False))
HOST_MAC = "02:50:41:4c:00:02"  # locally administered; "PAL"; the same in every namespace
GATEWAY_PORT = 15001  # the gateway's TCP listener in every VM namespace
DNS_PORT = 53
LISTEN_BACKLOG = 128  # per VM: a guest flooding SYNs fills only its own queue

_VM_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_SIOCSIFADDR, _SIOCSIFNETMASK, _SIOCSIFHWADDR = 0x8916, 0x891C, 0x8924
_IFF_UP = 0x1
_ARPHRD_ETHER = 1

T = TypeVar("T")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def node_tag(data_dir: Path) -> str:
    """A short tag per data dir: several Pal nodes on one host never touch each other's."""
    return hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:8]


def ns_name(tag: str, vm_id: str) -> str:
    """The namespace name of a VM; refuses ids that could escape /run/netns."""
    if not _VM_ID.match(vm_id):
        raise InvalidRequest(f"invalid VM id for a network namespace: {vm_id!r}")
    return f"pal-{tag}-{vm_id}"


def ns_path(name: str) -> Path:
    return NETNS_DIR / name


@dataclass
class VmNetns:
    """A VM's namespace as just made: the caller hands ``tap_fd`` to QEMU and the two
    sockets to the gateway, then closes its own copies (:meth:`close_fds`)."""

    name: str
    tap_fd: int
    listener: socket.socket
    dns: socket.socket

    def close_fds(self) -> None:
        """Idempotent: a second call must not close whatever now reuses the tap's number."""
        if self.tap_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.tap_fd)
            self.tap_fd = -1
        self.listener.close()
        self.dns.close()


def in_namespace(fn: Callable[[], T], *, new: str | None = None, enter: str | None = None) -> T:
    """Run ``fn`` in a fresh thread inside a namespace: a new one bind-mounted as ``new``,
    or the existing ``enter``. Blocking; call it through ``asyncio.to_thread``."""
    box: dict[str, object] = {}

    def body() -> None:
        libc = _libc()
        try:
            if new is not None:
                _create_bound(libc, new)
            elif enter is not None:
                fd = os.open(ns_path(enter), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns {enter}: {os.strerror(err)}")
                finally:
                    os.close(fd)
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc
        # The thread ends here, in whatever namespace: it is never reused.

    t = threading.Thread(target=body, name="pal-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def _mount(libc: ctypes.CDLL, src: bytes, target: bytes, flags: int, what: str) -> None:
    if libc.mount(src, target, None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _netns_dir_mounted(libc: ctypes.CDLL) -> None:
    """Make /run/netns a shared mount point of its own, as `ip netns add` does, before a
    namespace is bound in it. Otherwise the first `ip netns add` on this host (an operator's,
    a test's) bind-mounts /run/netns over itself: the namespaces bound there before are hidden
    under that mount, can no longer be unmounted or removed, and leak until reboot. Once it is
    a mount point, `ip` only makes it shared again. Idempotent; Pal processes take turns."""
    NETNS_DIR.mkdir(mode=0o755, exist_ok=True)
    NETNS_DIR_LOCK.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    target, shared = bytes(NETNS_DIR), _MS_SHARED | _MS_REC
    with open(NETNS_DIR_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _mount(libc, b"none", target, shared, f"make {NETNS_DIR} shared")
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: not a mount point yet
                raise
            _mount(libc, target, target, _MS_BIND | _MS_REC, f"bind mount of {NETNS_DIR} on itself")
            _mount(libc, b"none", target, shared, f"make {NETNS_DIR} shared")


def _create_bound(libc: ctypes.CDLL, name: str) -> None:
    """unshare a new network namespace for this thread and bind-mount it at /run/netns/name."""
    _netns_dir_mounted(libc)
    path = ns_path(name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    except FileExistsError:
        raise Unavailable(f"network namespace {name} already exists") from None
    os.close(fd)
    try:
        if libc.unshare(_CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        src = f"/proc/self/task/{threading.get_native_id()}/ns/net".encode()
        _mount(libc, src, bytes(path), _MS_BIND, f"bind mount of {path}")
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def _ifreq_flags(sock: socket.socket, ifname: str, set_flags: int) -> None:
    name = ifname.encode()
    cur = struct.unpack("16sh14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack("16sh14x", name, 0)))[1]
    fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh14x", name, cur | set_flags))


def _ifreq_inet(ifname: str, addr: str) -> bytes:
    return struct.pack("16sH2s4s8x", ifname.encode(), socket.AF_INET, b"\0\0", socket.inet_aton(addr))


def _netmask(prefix: int) -> str:
    return socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF))


def _setup_inside() -> tuple[int, socket.socket, socket.socket]:
    """In the VM's new namespace: tap, addresses, rules, the gateway's two sockets."""
    tap = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        flags = _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR
        fcntl.ioctl(tap, _TUNSETIFF, struct.pack("16sH22x", TAP.encode(), flags))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            _ifreq_flags(s, "lo", _IFF_UP)
            mac = bytes.fromhex(HOST_MAC.replace(":", ""))
            fcntl.ioctl(s, _SIOCSIFHWADDR, struct.pack("16sH6s8x", TAP.encode(), _ARPHRD_ETHER, mac))
            fcntl.ioctl(s, _SIOCSIFADDR, _ifreq_inet(TAP, HOST_IP))
            fcntl.ioctl(s, _SIOCSIFNETMASK, _ifreq_inet(TAP, _netmask(PREFIX)))
            _ifreq_flags(s, TAP, _IFF_UP)
        nft.run(nft.ruleset(tap=TAP, guest_net=GUEST_NET, gateway_port=GATEWAY_PORT, dns_port=DNS_PORT))
        listener, dns = _gateway_sockets()
    except BaseException:
        os.close(tap)
        raise
    return tap, listener, dns


def _gateway_sockets() -> tuple[socket.socket, socket.socket]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # REUSEADDR: a restarted gateway binds again while the old listener's
        # connections linger in TIME_WAIT.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST_IP, GATEWAY_PORT))
        listener.listen(LISTEN_BACKLOG)
        dns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        dns.bind((HOST_IP, DNS_PORT))
    except BaseException:
        listener.close()
        dns.close()
        raise
    return listener, dns


def create(name: str) -> VmNetns:
    """Make the namespace ``name`` with its tap, rules and sockets (blocking, ~2-5 ms).

    On failure nothing is left behind."""
    try:
        tap, listener, dns = in_namespace(_setup_inside, new=name)
    except BaseException:
        delete(name)
        raise
    return VmNetns(name=name, tap_fd=tap, listener=listener, dns=dns)


def forget_neighbours(name: str) -> None:
    """Drop the namespace's neighbour entries on the tap (blocking): a guest that took a
    new MAC on the same tap is then asked again instead of sent frames for the old one."""
    subprocess.run(
        ["ip", "-n", name, "neigh", "flush", "dev", TAP],
        check=True,
        capture_output=True,
        timeout=10,
    )


def gateway_sockets(name: str) -> tuple[socket.socket, socket.socket]:
    """New gateway sockets in the existing namespace ``name`` (a restarted gateway)."""
    return in_namespace(_gateway_sockets, enter=name)


def exists(name: str) -> bool:
    return ns_path(name).exists()


def delete(name: str) -> None:
    """Unmount and remove the namespace (idempotent). The kernel frees it once nothing
    (QEMU's tap, the gateway's sockets) holds it any more."""
    path = ns_path(name)
    libc = _libc()
    if libc.umount2(bytes(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def list_names(tag: str) -> list[str]:
    """This node's namespaces (other nodes' on the same host have other tags)."""
    prefix = f"pal-{tag}-"
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep(tag: str, keep: set[str]) -> list[str]:
    """Delete this node's namespaces not in ``keep`` (leftovers of VMs that died with a
    previous node process). Returns the names removed."""
    gone = []
    for name in list_names(tag):
        if name in keep:
            continue
        try:
            delete(name)
            gone.append(name)
        except OSError:
            continue
    return gone


def claim(tag: str, data_dir: Path) -> None:
    """Record that ``tag``'s namespaces belong to ``data_dir``, so that once that data dir is
    deleted (and no node of it will ever sweep them) another node removes them."""
    OWNERS_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    (OWNERS_DIR / tag).write_text(str(Path(data_dir).resolve()))


def sweep_orphans() -> list[str]:
    """Delete the namespaces of every tag whose data dir no longer exists, and its record.
    Tags without a record (made by an older Pal, or not Pal's) are left alone."""
    gone: list[str] = []
    try:
        records = [r for r in OWNERS_DIR.iterdir() if _TAG.match(r.name)]
    except FileNotFoundError:
        return gone
    for rec in records:
        try:
            data_dir = Path(rec.read_text())
        except OSError:
            continue
        if data_dir.is_dir() and node_tag(data_dir) == rec.name:
            continue
        gone += sweep(rec.name, set())
        if not list_names(rec.name):
            rec.unlink(missing_ok=True)
    return gone


def guest_mac(seed: bytes) -> str:
    """A locally administered unicast MAC for one guest incarnation."""
    b = bytearray(hashlib.sha256(seed).digest()[:6])
    b[0] = (b[0] & 0xFC) | 0x02
    return ":".join(f"{x:02x}" for x in b)
