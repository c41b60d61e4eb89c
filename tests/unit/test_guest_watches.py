"""The guest's directory watches (pal/guest/watches.py) on this host's inotify: events as
fsnotify names them, relative to the root; a recursive watch follows a directory made under
it (and reports what was made in it before its watch was); the bound drops the oldest and
says how many; a missing directory, a file and too many watches are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pal.guest import protocol as P
from pal.guest import watches as W
from pal.guest.errors import ExecError


def _read(ws: W.Watches, watch_id: str, until: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Events until ``until`` are among them (each read a long poll: no fixed sleep)."""
    got: set[tuple[str, str]] = set()
    for _ in range(50):
        res = ws.read({"watch_id": watch_id, "wait_ms": 200})
        assert res["dropped"] == 0
        got |= {(e["name"], e["op"]) for e in res["events"]}
        if until <= got:
            return got
    raise AssertionError(f"never saw {until - got}; saw {got}")


def test_events_rename_and_recursion(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("1")
    ws = W.Watches()
    flat = ws.new({"path": str(tmp_path)})["watch_id"]
    deep = ws.new({"path": str(tmp_path), "recursive": True})["watch_id"]
    (tmp_path / "new.txt").write_text("2")
    os.rename(tmp_path / "old.txt", tmp_path / "moved.txt")
    (tmp_path / "moved.txt").chmod(0o600)
    (tmp_path / "new.txt").unlink()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    want = {
        ("new.txt", "create"),
        ("new.txt", "write"),
        ("old.txt", "rename"),
        ("moved.txt", "create"),
        ("moved.txt", "chmod"),
        ("new.txt", "remove"),
        ("sub", "create"),
    }
    flat_events = _read(ws, flat, want)
    assert ("sub/a.txt", "create") not in flat_events  # not recursive
    assert ("sub/a.txt", "create") in _read(ws, deep, want | {("sub/a.txt", "create")})
    assert ws.delete({"watch_id": flat}) == {"watch_id": flat, "deleted": True}
    with pytest.raises(ExecError) as gone:
        ws.read({"watch_id": flat})
    assert gone.value.code == P.ERR_NOENT
    ws.delete({"watch_id": deep})


def test_the_bound_drops_the_oldest_and_says_how_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(W, "MAX_EVENTS", 3)
    ws = W.Watches()
    watch_id = ws.new({"path": str(tmp_path)})["watch_id"]
    for i in range(5):
        (tmp_path / f"f{i}").mkdir()
    seen: list[str] = []
    dropped = 0
    for _ in range(50):
        res = ws.read({"watch_id": watch_id, "wait_ms": 200})
        seen += [e["name"] for e in res["events"]]
        dropped += res["dropped"]
        if len(seen) + dropped >= 5:
            break
    assert len(seen) + dropped == 5 and "f4" in seen
    ws.delete({"watch_id": watch_id})


def test_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = W.Watches()
    (tmp_path / "file").write_text("x")
    cases = [
        (str(tmp_path / "missing"), P.ERR_NOENT),
        (str(tmp_path / "file"), P.ERR_NOTDIR),
        ("rel", P.ERR_INVAL),
    ]
    for path, code in cases:
        with pytest.raises(ExecError) as caught:
            ws.new({"path": path})
        assert caught.value.code == code
    monkeypatch.setattr(W, "MAX_WATCHES", 1)
    one = ws.new({"path": str(tmp_path)})["watch_id"]
    with pytest.raises(ExecError) as caught:
        ws.new({"path": str(tmp_path)})
    assert caught.value.code == P.ERR_LIMIT
    ws.delete({"watch_id": one})
