"""Issue 27 item 3: a fork fan-out of 50 on a busy 2-core host brings every child up.

Restores are admitted by the CPU that is free (pal/manager/restore_gate.py) and a guest's
first answer is timed in CPU time stretched by the load (pal/vmm/host_cpu.py), so a long
queue or other people's load makes children slower, never failed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import PalServer, qemu_pids_under
from tests.leaks import vm_dir_of

pytestmark = pytest.mark.vm

N = 50


def test_fork_50_every_child_comes_up_and_answers(pal_server: PalServer) -> None:
    key = pal_server.tenant("it-fanout", max_vms=N + 1)
    with pal_server.client(key, timeout=1800) as api:
        src = api.post("/v1/runtime/schedule", json={}).json()["vmId"]
        kids: list[str] = []
        kid_dirs: list[Path] = []
        try:
            api.put(f"/v1/runtime/vms/{src}/files/content", params={"path": "seed.txt"}, content="parent\n")
            r = api.post(f"/v1/runtime/vms/{src}/fork", json={"count": N})
            assert r.status_code == 200, r.text
            forks = r.json()["forks"]
            kids = [f["vmId"] for f in forks]
            assert len(set(kids)) == N
            failed = [f for f in forks if f["state"] != "running" or "error" in f]
            assert not failed, f"{len(failed)} of {N} children did not come up: {failed[:3]}"

            def answers(k: str) -> tuple[str, int, str]:
                out = api.post(
                    f"/v1/runtime/vms/{k}/exec",
                    json={"command": "/bin/sh", "argv": ["-c", "cat seed.txt; cat /etc/hostname"]},
                )
                return k, out.status_code, out.text

            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(answers, kids))
            bad = [(k, code, text[:200]) for k, code, text in replies if code != 200]
            assert not bad, bad
            for _, _, text in replies:
                body = httpx.Response(200, content=text).json()
                assert body["exitCode"] == 0 and body["stdout"].startswith("parent\n"), body
            views = [api.get(f"/v1/runtime/vms/{k}").json() for k in kids]
            assert {v["state"] for v in views} == {"running"}
            assert {v["parentVmId"] for v in views} == {src}
            kid_dirs = [vm_dir_of(pal_server.data_dir, k) for k in kids]
            assert all(qemu_pids_under(d) for d in kid_dirs), "each child has its QEMU in its slot"
        finally:
            for k in [*kids, src]:
                api.delete(f"/v1/runtime/vms/{k}")
    for d in kid_dirs:  # the pool is off in tests: nothing takes a freed slot meanwhile
        assert qemu_pids_under(d) == []
