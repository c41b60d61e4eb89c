"""The API load of `pal bench control-plane`: each operation through the public API of
every replica in turn (a follower forwards what only the leader does), many in flight,
with each call's latency; and the reads (GET, list pages by cursor, the metadata filter).

The control plane's own time of an operation is its latency minus what the simulated node
took (:class:`pal_tools.bench.simnode.SimTimes`), which the caller subtracts.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pal_tools.bench.common import pct

RUNTIME = "/v1/runtime"


@dataclass
class OpResult:
    op: str
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    samples_ms: list[float] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)
    node_ms: float = 0.0  # what the simulated node took of each call

    def summary(self) -> dict[str, Any]:
        cp = [max(0.0, s - self.node_ms) for s in self.samples_ms]
        return {
            "ok": self.ok,
            "errors": self.errors,
            "seconds": round(self.seconds, 2),
            "perSec": round(self.ok / self.seconds, 1) if self.seconds else None,
            "p50Ms": round(pct(self.samples_ms, 0.5), 1) if self.samples_ms else None,
            "p99Ms": round(pct(self.samples_ms, 0.99), 1) if self.samples_ms else None,
            "nodeMs": self.node_ms,
            "cpP50Ms": round(pct(cp, 0.5), 1) if cp else None,
            "cpP99Ms": round(pct(cp, 0.99), 1) if cp else None,
            "firstErrors": self.first_errors[:5],
        }


class Load:
    """Async clients of each replica, used in turn (round robin over requests)."""

    def __init__(self, urls: Sequence[str], key: str, concurrency: int) -> None:
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
        self.clients = [
            httpx.AsyncClient(
                base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
            )
            for u in urls
        ]
        self.concurrency = concurrency
        self._turn = itertools.cycle(range(len(self.clients)))

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    def client(self) -> httpx.AsyncClient:
        return self.clients[next(self._turn)]

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.client().request(method, path, **kw)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path} -> {r.status_code} {r.text[:200]}")
        return r.json() if r.content else None

    async def run(
        self,
        op: str,
        items: Sequence[Any] | None,
        one: Callable[[Any], Awaitable[Any]],
        *,
        seconds: float | None = None,
        node_ms: float = 0.0,
    ) -> tuple[OpResult, list[Any]]:
        """``one(item)`` for each of ``items`` (or, without items, as many as fit in
        ``seconds``), ``concurrency`` at a time; the results of those that succeeded."""
        res = OpResult(op, node_ms=node_ms)
        out: list[Any] = []
        todo = iter(items) if items is not None else itertools.count()
        deadline = time.monotonic() + seconds if seconds is not None else None
        lock = asyncio.Lock()

        async def worker() -> None:
            while True:
                async with lock:
                    if deadline is not None and time.monotonic() >= deadline:
                        return
                    item = next(todo, StopIteration)
                if item is StopIteration:
                    return
                t = time.perf_counter()
                try:
                    got = await one(item)
                except Exception as exc:
                    res.errors += 1
                    if len(res.first_errors) < 5:
                        res.first_errors.append(str(exc)[:300])
                    continue
                res.samples_ms.append((time.perf_counter() - t) * 1000)
                res.ok += 1
                out.append(got)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        res.seconds = time.perf_counter() - t0
        return res, out


SPEC = {"metadata": {"team": "bench", "run": "cp"}}


async def operations(
    load: Load, *, seconds: float, sample: int, forks: int, times: Any, mark: Callable[[str], None]
) -> dict[str, OpResult]:
    """Schedule for ``seconds``; pause, resume and fork some of those; delete them all.
    ``mark(op)`` after each (the caller's snapshot of the database's statements)."""

    async def schedule(_: Any) -> str:
        return str((await load.call("POST", f"{RUNTIME}/schedule", json=SPEC))["vmId"])

    async def pause(vm: str) -> str:
        await load.call("POST", f"{RUNTIME}/vms/{vm}/pause")
        return vm

    async def resume(vm: str) -> str:
        await load.call("POST", f"{RUNTIME}/vms/{vm}/resume")
        return vm

    async def fork(vm: str) -> list[str]:
        got = await load.call("POST", f"{RUNTIME}/vms/{vm}/fork", json={"count": 1})
        return [c["vmId"] for c in got["forks"]]

    async def delete(vm: str) -> str:
        await load.call("DELETE", f"{RUNTIME}/vms/{vm}")
        return vm

    out: dict[str, OpResult] = {}
    r, vms = await load.run("schedule", None, schedule, seconds=seconds, node_ms=times.spawn_ms)
    out["schedule"] = r
    mark("schedule")
    r, paused = await load.run("pause", vms[:sample], pause, node_ms=times.snapshot_ms)
    out["pause"] = r
    mark("pause")
    r, _ = await load.run("resume", paused, resume, node_ms=times.restore_ms)
    out["resume"] = r
    mark("resume")
    r, children = await load.run("fork", vms[:forks], fork, node_ms=times.snapshot_ms + times.restore_ms)
    out["fork"] = r
    mark("fork")
    doomed = vms + [c for cs in children for c in cs]
    r, _ = await load.run("delete", doomed, delete, node_ms=times.stop_ms)
    out["delete"] = r
    mark("delete")
    return out


async def reads(load: Load, sample: list[str], *, team: str, job: str, n: int) -> dict[str, OpResult]:
    """GET of random VMs of the tenant; the list's first page and pages further on (by
    cursor); the metadata filter (2 % and 0.1 % of the VMs), 100 a page."""
    rng = random.Random(35)

    async def get(vm: str) -> None:
        await load.call("GET", f"{RUNTIME}/vms/{vm}")

    async def walk(params: dict[str, str], pages: int) -> list[float]:
        took, cursor = [], None
        for _ in range(pages):
            q = dict(params, limit="100", **({"cursor": cursor} if cursor else {}))
            t = time.perf_counter()
            got = await load.call("GET", f"{RUNTIME}/vms", params=q)
            took.append((time.perf_counter() - t) * 1000)
            cursor = got.get("nextCursor")
            if not cursor:
                break
        return took

    out: dict[str, OpResult] = {}
    r, _ = await load.run("get", [rng.choice(sample) for _ in range(n)], get)
    out["get"] = r
    for name, params in (
        ("list", {}),
        ("listTeam", {"metadata.team": team}),
        ("listJob", {"metadata.job": job}),
    ):
        res = OpResult(name)
        t0 = time.perf_counter()
        for _ in range(max(1, n // 100)):
            try:
                res.samples_ms += await walk(params, 10)
                res.ok += 1
            except Exception as exc:
                res.errors += 1
                res.first_errors.append(str(exc)[:300])
        res.seconds = time.perf_counter() - t0
        out[name] = res
    return out
