"""Issue 9 item 3: idleness is decided from what the host observes, and that includes the
guest's network traffic through the egress gateway (not only execs, files and ports)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pal.manager.metrics import MetricsBook
from pal.manager.sampling import Sampler
from pal.manager.vm import LiveVm, VmRegistry
from tests.fakes import live_vm


def _vm(tmp_path: Path, vm_id: str, last_ms: int) -> LiveVm:
    return live_vm(tmp_path, vm_id, last_activity_ms=last_ms)


def test_bytes_through_the_gateway_count_as_host_observed_activity(tmp_path: Path) -> None:
    counters: dict[str, tuple[int, int]] = {"vm-net": (10, 20), "vm-quiet": (5, 5), "vm-live": (1, 1)}
    registry = VmRegistry(tmp_path / "vms", lambda *_: None)
    rt = Sampler(registry, MetricsBook(interval_s=5), heartbeat_interval_s=5, net_counters=counters.get)
    vms = [_vm(tmp_path, v, last_ms=1000) for v in counters]
    vms.append(_vm(tmp_path, "vm-unknown", last_ms=1000))  # the gateway does not know it
    vms[2].live = SimpleNamespace()  # type: ignore[assignment]  # live-paused
    rt.stamp_network_activity(vms)  # the first sample only records the counters
    assert [v.last_activity_ms for v in vms] == [1000] * 4

    counters["vm-net"] = (10, 4096)  # the guest sent something
    counters["vm-live"] = (9, 1)  # bytes held for a live-paused guest: not its activity
    rt.stamp_network_activity(vms)
    net, quiet, live, unknown = vms
    assert net.last_activity_ms > 1000
    assert quiet.last_activity_ms == live.last_activity_ms == unknown.last_activity_ms == 1000

    before = net.last_activity_ms
    rt.stamp_network_activity(vms)  # nothing moved since: no new stamp
    assert net.last_activity_ms == before
