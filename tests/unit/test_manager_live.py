"""Live pause on the node, the parts that need no VM: the notice board the scheduler polls,
the offload recipe on a real process mapping a shared file, and guest probe replies."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pal.manager import guest_input as gi
from pal.manager.notices import NoticeBoard
from pal.vmm import offload

MIB = 1024 * 1024


async def test_notices_are_numbered_kept_per_epoch_and_long_polled() -> None:
    board = NoticeBoard(keep=3)
    board.post("vm-1", "wait-ready")
    got = board.since(0, "")
    assert [n.seq for n in got.notices] == [1] and got.epoch == board.epoch and got.seq == 1
    assert board.since(1, board.epoch).notices == []
    assert [n.seq for n in board.since(1, "another-epoch").notices] == [1]  # a restart: all again
    waiter = asyncio.create_task(board.wait(1, board.epoch, 30))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    board.post("vm-1", "wake", reason="data (first-byte)")
    got = await asyncio.wait_for(waiter, 5)
    assert [(n.kind, n.reason) for n in got.notices] == [("wake", "data (first-byte)")]
    assert (await board.wait(2, board.epoch, 0)).notices == []  # no wait asked: at once
    for _ in range(5):
        board.post("vm-2", "offloaded", ms=1.0, freed_mib=2, resident_mib=0)
    assert [n.seq for n in board.since(0, board.epoch).notices] == [5, 6, 7]  # bounded


async def test_closing_the_board_ends_every_long_poll_at_once() -> None:
    """A node shutting down answers the scheduler's long poll now: its RPC server waits
    for requests in flight, so an open poll held every `pal up` stop for a whole poll."""
    board = NoticeBoard()
    waiters = [asyncio.create_task(board.wait(0, board.epoch, 30)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiters)
    board.close()
    for got in await asyncio.wait_for(asyncio.gather(*waiters), 5):
        assert got.notices == []
    assert (await asyncio.wait_for(board.wait(0, board.epoch, 30), 5)).notices == []


def test_probe_replies_are_checked() -> None:
    ok = {"result": {"runnable": 0, "cpu_busy": 5, "cpu_total": 10, "timer_ms": None}}
    assert gi.probe(ok) == {"runnable": 0, "cpu_busy": 5, "cpu_total": 10, "timer_ms": None}
    for bad in (
        {"result": {"runnable": -1, "cpu_busy": 5, "cpu_total": 10}},
        {"result": {"runnable": 0, "cpu_busy": 11, "cpu_total": 10}},
        {"result": {"runnable": True, "cpu_busy": 1, "cpu_total": 10}},
        {"result": "x"},
    ):
        with pytest.raises(gi.BadReply):
            gi.probe(bad)
    assert gi.probe({"result": {**ok["result"], "timer_ms": "soon"}})["timer_ms"] is None


def test_coalesce_joins_close_runs() -> None:
    assert offload.coalesce([(0, 4096), (8192, 4096), (1 << 20, 4096)], gap=64 * 1024) == [
        (0, 12288),
        (1 << 20, 4096),
    ]
    assert offload.coalesce([]) == []


CHILD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, int(sys.argv[2]), mmap.MAP_SHARED)
for i in range(0, int(sys.argv[3]), 4096):
    m[i] = (i // 4096) % 251 or 1
print("ready", flush=True)
sys.stdin.read(1)  # stopped here, like a guest with its vCPUs stopped
print(sum(m[i] for i in range(0, int(sys.argv[3]), 4096)), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="process_madvise on another process needs CAP_SYS_NICE (root)")
def test_offload_hands_a_shared_file_mapping_back_and_prefetch_brings_it_again(tmp_path: Path) -> None:
    """The recipe on a real process standing in for QEMU: 32 MiB of a 64 MiB shared RAM
    file dirtied; offload leaves (almost) none of it resident; the data is intact."""
    ram = tmp_path / "mem"
    with open(ram, "wb") as f:
        f.truncate(64 * MIB)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ram), str(64 * MIB), str(32 * MIB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        m = offload.find_mapping(child.pid, ram)
        assert m.shared and m.size == 64 * MIB
        assert offload.resident_bytes(child.pid, ram) >= 32 * MIB
        res = offload.offload(child.pid, ram)
        assert res.shared and res.resident_before >= 32 * MIB
        assert res.resident_after <= res.resident_before * 0.1, res
        assert res.freed >= 0.9 * res.resident_before and set(res.phases_ms) >= {
            "fsync",
            "pageout",
            "fadvise",
        }
        assert sum(n for _, n in res.working_set) == res.resident_before
        assert offload.prefetch(ram, res.working_set) == sum(n for _, n in offload.coalesce(res.working_set))
        child.stdin.write("x")
        child.stdin.flush()
        want = sum((i // 4096) % 251 or 1 for i in range(0, 32 * MIB, 4096))
        assert int(child.stdout.readline()) == want, "every page came back with its data"
    finally:
        child.kill()
        child.wait()
