"""Issue 23 item 5: under an allow list with a CIDR entry, a name the list does not name is
not resolved, and no query for it leaves the gateway (dnspython on the wire)."""

from __future__ import annotations

import asyncio
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype

from pal.network.gateway import Gateway
from pal.network.lookups import Found
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.vm_gateway import VmGateway
from pal.spec import EgressAllow


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: object) -> None:
        self.sent.append(data)


async def ask(vm: VmGateway, name: str) -> dns.message.Message:
    tr = _Transport()
    vm.dns_query(tr, dns.message.make_query(name, dns.rdatatype.A).to_wire(), ("10.0.2.15", 5353))  # type: ignore[arg-type]
    deadline = asyncio.get_running_loop().time() + 60  # a hang guard, not a speed bound
    while not tr.sent:
        assert asyncio.get_running_loop().time() < deadline, "no answer"
        await asyncio.sleep(0.002)
    return dns.message.from_wire(tr.sent[0])


async def test_a_cidr_entry_sends_no_other_name_to_the_resolver() -> None:
    gw = Gateway()
    gw.configure("api.test=151.101.0.1,other.test=151.101.0.2", [])  # host DNS on, as by default
    asked: list[str] = []
    lookup = gw.resolver.lookup

    async def counting(name: str, slots: Any = None) -> Found:
        asked.append(name)
        return await lookup(name, slots)

    gw.resolver.lookup = counting  # type: ignore[method-assign]
    vm = VmGateway(gw, "vm-1", Policy(EgressAllow(allow=["api.test", "151.101.0.0/16"])), {}, NameTable())
    assert (await ask(vm, "api.test")).rcode() == dns.rcode.NOERROR
    for name in ("other.test", "c2VjcmV0.exfil.example"):
        assert (await ask(vm, name)).rcode() == dns.rcode.NXDOMAIN
    assert asked == ["api.test"], "only the listed name was looked up"
    rules = {e["name"]: e["rule"] for e in gw.events.since(0)}
    assert rules == {"other.test": "not in the allow list", "c2vjcmv0.exfil.example": "not in the allow list"}
