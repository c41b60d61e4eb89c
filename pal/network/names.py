"""Synthetic DNS addresses: the gateway answers each allowed name with an address of its own
from 198.18.0.0/15 (RFC 2544's benchmarking range, never on the Internet), one per name
and VM. A connection to such an address names its destination exactly, which makes name
rules exact and lets `api.test` point at a server on the host's loopback (a guest
connecting to 127.0.0.1 would reach its own).

The table is part of the guest's state: a program may hold an address it resolved before
a pause or a fork. It is saved with every snapshot (net.json) and loaded on restore.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from typing import Any

SYNTHETIC_NET = ipaddress.IPv4Network("198.18.0.0/15")
MAX_NAMES = 4096  # per VM; past it the least recently used name gives up its address
_FIRST = int(SYNTHETIC_NET.network_address) + 1


def is_synthetic(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return addr.version == 4 and addr in SYNTHETIC_NET


class NameTable:
    def __init__(self, max_names: int = MAX_NAMES) -> None:
        self.max_names = max_names
        self._by_name: OrderedDict[str, ipaddress.IPv4Address] = OrderedDict()
        self._by_addr: dict[ipaddress.IPv4Address, str] = {}
        self._next = _FIRST

    def __len__(self) -> int:
        return len(self._by_name)

    def address(self, name: str) -> ipaddress.IPv4Address:
        """The address of ``name``, allocated on first use."""
        addr = self._by_name.get(name)
        if addr is not None:
            self._by_name.move_to_end(name)
            return addr
        if len(self._by_name) >= self.max_names:
            _, addr = self._by_name.popitem(last=False)
            del self._by_addr[addr]
        else:
            addr = ipaddress.IPv4Address(self._next)
            self._next += 1
        self._by_name[name] = addr
        self._by_addr[addr] = name
        return addr

    def name(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        if addr.version != 4:
            return None
        return self._by_addr.get(addr)  # type: ignore[arg-type]

    def to_json(self) -> list[list[str]]:
        return [[n, str(a)] for n, a in self._by_name.items()]

    @classmethod
    def from_json(cls, raw: Any, max_names: int = MAX_NAMES) -> NameTable:
        """Rebuild a saved table; malformed entries are skipped (it comes from a snapshot)."""
        t = cls(max_names)
        if not isinstance(raw, list):
            return t
        for item in raw[-max_names:]:
            try:
                name, addr_s = item
                addr = ipaddress.IPv4Address(addr_s)
            except (TypeError, ValueError):
                continue
            if not isinstance(name, str) or addr not in SYNTHETIC_NET or addr in t._by_addr:
                continue
            if name in t._by_name:
                continue
            t._by_name[name] = addr
            t._by_addr[addr] = name
            t._next = max(t._next, int(addr) + 1)
        if t._next > int(SYNTHETIC_NET.broadcast_address) - 1:
            t._next = _FIRST  # exhausted: only reuse by eviction from here on
        return t
