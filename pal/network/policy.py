"""The egress matcher: one VM's policy, compiled, deciding names and connections.

Decisions:
- ``name_allowed(name)``: may this name be resolved at all (DNS)? A name is resolvable when
  some connection *by that name* could be allowed: under an allow list, a domain entry
  matches it (network entries never make a name resolvable: otherwise every name, and with
  it ``<data>.attacker.example``, would reach the host's resolver); under a deny list, it
  is not denied on every port.
- ``decide(name, addresses, port)``: which of the candidate addresses may this connection
  go to? ``name`` is what the guest asked for (its DNS query, TLS SNI or HTTP Host) or None
  for a bare IP; ``addresses`` are the addresses the gateway resolved itself for that name
  (or the bare IP). Domain rules match the name, network rules each address.
- Internal destinations (not globally routable, or the host's own addresses) are removed
  afterwards under every policy unless the operator's PAL_EGRESS_ALLOW_INTERNAL lists
  them (:class:`InternalGuard`); a tenant's policy can never reach them.
- ``host_permitted(name, port)`` / ``binds(name, port)``: what a connection may *say* (TLS
  SNI, HTTP Host) once it was allowed by its name (namecheck.py).

An allow-list domain entry without a port allows :data:`DEFAULT_NAME_PORTS` only (HTTP and
HTTPS); other ports must be listed. A deny-list entry without a port denies every port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from pal.network import internal
from pal.spec import Egress, EgressAllow, EgressEntry, parse_entry

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

NONE_RULE = "egress none"
NOT_ALLOWED_RULE = "not in the allow list"
INTERNAL_RULE = "internal address (PAL_EGRESS_ALLOW_INTERNAL)"
DEFAULT_NAME_PORTS = (80, 443)  # an allow-list name entry without a port


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    addresses: tuple[Address, ...] = ()
    rule: str = ""  # the refusing rule (or the allowing one, for logs)


def _domain_matches(entry: EgressEntry, name: str) -> bool:
    assert entry.domain is not None
    if entry.wildcard:
        return name.endswith("." + entry.domain)
    return name == entry.domain


def _port_ok(entry: EgressEntry, port: int | None) -> bool:
    return entry.port is None or port is None or entry.port == port


def _name_port_ok(entry: EgressEntry, port: int | None) -> bool:
    """An allow-list name entry: its port, or HTTP and HTTPS when it names none."""
    if port is None:
        return True
    return port == entry.port if entry.port is not None else port in DEFAULT_NAME_PORTS


def _unmapped(a: Address) -> Address:
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


class Policy:
    def __init__(self, egress: Egress) -> None:
        self.egress = egress
        self.mode: str
        if isinstance(egress, str):
            self.mode = egress
            self.entries: list[EgressEntry] = []
        else:
            self.mode = "allow" if isinstance(egress, EgressAllow) else "deny"
            texts = egress.allow if isinstance(egress, EgressAllow) else egress.deny
            self.entries = [parse_entry(t) for t in texts]
        self.domains = [e for e in self.entries if e.domain is not None]
        self.networks = [e for e in self.entries if e.network is not None]

    def domain_rule(self, name: str | None, port: int | None) -> EgressEntry | None:
        if name is None:
            return None
        port_ok = _name_port_ok if self.mode == "allow" else _port_ok
        for e in self.domains:
            if _domain_matches(e, name) and port_ok(e, port):
                return e
        return None

    def host_permitted(self, name: str | None, port: int) -> bool:
        """May a connection to ``port`` name ``name`` (in its SNI or Host; None: it names
        nothing, which an allow list's name rule cannot vouch for)?"""
        if self.mode == "allow":
            return self.domain_rule(name, port) is not None
        if self.mode == "deny":
            return self.domain_rule(name, port) is None
        return self.mode == "open"

    def binds(self, name: str | None, port: int) -> bool:
        """Must what this allowed connection says (SNI, every Host) be checked? Under an
        allow list when a name rule allowed it (a network rule allows the address whatever
        it is called); under a deny list with name entries, always (a connection to an
        address not denied must not name a denied host)."""
        if self.mode == "allow":
            return self.domain_rule(name, port) is not None
        return self.mode == "deny" and bool(self.domains)

    def _net_rule(self, addr: Address, port: int | None) -> EgressEntry | None:
        a = _unmapped(addr)
        for e in self.networks:
            assert e.network is not None
            if a.version == e.network.version and a in e.network and _port_ok(e, port):
                return e
        return None

    def name_allowed(self, name: str) -> tuple[bool, str]:
        """Whether DNS may answer for ``name`` (port unknown yet)."""
        if self.mode == "none":
            return False, NONE_RULE
        if self.mode == "open":
            return True, "open"
        if self.mode == "allow":
            if self.domain_rule(name, None) is not None:
                return True, "allow"
            return False, NOT_ALLOWED_RULE
        for e in self.domains:  # deny: refused only when denied on every port
            if e.port is None and _domain_matches(e, name):
                return False, f"deny {e.text}"
        return True, "deny list"

    def decide(self, name: str | None, addresses: Iterable[Address], port: int) -> Verdict:
        addrs = tuple(addresses)
        if self.mode == "none":
            return Verdict(False, rule=NONE_RULE)
        if self.mode == "open":
            return Verdict(bool(addrs), addrs, "open")
        if self.mode == "allow":
            by_name = self.domain_rule(name, port)
            if by_name is not None:
                return Verdict(bool(addrs), addrs, f"allow {by_name.text}")
            ok = tuple(a for a in addrs if self._net_rule(a, port) is not None)
            if ok:
                rule = self._net_rule(ok[0], port)
                return Verdict(True, ok, f"allow {rule.text if rule else ''}")
            return Verdict(False, rule=NOT_ALLOWED_RULE)
        denied = self.domain_rule(name, port)
        if denied is not None:
            return Verdict(False, rule=f"deny {denied.text}")
        ok = tuple(a for a in addrs if self._net_rule(a, port) is None)
        if not ok and addrs:
            rule = self._net_rule(addrs[0], port)
            return Verdict(False, rule=f"deny {rule.text if rule else ''}")
        return Verdict(bool(ok), ok, "deny list")


class InternalGuard:
    """Which addresses are internal, and which of them the operator opened.

    Internal: see pal/network/internal.py (not globally routable, the host's own
    addresses, and IPv6 forms judged by the IPv4 address they carry). ``allowed`` entries
    come from PAL_EGRESS_ALLOW_INTERNAL (addresses or CIDRs, optionally with a port).
    """

    def __init__(self, allowed: Iterable[str] = (), host_addresses: Iterable[Address] = ()) -> None:
        self.allowed = [parse_entry(a) for a in allowed]
        for e in self.allowed:
            if e.network is None:
                raise ValueError(f"PAL_EGRESS_ALLOW_INTERNAL takes addresses or CIDRs, not {e.text!r}")
        self.host_addresses: frozenset[Address] = frozenset(_unmapped(a) for a in host_addresses)

    def is_internal(self, addr: Address) -> bool:
        return internal.is_internal(addr, self.host_addresses)

    def permits(self, addr: Address, port: int | None) -> bool:
        """May a connection go to ``addr``:``port`` as far as internal ranges go? Each form
        that makes it internal (itself, an IPv4 address it embeds) must be opened."""
        return all(self._opened(v, port) for v in internal.internal_views(addr, self.host_addresses))

    def _opened(self, a: Address, port: int | None) -> bool:
        for e in self.allowed:
            assert e.network is not None
            if a.version == e.network.version and a in e.network and _port_ok(e, port):
                return True
        return False


def parse_list(raw: str | None) -> list[str]:
    return [p.strip() for p in (raw or "").split(",") if p.strip()]


def parse_static_names(raw: str | None) -> dict[str, list[Address]]:
    """PAL_EGRESS_RESOLVE=name=ip[,name=ip...] (like curl --resolve): fixed answers that
    take precedence over the host's resolver. A name may be listed more than once."""
    out: dict[str, list[Address]] = {}
    for part in parse_list(raw):
        name, sep, ip = part.partition("=")
        if not sep:
            raise ValueError(f"PAL_EGRESS_RESOLVE entry {part!r} is not name=ip")
        try:
            addr = ipaddress.ip_address(ip.strip().strip("[]"))
        except ValueError as exc:
            raise ValueError(f"PAL_EGRESS_RESOLVE entry {part!r}: {exc}") from exc
        out.setdefault(name.strip().lower().rstrip("."), []).append(addr)
    return out
