"""Brokered secrets without VMs: the header rules, the gateway's TLS terminator against a
real local HTTPS server (many connections in a row, rotation in between), the guest's CA
installation, and how the control plane stores, opens and rotates values."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import ssl
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import InvalidRequest, NotFound
from pal.guest.system import CA_BEGIN, install_ca
from pal.manager.vmnet import Brokered, VmNetworking
from pal.network import broker
from pal.network.ca import Issuer, new_ca
from pal.network.gateway import Gateway
from pal.network.names import NameTable
from pal.network.policy import Policy
from pal.network.relay import Connection, GuestSide
from pal.network.vm_gateway import VmGateway
from pal.scheduler.brokering import SecretBroker
from pal.secretbox import SecretUnreadable
from pal.spec import AgentSpec
from pal.store import Store
from pal.wire.models import TenantCa

LOCAL = ipaddress.ip_address("127.0.0.1")
RULE = {
    "name": "KEY",
    "value": "REAL-VALUE",
    "placeholder": "PH-123",
    "hosts": ["api.test", "*.wild.test"],
    "header": "Authorization",
    "format": "Bearer {value}",
}


def test_rules_match_hosts_and_rewrite_headers() -> None:
    rules = broker.Rules([RULE])
    assert [r.name for r in rules.for_host("api.test")] == ["KEY"]
    assert rules.for_host("a.wild.test") and not rules.for_host("wild.test")
    assert not rules.for_host("other.test") and not rules.for_host(None)
    out = rules.rewrite("api.test", [(b"Authorization", b"token PH-123"), (b"X-Other", b"k=PH-123;")])
    # The value goes into the configured header only (issue 23 item 2): a placeholder in any
    # other header (one an upstream may reflect) stays the placeholder.
    assert out == [(b"X-Other", b"k=PH-123;"), (b"Authorization", b"Bearer REAL-VALUE")]
    # No header named: the placeholder is replaced in the credential headers only.
    sub = broker.Rules([{**RULE, "header": None}])
    assert sub.rewrite("api.test", [(b"X-Api-Key", b"PH-123")]) == [(b"X-Api-Key", b"REAL-VALUE")]
    assert sub.rewrite("api.test", [(b"authorization", b"Bearer PH-123")]) == [
        (b"authorization", b"Bearer REAL-VALUE")
    ]
    for reflected in (b"Host", b"Origin", b"Referer", b"X-Request-Id", b"X-Org"):
        assert sub.rewrite("api.test", [(reflected, b"PH-123")]) == [(reflected, b"PH-123")]
    # Another host: nothing changes.
    assert rules.rewrite("other.test", [(b"X", b"PH-123")]) == [(b"X", b"PH-123")]


def _server_ctx(issuer: Issuer, host: str) -> ssl.SSLContext:
    chain, key = issuer.leaf(host)
    fd = os.memfd_create("t")
    os.write(fd, (chain + key).encode())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    os.close(fd)
    return ctx


async def test_gateway_brokers_each_connection_and_rotation_applies() -> None:
    """A real HTTPS upstream with its own CA; the client trusts only the tenant CA. Many
    connections in a row, a rotation between two requests on one connection."""
    up_ca, up_key = new_ca("upstream")
    seen: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while head := await r.readuntil(b"\r\n\r\n"):
                seen.append(head)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    srv = await asyncio.start_server(
        upstream, "127.0.0.1", 0, ssl=_server_ctx(Issuer(up_ca, up_key), "api.test")
    )
    port = srv.sockets[0].getsockname()[1]
    gw = Gateway()
    gw.tls.configure(up_ca)
    tenant_ca, tenant_key = new_ca("tenant")
    vm = VmGateway(
        gw,
        "vm-t",
        Policy("open"),
        {},
        NameTable(),
        broker.Rules([RULE]),
        {"cert": tenant_ca, "key": tenant_key},
    )
    gw.vms["vm-t"] = vm
    loop = asyncio.get_running_loop()
    made: asyncio.Queue[Connection] = asyncio.Queue()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        side.conn = Connection(gw.next_id(), transport, ("127.0.0.1", port))
        side.conn.state, side.conn.name = "connecting", "api.test"
        made.put_nowait(side.conn)

    guests = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    gport = guests.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cadata=tenant_ca)
    for i in range(12):
        opening = loop.create_task(
            asyncio.open_connection("127.0.0.1", gport, ssl=client_ctx, server_hostname="api.test")
        )
        conn = await made.get()
        assert await vm._starts_with_tls(conn)
        await vm._broker(conn, "api.test", port, [LOCAL], vm.policy)
        r, w = await asyncio.wait_for(opening, 30)
        w.write(b"GET / HTTP/1.1\r\nHost: api.test\r\nAuthorization: PH-123\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"ok"), 30)).endswith(b"ok")
        if i == 5:  # rotate: the next request on this very connection gets the new value
            await gw.handle({"op": "brokered", "vmId": "vm-t", "brokered": [{**RULE, "value": "NEW"}]}, [])
            w.write(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"ok"), 30)
        w.close()
    assert all(b"Authorization: Bearer REAL-VALUE" in h for h in seen[:6])
    assert all(b"Authorization: Bearer NEW" in h for h in seen[6:])
    assert len(seen) == 13 and not any(b"PH-123" in h for h in seen)
    guests.close()
    srv.close()


@pytest.mark.parametrize("why", ["an unknown CA", "another host's certificate"])
async def test_an_upstream_whose_certificate_does_not_verify_never_gets_the_value(why: str) -> None:
    """The gateway verifies the upstream before it sends a byte of the request: a server
    with a certificate it does not trust (or one for another name) gets no request at all,
    so the value is never sent, and the guest's connection ends without an answer."""
    up_ca, up_key = new_ca("upstream")
    seen: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            seen.append(await r.readuntil(b"\r\n\r\n"))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    leaf_host = "api.test" if why == "an unknown CA" else "other.test"
    srv = await asyncio.start_server(
        upstream, "127.0.0.1", 0, ssl=_server_ctx(Issuer(up_ca, up_key), leaf_host)
    )
    port = srv.sockets[0].getsockname()[1]
    gw = Gateway()
    tenant_ca, tenant_key = new_ca("tenant")
    vm = VmGateway(
        gw,
        "vm-t",
        Policy("open"),
        {},
        NameTable(),
        broker.Rules([RULE]),
        {"cert": tenant_ca, "key": tenant_key},
    )
    loop = asyncio.get_running_loop()
    made: asyncio.Queue[Connection] = asyncio.Queue()

    def on_made(side: GuestSide, transport: asyncio.Transport) -> None:
        side.conn = Connection(gw.next_id(), transport, ("127.0.0.1", port))
        side.conn.state, side.conn.name = "connecting", "api.test"
        made.put_nowait(side.conn)

    guests = await loop.create_server(lambda: GuestSide(on_made), "127.0.0.1", 0)
    gport = guests.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cadata=tenant_ca)

    async def request(trusted: str | None) -> bytes:
        """The guest's request through the gateway (upstream CA trusted: ``trusted``)."""
        gw.tls.configure(trusted)
        opening = loop.create_task(
            asyncio.open_connection("127.0.0.1", gport, ssl=client_ctx, server_hostname="api.test")
        )
        conn = await made.get()
        assert await vm._starts_with_tls(conn)
        await vm._broker(conn, "api.test", port, [LOCAL], vm.policy)
        r, w = await asyncio.wait_for(opening, 30)
        w.write(b"GET / HTTP/1.1\r\nHost: api.test\r\nAuthorization: PH-123\r\n\r\n")
        try:
            return await asyncio.wait_for(r.readuntil(b"ok"), 30)
        except asyncio.IncompleteReadError as exc:  # the end, without a whole answer
            return exc.partial
        except (ConnectionError, ssl.SSLError):
            return b""
        finally:
            w.close()

    # Without PAL_EGRESS_CA_BUNDLE naming its CA (or with a certificate for another name),
    # the upstream does not verify.
    assert await request(None if why == "an unknown CA" else up_ca) == b"", "no answer reaches the guest"
    assert seen == [], "the upstream got no request, so never the value"
    if why == "an unknown CA":  # the same server once its CA is trusted: the value goes through
        assert (await request(up_ca)).endswith(b"ok")
        assert len(seen) == 1 and b"Authorization: Bearer REAL-VALUE" in seen[0]
    guests.close()
    srv.close()


def test_install_ca_marks_one_block_and_points_clients_at_it(tmp_path: Path) -> None:
    bundle = tmp_path / "certs" / "ca-certificates.crt"
    bundle.parent.mkdir()
    bundle.write_text("SYSTEM CERTS\n")
    pem, _ = new_ca("t")
    env = install_ca(pem, bundles=(str(bundle),), ca_file=str(tmp_path / "certs" / "pal.pem"))
    env = install_ca(pem, bundles=(str(bundle),), ca_file=str(tmp_path / "certs" / "pal.pem"))  # again
    text = bundle.read_text()
    assert text.startswith("SYSTEM CERTS\n") and text.count(CA_BEGIN) == 1 and pem in text
    assert env == {
        "SSL_CERT_FILE": str(bundle),
        "REQUESTS_CA_BUNDLE": str(bundle),
        "NODE_EXTRA_CA_CERTS": str(tmp_path / "certs" / "pal.pem"),
    }
    assert ssl.create_default_context(cafile=str(bundle))  # still a valid bundle


def test_secret_broker_seals_opens_and_rotates(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    store = Store.open(settings)
    b = SecretBroker(settings, store)
    spec = AgentSpec.model_validate(
        {"secrets": {"K": {"value": "value-one", "brokered": {"hosts": ["api.test"]}}, "P": "plain"}}
    )
    stored = b.store_form("t-1", spec.secrets)
    assert "value-one" not in repr(stored) and "plain" not in repr(stored)
    env = b.env("t-1", stored)
    assert env["P"] == "plain" and env["K"] == stored["K"]["placeholder"]
    [rule] = b.rules("t-1", stored)
    assert (rule.value, rule.hosts, rule.format) == ("value-one", ["api.test"], "{value}")
    with pytest.raises(Exception, match="does not open"):
        b.rules("t-2", stored)  # bound to its tenant
    new = b.rotated("t-1", stored, "K", "v2")
    assert b.rules("t-1", new)[0].value == "v2" and new["K"]["placeholder"] == stored["K"]["placeholder"]
    with pytest.raises(InvalidRequest):
        b.rotated("t-1", stored, "P", "x")
    with pytest.raises(NotFound):
        b.rotated("t-1", stored, "NOPE", "x")
    store.close()


def test_replicas_on_different_machines_share_each_tenants_ca_through_the_store(
    tmp_path: Path, db_url: str
) -> None:
    """Two control-plane replicas with data dirs of their own (two machines) and one secrets
    key file (PAL_SECRETS_KEY_FILE, the same on each): whichever builds a VM's spawn
    request, its guest trusts the one CA the gateways sign with. The key is sealed."""
    key_file = tmp_path / "shared" / "secrets.key"
    replicas = []
    for name in ("cp-1", "cp-2"):
        settings = Settings(data_dir=tmp_path / name, database_url=db_url, secrets_key_file=key_file)
        replicas.append(SecretBroker(settings, Store.open(settings)))
    one, two = replicas
    tenant, _ = one.store.create_tenant("acme", 2)
    ca = one.tenant_ca(tenant.id)
    assert two.tenant_ca(tenant.id) == ca
    assert one.tenant_ca(tenant.id) == ca  # made once
    cert, sealed = one.store.tenant_ca(tenant.id) or ("", "")
    assert cert == ca.cert and "PRIVATE KEY" not in sealed and ca.key not in sealed
    assert "PRIVATE KEY" in ca.key
    assert not (tmp_path / "cp-1" / "keys" / "tenant-ca").exists()  # nothing per machine
    with pytest.raises(SecretUnreadable):  # a CA key opens as nothing else
        one.box.open(sealed, tenant.id)
    other_key = Settings(data_dir=tmp_path / "cp-3", database_url=db_url)
    with pytest.raises(SecretUnreadable):  # a replica with another secrets key cannot use it
        SecretBroker(other_key, one.store).tenant_ca(tenant.id)
    with pytest.raises(InvalidRequest):
        one.tenant_ca("../evil")
    with pytest.raises(NotFound):
        one.tenant_ca("t-nobody")
    for b in replicas:
        b.store.close()


def test_a_ca_an_older_pal_kept_in_a_file_is_moved_into_the_store(tmp_path: Path) -> None:
    """Guests already trust the CA an older Pal made: it stays that tenant's CA."""
    settings = Settings(data_dir=tmp_path)
    store = Store.open(settings)
    tenant, _ = store.create_tenant("acme", 2)
    cert, key = new_ca(tenant.id)
    legacy = tmp_path / "keys" / "tenant-ca"
    legacy.mkdir(parents=True)
    (legacy / f"{tenant.id}.pem").write_text(cert)
    (legacy / f"{tenant.id}.key").write_text(key)
    assert SecretBroker(settings, store).tenant_ca(tenant.id) == TenantCa(cert=cert, key=key)
    (legacy / f"{tenant.id}.key").unlink()
    (legacy / f"{tenant.id}.pem").unlink()
    assert SecretBroker(settings, store).tenant_ca(tenant.id) == TenantCa(cert=cert, key=key)
    store.close()


def test_a_nodes_record_of_brokered_secrets_is_sealed_and_bound_to_its_vm(tmp_path: Path) -> None:
    """What a node writes in a VM's state.json (to give a restarted gateway the secrets
    again) holds neither the real value nor the CA's key in clear; it opens for that VM
    only; a record in clear from an older Pal still reads."""
    net = VmNetworking(Settings(data_dir=tmp_path))
    ca = {"cert": "CERT-PEM", "key": "CA-KEY-PEM"}
    b = Brokered([RULE], ca)
    sealed = net.seal_brokered("vm-a", b)
    assert sealed is not None and "REAL-VALUE" not in sealed and "CA-KEY-PEM" not in sealed
    assert net.open_brokered("vm-a", sealed) == b
    with pytest.raises(SecretUnreadable):
        net.open_brokered("vm-b", sealed)
    assert (tmp_path / "keys" / "secrets.key").stat().st_mode & 0o777 == 0o600
    assert net.seal_brokered("vm-a", Brokered()) is None and net.open_brokered("vm-a", None) == Brokered()
    assert net.open_brokered("vm-a", [RULE], ca) == b
