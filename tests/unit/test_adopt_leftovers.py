"""Adoption never leaves a QEMU without an owner (pal/manager/adopt.py): the QEMUs under a
data dir's ``vms/`` are found by what their command lines name, whatever state file they
have or lack, and only this data dir's (a path that merely contains it is another's)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.manager.adopt import _kill_all, _qemus_labelled


def _fake_qemu(vms: Path, slot: str) -> subprocess.Popen[bytes]:
    """A process that looks like a QEMU of ``slot`` in ``ps``: its argv[0] and the labels
    handoff.py gives QEMU (``-name pal-<slot>``, ``-add-fd ...,opaque=<path>``)."""
    code = "import time; time.sleep(600)"
    argv = ["qemu-system-x86_64", "-c", code, "-name", f"pal-{slot},process=pal-{slot}"]
    argv += ["-add-fd", f"fd=3,set=1,opaque={vms}/{slot}/disk"]
    return subprocess.Popen(argv, executable=sys.executable)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for p in made:
        p.kill()
        p.wait()


def test_leftover_qemus_are_found_by_their_labels_and_killed(tmp_path: Path, procs: list) -> None:
    vms = tmp_path / "d" / "vms"
    other = Path(f"{tmp_path}/x{tmp_path}/d")  # holds this data dir's path inside its own
    procs += [_fake_qemu(vms, "s-aaaa"), _fake_qemu(vms, "s-bbbb"), _fake_qemu(other / "vms", "s-cccc")]
    mine = _qemus_labelled(f"{vms}/")
    assert {mine[p.pid] for p in procs[:2]} == {"s-aaaa", "s-bbbb"} and procs[2].pid not in mine
    assert _qemus_labelled(f"{vms / 's-aaaa'}/") == {procs[0].pid: "s-aaaa"}
    assert _kill_all({procs[0].pid: "s-aaaa"})
    assert not Path(f"/proc/{procs[0].pid}").exists(), "killed and reaped"
    assert procs[1].poll() is None and procs[2].poll() is None
    assert procs[0].pid not in _qemus_labelled(f"{vms}/")
