"""Which destination addresses are internal: the one rule behind PAL_EGRESS_ALLOW_INTERNAL.

Internal: everything not globally routable (loopback, link-local with 169.254.169.254,
RFC 1918, CGNAT, ULA, multicast, the synthetic range, ...) and the host's own addresses.
An IPv6 address that carries an IPv4 address is judged by that address too, because a
translator or tunnel on the path delivers it there: IPv4-mapped (``::ffff:a.b.c.d``) and
IPv4-compatible (``::a.b.c.d``) addresses, NAT64 (``64:ff9b::/96``, RFC 6052), 6to4
(``2002::/16``) and Teredo (``2001::/32``, server and client). The NAT64 local-use prefix
(``64:ff9b:1::/48``, RFC 8215) is internal outright: it only reaches this site's own
translators, which may embed the IPv4 address at any of RFC 6052's positions.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")


def unmapped(a: Address) -> Address:
    """An IPv4-mapped IPv6 address is its IPv4 address (a dual-stack socket goes there)."""
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def embedded_ipv4(a: Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address delivers to (none for a plain one)."""
    if not isinstance(a, ipaddress.IPv6Address):
        return ()
    if a.ipv4_mapped is not None:
        return (a.ipv4_mapped,)
    n = int(a)
    low = ipaddress.IPv4Address(n & 0xFFFFFFFF)
    if n >> 32 == 0 and n > 1:  # IPv4-compatible (:: and ::1 are themselves)
        return (low,)
    if a in NAT64_WELL_KNOWN or a in NAT64_LOCAL_USE:
        return (low,)
    if a.sixtofour is not None:
        return (a.sixtofour,)
    if a.teredo is not None:
        return a.teredo
    return ()


def _plainly_internal(a: Address, host: Collection[Address]) -> bool:
    return not a.is_global or a.is_multicast or a in host or a in NAT64_LOCAL_USE


def internal_views(addr: Address, host: Collection[Address] = ()) -> list[Address]:
    """The forms of ``addr`` that make it internal (empty: it is not): the address itself
    and/or the IPv4 addresses it carries. An operator's exception must cover each."""
    a = unmapped(addr)
    views: list[Address] = [a] if _plainly_internal(a, host) else []
    views += [v4 for v4 in embedded_ipv4(a) if _plainly_internal(v4, host)]
    return views


def is_internal(addr: Address, host: Collection[Address] = ()) -> bool:
    return bool(internal_views(addr, host))
