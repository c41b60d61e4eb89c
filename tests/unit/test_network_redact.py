"""Issue 23 item 2, defence in depth: a brokered value an upstream reflects is cut out of the
response, wherever the stream is split (pal/network/redact.py)."""

from __future__ import annotations

import pytest

from pal.network.redact import Redactor, pairs_of, redact_headers

VALUE = "sk-real-0123456789abcdef"
PH = "pal-brokered-key-XYZ"
BODY = (f'{{"error": "bad key Bearer {VALUE}", "echo": "{VALUE}{VALUE}", "s": "sk-re"}}').encode()
WANT = BODY.replace(VALUE.encode(), PH.encode())


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 23, 24, 25, 1000])
def test_every_split_of_the_body_is_redacted(step: int) -> None:
    r = Redactor(pairs_of([(VALUE, PH)]))
    out = b"".join(r.feed(BODY[i : i + step]) for i in range(0, len(BODY), step)) + r.flush()
    assert out == WANT and r.hits == 3


def test_only_a_possible_start_of_the_value_is_kept_back() -> None:
    """A streamed response (server-sent events) is not held up: bytes that cannot begin the
    value go out at once, a tail that can waits for the next piece."""
    r = Redactor(pairs_of([(VALUE, PH)]))
    assert r.feed(b"data: token\n\n") == b"data: token\n\n"
    assert r.feed(b"data: sk-re") == b"data: "
    assert r.feed(b"ad\n\n") == b"sk-read\n\n"
    assert r.feed(b"x sk-real-0123") == b"x "
    assert r.flush() == b"sk-real-0123" and r.hits == 0


def test_several_values_and_headers() -> None:
    pairs = pairs_of([(VALUE, PH), ("short", "PH2"), ("", "never")])
    r = Redactor(pairs)
    assert r.feed(b"short " + VALUE.encode()) + r.flush() == b"PH2 " + PH.encode()
    headers, hits = redact_headers(
        [(b"X-Echo-Authorization", f"Bearer {VALUE}".encode()), (b"Location", b"https://x/?k=short")], pairs
    )
    assert headers == [(b"X-Echo-Authorization", f"Bearer {PH}".encode()), (b"Location", b"https://x/?k=PH2")]
    assert hits == 2
    assert Redactor([]).feed(b"untouched") == b"untouched"
