"""The stats verb (issue 38's demonstration of a guest verb added in four files): the guest
answers from /proc, the node relays it with no code of its own (pal/manager/guest_relay.py)
and checks what the guest says against the answer model, and the API shows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pal.errors import NotFound, Unavailable
from pal.guest import protocol as p
from pal.manager.channel import GuestError
from pal.manager.guest_relay import relay
from pal.manager.vm import VmRegistry
from pal.wire import verbs
from pal.wire.processes import ProcessRef, ProcessStats
from tests.fakes import live_vm
from tests.harnesshost import TOKEN, Host


def _stats(host: Host, pid: int) -> dict[str, Any]:
    reply = host.call("pstats", tok=TOKEN, pid=pid)
    assert reply["k"] == p.K_OK, reply
    ProcessStats.model_validate(reply["result"])  # what the node takes
    return dict(reply["result"])


def test_the_guest_reads_a_running_process_and_an_ended_one(host: Host) -> None:
    started = host.call(p.K_PSTART, tok=TOKEN, argv=["/bin/sh", "-c", "echo up; read line"], stdin=True)
    pid = started["result"]["process"]["pid"]
    # once it printed, it is the shell (not a child between fork and exec, which has no memory yet)
    host.call(p.K_PREAD, tok=TOKEN, pid=pid, wait_ms=10_000, **{"from": 0})
    now = _stats(host, pid)
    assert now["pid"] == pid and now["running"] is True and now["state"] in ("S", "R")
    assert now["threads"] >= 1 and now["rss_bytes"] > 0
    assert now["cpu_user_ms"] >= 0 and now["cpu_system_ms"] >= 0
    host.call(p.K_PSTDIN, b"x\n", tok=TOKEN, pid=pid, eof=True)
    while host.call(p.K_PWAIT, tok=TOKEN, pid=pid, timeout_ms=10_000)["result"]["process"]["running"]:
        pass
    ended = _stats(host, pid)
    assert (ended["running"], ended["state"]) == (False, "exited")
    assert [ended[k] for k in ("cpu_user_ms", "cpu_system_ms", "rss_bytes", "threads")] == [None] * 4
    gone = host.call("pstats", tok=TOKEN, pid=pid + 1000)
    assert (gone["k"], gone["code"]) == (p.K_ERR, p.ERR_NOENT)


def _registry(tmp_path: Path, reply: Any) -> VmRegistry:
    reg = VmRegistry(tmp_path, lambda vm_id, b: None)
    lv = reg.vms["vm-1"] = live_vm(tmp_path, "vm-1")

    async def request_in_flight(msg: p.Message, data: bytes | None = None, **kw: Any) -> Any:
        assert msg == {"k": "pstats", "pid": 3}, "the request's fields but its VM"
        if isinstance(reply, Exception):
            raise reply
        return {"k": p.K_OK, "result": reply}, b""

    lv.request_in_flight = request_in_flight  # type: ignore[method-assign]
    return reg


async def test_the_node_relays_it_and_checks_what_the_guest_says(tmp_path: Path) -> None:
    good = {"pid": 3, "running": True, "state": "S", "cpu_user_ms": 5, "cpu_system_ms": 1}
    good |= {"rss_bytes": 4096, "threads": 1, "extra": "dropped"}
    handle = relay(_registry(tmp_path, good), verbs.PROCESS_STATS)
    got = await handle(ProcessRef(vm_id="vm-1", pid=3))
    assert got == ProcessStats(
        pid=3, running=True, state="S", cpu_user_ms=5, cpu_system_ms=1, rss_bytes=4096, threads=1
    )
    for hostile in ({**good, "rss_bytes": -1}, {**good, "state": "x" * 100}, {**good, "threads": "many"}, []):
        with pytest.raises(Unavailable, match="invalid reply") as err:
            await relay(_registry(tmp_path, hostile), verbs.PROCESS_STATS)(ProcessRef(vm_id="vm-1", pid=3))
        assert err.value.code == "GUEST_ERROR"
    missing = relay(_registry(tmp_path, GuestError(p.ERR_NOENT, "no process 3")), verbs.PROCESS_STATS)
    with pytest.raises(NotFound) as nf:
        await missing(ProcessRef(vm_id="vm-1", pid=3))
    assert nf.value.code == "PROCESS_NOT_FOUND", "mapped as process requests' errors"
