"""Everything a guest sends, checked before the host uses it.

The guest is hostile (docs/security.md): any field of any message may be missing, of the
wrong type, huge, or a lie. Nothing here raises on bad input: each function returns a
value of the documented type, clamped into its range, or ``None`` / a refusal the caller
turns into an error for *that* VM's request only. The channel (channel.py) routes only
messages that pass :func:`route`; the runtime reads heartbeats, exec events and file
replies only through this module.

What a guest's report may still decide, and the bounds (idle.py applies them):
- its own metrics figures (displayed, never used for a decision);
- ``active`` / ``last_activity_ms``: can keep its own VM awake past the host-observed
  activity by at most one idle timeout (never forever; never into the future);
- ``vm_id`` / ``incarnation``: whether the harness has taken the identity the host gave
  it (a wrong claim only delays or fails its own VM).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from typing import Any

from pal.guest import protocol as p

# Longest guest text (error messages, ids, boot ids) that reaches a log or an API error.
MAX_GUEST_TEXT = 300
# Longest line the host reads from a guest: the largest legitimate message is a file read
# of MAX_FILE_BYTES, base64-encoded, plus its JSON envelope.
MAX_GUEST_LINE_BYTES = (p.MAX_FILE_BYTES * 4) // 3 + 64 * 1024
MAX_LS_ENTRIES = 1000  # the harness lists at most this many (pal/guest/harness.py)
MAX_NAME_CHARS = 1024  # a guest file name (Linux allows 255 bytes)
MAX_JSON_INT = 2**53  # anything above is not a count, size or time we believe
MAX_EXIT_CODE = 2**31 - 1

GUEST_KINDS = frozenset({p.K_HEARTBEAT, p.K_OUT, p.K_EXIT, p.K_OK, p.K_ERR, p.K_STARTED, p.K_GAP, p.K_CEV})
GUEST_ERROR_CODES = frozenset(
    {
        p.ERR_AUTH,
        p.ERR_NOENT,
        p.ERR_ESCAPE,
        p.ERR_TOOBIG,
        p.ERR_ISDIR,
        p.ERR_NOTDIR,
        p.ERR_INVAL,
        p.ERR_PERM,
        p.ERR_TIMEOUT,
        p.ERR_IO,
        p.ERR_STATE,
        p.ERR_LIMIT,
        p.ERR_NOKERNEL,
    }
)
FILE_TYPES = frozenset({"file", "dir", "symlink", "other"})

# C0/C1 controls, DEL, line/paragraph separators and bidi overrides: in a log line or an
# error message they forge lines, colours or reading order.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def text(value: object, limit: int = MAX_GUEST_TEXT) -> str:
    """``value`` fit for a log line or an error message: a string with control
    characters replaced by ``?``, lone surrogates by U+FFFD, and cut at ``limit``."""
    if not isinstance(value, str):
        return f"<{type(value).__name__}>"
    cut = value[: limit + 1]
    clean = _CONTROL.sub("?", _unicode(cut))
    return clean[:limit] + "…" if len(clean) > limit else clean


def _unicode(value: str) -> str:
    """Lone surrogates (a non-UTF-8 name the guest escaped) as U+FFFD, so the text can be
    encoded in a JSON response."""
    return value.encode("utf-8", "replace").decode("utf-8")


def integer(value: object, lo: int, hi: int) -> int | None:
    """``value`` if it is an int (not a bool) within [lo, hi], else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


def nested_json(raw: str, max_depth: int) -> Any:
    """The JSON value of ``raw`` when it parses and nests at most ``max_depth`` arrays and
    objects deep, else None (as for ``null`` itself). Too deep for the parser (a
    RecursionError) is too deep."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    level, depth = [value], 0
    while True:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            return value
        depth += 1
        if depth > max_depth:
            return None
        level = [x for v in containers for x in (v.values() if isinstance(v, dict) else v)]


def route(msg: object) -> tuple[int, str] | None:
    """(request id, kind) of a guest message the channel may route, or None to drop it.

    The id must be an int (``True``, lists, huge numbers are not), the kind one the guest
    may send; heartbeats travel on id 0."""
    if not isinstance(msg, dict):
        return None
    rid = integer(msg.get("id", 0), 0, MAX_JSON_INT)
    kind = msg.get("k")
    if rid is None or not isinstance(kind, str) or kind not in GUEST_KINDS:
        return None
    if (kind == p.K_HEARTBEAT) != (rid == 0):
        return None
    return rid, kind


# --------------------------------------------------------------------------- heartbeat


def heartbeat(msg: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """A heartbeat with only known fields, each of its type and range: ``vm_id`` (a safe
    id or ""), ``incarnation`` (int or None), ``active`` (bool), ``last_activity_ms``
    (clamped to [0, now_ms]: a future claim counts as now), ``boot_id``, ``uptime_s`` and
    the usage figures (ints, used <= total, else dropped)."""
    vm_id = msg.get("vm_id")
    out: dict[str, Any] = {
        "vm_id": vm_id if isinstance(vm_id, str) and _SAFE_ID.match(vm_id) else "",
        "incarnation": integer(msg.get("incarnation"), 0, 2**31 - 1),
        "active": msg.get("active") is True,
        "last_activity_ms": min(integer(msg.get("last_activity_ms"), 0, MAX_JSON_INT) or 0, now_ms),
        "boot_id": text(msg.get("boot_id"), 64) if isinstance(msg.get("boot_id"), str) else "",
    }
    up = msg.get("uptime_s")
    if isinstance(up, int | float) and not isinstance(up, bool) and math.isfinite(up) and up >= 0:
        out["uptime_s"] = float(up)
    for used, total in (("mem_used", "mem_total"), ("disk_used", "disk_total")):
        u, t = integer(msg.get(used), 0, MAX_JSON_INT), integer(msg.get(total), 0, MAX_JSON_INT)
        if t is not None:
            out[total] = t
            if u is not None and u <= t:
                out[used] = u
    return out


# --------------------------------------------------------------------------- exec


def payload(msg: dict[str, Any], limit: int = MAX_GUEST_LINE_BYTES) -> bytes | None:
    """The message's binary payload (b"" when it has none), or None when ``data`` is not
    valid base64 of at most ``limit`` bytes."""
    raw = msg.get("data")
    if raw is None or raw == "":
        return b""
    if not isinstance(raw, str) or len(raw) > (limit * 4) // 3 + 4:
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return None


def out_fd(msg: dict[str, Any]) -> int:
    return 2 if msg.get("fd") == 2 else 1


def exit_code(msg: dict[str, Any]) -> int:
    """The exit status of an ``exit`` message; -1 when the guest sent no usable one."""
    code = integer(msg.get("code"), -MAX_EXIT_CODE, MAX_EXIT_CODE)
    return -1 if code is None else code


def error(msg: dict[str, Any]) -> tuple[str, str]:
    """(code, message) of an ``err`` message: a known protocol code (else EIO) and a
    message cleaned for logs and API errors."""
    code = msg.get("code")
    if not isinstance(code, str) or code not in GUEST_ERROR_CODES:
        code = p.ERR_IO
    message = msg.get("msg")
    return code, text(message) if isinstance(message, str) else "guest error"


# --------------------------------------------------------------------------- files


class BadReply(Exception):
    """A guest reply that does not have the shape the protocol promises."""


def _result(msg: dict[str, Any]) -> dict[str, Any]:
    res = msg.get("result")
    if not isinstance(res, dict):
        raise BadReply("reply has no result object")
    return res


def _path(res: dict[str, Any]) -> str:
    path = res.get("path")
    if not isinstance(path, str) or len(path) > 4096:
        raise BadReply("reply has no valid path")
    return _unicode(path)


def file_list(msg: dict[str, Any]) -> dict[str, Any]:
    """``{path, entries: [{name, type, size}], truncated}`` of an ``ls`` reply (BadReply
    when it is not one). Names keep their characters (JSON escapes them) but not lone
    surrogates; at most MAX_LS_ENTRIES entries."""
    res = _result(msg)
    entries = res.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_LS_ENTRIES:
        raise BadReply("reply has no valid entries")
    out = []
    for e in entries:
        if not isinstance(e, dict):
            raise BadReply("an entry is not an object")
        name, kind = e.get("name"), e.get("type")
        size = integer(e.get("size"), 0, MAX_JSON_INT)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or kind not in FILE_TYPES:
            raise BadReply("an entry has no valid name or type")
        out.append({"name": _unicode(name), "type": kind, "size": size})
    return {"path": _path(res), "entries": out, "truncated": res.get("truncated") is True}


def file_read(msg: dict[str, Any], data: bytes, limit: int = p.MAX_FILE_BYTES) -> tuple[bytes, bool]:
    """(content cut at ``limit``, truncated) of a ``read`` reply whose payload is ``data``."""
    res = _result(msg)
    truncated = res.get("truncated") is True or len(data) > limit
    return data[:limit], truncated


def file_written(msg: dict[str, Any], sent: int) -> dict[str, Any]:
    """``{path, bytesWritten}`` of a ``write`` reply; the count cannot exceed what was sent."""
    res = _result(msg)
    n = integer(res.get("bytesWritten"), 0, sent)
    if n is None:
        raise BadReply("reply has no valid bytesWritten")
    return {"path": _path(res), "bytesWritten": n}


# --------------------------------------------------------------------------- probe


def probe(msg: dict[str, Any]) -> dict[str, Any]:
    """``{runnable, cpu_busy, cpu_total, timer_ms}`` of a ``probe`` reply (BadReply when it
    is not one). A lying guest can only get its own VM paused (or not): waits.py."""
    res = _result(msg)
    runnable = integer(res.get("runnable"), 0, 1 << 20)
    busy = integer(res.get("cpu_busy"), 0, MAX_JSON_INT)
    total = integer(res.get("cpu_total"), 0, MAX_JSON_INT)
    if runnable is None or busy is None or total is None or busy > total:
        raise BadReply("reply has no valid runnable/cpu figures")
    raw = res.get("timer_ms")
    timer = integer(raw, 0, MAX_JSON_INT) if raw is not None else None
    return {"runnable": runnable, "cpu_busy": busy, "cpu_total": total, "timer_ms": timer}


# --------------------------------------------------------------------------- processes

MAX_PROCESSES = 1024  # a process list longer than this is no harness's (it keeps 256 + 128)
MAX_ARGV_ITEMS = 4096


def _bool(res: dict[str, Any], name: str) -> bool:
    value = res.get(name)
    if not isinstance(value, bool):
        raise BadReply(f"process has no valid {name}")
    return value


def _int_field(res: dict[str, Any], name: str, lo: int = 0, hi: int = MAX_JSON_INT) -> int:
    value = integer(res.get(name), lo, hi)
    if value is None:
        raise BadReply(f"process has no valid {name}")
    return value


def process(raw: object) -> dict[str, Any]:
    """A process as the harness describes it (protocol.py ``process``), each field of its
    type and range, strings cleaned of lone surrogates and cut; BadReply otherwise."""
    if not isinstance(raw, dict):
        raise BadReply("process is not an object")
    argv = raw.get("argv")
    if not isinstance(argv, list) or len(argv) > MAX_ARGV_ITEMS or not all(isinstance(a, str) for a in argv):
        raise BadReply("process has no valid argv")
    pty = raw.get("pty")
    if pty is not None:
        if not isinstance(pty, dict):
            raise BadReply("process has no valid pty")
        pty = {"cols": _int_field(pty, "cols", 1, 1000), "rows": _int_field(pty, "rows", 1, 1000)}
    journal = raw.get("journal")
    if not isinstance(journal, dict):
        raise BadReply("process has no journal")
    start, end = _int_field(journal, "start"), _int_field(journal, "end")
    capacity = _int_field(journal, "capacity", 0, p.JOURNAL_MAX_BYTES)
    if start > end:
        raise BadReply("process journal starts after its end")
    running = _bool(raw, "running")
    code = raw.get("exit_code")
    exit_code_ = None if running or code is None else integer(code, -MAX_EXIT_CODE, MAX_EXIT_CODE)
    ended = raw.get("ended_ms")
    strings = {}
    for name, limit in (("tag", p.MAX_TAG_CHARS), ("user", 64), ("cwd", 4096)):
        value = raw.get(name)
        if not isinstance(value, str):
            raise BadReply(f"process has no valid {name}")
        strings[name] = _unicode(value[:limit])
    return {
        "process_id": _int_field(raw, "pid", 1),
        "os_pid": _int_field(raw, "os_pid", 0, 2**31 - 1),
        "argv": [_unicode(a[:4096]) for a in argv],
        **strings,
        "pty": pty,
        "stdin": _bool(raw, "stdin"),
        "keep_awake": _bool(raw, "keep_awake"),
        "started_ms": _int_field(raw, "started_ms"),
        "ended_ms": None if running or ended is None else integer(ended, 0, MAX_JSON_INT),
        "running": running,
        "exit_code": exit_code_,
        "timed_out": _bool(raw, "timed_out"),
        "journal": {"start": start, "end": end, "capacity": capacity},
    }


def process_reply(msg: dict[str, Any]) -> dict[str, Any]:
    """The ``process`` of an ``ok`` reply (pstart, pget, pwait)."""
    return process(_result(msg).get("process"))


def process_list(msg: dict[str, Any]) -> list[dict[str, Any]]:
    procs = _result(msg).get("processes")
    if not isinstance(procs, list) or len(procs) > MAX_PROCESSES:
        raise BadReply("reply has no valid processes")
    return [process(x) for x in procs]


def process_read(msg: dict[str, Any], data: bytes, start: int, max_bytes: int) -> dict[str, Any]:
    """``{from, next, gap, chunks: [(offset, fd, bytes)], process}`` of a ``pread`` reply.

    The records must tile the payload exactly, in order, without overlap, from ``start``
    plus the gap on, at most ``max_bytes`` in all, and end where ``next`` says: a guest
    cannot hand a reader bytes twice nor skip any it does not call lost."""
    res = _result(msg)
    records = res.get("records")
    gap = integer(res.get("gap"), 0, MAX_JSON_INT)
    nxt = integer(res.get("next"), 0, MAX_JSON_INT)
    if res.get("from") != start or gap is None or nxt is None or not isinstance(records, list):
        raise BadReply("reply has no valid from/next/gap/records")
    if len(data) > max_bytes or len(records) > max_bytes:
        raise BadReply("reply carries more output than asked")
    pos, used, chunks = start + gap, 0, []
    for rec in records:
        if not isinstance(rec, dict):
            raise BadReply("a record is not an object")
        off, n = integer(rec.get("o"), 0, MAX_JSON_INT), integer(rec.get("n"), 1, max_bytes)
        if off != pos or n is None or rec.get("fd") not in (1, 2):
            raise BadReply("records do not follow each other")
        chunks.append((off, int(rec["fd"]), data[used : used + n]))
        pos, used = pos + n, used + n
    if used != len(data) or nxt != pos:
        raise BadReply("records do not match the payload or next")
    proc = process(res.get("process"))
    if proc["journal"]["end"] < nxt:
        raise BadReply("reply reads past the journal's end")
    return {"from": start, "next": nxt, "gap": gap, "chunks": chunks, "process": proc}


def stream_out(msg: dict[str, Any], offset: int) -> tuple[int, bytes] | None:
    """(fd, bytes) of an ``out`` chunk of a stream now at ``offset``: its ``o`` must be
    ``offset`` plus its length (None otherwise: the stream is not to be trusted)."""
    data = payload(msg)
    if data is None or not data or integer(msg.get("o"), 0, MAX_JSON_INT) != offset + len(data):
        return None
    return out_fd(msg), data


def gap(msg: dict[str, Any]) -> int | None:
    return integer(msg.get("n"), 1, MAX_JSON_INT)


def stdin_result(msg: dict[str, Any], sent: int) -> dict[str, Any]:
    res = _result(msg)
    written = integer(res.get("written"), 0, sent)
    if written is None:
        raise BadReply("reply has no valid written count")
    return {"written": written, "closed": res.get("closed") is True}
