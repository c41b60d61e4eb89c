"""What an allowed connection says must match what it was allowed as: TLS SNI and HTTP Host.

A connection allowed by a name (``pypi.org``) goes to that name's addresses, which are often
a CDN's, shared with every other site on it. Without this check a guest reaches any of them
by sending ``Host: other-site`` on port 80 (on any request of a keep-alive connection) or
``other-site`` as the TLS SNI. :class:`NameCheck` reads the guest's bytes on their way up,
before they are sent, and raises :class:`Refused` when they name a host the policy does not
permit on that port:

- **TLS** (the first bytes are a handshake record): the ClientHello must carry an SNI that
  is permitted; nothing is checked after it (the rest is encrypted). An encrypted
  ClientHello (ECH) is judged by its outer SNI.
- **HTTP/1** (the first bytes are a request line): every request's ``Host`` (exactly one)
  and an absolute-form target's authority must be permitted; requests are framed
  (Content-Length, chunked) so each one on a keep-alive connection is read, and what
  servers disagree about (both framings, another transfer coding, folded header lines,
  ``CONNECT``) is refused. An ``Upgrade`` on the connection's first request makes the rest
  opaque once the upstream answers ``101``; the guest may send nothing before that answer
  (RFC 6455 and RFC 7540 clients wait for it).
- **Anything else** on HTTP's and HTTPS's ports (:data:`STRICT_PORTS`) is refused; on
  another port (one the entry names) a protocol that is neither is relayed unchecked.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from pal.network import sniff
from pal.network.names import is_synthetic
from pal.network.policy import DEFAULT_NAME_PORTS, Policy
from pal.network.relay import Connection

STRICT_PORTS = DEFAULT_NAME_PORTS  # only TLS or HTTP may be spoken here
MAX_HEAD = 64 * 1024  # request line + headers
MAX_CHUNK_LINE = 4096

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rb"^(" + _TOKEN + rb") (\S+) HTTP/1\.([01])$")
_METHOD_START = re.compile(rb"^[A-Z]{1,16}( |$)")
_HEADER = re.compile(rb"^(" + _TOKEN + rb"):[ \t]*(.*?)[ \t]*$")
_ABSOLUTE = re.compile(rb"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)")
_NAME = re.compile(r"^[a-z0-9.-]{1,253}$")
_CHUNK_SIZE = re.compile(rb"^([0-9A-Fa-f]{1,16})(;.*)?$")


class Refused(Exception):
    """The connection named a host it may not reach (or spoke so that it cannot be told)."""

    def __init__(self, reason: str, host: str | None = None) -> None:
        super().__init__(reason)
        self.host = host


def authority_name(raw: bytes) -> str | None:
    """The host name of a Host value or a URL authority (``name[:port]``, no userinfo);
    None for an IP literal in brackets (no name: judged like a missing one)."""
    if b"@" in raw:
        raise Refused("userinfo in a request's authority")
    if raw.startswith(b"["):
        return None
    host = raw.rsplit(b":", 1)[0] if raw.count(b":") == 1 else raw
    try:
        name = host.decode("ascii").strip().lower().rstrip(".")
    except UnicodeDecodeError:
        raise Refused("a non-ASCII requested host") from None
    if not _NAME.match(name):
        raise Refused(f"a malformed requested host {name[:80]!r}")
    return name


class _Head:
    """One request head, validated."""

    def __init__(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        m = _REQUEST_LINE.match(lines[0])
        if m is None:
            raise Refused("not an HTTP/1 request line")
        method, target, minor = m.group(1), m.group(2), m.group(3)
        if method.upper() == b"CONNECT":
            raise Refused("CONNECT through an allowed name")
        hosts: list[bytes] = []
        lengths: set[bytes] = set()
        codings: list[bytes] = []
        self.upgrade = False
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t"):
                raise Refused("a folded header line")
            h = _HEADER.match(line)
            if h is None:
                raise Refused("a malformed header line")
            key, value = h.group(1).lower(), h.group(2)
            if key == b"host":
                hosts.append(value)
            elif key == b"content-length":
                lengths.update(v.strip() for v in value.split(b","))
            elif key == b"transfer-encoding":
                codings.extend(v.strip().lower() for v in value.split(b",") if v.strip())
            elif key == b"upgrade":
                self.upgrade = True
        if len(hosts) > 1:
            raise Refused("a request with more than one Host header")
        self.names = [authority_name(hosts[0]) if hosts else None]
        absolute = _ABSOLUTE.match(target)
        if absolute is not None:
            self.names.append(authority_name(absolute.group(1)))
        if codings and lengths:
            raise Refused("both Content-Length and Transfer-Encoding")
        self.chunked = bool(codings)
        if codings and (codings != [b"chunked"] or minor == b"0"):
            raise Refused("a transfer coding other than chunked")
        if len(lengths) > 1 or any(not v.isdigit() or len(v) > 18 for v in lengths):
            raise Refused("an invalid Content-Length")
        self.length = int(next(iter(lengths))) if lengths else 0


class NameCheck:
    """The guest's bytes of one connection, checked before they go up (see the module)."""

    def __init__(self, port: int, permitted: Callable[[str | None], bool]) -> None:
        self.strict = port in STRICT_PORTS
        self.permitted = permitted
        # first | head | body | chunk-size | chunk-data | chunk-end | trailer | 101? | opaque
        self.state = "first"
        self.buf = bytearray()
        self.left = 0  # body or chunk bytes still to pass
        self.requests = 0
        self._answer = bytearray()  # the upstream's first bytes, while an Upgrade waits

    def feed(self, data: bytes) -> bytes:
        """The bytes that may go up now (a request head is held until it is whole)."""
        if self.state == "opaque":
            return data
        if self.state == "101?":
            if data:
                raise Refused("data before the answer to an Upgrade")
            return b""
        self.buf += data
        if self.state == "first":
            return self._first()
        return self._http()

    def upstream(self, data: bytes) -> None:
        """The upstream's bytes: whether it switched protocols after an Upgrade."""
        if self.state != "101?":
            return
        self._answer += data[:16]
        if len(self._answer) < 12:
            return
        switched = self._answer[:12] in (b"HTTP/1.1 101", b"HTTP/1.0 101")
        self.state = "opaque" if switched else "head"
        self._answer = bytearray()

    def _name(self, name: str | None, what: str) -> None:
        """``name`` (None: none given) must be permitted: under an allow list a connection
        that names nothing is refused, under a deny list it is judged by its address."""
        if self.permitted(name):
            return
        if name is None:
            raise Refused(f"{what} names no host")
        raise Refused(f"{what} {name} does not match the allowed name", name)

    def _first(self) -> bytes:
        data = bytes(self.buf)
        if len(data) < 2:
            return b""
        if data[0] == 0x16 and data[1] == 0x03:
            try:
                sni = sniff.tls_sni(data)
            except sniff.NeedMore:
                return b""
            except ValueError as exc:
                raise Refused(f"unreadable TLS ClientHello ({exc})") from None
            self._name(sni, "TLS SNI")
            return self._pass_rest()
        line_end = data.find(b"\r\n")
        if line_end < 0:
            if len(data) <= 8192 and _METHOD_START.match(data[:17]):
                return b""  # a request line so far: undecided yet
            return self._not_http()
        if not _REQUEST_LINE.match(data[:line_end]):
            return self._not_http()
        self.state = "head"
        return self._http()

    def _not_http(self) -> bytes:
        if self.strict:
            raise Refused("neither TLS nor HTTP on an HTTP port")
        return self._pass_rest()  # another protocol on a port the entry names: unchecked

    def _pass_rest(self) -> bytes:
        self.state = "opaque"
        out, self.buf = bytes(self.buf), bytearray()
        return out

    def _http(self) -> bytes:
        steps: dict[str, Callable[[], bytes | None]] = {
            "head": self._head,
            "body": self._body,
            "chunk-size": self._chunk_size,
            "chunk-data": self._body,
            "chunk-end": self._chunk_end,
            "trailer": self._trailer,
        }
        out = bytearray()
        while self.buf and self.state in steps:
            step = steps[self.state]()
            if step is None:
                break
            out += step
        if self.buf and self.state == "101?":
            raise Refused("data before the answer to an Upgrade")
        return bytes(out)

    def _head(self) -> bytes | None:
        if self.buf[:2] == b"\r\n":  # a stray line end between requests (RFC 9112 2.2)
            del self.buf[:2]
            return b"\r\n"
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                raise Refused("a request head larger than 64 KiB")
            return None
        raw = bytes(self.buf[: end + 4])
        del self.buf[: end + 4]
        head = _Head(raw[:-4])
        for name in head.names:
            self._name(name, "HTTP Host")
        self.requests += 1
        if head.upgrade and self.requests == 1 and not head.chunked and head.length == 0:
            self.state = "101?"
        elif head.chunked:
            self.state = "chunk-size"
        elif head.length:
            self.state, self.left = "body", head.length
        return raw

    def _body(self) -> bytes:
        n = min(self.left, len(self.buf))
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.left -= n
        if self.left == 0:
            self.state = "head" if self.state == "body" else "chunk-end"
        return out

    def _chunk_end(self) -> bytes | None:
        if len(self.buf) < 2:
            return None
        if self.buf[:2] != b"\r\n":
            raise Refused("a malformed chunk")
        del self.buf[:2]
        self.state = "chunk-size"
        return b"\r\n"

    def _line(self) -> bytes | None:
        end = self.buf.find(b"\r\n")
        if end < 0:
            if len(self.buf) > MAX_CHUNK_LINE:
                raise Refused("a chunk line larger than 4 KiB")
            return None
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def _chunk_size(self) -> bytes | None:
        line = self._line()
        if line is None:
            return None
        m = _CHUNK_SIZE.match(line)
        if m is None:
            raise Refused("a malformed chunk size")
        size = int(m.group(1), 16)
        self.state, self.left = ("trailer", 0) if size == 0 else ("chunk-data", size)
        return line + b"\r\n"

    def _trailer(self) -> bytes | None:
        line = self._line()
        if line is None:
            return None
        if line == b"":
            self.state = "head"
        elif _HEADER.match(line) is None:
            raise Refused("a malformed trailer")
        return line + b"\r\n"


def bind(
    conn: Connection,
    port: int,
    policy: Callable[[], Policy],
    denied: Callable[..., None],
) -> None:
    """Check what ``conn`` says from now on, against the VM's policy in force (``policy``);
    a refusal is an ``egress_denied`` event (``denied``, gateway.VmGateway.denied) and a
    reset."""
    # A client that kept the synthetic address it resolved sends it as its Host: that
    # address stands for exactly the name it was allowed as.
    own = conn.dst[0] if is_synthetic(ipaddress.ip_address(conn.dst[0])) else None

    def permitted(name: str | None) -> bool:
        return (name is not None and name == own) or policy().host_permitted(name, port)

    check = NameCheck(port, permitted)

    def up(data: bytes) -> bytes | None:
        try:
            return check.feed(data)
        except Refused as exc:
            addr = conn.upstream_addr[0] if conn.upstream_addr else conn.dst[0]
            denied(name=exc.host or conn.name, address=addr, port=port, rule=str(exc))
            conn.reset()
            return None

    conn.inspect_up = up
    conn.inspect_down = check.upstream
