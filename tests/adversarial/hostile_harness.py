"""A hostile guest, run as root inside a real VM by tests/adversarial/test_hostile_guest.py.

It does what a guest that owns its kernel can do to the host's side of the channel: it
takes a duplicate of the harness's own virtio-serial descriptor from PID 1
(``pidfd_getfd``: root in the guest may), and writes whatever it likes on it, beside the
real harness. What it writes is chosen by the word in ``/workspace/mode``, re-read between
rounds:

- ``hb``: heartbeats that lie (always active, last activity in the far future) and
  heartbeats of every wrong type (strings, floats, lists, negative and huge numbers,
  control characters), a few dozen per second;
- ``garbage``: random bytes, invalid UTF-8, frames of 3 MiB, JSON nested 200 000 deep,
  numbers of 5 000 digits, non-hashable and boolean ids, unknown kinds, replies to
  requests it never got (``err`` with terminal escapes and forged log lines, ``out`` with
  invalid base64);
- ``stop``: exits.

Stdlib only (the guest's Python). Writes ``/workspace/hostile.log`` (what it sent, for a
failing test's message); the test reads nothing else from it.
"""

import ctypes
import json
import os
import random
import select
import sys
import time

SYS_PIDFD_GETFD = 438  # x86_64
MODE = "/workspace/mode"
LOG = "/workspace/hostile.log"


def log(text):
    with open(LOG, "a") as f:
        f.write(text + "\n")


def harness_port():
    """A duplicate of PID 1's descriptor on the agent's virtio port."""
    libc = ctypes.CDLL(None, use_errno=True)
    for n in os.listdir("/proc/1/fd"):
        try:
            target = os.readlink("/proc/1/fd/" + n)
        except OSError:
            continue
        if target.startswith("/dev/vport"):
            pidfd = os.pidfd_open(1)
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(n), 0)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "pidfd_getfd")
            return fd
    raise SystemExit("no virtio port open in PID 1")


def send(fd, data):
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # the harness's descriptor may be non-blocking
            select.select([], [fd], [], 1.0)
            continue
        view = view[n:]


def line(obj):
    return json.dumps(obj).encode() + b"\n"


def lying_heartbeats(vm_id):
    far = 2**62
    bad = [
        {"id": 0, "k": "hb", "last_activity_ms": "soon", "incarnation": "x", "active": "yes"},
        {"id": 0, "k": "hb", "last_activity_ms": 1e308, "incarnation": [1], "mem_used": -1, "mem_total": "x"},
        {
            "id": 0,
            "k": "hb",
            "last_activity_ms": -5,
            "incarnation": 2**70,
            "uptime_s": "nan",
            "disk_used": 2**80,
        },
        {"id": 0, "k": "hb", "vm_id": "../../etc\x1b[2J\nforged log line", "boot_id": "\x07" * 10000},
        {"id": 0, "k": "hb", "last_activity_ms": None, "active": None, "mem_total": 1.5, "disk_total": []},
    ]
    # The claim that matters last, so it is the one the host holds most of the time.
    good = {"id": 0, "k": "hb", "vm_id": vm_id, "active": True, "last_activity_ms": far, "uptime_s": 1.0}
    return b"".join(line(m) for m in bad) + line(good)


def garbage(rng):
    """One round: cheap malformed lines first (they end the channel within a round), then
    the heavy ones (a frame over the host's line limit, deep nesting, huge numbers)."""
    evil = "\x1b[31mEVIL\x1b[0m\nERROR forged log line\r" * 200
    parts = []
    for i in range(40):
        parts += [
            bytes(rng.getrandbits(8) for _ in range(256)).replace(b"\n", b" ") + b"\n",
            b"\xff\xfe\xfd invalid utf-8 \xc3\x28\n",
            line({"id": [i], "k": "ok", "result": {}}),
            line({"id": {"a": i}, "k": "exit", "code": 0}),
            line({"id": True, "k": "ok"}),
            line({"id": 1.5, "k": "out", "fd": 1, "data": "eA=="}),
            line({"id": 2**80, "k": "ok"}),
            line({"id": 0, "k": "exec", "argv": ["/bin/sh"]}),
            line({"id": 7, "k": "\x00kind"}),
            line([1, 2, 3]),
            b"null\n",
        ]
    for rid in range(1, 100):
        parts.append(line({"id": rid, "k": "err", "code": "\x1bEVIL", "msg": evil}))
        parts.append(line({"id": rid, "k": "out", "fd": 1, "data": "!!not base64!!"}))
    parts += [
        b"[" * 200_000 + b"]" * 200_000 + b"\n",
        b'{"id":0,"k":"hb","x":' + b"{" * 100_000 + b"\n",
        b'{"id":0,"k":"hb","last_activity_ms":' + b"9" * 5000 + b"}\n",
        b"x" * (3 * 1024 * 1024) + b"\n",  # over the host's line limit (~1.4 MiB)
    ]
    return parts


def main():
    vm_id = sys.argv[1] if len(sys.argv) > 1 else ""
    fd = harness_port()
    rng = random.Random(9)
    log("took PID 1's port")
    rounds = {}
    while True:
        try:
            with open(MODE) as f:
                mode = f.read().strip()
        except OSError:
            mode = "hb"
        if mode == "stop":
            log(f"stop after {rounds}")
            return
        rounds[mode] = rounds.get(mode, 0) + 1
        if mode == "garbage":
            for part in garbage(rng):
                send(fd, part)
        else:
            send(fd, lying_heartbeats(vm_id))
            time.sleep(0.05)


if __name__ == "__main__":
    main()
