"""Issue 23 item 4: what a connection allowed by name says (TLS SNI, every HTTP Host) must
match that name. Pure logic here (pal/network/namecheck.py); the gateway with real VMs in
tests/adversarial/test_egress_names_and_secrets.py."""

from __future__ import annotations

import ssl

import pytest

from pal.network.namecheck import NameCheck, Refused


def check(port: int = 80, allowed: tuple[str, ...] = ("pypi.org",)) -> NameCheck:
    return NameCheck(port, lambda name: name in allowed)  # None (no name): refused, as allow lists do


def feed_all(c: NameCheck, data: bytes, step: int) -> bytes:
    """Feed ``data`` in pieces of ``step`` bytes; what went up."""
    return b"".join(c.feed(data[i : i + step]) for i in range(0, len(data), step))


def client_hello(sni: str) -> bytes:
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


GET = b"GET /simple/ HTTP/1.1\r\nHost: pypi.org\r\nUser-Agent: t\r\n\r\n"


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_keep_alive_requests_are_each_checked_however_the_bytes_arrive(step: int) -> None:
    post = b"POST /x HTTP/1.1\r\nHost: PyPI.org.:80\r\nContent-Length: 40\r\n\r\n" + b"b" * 40
    chunked = (
        b"POST /c HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"20\r\nGET / HTTP/1.1\r\nHost: evil.t\r\n\r\n\r\n0\r\nX-T: 1\r\n\r\n"
    )  # a body that looks like a request is a body
    ok = GET + post + chunked + b"\r\n" + GET
    c = check()
    assert feed_all(c, ok, step) == ok
    assert c.requests == 4
    with pytest.raises(Refused, match=r"evil\.test does not match") as err:
        feed_all(c, b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n", step)
    assert err.value.host == "evil.test"


def test_a_head_is_held_until_it_is_whole() -> None:
    c = check()
    assert c.feed(GET[:20]) == b""
    assert c.feed(GET[20:]) == GET


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"GET / HTTP/1.1\r\nHost: other.site\r\n\r\n", "does not match"),
        (b"GET http://other.site/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "other.site does not match"),
        (b"GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\n", "names no host"),
        (b"GET / HTTP/1.1\r\nHost: pypi.org\r\nHost: other.site\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n", "names no host"),
        (b"GET / HTTP/1.1\r\nHost: pypi.org\r\n other.site\r\n\r\n", "folded"),
        (b"GET / HTTP/1.1\r\nHost : pypi.org\r\n\r\n", "malformed header"),
        (b"CONNECT other.site:443 HTTP/1.1\r\nHost: pypi.org\r\n\r\n", "CONNECT"),
        (
            b"POST / HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "both",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            "other than chunked",
        ),
        (b"POST / HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 3, 4\r\n\r\n", "Content-Length"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "neither TLS nor HTTP"),
        (b"\x00\x00\x00\x08\x04\xd2\x16\x2f", "neither TLS nor HTTP"),
    ],
)
def test_what_cannot_be_told_apart_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(Refused, match=why):
        check().feed(raw)


def test_tls_sni_must_be_the_allowed_name() -> None:
    hello = client_hello("pypi.org")
    c = check(443)
    assert feed_all(c, hello, 100) == hello
    assert c.feed(b"\x17\x03\x03 anything encrypted") == b"\x17\x03\x03 anything encrypted"
    with pytest.raises(Refused, match=r"TLS SNI other\.site does not match"):
        feed_all(check(443), client_hello("other.site"), 100)
    with pytest.raises(Refused, match="names no host"):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        with pytest.raises(ssl.SSLWantReadError):
            ctx.wrap_bio(inc, out).do_handshake()  # no server_hostname: no SNI
        check(443).feed(out.read())


def test_under_a_deny_list_a_connection_that_names_nothing_is_judged_by_its_address() -> None:
    """``curl https://<ip>`` sends no SNI; an HTTP/1.0 client may send no Host."""
    deny = NameCheck(443, lambda name: name != "evil.test")
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        ctx.wrap_bio(inc, out, server_hostname="203.0.113.9").do_handshake()  # an IP: no SNI
    hello = out.read()
    assert deny.feed(hello) == hello
    deny = NameCheck(80, lambda name: name != "evil.test")
    assert deny.feed(b"GET / HTTP/1.0\r\n\r\n") == b"GET / HTTP/1.0\r\n\r\n"
    with pytest.raises(Refused, match="evil"):
        deny.feed(b"GET / HTTP/1.0\r\nHost: evil.test\r\n\r\n")


def test_other_protocols_pass_unchecked_only_on_ports_the_entry_names() -> None:
    pg_ssl_request = b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert check(5432).feed(pg_ssl_request) == pg_ssl_request  # at once: the client waits
    ssh = NameCheck(22, lambda _n: False)
    assert ssh.feed(b"SSH-2.0-OpenSSH_9.2\r\n") == b"SSH-2.0-OpenSSH_9.2\r\n"
    # HTTP on such a port is still checked.
    with pytest.raises(Refused, match="does not match"):
        check(8080).feed(b"GET / HTTP/1.1\r\nHost: other.site\r\n\r\n")


def test_an_upgrade_makes_the_connection_opaque_only_after_a_101() -> None:
    ws = b"GET /ws HTTP/1.1\r\nHost: pypi.org\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    c = check()
    assert c.feed(ws) == ws
    with pytest.raises(Refused, match="before the answer"):
        c.feed(b"\x81\x85frame")  # the guest may not send before the answer
    c = check()
    c.feed(ws)
    c.upstream(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    assert c.feed(b"\x81\x85 any frame, Host: other.site") == b"\x81\x85 any frame, Host: other.site"
    # Declined (no 101): the connection is HTTP again, checked as before.
    c = check()
    c.feed(ws)
    c.upstream(b"HTTP/1.1 426 Upgrade Required\r\n\r\n")
    with pytest.raises(Refused, match="does not match"):
        c.feed(b"GET / HTTP/1.1\r\nHost: other.site\r\n\r\n")
    # An Upgrade on a later request switches nothing here: what follows must be HTTP.
    c = check()
    c.feed(GET + ws)
    c.upstream(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    assert c.feed(b"\x81\x85frame") == b""  # nothing goes up ...
    with pytest.raises(Refused, match="request line"):
        c.feed(b"\r\n\r\n")  # ... and it is no request
