"""The host's checks on what a (hostile) guest sends for a cell (pal/manager/code.py): each
event's shape, the cell's totals, and the error mapping; and the buffered answer's folding
(pal/api/code.py)."""

from __future__ import annotations

import json

import pytest

from pal.api.code import CellFold
from pal.api.exec_budget import ExecBudget
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
    assert got <= p.MAX_CELL_STREAM_CHARS + p.CELL_NOTE_RESERVE


def test_errors_count_in_the_same_bound_as_text() -> None:
    """A guest flooding error events (a kernel calling showtraceback() in a loop, or root
    writing into the driver's pipe) gets no further than one flooding text: errors, text
    and empty events all count, each with its overhead."""
    bound = CellBound()
    sent = kept = 0
    flood = {"t": "error", "name": "E", "value": "v" * 100, "traceback": ["line"] * 20}
    for _ in range(100_000):
        ev = bound.event(flood)
        sent += 1
        if ev is not None:
            assert ev.error is not None
            kept += p.cell_event_chars(ev.error.name, ev.error.value, *ev.error.traceback)
    assert kept <= p.MAX_CELL_STREAM_CHARS + p.CELL_NOTE_RESERVE and bound.dropped > 0
    assert bound.event({"t": "stream", "name": "stdout", "text": "x" * 500}) is None, "text shares the bound"
    tiny = CellBound()
    kept_tiny = sum(tiny.event({"t": "error", "name": "", "value": ""}) is not None for _ in range(100_000))
    assert kept_tiny <= (p.MAX_CELL_STREAM_CHARS + p.CELL_NOTE_RESERVE) // p.CELL_EVENT_OVERHEAD


def test_a_result_nested_too_deep_is_dropped_not_raised() -> None:
    """JSON nested 100,000 levels (RecursionError in json.loads) or past the depth bound
    is not carried: the result keeps its other types, or is dropped; nothing raises."""
    bound = CellBound()
    deep = "[" * 100_000 + "]" * 100_000
    assert bound.event({"t": "result", "mime": {"application/json": deep}}) is None
    mid = "[" * (p.MAX_RESULT_JSON_DEPTH + 1) + "]" * (p.MAX_RESULT_JSON_DEPTH + 1)
    ev = bound.event({"t": "result", "mime": {"application/json": mid, "text/plain": "[[...]]"}})
    assert ev is not None and ev.data == {"text/plain": "[[...]]"}
    ok = "[" * p.MAX_RESULT_JSON_DEPTH + "]" * p.MAX_RESULT_JSON_DEPTH
    ev = bound.event({"t": "result", "mime": {"application/json": ok}})
    assert ev is not None and "application/json" in (ev.data or {})


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
    fold = CellFold()
    assert [fold.add(e) for e in events if e is not None] == [False, False, False, True]
    res = fold.result()
    assert res.text == "42" and res.stdout == "hi\n" and res.execution_count == 3
    assert res.truncated is None
    assert res.results == [
        {"image/png": "iVBO", "isMainResult": False},
        {"text/plain": "42", "isMainResult": True},
    ]


def test_the_buffered_answer_charges_every_kind_to_the_tenants_budget() -> None:
    """Text, results and errors all count against the tenant's buffered output; past it
    nothing more is kept, the answer says truncated, and the budget comes back on release."""
    budget = ExecBudget(4096)
    lease = budget.lease("t")
    fold = CellFold(lease)
    bound = CellBound()
    err = {"t": "error", "name": "E", "value": "v" * 500, "traceback": ["x" * 100] * 5}
    for _ in range(50):
        ev = bound.event(err)
        assert ev is not None
        fold.add(ev)
    assert budget.held["t"] <= 4096 and fold.cut
    ev = bound.event({"t": "stream", "name": "stdout", "text": "late"})
    assert ev is not None
    fold.add(ev)
    fold.add(_end({"context_id": "default-python", "execution_count": 1}))
    res = fold.result()
    assert res.truncated is True and res.stdout == "" and res.error is not None
    lease.release()
    assert "t" not in budget.held


def test_the_channel_routes_code_events_and_their_error_code() -> None:
    assert gi.route({"id": 3, "k": p.K_CEV, "t": "stream"}) == (3, p.K_CEV)
    assert gi.error({"k": p.K_ERR, "code": p.ERR_NOKERNEL, "msg": "no Jupyter"})[0] == p.ERR_NOKERNEL
