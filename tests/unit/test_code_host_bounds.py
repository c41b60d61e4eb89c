"""The host's checks on what a (hostile) guest sends for a cell (pal/manager/code.py): each
event's shape, the cell's totals, and the error mapping; and the buffered answer's folding
(pal/api/code.py)."""

from __future__ import annotations

import json

import pytest

from pal.api.code import result_of
from pal.guest import protocol as p
from pal.manager import guest_input as gi
from pal.manager.channel import GuestError
from pal.manager.code import CellBound, _end, _error, context


def test_stream_text_is_bounded_across_events() -> None:
    bound = CellBound()
    got = 0
    for _ in range(40):
        ev = bound.event({"t": "stream", "name": "stdout", "text": "a" * 100_000})
        got += len(ev.text or "") if ev else 0
    assert got <= p.MAX_CELL_STREAM_CHARS + 1024


def test_results_are_filtered_and_bounded() -> None:
    bound = CellBound()
    ev = bound.event(
        {"t": "result", "mime": {"text/plain": "1", "text/x-evil": "x", "image/png": 5}, "main": True}
    )
    assert ev is not None and ev.data == {"text/plain": "1"} and ev.is_main_result is True
    js = bound.event({"t": "result", "mime": {"application/json": json.dumps({"a": [1]})}})
    assert js is not None and js.data == {"application/json": {"a": [1]}}
    kept = sum(bound.event({"t": "result", "mime": {"text/plain": "x"}}) is not None for _ in range(200))
    assert kept <= p.MAX_CELL_RESULTS
    big = CellBound()
    huge = {"t": "result", "mime": {"text/html": "x" * (p.MAX_CELL_RESULT_BYTES + 1)}}
    assert big.event(huge) is None


def test_garbage_events_are_dropped_and_errors_cleaned() -> None:
    bound = CellBound()
    for junk in ({"t": "stream", "name": "stdin", "text": "x"}, {"t": "result", "mime": []}, {"t": "?"}, {}):
        assert bound.event(junk) is None
    err = bound.event(
        {"t": "error", "name": 3, "value": "v" * 20_000, "traceback": ["\x1b[0;31mboom\x1b[0m", 7] * 500}
    )
    assert err is not None and err.error is not None
    assert err.error.name == "" and len(err.error.value) == 10_000
    assert len(err.error.traceback) == 200 and err.error.traceback[0] == "boom"


def test_end_and_contexts_are_checked() -> None:
    with pytest.raises(gi.BadReply):
        _end({"context_id": "../etc"})
    end = _end({"context_id": "default-python", "execution_count": True, "timed_out": 1})
    assert end.execution_count is None and end.timed_out is False
    with pytest.raises(gi.BadReply):
        context({"id": "x", "language": "cobol"})


def test_no_kernel_is_409_naming_the_image() -> None:
    err = _error(GuestError(p.ERR_NOKERNEL, "no Jupyter kernel support in this image"))
    assert err.status == 409 and err.code == "KERNEL_UNAVAILABLE" and "code-interpreter" in err.message
    assert _error(GuestError(p.ERR_NOENT, "no code context 'x'")).status == 404
    assert _error(GuestError(p.ERR_LIMIT, "8 code contexts")).status == 429


def test_the_buffered_answer_folds_the_events() -> None:
    bound = CellBound()
    events = [
        bound.event({"t": "stream", "name": "stdout", "text": "hi\n"}),
        bound.event({"t": "result", "mime": {"image/png": "iVBO"}}),
        bound.event({"t": "result", "mime": {"text/plain": "42"}, "main": True}),
        _end({"context_id": "default-python", "execution_count": 3, "timed_out": False}),
    ]
    res = result_of([e for e in events if e is not None])
    assert res.text == "42" and res.stdout == "hi\n" and res.execution_count == 3
    assert res.results == [
        {"image/png": "iVBO", "isMainResult": False},
        {"text/plain": "42", "isMainResult": True},
    ]


def test_the_channel_routes_code_events_and_their_error_code() -> None:
    assert gi.route({"id": 3, "k": p.K_CEV, "t": "stream"}) == (3, p.K_CEV)
    assert gi.error({"k": p.K_ERR, "code": p.ERR_NOKERNEL, "msg": "no Jupyter"})[0] == p.ERR_NOKERNEL
