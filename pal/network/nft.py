"""The nftables rules inside one VM's network namespace, applied through libnftables.

The rules live in the VM's own namespace only (nothing on the host's interfaces):
- every TCP segment from the tap is redirected to the gateway's listener (the gateway
  reads the destination the guest asked for with SO_ORIGINAL_DST);
- UDP to port 53, whatever the server address, goes to the gateway's DNS socket;
- everything else (other UDP, ICMP, IPv6, spoofed sources) is dropped;
- new connections and DNS packets are rate-limited per VM, so a flooding guest slows only
  itself;
- replies to connections the node opens from the namespace into the guest (ports: the
  host reaching a server in the guest) come back in; the guest can open nothing else here;
- a TCP segment of a connection this namespace never saw (a guest restored from a snapshot
  with an open connection) is answered with a reset, so the guest sees ECONNRESET, not a hang.

libnftables is called in-process (ctypes) instead of `nft -f`: 1-2 ms instead of ~15 ms
for the fork+exec (docs/network.md has the measurements). The calling thread's network
namespace is the one changed.
"""

from __future__ import annotations

import ctypes
import functools

from pal.errors import Unavailable

# Per-VM rates, enforced in the VM's namespace before any packet reaches the gateway.
SYN_RATE_PER_S = 100  # new TCP connections per second (burst SYN_BURST)
SYN_BURST = 200
DNS_RATE_PER_S = 100  # DNS packets per second (burst DNS_BURST)
DNS_BURST = 200

TABLE = "pal"


def ruleset(*, tap: str, guest_net: str, gateway_port: int, dns_port: int) -> str:
    """The whole table for one VM namespace, for a fresh namespace (replacing a table with
    `delete table` costs ~10 ms of kernel synchronisation; a new namespace has none)."""
    return f"""
table inet {TABLE} {{
  chain screen {{
    type filter hook prerouting priority raw; policy drop;
    iifname "lo" accept
    iifname != "{tap}" drop
    meta nfproto ipv6 drop
    ip saddr != {guest_net} drop
    tcp flags & (fin|syn|rst|ack) == syn \\
      limit rate over {SYN_RATE_PER_S}/second burst {SYN_BURST} packets drop
    meta l4proto tcp accept
    udp dport 53 limit rate over {DNS_RATE_PER_S}/second burst {DNS_BURST} packets drop
    udp dport 53 accept
  }}
  chain to_gateway {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{tap}" meta l4proto tcp redirect to :{gateway_port}
    iifname "{tap}" udp dport 53 redirect to :{dns_port}
  }}
  chain local_in {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related ct direction reply accept
    tcp dport {gateway_port} tcp flags & (fin|syn|rst|ack) != syn ct state new reject with tcp reset
    tcp dport {gateway_port} accept
    udp dport {dns_port} accept
  }}
}}
"""


class _Lib:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libnftables.so.1")
        except OSError as exc:
            raise Unavailable(f"libnftables is missing ({exc}): install the nftables package") from exc
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        self.lib = lib

    def run(self, commands: str) -> str:
        """Run nft commands in the calling thread's network namespace; returns their output."""
        ctx = self.lib.nft_ctx_new(0)
        if not ctx:
            raise Unavailable("nft_ctx_new failed")
        try:
            self.lib.nft_ctx_buffer_error(ctx)
            self.lib.nft_ctx_buffer_output(ctx)
            rc = self.lib.nft_run_cmd_from_buffer(ctx, commands.encode())
            if rc != 0:
                err = (self.lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
                raise Unavailable(f"nftables refused the rules: {err.strip()[-500:]}")
            return (self.lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
        finally:
            self.lib.nft_ctx_free(ctx)


@functools.cache
def _lib() -> _Lib:
    return _Lib()


def run(commands: str) -> str:
    return _lib().run(commands)


def available() -> None:
    """Raise Unavailable when libnftables cannot be loaded."""
    _lib()
