"""The claimable warm pool: VMs restored from their image's and size's template ahead of
time, then live-paused and offloaded, for a schedule of that image and size to claim
(docs/lifecycle.md, "The warm pool"). An entry of PAL_POOL is a size of the default image
or ``<image>@<size>`` (sizes.pool_entry): its key here.

- **Fill** (in the background, one VM at a time): a VM of a pooled entry is spawned under a
  pool id of its own (``pool-…``) from the template, exactly as a tenant's would be, but
  kept out of the registry: no heartbeat reports it, no API call reaches it, the gateway
  forgets it. It is primed (the image's no-op commands; an image whose template started a
  kernel runs an empty cell in it, which leaves no state), then its vCPUs are stopped and
  its RAM handed back (offload.py): it costs its QEMU's own memory and a few MiB of guest
  RAM. One whose template started a kernel keeps its RAM (a claim's first cell would read
  the kernel back page by page). It has never run a tenant's code.
- **Claim** (spawn.py asks first, for a schedule of a pooled image and size): one pooled
  VM is taken (in memory, without an await: never two claims of one VM), its slot is
  re-keyed to the tenant's vm id (slots.py), the gateway gets the tenant's policy, limits,
  secrets and wait rule on fresh sockets, its working set is read back, its vCPUs run, and
  it takes the tenant's identity like any restored guest (identify.py: incarnation,
  token, env, a new MAC and hostname, an RNG reseed, the host's clock, the tenant CA).
  Then it enters the registry and its state file is rewritten as the tenant's: that
  write is the claim's commit.
- **Crash safety**: until that commit its state file says ``pooled``, and a restarted
  manager never adopts a pooled VM (adopt.py kills it and frees its slot), so a crash
  mid-claim leaves the tenant's spawn failed (the scheduler settles it) and the VM gone,
  never handed to anyone twice nor leaked. After the commit it is the tenant's VM.
- **Cost**: each pooled VM holds its QEMU (RSS, mostly TCG and device state) and what of
  its guest RAM stayed resident after the offload; ``status`` measures both.
  ``PAL_POOL_MEMORY_MIB`` bounds the guest RAM the pool may add up to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pal import failpoints, sizes
from pal.config import Settings
from pal.errors import Unavailable
from pal.guest import protocol as p
from pal.images.paths import load_image
from pal.manager.identify import identify
from pal.manager.refill import StandingSet
from pal.manager.restore import brokered_of, continued_timings, identity_of
from pal.manager.spawned import disk_limits, spawn_result
from pal.manager.templates import (
    PRIME_COMMANDS,
    PRIME_TIMEOUT_S,
    TemplateCache,
    TemplateHost,
    warm_kernel,
    warm_kernel_language,
)
from pal.manager.vm import LiveVm, VmRegistry, kill_quietly
from pal.manager.vm_states import VmPhase, check_move
from pal.manager.vmnet import VmNetworking, limits_json, wait_rule
from pal.vmm import offload
from pal.wire.models import SpawnRequest, SpawnResult

log = logging.getLogger(__name__)

POOL_ID_PREFIX = "pool-"
PREFETCH_WAIT_S = 2.0  # a claim waits this long at most for the working set
REFILL_AFTER_CLAIM_S = 5.0  # a claim's refill starts this long after it


@dataclass
class PooledVm:
    lv: LiveVm
    size: str  # the pool entry's key (sizes.pool_entry): a size, or <image>@<size>
    working_set: list[tuple[int, int]] = field(default_factory=list)
    made_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int | None:
        return self.lv.qemu.pid


@dataclass
class PoolDeps:
    """Exactly what the pool needs of the node."""

    settings: Settings
    registry: VmRegistry
    net: VmNetworking
    spawn_pooled: Callable[[SpawnRequest], Awaitable[LiveVm]]  # spawn.Spawner.spawn_pooled
    free_vm_files: Callable[[str, str], Awaitable[Any]]  # stop.VmFiles.free_vm_files
    templates: TemplateCache | None  # None: PAL_TEMPLATES=0
    template_host: TemplateHost  # builds a missing template


async def template_ready(d: PoolDeps, key: str) -> bool:
    """The template pooled VMs of entry ``key`` restore from, built first when missing;
    False when there is none to be had (PAL_TEMPLATES=0, a size without templates, a failed
    build): pooled VMs are only ever restored from a template."""
    templates = d.templates
    if templates is None:
        return False
    name, size = sizes.split_pool_entry(key)
    image = load_image(d.settings, name)
    if templates.lookup(image, size) is not None:
        return True
    task = templates.ensure_in_background(d.template_host, image, size)
    return task is not None and await task is not None


def pool_key(image: str, memory_mib: int, vcpus: int, disk_mib: int) -> str:
    """The pool entry a spawn of this image and size would claim from (sizes.pool_entry)."""
    return sizes.pool_entry(image, sizes.size_name(memory_mib, vcpus, disk_mib))


def budgeted_targets(wanted: tuple[tuple[str, int], ...], budget_mib: int) -> dict[str, int]:
    """How many VMs of each entry the pool keeps: PAL_POOL's counts, in its order, while the
    guest RAM they add up to stays within ``budget_mib``."""
    out: dict[str, int] = {}
    left = budget_mib
    for key, count in wanted:
        mem = sizes.parse_size_name(sizes.split_pool_entry(key)[1])[0]
        n = min(count, left // mem) if mem else 0
        out[key] = n
        left -= n * mem
    return out


async def prime(lv: LiveVm) -> None:
    """Run the image's own no-op commands once (templates.PRIME_COMMANDS), as a template
    does before its capture, and an empty cell in the kernel its template started (if any:
    templates.warm_kernel): this QEMU then has the first exec's and the first cell's guest
    code translated (TCG keeps it across the pause), so a claim's first exec and first cell
    run warm. Nothing of a tenant's runs: the commands are the image's, the identity the
    pool's, and an empty cell leaves no state in the kernel (no count, no history)."""
    for argv in PRIME_COMMANDS:
        msg: p.Message = {"k": p.K_EXEC, "tok": lv.token, "argv": list(argv), "env": {}}
        msg |= {"cwd": None, "timeout": PRIME_TIMEOUT_S, "user": None}
        with contextlib.suppress(Exception):  # an image without them: no priming
            replies = await lv.channel.start_stream(msg)
            try:
                async for _ in replies:
                    pass
            finally:
                await replies.aclose()
    await warm_kernel(lv, lv.image)


class WarmPool(StandingSet[PooledVm]):
    """Pooled VMs by pool id (``ready``), kept at PAL_POOL's targets."""

    MAKING, TAKEN = "filling", "claims"

    def __init__(self, deps: PoolDeps) -> None:
        super().__init__(budgeted_targets(deps.settings.pool, deps.settings.pool_memory_mib))
        self.d = deps

    # ------------------------------------------------------------------ fill

    def start(self) -> None:
        """Fill the pool in the background (and refill it after every claim)."""
        if any(self.targets.values()) and self._task is None:
            self._refill_in_background("warm-pool", self.fill_one)

    async def fill_one(self, size: str) -> bool:
        """Make one pooled VM of entry ``size``; False when it could not be made now."""
        image, size_text = sizes.split_pool_entry(size)
        mem, vcpus, disk = sizes.parse_size_name(size_text)
        pool_id = POOL_ID_PREFIX + secrets.token_hex(6)
        req = SpawnRequest(
            vm_id=pool_id,
            tenant_id="",
            image=image,
            vcpus=vcpus,
            memory_mib=mem,
            disk_mib=disk,
            token=secrets.token_urlsafe(24),
        )
        lv: LiveVm | None = None
        try:
            if not await template_ready(self.d, size):
                raise Unavailable(f"no template of {size} to restore pooled VMs from")
            lv = await self.d.spawn_pooled(req)
            await prime(lv)
            # No network until a claim: the gateway forgets it, its namespace and tap stay.
            await self.d.net.unregister(pool_id)
            await lv.qemu.pause()
            if warm_kernel_language(lv.image) is not None:
                # Kept resident: a claim's first cell would fault its started kernel back in
                # from the RAM file page by page (measured: docs/benchmarks/code.md). The
                # memory budget (PAL_POOL_MEMORY_MIB) counts a pooled VM's whole RAM anyway.
                self.ready[pool_id] = PooledVm(lv, size)
                self.last_error = None
                log.info("pool: VM %s of %s ready (paused, its kernel's RAM resident)", pool_id, size)
                return True
            res = await asyncio.to_thread(offload.offload, lv.qemu.pid or 0, lv.qemu.mem_path)
            self.ready[pool_id] = PooledVm(lv, size, res.working_set)
            self.last_error = None
            log.info(
                "pool: VM %s of %s ready (%d MiB of guest RAM resident after the offload)",
                pool_id,
                size,
                res.resident_after >> 20,
            )
            return True
        except Exception as exc:
            self.last_error = f"{size}: {exc}"
            log.warning("pool: a VM of %s could not be made: %s", size, exc)
            if lv is not None:
                await self._kill(lv)
            return False

    # ------------------------------------------------------------------ claim

    def take(self, size: str) -> PooledVm | None:
        """One pooled VM of ``size`` out of the pool (the oldest), or None. No await
        between the look and the pop: a VM is taken by one claim only."""
        for pool_id, pv in sorted(self.ready.items(), key=lambda kv: kv[1].made_at):
            if pv.size == size and not pv.lv.qemu.exited.is_set():
                return self.ready.pop(pool_id)
        return None

    async def claim(self, req: SpawnRequest) -> SpawnResult | None:
        """The spawn of ``req`` by claiming a pooled VM; None when none fits (the caller
        spawns as usual). A claim that fails kills that VM (it never goes back)."""
        if req.restore is not None or req.boot == "cold":
            return None
        size = pool_key(req.image, req.memory_mib, req.vcpus, req.disk_mib)
        if size not in self.targets:
            return None
        pv = self.take(size)
        if pv is None:
            self.misses += 1
            return None
        # Refill, but not at once: under TCG a template restore beside the claimed VM's first
        # requests takes the CPU they need on a small host (docs/benchmarks/code.md).
        asyncio.get_running_loop().call_later(REFILL_AFTER_CLAIM_S, self._wake.set)
        if pv.lv.image.agent_version_id != load_image(self.d.settings, req.image).agent_version_id:
            await self._kill(pv.lv)  # made from an image build that was replaced since
            return None
        try:
            res = await self._claim(pv, req)
        except Exception as exc:
            log.warning("pool: the claim of %s for VM %s failed: %s", pv.lv.slot, req.vm_id, exc)
            self.d.registry.vms.pop(req.vm_id, None)
            await self._kill(pv.lv)
            return None
        self.taken += 1
        return res

    async def _claim(self, pv: PooledVm, req: SpawnRequest) -> SpawnResult:
        lv = pv.lv
        check_move(lv, VmPhase.RUNNING)
        t0 = time.perf_counter()
        failpoints.hit("manager:pool-taken")  # taken; its state file still says pooled
        self.d.registry.slots.rekey(lv.vm_id, req.vm_id)
        self.d.net.rekey_source(lv.vm_id, req.vm_id)
        lv.vm_id = lv.channel.vm_id = lv.qemu.spec.vm_id = req.vm_id
        prefetch = asyncio.create_task(asyncio.to_thread(offload.prefetch, lv.qemu.mem_path, pv.working_set))
        limits, brokered = limits_json(req.egress_mbps, req.max_connections), brokered_of(req)
        # the VM's volumes exported to it while the gateway takes it (the export: 1-5 ms)
        registered, exported = await asyncio.gather(
            self.d.net.reregister(
                req.vm_id, lv.slot, req.egress, limits, brokered, wait_rule(req.wait_pause), new_guest=True
            ),
            self.d.net.mount_volumes(req, lv.image),
            return_exceptions=True,
        )
        for got in (registered, exported):
            if isinstance(got, BaseException):
                raise got
        t_net = time.perf_counter()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(prefetch), PREFETCH_WAIT_S)
        t_prefetch = time.perf_counter()
        await lv.qemu.limit_disk(disk_limits(req))  # the tenant's, before its first request
        await lv.qemu.cont()
        t_cont = time.perf_counter()
        who = identity_of(req, self.d.net.new_mac())
        settings = self.d.settings
        timeout = settings.harness_ready_timeout_ms / 1000
        steps = await identify(lv.channel, lv.qemu, who, timeout, settings.heartbeat_interval_s)
        failpoints.hit("manager:pool-identified")  # the tenant's identity, not committed
        lv.tenant_id, lv.incarnation, lv.token, lv.env = (
            req.tenant_id,
            req.incarnation,
            req.token,
            dict(req.env),
        )
        lv.egress, lv.net_limits, lv.mac, lv.brokered = req.egress, limits, who.mac, brokered
        lv.wait, lv.pooled, lv.volumes = req.wait_pause, False, list(req.volumes)
        lv.touch()
        self.d.registry.vms[req.vm_id] = lv
        self.d.registry.write_state(lv)  # the commit: from now on the tenant's VM
        failpoints.hit("manager:pool-claimed")
        t_end = time.perf_counter()
        timings = {
            "pooled_s": round(time.time() - pv.made_at, 1),
            **continued_timings((t0, t_net, t_prefetch, t_cont, t_end), steps),
            **(exported if isinstance(exported, dict) else {}),
        }
        boot_ms = (t_end - t0) * 1000
        log.info("VM %s up from the pool (%s) in %.0f ms: %s", req.vm_id, lv.slot, boot_ms, timings)
        return spawn_result(req, lv.qemu, boot_ms, "pool", lv.image.agent_version_id, timings=timings)

    # ------------------------------------------------------------------ discard

    async def _kill(self, lv: LiveVm) -> None:
        await kill_quietly(lv)
        await self.d.free_vm_files(lv.vm_id, lv.slot)

    async def evict(self, need_mib: int) -> int:
        """Discard pooled VMs (the newest first) until ``need_mib`` of guest RAM is freed;
        the MiB freed. A tenant's spawn that needs the memory comes first."""
        freed = 0
        for pool_id, pv in sorted(self.ready.items(), key=lambda kv: -kv[1].made_at):
            if freed >= need_mib:
                break
            self.ready.pop(pool_id, None)
            await self._kill(pv.lv)
            freed += pv.lv.memory_mib
        return freed

    async def close(self) -> None:
        """Stop filling and discard every pooled VM (the node stops)."""
        vms = await self._stop()
        await asyncio.gather(*(self._kill(pv.lv) for pv in vms), return_exceptions=True)
