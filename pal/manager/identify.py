"""A guest takes its identity: the first exchange with every booted, restored or unparked
guest (clock, RNG seed, token, MAC, the tenant CA to trust when it has brokered secrets)."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pal.errors import BackendError, GuestTimeout
from pal.guest import protocol as p
from pal.manager import guest_clock
from pal.manager import guest_input as gi
from pal.manager.channel import HarnessChannel
from pal.vmm.host_cpu import LoadSampler, Stretch
from pal.vmm.qemu import QemuVm

STRETCH_SLICE_S = 0.25  # how often a stretched timeout looks at the load


@dataclass(frozen=True)
class Identity:
    vm_id: str
    incarnation: int
    token: str
    env: dict[str, str] = field(default_factory=dict)
    mac: str = ""
    ca: str = ""  # PEM of the tenant CA (brokered secrets), else ""
    own: bool = True  # a tenant's VM (False: a template's or a pooled VM's; protocol.py)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # {export, path, ro} (volumes)

    def message(self, hb_interval: float) -> p.Message:
        return {
            "own": self.own,
            "ca_pem": self.ca,
            "mac": self.mac,
            "k": p.K_IDENTIFY,
            "vm_id": self.vm_id,
            "incarnation": self.incarnation,
            "token": self.token,
            "now_ns": time.time_ns(),
            "seed": secrets.token_hex(64),
            "env": self.env,
            "hb_interval": hb_interval,
            "mounts": self.mounts,
        }


async def identify(
    channel: HarnessChannel,
    qemu: QemuVm,
    who: Identity,
    timeout: float,
    hb_interval: float,
    load: LoadSampler | None = None,
) -> dict[str, Any]:
    """Give the guest its identity and wait for it to say so. Returns the timing of the
    steps: the guest's own (µs) and, from the host, ``first_line_ms`` (the guest's first
    word since the request) and ``reply_ms`` (its answer).

    The answer names the VM and incarnation it took, so no heartbeat is awaited on top
    (it follows the answer; waiting for it cost a cold heartbeat path per restore).

    With ``load``, ``timeout`` is seconds of an uncontended CPU (host_cpu.Stretch): a busy
    host, or a long queue of restores, gives the guest longer."""
    t0 = time.monotonic()
    channel.first_line_at = 0.0  # a parked guest's channel heard it long ago
    budget = Stretch(timeout, load) if load is not None else None
    plain = None if budget is not None else timeout
    waiter = asyncio.create_task(channel.request(who.message(hb_interval), timeout=plain))
    died = asyncio.create_task(qemu.exited.wait())
    try:
        done = await _first_of(waiter, died, budget)
        if not done:
            assert budget is not None
            raise GuestTimeout(f"VM {who.vm_id}: guest did not answer identify in {budget.describe()}")
        if died in done and waiter not in done:
            raise BackendError(f"VM {who.vm_id}: QEMU exited while booting")
        reply, _ = waiter.result()
        t_reply, received_ns = time.monotonic(), time.time_ns()
        result = reply.get("result") or {}
        if result.get("vm_id") != who.vm_id or result.get("incarnation") != who.incarnation:
            raise BackendError(
                f"VM {who.vm_id}: the guest answered identify as {gi.text(str(result.get('vm_id')))} "
                f"incarnation {gi.text(str(result.get('incarnation')))}"
            )
        channel.heard()
        lag = await guest_clock.correct(channel, result, received_ns)
        steps = result.get("steps_us")
        out: dict[str, Any] = {
            f"guest_{k}_us": v
            for k, v in (steps.items() if isinstance(steps, dict) else ())
            if isinstance(v, int) and not isinstance(v, bool)
        }
        if channel.first_line_at:
            out["first_line_ms"] = round((channel.first_line_at - t0) * 1000, 1)
        out["reply_ms"] = round((t_reply - t0) * 1000, 1)
        out["clock_lag_ms"] = round(lag / 1e6, 1)
        return out
    finally:
        for t in (waiter, died):
            t.cancel()
        await asyncio.gather(waiter, died, return_exceptions=True)


async def _first_of(
    waiter: asyncio.Task[Any], died: asyncio.Task[Any], budget: Stretch | None
) -> set[asyncio.Task[Any]]:
    """The tasks done first; empty when the stretched budget ran out."""
    while True:
        slice_s = None if budget is None else STRETCH_SLICE_S
        done, _ = await asyncio.wait({waiter, died}, timeout=slice_s, return_when=asyncio.FIRST_COMPLETED)
        if done:
            return done
        assert budget is not None
        if budget.expired:
            return set()
