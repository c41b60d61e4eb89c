"""The name a guest connection asks for, from its first bytes: TLS SNI or HTTP Host.

Used only for connections to a bare IP (a connection to one of the gateway's synthetic
DNS addresses already names its destination). Input is hostile: every length is checked,
nothing is trusted beyond the bytes given.
"""

from __future__ import annotations

import re

MAX_PEEK = 16 * 1024  # a ClientHello or a request head larger than this is not looked at

_HOST_HEADER = re.compile(rb"\r\nhost:[ \t]*([^\r\n]*)\r\n", re.IGNORECASE)
_METHOD = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r\n")
_NAME = re.compile(r"^[a-z0-9.-]{1,253}$")


class NeedMore(Exception):
    """Not enough bytes yet to tell."""


def _clean(raw: bytes) -> str | None:
    try:
        name = raw.decode("ascii").strip().lower().rstrip(".")
    except UnicodeDecodeError:
        return None
    return name if _NAME.match(name) else None


def tls_sni(data: bytes) -> str | None:
    """server_name of a TLS ClientHello, None if absent; NeedMore if cut short.
    ValueError if ``data`` is not a ClientHello at all."""
    if len(data) < 5:
        raise NeedMore
    if data[0] != 0x16 or data[1] != 0x03:
        raise ValueError("not a TLS handshake record")
    rec_len = int.from_bytes(data[3:5], "big")
    if len(data) < 5 + rec_len:
        if 5 + rec_len > MAX_PEEK:
            raise ValueError("ClientHello too large to inspect")
        raise NeedMore
    hs = data[5 : 5 + rec_len]
    if len(hs) < 4 or hs[0] != 0x01:
        raise ValueError("not a ClientHello")
    body = hs[4 : 4 + int.from_bytes(hs[1:4], "big")]
    pos = 2 + 32  # client_version, random
    if len(body) < pos + 1:
        raise ValueError("short ClientHello")
    pos += 1 + body[pos]  # session id
    if len(body) < pos + 2:
        raise ValueError("short ClientHello")
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")  # cipher suites
    if len(body) < pos + 1:
        raise ValueError("short ClientHello")
    pos += 1 + body[pos]  # compression methods
    if len(body) < pos + 2:
        return None  # no extensions
    end = min(len(body), pos + 2 + int.from_bytes(body[pos : pos + 2], "big"))
    pos += 2
    while pos + 4 <= end:
        ext_type = int.from_bytes(body[pos : pos + 2], "big")
        ext_len = int.from_bytes(body[pos + 2 : pos + 4], "big")
        ext = body[pos + 4 : pos + 4 + ext_len]
        pos += 4 + ext_len
        if ext_type != 0:  # server_name
            continue
        # server_name_list: len(2), then entries type(1) len(2) name
        i = 2
        while i + 3 <= len(ext):
            kind = ext[i]
            n = int.from_bytes(ext[i + 1 : i + 3], "big")
            if kind == 0:
                return _clean(ext[i + 3 : i + 3 + n])
            i += 3 + n
        return None
    return None


def http_host(data: bytes) -> str | None:
    """Host of an HTTP/1 request head; NeedMore until the head is complete.
    ValueError if ``data`` does not start like an HTTP request."""
    line_end = data.find(b"\r\n")
    if line_end < 0:
        if len(data) > 8192 or (data and not data[:1].isalpha()):
            raise ValueError("not an HTTP request")
        raise NeedMore
    if not _METHOD.match(data[: line_end + 2]):
        raise ValueError("not an HTTP request")
    head_end = data.find(b"\r\n\r\n")
    head = data if head_end < 0 else data[: head_end + 2]
    m = _HOST_HEADER.search(head)
    if m is None:
        if head_end < 0:
            raise NeedMore
        return None
    host = m.group(1).strip()
    if host.startswith(b"["):  # [v6]:port
        return None
    return _clean(host.split(b":", 1)[0])


def name_in(data: bytes) -> str | None:
    """The destination name in a connection's first bytes; NeedMore if undecided yet."""
    if not data:
        raise NeedMore
    for parse in (tls_sni, http_host):
        try:
            return parse(data)
        except ValueError:
            continue
    return None
