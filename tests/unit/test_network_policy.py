"""Egress policy: the entry grammar (pal/spec.py) and the matcher (pal/network/policy.py)."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from pal.network.policy import INTERNAL_RULE, InternalGuard, Policy, parse_static_names
from pal.spec import (
    MAX_EGRESS_ENTRIES,
    AgentSpec,
    EgressAllow,
    EgressDeny,
    EgressUpdate,
    egress_from_json,
    egress_to_json,
    parse_egress_default,
    parse_entry,
)

ip = ipaddress.ip_address


@pytest.mark.parametrize(
    ("raw", "text", "port", "domain", "wildcard", "net"),
    [
        ("pypi.org", "pypi.org", None, "pypi.org", False, None),
        ("PyPI.org.", "pypi.org", None, "pypi.org", False, None),
        ("*.githubusercontent.com", "*.githubusercontent.com", None, "githubusercontent.com", True, None),
        ("api.test:8443", "api.test:8443", 8443, "api.test", False, None),
        ("1.2.3.4", "1.2.3.4", None, None, False, "1.2.3.4/32"),
        ("1.2.3.4:443", "1.2.3.4:443", 443, None, False, "1.2.3.4/32"),
        ("10.0.0.0/8", "10.0.0.0/8", None, None, False, "10.0.0.0/8"),
        ("10.1.2.3/8:22", "10.0.0.0/8:22", 22, None, False, "10.0.0.0/8"),
        ("2001:db8::1", "2001:db8::1", None, None, False, "2001:db8::1/128"),
        ("2001:db8::/32", "2001:db8::/32", None, None, False, "2001:db8::/32"),
        ("[2001:db8::1]:443", "[2001:db8::1]:443", 443, None, False, "2001:db8::1/128"),
    ],
)
def test_entries_parse_and_normalise(
    raw: str, text: str, port: int | None, domain: str | None, wildcard: bool, net: str | None
) -> None:
    e = parse_entry(raw)
    assert (e.text, e.port, e.domain, e.wildcard) == (text, port, domain, wildcard)
    assert (str(e.network) if e.network else None) == net


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "bad entry!",
        "a..b",
        "-x.com",
        "x.com:0",
        "x.com:65536",
        "x.com:http",
        "1.2.3.400",
        "1.2.3",
        "[1.2.3.4]:80",
        "*.",
        "*",
        "exa_mple.com",
        "a" * 64 + ".com",
        "x.123",
    ],
)
def test_malformed_entries_are_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_entry(bad)
    assert repr(bad) in str(err.value) or bad == ""


def test_agent_spec_egress_shapes_and_errors() -> None:
    assert AgentSpec.model_validate({}).egress is None  # the server default applies
    assert AgentSpec.model_validate({"egress": "open"}).egress == "open"
    allow = AgentSpec.model_validate({"egress": {"allow": ["API.test:8080"]}}).egress
    assert isinstance(allow, EgressAllow) and allow.allow == ["api.test:8080"]
    deny = AgentSpec.model_validate({"egress": {"deny": ["10.0.0.0/8"]}}).egress
    assert isinstance(deny, EgressDeny)
    for body, says in [
        ({"egress": "bogus"}, "egress must be"),
        ({"egress": {"allow": ["ok.com", "not ok"]}}, "'not ok'"),
        ({"egress": {"allow": ["a.com"], "deny": ["b.com"]}}, "one key"),
        ({"egress": {"allow": ["x.com"] * (MAX_EGRESS_ENTRIES + 1)}}, f"at most {MAX_EGRESS_ENTRIES}"),
        ({"egress": {"allow": "x.com"}}, "list"),
    ]:
        with pytest.raises(ValidationError) as err:
            AgentSpec.model_validate(body)
        assert says in str(err.value)


def test_egress_round_trips_through_json() -> None:
    for e in ("none", "open", EgressAllow(allow=["a.com"]), EgressDeny(deny=["1.2.3.4:80"])):
        assert egress_from_json(egress_to_json(e)) == e
    assert EgressUpdate.model_validate({"egress": {"deny": ["x.org"]}}).egress == EgressDeny(deny=["x.org"])
    assert parse_egress_default(None) == "open"
    assert parse_egress_default("none") == "none"
    assert parse_egress_default('{"allow": ["pypi.org"]}') == EgressAllow(allow=["pypi.org"])
    with pytest.raises(ValueError, match="PAL_EGRESS_DEFAULT"):
        parse_egress_default("closed")


def test_none_and_open() -> None:
    none, open_ = Policy("none"), Policy("open")
    assert none.name_allowed("pypi.org")[0] is False
    assert none.decide("pypi.org", [ip("151.101.0.1")], 443).allowed is False
    assert open_.name_allowed("anything.example")[0] is True
    v = open_.decide(None, [ip("151.101.0.1")], 443)
    assert v.allowed and v.addresses == (ip("151.101.0.1"),)


def test_allow_list_matches_names_ports_wildcards_and_networks() -> None:
    p = Policy(EgressAllow(allow=["api.test:8080", "*.github.test", "151.101.0.0/16:443"]))
    a = [ip("203.0.113.7")]
    assert p.decide("api.test", a, 8080).allowed
    assert not p.decide("api.test", a, 8081).allowed  # port-bound rule
    assert p.decide("raw.github.test", a, 443).allowed  # wildcard: any subdomain
    assert not p.decide("github.test", a, 443).allowed  # ... but not the bare domain
    assert not p.decide("evil.test", a, 443).allowed
    assert p.decide(None, [ip("151.101.3.4")], 443).allowed
    assert not p.decide(None, [ip("151.101.3.4")], 80).allowed
    # a name not listed can still reach an allowed network, only at addresses inside it
    v = p.decide("cdn.test", [ip("151.101.1.1"), ip("8.8.8.8")], 443)
    assert v.allowed and v.addresses == (ip("151.101.1.1"),)
    assert p.name_allowed("api.test")[0] and p.name_allowed("x.github.test")[0]
    assert Policy(EgressAllow(allow=["api.test"])).name_allowed("evil.test")[0] is False


def test_an_allowed_name_without_a_port_is_http_and_https_only() -> None:
    """Issue 23 item 4: an entry without a port no longer allows every port."""
    p = Policy(EgressAllow(allow=["pypi.org", "*.github.test", "git.test:22"]))
    a = [ip("203.0.113.7")]
    for name, port in [("pypi.org", 80), ("pypi.org", 443), ("raw.github.test", 443), ("git.test", 22)]:
        assert p.decide(name, a, port).allowed, (name, port)
    for name, port in [("pypi.org", 22), ("pypi.org", 8080), ("raw.github.test", 25), ("git.test", 443)]:
        assert not p.decide(name, a, port).allowed, (name, port)
    # A deny entry without a port still denies every port.
    assert not Policy(EgressDeny(deny=["evil.test"])).decide("evil.test", a, 8443).allowed


def test_a_network_entry_makes_no_name_resolvable() -> None:
    """Issue 23 item 5: with a CIDR in an allow list, a name outside it does not resolve
    (its query would carry data to the host's resolver); listed names still do."""
    p = Policy(EgressAllow(allow=["api.test:8080", "151.101.0.0/16"]))
    assert p.name_allowed("api.test")[0]
    assert p.name_allowed("secret-data.attacker.test") == (False, "not in the allow list")
    assert p.decide(None, [ip("151.101.3.4")], 443).allowed  # the network by address, still


def test_what_a_connection_may_name_follows_the_policy() -> None:
    allow = Policy(EgressAllow(allow=["pypi.org", "151.101.0.0/16"]))
    assert allow.binds("pypi.org", 443) and not allow.binds(None, 443)
    assert not allow.binds("cdn.test", 443)  # allowed by its address: whatever it is called
    assert allow.host_permitted("pypi.org", 443) and not allow.host_permitted("evil.test", 443)
    deny = Policy(EgressDeny(deny=["evil.test"]))
    assert deny.binds(None, 80) and deny.binds("fine.test", 443)
    assert deny.host_permitted("fine.test", 80) and not deny.host_permitted("evil.test", 80)
    assert deny.host_permitted(None, 443) and not allow.host_permitted(None, 443)  # names nothing
    assert not Policy(EgressDeny(deny=["10.0.0.0/8"])).binds("x.test", 80)
    assert not Policy("open").binds("x.test", 80)


def test_deny_list_is_open_minus_entries() -> None:
    p = Policy(EgressDeny(deny=["evil.test", "*.ads.test:443", "198.51.100.0/24"]))
    a = [ip("203.0.113.7")]
    assert not p.decide("evil.test", a, 80).allowed
    assert not p.decide("x.ads.test", a, 443).allowed
    assert p.decide("x.ads.test", a, 80).allowed
    assert p.decide("fine.test", a, 443).allowed
    assert not p.decide(None, [ip("198.51.100.9")], 443).allowed
    v = p.decide("mixed.test", [ip("198.51.100.9"), ip("203.0.113.7")], 443)
    assert v.addresses == (ip("203.0.113.7"),)
    assert p.name_allowed("evil.test")[0] is False
    assert p.name_allowed("x.ads.test")[0] is True  # denied on one port only: still resolvable


def test_internal_addresses_need_the_operator() -> None:
    g = InternalGuard(host_addresses=[ip("203.0.113.50")])
    for internal in (
        "127.0.0.1",
        "169.254.169.254",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "198.18.0.5",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:127.0.0.1",
        "203.0.113.50",
    ):
        assert g.is_internal(ip(internal)), internal
        assert not g.permits(ip(internal), 80), internal
    assert not g.is_internal(ip("151.101.0.1")) and g.permits(ip("151.101.0.1"), 80)
    g2 = InternalGuard(["127.0.0.2", "10.0.0.0/8:5432"])
    assert g2.permits(ip("127.0.0.2"), 1234)
    assert not g2.permits(ip("127.0.0.1"), 1234)
    assert g2.permits(ip("10.9.9.9"), 5432) and not g2.permits(ip("10.9.9.9"), 22)
    with pytest.raises(ValueError, match="addresses or CIDRs"):
        InternalGuard(["metadata.test"])
    assert INTERNAL_RULE.startswith("internal")


def test_static_names() -> None:
    got = parse_static_names("api.test=127.0.0.2, API.test=127.0.0.3,v6.test=[::1]")
    assert got == {"api.test": [ip("127.0.0.2"), ip("127.0.0.3")], "v6.test": [ip("::1")]}
    with pytest.raises(ValueError, match="name=ip"):
        parse_static_names("api.test")
    with pytest.raises(ValueError, match="bogus"):
        parse_static_names("api.test=bogus")
