"""Issue 22: what the host does with a process's output (pure logic, no VM): text that
never cuts a character and offsets that neither skip nor repeat a byte; a hostile guest's
process replies refused (guest_input.py)."""

from __future__ import annotations

import base64
import random
from typing import Any

import pytest

from pal.api.process_output import TextOutput, incomplete_tail, read_view
from pal.manager import guest_input as gi
from pal.wire.processes import OutputChunk, ProcessInfo, ProcessOutput


def test_incomplete_tail_counts_only_a_started_character() -> None:
    euro = "€".encode()  # 3 bytes
    assert incomplete_tail(b"abc") == 0
    assert incomplete_tail(b"a" + euro) == 0
    assert incomplete_tail(b"a" + euro[:1]) == 1
    assert incomplete_tail(b"a" + euro[:2]) == 2
    assert incomplete_tail("😀".encode()[:3]) == 3
    assert incomplete_tail(b"\xff") == 0  # not UTF-8 at all: given as U+FFFD, not held


def test_text_pieces_resume_exactly_where_their_offsets_say() -> None:
    text = "".join(random.Random(7).choice(["a", "é", "€", "😀", "\n"]) for _ in range(3000))
    data = text.encode()
    rnd = random.Random(8)
    cuts = sorted(rnd.sample(range(1, len(data)), 200))
    out, pos = TextOutput(), 0
    pieces: list[tuple[str, str, int]] = []
    for cut in [*cuts, len(data)]:
        pieces += out.feed("stdout", cut, data[pos:cut])
        pos = cut
    pieces += out.flush()
    assert "".join(p[1] for p in pieces) == text
    for _, piece, end in pieces:  # each offset is after exactly the bytes given so far
        assert data[:end].decode().endswith(piece)


def test_a_held_tail_of_one_stream_goes_out_before_another_streams_bytes() -> None:
    out = TextOutput()
    euro = "€".encode()
    assert out.feed("stdout", 2, euro[:2]) == []
    assert out.offset == 0
    got = out.feed("stderr", 5, b"err")
    assert got == [("stdout", "\ufffd", 2), ("stderr", "err", 5)]


def _proc(**kw: Any) -> dict[str, Any]:
    raw = {
        "pid": 1, "os_pid": 10, "argv": ["sh"], "tag": "", "user": "pal", "cwd": "/workspace",
        "pty": None, "stdin": False, "keep_awake": False, "started_ms": 1, "ended_ms": None,
        "running": True, "exit_code": None, "timed_out": False,
        "journal": {"start": 0, "end": 10, "capacity": 65536},
    }  # fmt: skip
    return {**raw, **kw}


def _read(records: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {
        "k": "ok",
        "result": {"from": 0, "next": 10, "gap": 0, "records": records, "process": _proc(), **kw},
    }


def test_a_read_must_tile_its_payload() -> None:
    good = _read([{"fd": 1, "o": 0, "n": 4}, {"fd": 2, "o": 4, "n": 6}])
    res = gi.process_read(good, b"0123456789", 0, 100)
    assert [(o, fd, d) for o, fd, d in res["chunks"]] == [(0, 1, b"0123"), (4, 2, b"456789")]
    hostile = [
        _read([{"fd": 1, "o": 0, "n": 4}, {"fd": 1, "o": 2, "n": 8}]),  # overlap: bytes twice
        _read([{"fd": 1, "o": 0, "n": 4}, {"fd": 1, "o": 6, "n": 4}]),  # a hole nobody calls lost
        _read([{"fd": 1, "o": 0, "n": 10}], next=12),  # next past the bytes
        _read([{"fd": 3, "o": 0, "n": 10}]),  # no such stream
        _read([{"fd": 1, "o": 0, "n": 10}], process=_proc(journal={"start": 0, "end": 5, "capacity": 9})),
        _read([{"fd": 1, "o": 0, "n": 10}], **{"from": 3}),  # not the read asked for
    ]
    for msg in hostile:
        with pytest.raises(gi.BadReply):
            gi.process_read(msg, b"0123456789", 0, 100)
    with pytest.raises(gi.BadReply):  # more than asked
        gi.process_read(good, b"0123456789", 0, 5)


def test_a_process_with_wrong_fields_is_refused() -> None:
    assert gi.process(_proc())["process_id"] == 1
    for bad in (
        _proc(pid=0),
        _proc(pid=True),
        _proc(argv="sh"),
        _proc(journal={"start": 5, "end": 1, "capacity": 9}),
        _proc(pty={"cols": 0, "rows": 9}),
        _proc(stdin="yes"),
        _proc(tag=None),
    ):
        with pytest.raises(gi.BadReply):
            gi.process(bad)
    # A running process has no exit code, whatever the guest says.
    assert gi.process(_proc(exit_code=3))["exit_code"] is None


def test_a_stream_chunk_must_continue_the_stream() -> None:
    data = base64.b64encode(b"abc").decode()
    assert gi.stream_out({"fd": 1, "o": 13, "data": data}, 10) == (1, b"abc")
    assert gi.stream_out({"fd": 1, "o": 12, "data": data}, 10) is None
    assert gi.stream_out({"fd": 1, "o": 13, "data": "%%%"}, 10) is None


def test_a_json_read_holds_back_a_cut_character_and_says_so_in_next() -> None:
    proc = ProcessInfo.model_validate(gi.process(_proc(journal={"start": 0, "end": 5, "capacity": 9})))
    data = "ab€".encode()[:4]  # a, b, and two of the euro sign's three bytes
    res = ProcessOutput.model_validate(
        {
            "from": 0,
            "next": 4,
            "gap": 0,
            "chunks": [OutputChunk(stream="stdout", offset=0, data=base64.b64encode(data).decode())],
            "process": proc,
        }
    )
    view = read_view(res, "text")
    assert view["output"] == [{"stream": "stdout", "data": "ab"}] and view["next"] == 2
    raw = read_view(res, "base64")
    assert base64.b64decode(raw["output"][0]["data"]) == data and raw["next"] == 4
