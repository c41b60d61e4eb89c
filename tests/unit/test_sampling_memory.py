"""The metrics sampler reads a QEMU's memory (smaps_rollup, a page-table walk) every sample
while its VM runs, but once per state while it is live-paused: before and after its offload.
At hundreds of idle VMs the walks cost the node a good part of a core (docs/benchmarks/density.md)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from pal.manager import sampling
from pal.manager.vm import LivePause
from pal.vmm import usage
from tests.fakes import live_vm


def test_a_paused_qemu_is_read_once_before_and_once_after_its_offload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks = itertools.count(1)  # each walk sees a different resident size, as the kernel would
    monkeypatch.setattr(usage, "process_memory", lambda pid: usage.ProcessMemory(next(walks) << 20, 1 << 20))
    monkeypatch.setattr(usage, "cpu_ns", lambda pid, cg: (0, "proc"))
    lv = live_vm(tmp_path, "vm-1", pid=4242, memory_mib=256)

    def rss_mib() -> int:
        reading = sampling._read(lv, 15.0, None)
        assert reading.rss_bytes is not None
        return reading.rss_bytes >> 20

    assert [rss_mib(), rss_mib()] == [1, 2], "a running VM is read at every sample"
    lv.live = LivePause(by="idle", since=time.time())
    assert [rss_mib(), rss_mib(), rss_mib()] == [3, 3, 3], "paused: its QEMU does not change"
    lv.live.offloaded = True
    assert [rss_mib(), rss_mib()] == [4, 4], "the offload changed it: read again, once"
    lv.live = None  # resumed
    assert [rss_mib(), rss_mib()] == [5, 6]
    lv.live = LivePause(by="operator", since=time.time())  # a new pause reads afresh
    assert rss_mib() == 7
