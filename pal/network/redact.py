"""Brokered secrets never come back: the real value is cut out of what an upstream answers.

The gateway injects a secret's value only into the configured header of requests to the
configured hosts (broker.py). An upstream can still reflect it: an error that quotes the
credential, a debug echo of the request's headers. As defence in depth, every response on
a brokered connection is searched for each injected value and the value is replaced by its
placeholder, in header names and values, trailers, and identity-encoded bodies. A secret's
formatted form (``Bearer {value}``) contains the value, so it comes back as the format with
the placeholder.

Bodies are searched as they stream: :class:`Redactor` keeps back only a tail that could be
the start of a value cut by a chunk boundary (so a server-sent-events stream is not held
up by it), and gives it back at the end of the body.
"""

from __future__ import annotations

from collections.abc import Iterable

Pair = tuple[bytes, bytes]  # (real value, placeholder)


def pairs_of(values: Iterable[tuple[str, str]]) -> list[Pair]:
    """(value, placeholder) pairs, longest value first, empty values left out."""
    out = {v.encode(): p.encode() for v, p in values if v}
    return sorted(out.items(), key=lambda kv: -len(kv[0]))


def _replace(data: bytes, pairs: list[Pair]) -> tuple[bytes, int]:
    hits = 0
    for value, placeholder in pairs:
        n = data.count(value)
        if n:
            hits += n
            data = data.replace(value, placeholder)
    return data, hits


def redact_headers(headers: Iterable[tuple[bytes, bytes]], pairs: list[Pair]) -> tuple[list[Pair], int]:
    """Headers (names and values) with every value replaced by its placeholder; the count."""
    out: list[Pair] = []
    hits = 0
    for k, v in headers:
        k, a = _replace(k, pairs)
        v, b = _replace(v, pairs)
        hits += a + b
        out.append((k, v))
    return out, hits


class Redactor:
    """One body, streamed: ``feed`` each piece, ``flush`` at its end; ``hits`` counts."""

    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs
        self.tail = b""
        self.hits = 0

    def feed(self, data: bytes) -> bytes:
        if not self.pairs:
            return data
        buf = self.tail + data
        out = bytearray()
        i = 0
        while True:
            at, pair = self._next(buf, i)
            if pair is None:
                break
            out += buf[i:at] + pair[1]
            i = at + len(pair[0])
            self.hits += 1
        keep = self._partial(buf, i)
        out += buf[i : len(buf) - keep]
        self.tail = buf[len(buf) - keep :] if keep else b""
        return bytes(out)

    def flush(self) -> bytes:
        out, self.tail = self.tail, b""
        return out

    def _next(self, buf: bytes, start: int) -> tuple[int, Pair | None]:
        """The earliest whole value at or after ``start`` (the longest, at a tie)."""
        best: tuple[int, Pair | None] = (len(buf), None)
        for pair in self.pairs:
            at = buf.find(pair[0], start)
            if at >= 0 and at < best[0]:
                best = (at, pair)
        return best

    def _partial(self, buf: bytes, start: int) -> int:
        """How many bytes at the end of ``buf`` (after ``start``) could begin a value."""
        keep = 0
        for value, _ in self.pairs:
            first = value[:1]
            p = buf.find(first, max(start, len(buf) - len(value) + 1))
            while p >= 0:
                if value.startswith(buf[p:]):
                    keep = max(keep, len(buf) - p)
                    break
                p = buf.find(first, p + 1)
        return keep
