"""The runtime manager: owns the VMs of one host.

Spawn (cold boot, warm template, or restore), stop, snapshot, exec and file proxying, and
the node heartbeat. It knows VM ids, images and snapshots, never tenants' quotas or
lifecycle states: those are the scheduler's. Every method follows the contract documented
in ``pal/manager/api.py``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal import failpoints
from pal.config import Settings
from pal.errors import BackendError, Conflict, NotFound, PalError
from pal.guest import protocol as p
from pal.images.paths import ImagePaths, load_image
from pal.manager.channel import GuestError, HarnessChannel
from pal.manager.guest_errors import to_pal_error
from pal.manager.models import (
    ExecEvent,
    FileList,
    FileWritten,
    NodeHeartbeat,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
    VmActivity,
)
from pal.scheduler.spec import ExecRequest
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from pal.vmm import disks, jail
from pal.vmm.accel import AccelInfo
from pal.vmm.qemu import QemuVm, VmSpec

log = logging.getLogger(__name__)

COLD_BOOT_TIMEOUT_S = 120.0  # TCG boots take seconds; a loaded CI machine more


@dataclass
class LiveVm:
    vm_id: str
    tenant_id: str
    qemu: QemuVm
    channel: HarnessChannel
    image: ImagePaths
    incarnation: int
    token: str
    env: dict[str, str]
    memory_mib: int
    vcpus: int
    disk_mib: int
    mem_snapshot_id: str | None = None  # snapshot whose mem is mapped privately (forks)
    mem_ref: SnapshotRef | None = None
    started_at: float = field(default_factory=time.time)
    # Host-side activity: known at once, unlike the guest's 5 s heartbeat.
    active_execs: int = 0
    last_activity_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class NodeRuntime:
    def __init__(self, settings: Settings, store: SnapshotStore, accel: AccelInfo) -> None:
        self.settings = settings
        self.store = store
        self.accel = accel
        self.node_id = os.uname().nodename
        self.vms: dict[str, LiveVm] = {}
        self._spawning: set[str] = set()
        self._uids: dict[str, int] = {}  # vm id -> the uid its QEMU runs as (jail.py)
        self.templates: Any = None  # pal.images.templates.TemplateCache, set by the server

    # ------------------------------------------------------------------ helpers
    def _vm_dir(self, vm_id: str) -> Path:
        return self.settings.vms_dir / vm_id

    def _live(self, vm_id: str) -> LiveVm:
        lv = self.vms.get(vm_id)
        if lv is None or lv.qemu.exited.is_set():
            raise Conflict(f"VM {vm_id} is not running on this node")
        return lv

    def _identity(self, vm_id: str, incarnation: int, token: str, env: dict[str, str]) -> p.Message:
        return {
            "k": p.K_IDENTIFY,
            "vm_id": vm_id,
            "incarnation": incarnation,
            "token": token,
            "now_ns": time.time_ns(),
            "seed": secrets.token_hex(64),
            "env": env,
            "hb_interval": self.settings.heartbeat_interval_s,
        }

    def _write_config_drive(self, vm_dir: Path, req: SpawnRequest) -> Path:
        cfg = {
            "vm_id": req.vm_id,
            "incarnation": req.incarnation,
            "token": req.token,
            "env": req.env,
            "hb_interval": self.settings.heartbeat_interval_s,
        }
        path = vm_dir / "config.img"
        path.write_bytes(p.encode_config(cfg))
        return path

    def _vm_spec(self, req: SpawnRequest, image: ImagePaths, vm_dir: Path, disk: Path, fmt: str) -> VmSpec:
        run_as = jail.pick_identity(set(self._uids.values()))
        if run_as is not None:
            self._uids[req.vm_id] = run_as[0]
        return VmSpec(
            run_as=run_as,
            vm_id=req.vm_id,
            vm_dir=vm_dir,
            image=image,
            vcpus=req.vcpus,
            memory_mib=req.memory_mib,
            disk_path=disk,
            disk_format=fmt,
            config_drive=vm_dir / "config.img",
            accel=self.accel.name,
        )

    # ------------------------------------------------------------------ spawn
    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        if req.vm_id in self.vms or req.vm_id in self._spawning:
            raise Conflict(f"VM {req.vm_id} is already live on this node")
        self._spawning.add(req.vm_id)
        t0 = time.perf_counter()
        vm_dir = self._vm_dir(req.vm_id)
        qemu: QemuVm | None = None
        channel: HarnessChannel | None = None
        try:
            image = load_image(self.settings, req.image)
            if vm_dir.exists():
                shutil.rmtree(vm_dir)
            vm_dir.mkdir(parents=True)
            self._write_config_drive(vm_dir, req)
            mem_ref: SnapshotRef | None = None
            method: str
            template = None
            if req.restore is None and req.boot != "cold" and self.templates is not None:
                template = self.templates.lookup(image, req.memory_mib, req.vcpus, req.disk_mib)
                if template is None:
                    # This one boots cold; the next VM of this size restores warm.
                    self.templates.ensure_in_background(self, image, req.memory_mib, req.vcpus, req.disk_mib)
            if req.restore is not None:
                r = req.restore
                ref = SnapshotRef(r.agent_version_id, r.source_vm_id, r.snapshot_id, r.tenant_id)
                snap_dir = await asyncio.to_thread(self.store.locate, ref)
                disk, fmt = await self._disk_from(snap_dir / "rootfs", image, vm_dir, req.disk_mib)
                spec = self._vm_spec(req, image, vm_dir, disk, fmt)
                t_prep = time.perf_counter()
                qemu = await QemuVm.restore(spec, snap_dir, r.mem_mode)
                if r.mem_mode == "private" and (snap_dir / "mem").exists():
                    mem_ref = ref
                method = "restore"
            elif template is not None:
                disk, fmt = await self._disk_from(template / "rootfs", image, vm_dir, req.disk_mib)
                spec = self._vm_spec(req, image, vm_dir, disk, fmt)
                t_prep = time.perf_counter()
                qemu = await QemuVm.restore(spec, template, "shared")
                method = "template"
            else:
                disk, fmt = await self._disk_from(image.rootfs, image, vm_dir, req.disk_mib)
                spec = self._vm_spec(req, image, vm_dir, disk, fmt)
                t_prep = time.perf_counter()
                qemu = await QemuVm.boot(spec)
                method = "cold"
            t_vmm = time.perf_counter()
            channel = HarnessChannel(qemu.agent_socket, req.vm_id)
            await channel.connect()
            timeout = (
                COLD_BOOT_TIMEOUT_S if method == "cold" else self.settings.harness_ready_timeout_ms / 1000
            )
            await self._identify(channel, req.vm_id, req.incarnation, req.token, req.env, timeout, qemu)
            lv = LiveVm(
                vm_id=req.vm_id,
                tenant_id=req.tenant_id,
                qemu=qemu,
                channel=channel,
                image=image,
                incarnation=req.incarnation,
                token=req.token,
                env=dict(req.env),
                memory_mib=req.memory_mib,
                vcpus=req.vcpus,
                disk_mib=req.disk_mib,
                mem_snapshot_id=mem_ref.snapshot_id if mem_ref else None,
                mem_ref=mem_ref,
            )
            self.vms[req.vm_id] = lv
            self._write_state(lv)
            boot_ms = (time.perf_counter() - t0) * 1000
            log.info(
                "VM %s up by %s in %.0f ms (pid %s): prepare %.0f, vmm %s, identify %.0f ms",
                req.vm_id,
                method,
                boot_ms,
                qemu.pid,
                (t_prep - t0) * 1000,
                qemu.timings_ms,
                (time.perf_counter() - t_vmm) * 1000,
            )
            return SpawnResult(
                vm_id=req.vm_id,
                pid=qemu.pid or 0,
                incarnation=req.incarnation,
                boot_ms=boot_ms,
                method=method,  # type: ignore[arg-type]
                agent_version_id=image.agent_version_id,
                mem_snapshot_id=lv.mem_snapshot_id,
            )
        except BaseException as exc:
            if channel is not None:
                await channel.close()
            if qemu is not None:
                tail = qemu.log_tail()
                await qemu.kill()
                if isinstance(exc, PalError) and tail and not isinstance(exc, NotFound):
                    log.warning("VM %s failed to start: %s\n%s", req.vm_id, exc, tail)
            with contextlib.suppress(OSError):
                shutil.rmtree(vm_dir)
            self._uids.pop(req.vm_id, None)
            raise
        finally:
            self._spawning.discard(req.vm_id)

    async def _identify(
        self,
        channel: HarnessChannel,
        vm_id: str,
        incarnation: int,
        token: str,
        env: dict[str, str],
        timeout: float,
        qemu: QemuVm,
    ) -> None:
        """Give the guest its identity (clock, RNG seed, token) and wait for it to say so."""
        ident = self._identity(vm_id, incarnation, token, env)
        waiter = asyncio.create_task(channel.request(ident, timeout=timeout))
        died = asyncio.create_task(qemu.exited.wait())
        try:
            done, _ = await asyncio.wait({waiter, died}, return_when=asyncio.FIRST_COMPLETED)
            if died in done and waiter not in done:
                raise BackendError(f"VM {vm_id}: QEMU exited while booting")
            waiter.result()
            await channel.wait_heartbeat(incarnation, timeout)
        finally:
            for t in (waiter, died):
                t.cancel()
            await asyncio.gather(waiter, died, return_exceptions=True)

    async def _disk_from(self, src: Path, image: ImagePaths, vm_dir: Path, disk_mib: int) -> tuple[Path, str]:
        """A per-VM writable disk: reflink where possible, qcow2 overlay otherwise."""
        if not src.exists():
            # A legacy snapshot without a captured disk (the spec's behaviour): restore onto
            # the base image, which does not match the snapshot's memory.
            log.warning("snapshot at %s has no rootfs; restoring onto the base image", src.parent)
            src = image.rootfs
        dst = vm_dir / "disk"
        method = await asyncio.to_thread(disks.clone, src, dst, disk_mib * 1024 * 1024)
        return dst, disks.disk_format_for(method)

    def _write_state(self, lv: LiveVm) -> None:
        """Everything needed to re-adopt this VM if the manager process dies (root-only:
        it holds the exec token and the VM's secrets)."""
        state = {
            "vmId": lv.vm_id,
            "tenantId": lv.tenant_id,
            "pid": lv.qemu.pid,
            "incarnation": lv.incarnation,
            "token": lv.token,
            "env": lv.env,
            "image": lv.image.name,
            "memoryMib": lv.memory_mib,
            "vcpus": lv.vcpus,
            "diskMib": lv.disk_mib,
            "diskFormat": lv.qemu.spec.disk_format,
            "memPath": str(lv.qemu.mem_path),
            "memShare": lv.qemu.mem_share,
            "runAs": list(lv.qemu.spec.run_as) if lv.qemu.spec.run_as else None,
            "memRef": None
            if lv.mem_ref is None
            else [lv.mem_ref.agent_version_id, lv.mem_ref.vm_id, lv.mem_ref.snapshot_id],
        }
        path = self._vm_dir(lv.vm_id) / "state.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    async def adopt_all(self) -> tuple[list[str], list[str]]:
        """At start: take over the QEMUs a previous manager of this data dir left running
        (a crash or restart of the control plane must not kill the sandboxes). A VM that
        cannot be adopted is killed; the scheduler's reconciliation then settles its state.
        """
        adopted: list[str] = []
        killed: list[str] = []
        root = self.settings.vms_dir
        if not root.is_dir():
            return adopted, killed
        for vm_dir in sorted(root.iterdir()):
            try:
                lv = await self._adopt(vm_dir)
            except Exception as exc:
                log.warning("cannot adopt %s: %s", vm_dir.name, exc)
                self._uids.pop(vm_dir.name, None)
                lv = None
            if lv is not None:
                self.vms[lv.vm_id] = lv
                adopted.append(lv.vm_id)
                continue
            if self._kill_leftover(vm_dir):
                killed.append(vm_dir.name)
            shutil.rmtree(vm_dir, ignore_errors=True)
        return adopted, killed

    async def _adopt(self, vm_dir: Path) -> LiveVm | None:
        st = json.loads((vm_dir / "state.json").read_text())
        pid = int(st["pid"])
        if not _is_qemu_of(pid, vm_dir):
            return None
        image = load_image(self.settings, st["image"])
        spec = VmSpec(
            vm_id=st["vmId"],
            vm_dir=vm_dir,
            image=image,
            vcpus=int(st["vcpus"]),
            memory_mib=int(st["memoryMib"]),
            disk_path=vm_dir / "disk",
            disk_format=st["diskFormat"],
            config_drive=vm_dir / "config.img",
            accel=self.accel.name,
            run_as=tuple(st["runAs"]) if st.get("runAs") else None,  # type: ignore[arg-type]
        )
        if spec.run_as is not None:
            self._uids[spec.vm_id] = spec.run_as[0]
        qemu = await QemuVm.adopt(spec, pid, mem_path=Path(st["memPath"]), mem_share=bool(st["memShare"]))
        channel = HarnessChannel(qemu.agent_socket, spec.vm_id)
        try:
            await channel.connect(timeout=2)
            # The harness heartbeats as soon as it sees the new connection.
            await channel.wait_heartbeat(int(st["incarnation"]), timeout=5)
        except BaseException:
            await channel.close()
            await qemu.kill()
            raise
        mem_ref = None
        if st.get("memRef"):
            av, src, snap = st["memRef"]
            mem_ref = SnapshotRef(av, src, snap, None)
        log.info("adopted VM %s (QEMU pid %d) left by a previous manager", spec.vm_id, pid)
        return LiveVm(
            vm_id=spec.vm_id,
            tenant_id=st["tenantId"],
            qemu=qemu,
            channel=channel,
            image=image,
            incarnation=int(st["incarnation"]),
            token=st["token"],
            env=dict(st.get("env") or {}),
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            disk_mib=int(st["diskMib"]),
            mem_snapshot_id=mem_ref.snapshot_id if mem_ref else None,
            mem_ref=mem_ref,
        )

    @staticmethod
    def _kill_leftover(vm_dir: Path) -> bool:
        with contextlib.suppress(OSError, ValueError):
            pid = int((vm_dir / "qemu.pid").read_text().strip())
            if _is_qemu_of(pid, vm_dir):
                os.killpg(pid, 9)
                return True
        return False

    # ------------------------------------------------------------------ stop
    async def stop(self, vm_id: str) -> None:
        lv = self.vms.pop(vm_id, None)
        if lv is not None:
            await lv.channel.close()
            await lv.qemu.kill()
        self._uids.pop(vm_id, None)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._vm_dir(vm_id))

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(v) for v in list(self.vms)), return_exceptions=True)

    # ------------------------------------------------------------------ snapshot
    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        lv = self._live(vm_id)
        async with lv.op_lock:
            ref = SnapshotRef(req.agent_version_id, vm_id, req.snapshot_id, req.tenant_id)
            staging = self.store.staging_dir(req.snapshot_id)
            t0 = time.perf_counter()
            try:
                art = await lv.qemu.capture(staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                with contextlib.suppress(Exception):
                    if not lv.qemu.exited.is_set():
                        await lv.qemu.cont()
                raise
            t_capture = time.perf_counter()
            failpoints.hit("manager:captured")
            if req.keep_running:
                # The capture is independent reflinked files: the guest may run on while
                # they are checksummed and committed.
                await lv.qemu.cont()
            meta: dict[str, Any] = {
                "tenantId": req.tenant_id,
                "vmId": vm_id,
                "agentVersionId": req.agent_version_id,
                "parentSnapshotId": req.parent_snapshot_id or lv.mem_snapshot_id,
                "image": lv.image.name,
                "memoryMib": lv.memory_mib,
                "vcpus": lv.vcpus,
                "diskMib": lv.disk_mib,
                "memoryKind": art.memory_kind,
                "qemuVersion": art.meta.get("qemuVersion"),
                "kernelVersion": lv.image.meta.get("kernelVersion"),
                "accel": self.accel.name,
            }
            try:
                path = await asyncio.to_thread(self.store.commit, staging, ref, meta)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                if not req.keep_running and not lv.qemu.exited.is_set():
                    with contextlib.suppress(Exception):
                        await lv.qemu.cont()
                raise
            t_commit = time.perf_counter()
            failpoints.hit("manager:committed")
            if not req.keep_running:
                await self.stop(vm_id)
            t_end = time.perf_counter()
            # Retention after every write; the snapshot just made is always kept.
            keep = set(req.protected) | self._mapped_snapshots() | {req.snapshot_id}
            try:
                await asyncio.to_thread(self.store.apply_retention, req.agent_version_id, vm_id, keep)
            except Exception:
                log.exception("retention after snapshot %s failed; it runs again next time", req.snapshot_id)
            durations = dict(art.durations_ms)
            durations.update(
                capture=(t_capture - t0) * 1000,
                commit=(t_commit - t_capture) * 1000,
                stop=(t_end - t_commit) * 1000,
                total=(t_end - t0) * 1000,
            )
            log.info(
                "snapshot %s of %s: %s",
                req.snapshot_id,
                vm_id,
                {k: round(v, 1) for k, v in durations.items()},
            )
            return SnapshotResult(
                snapshot_id=req.snapshot_id,
                path=str(path),
                sizes=art.sizes,
                durations_ms=durations,
                memory_kind="stream" if art.memory_kind == "stream" else "file",
            )

    def _mapped_snapshots(self) -> set[str]:
        return {lv.mem_snapshot_id for lv in self.vms.values() if lv.mem_snapshot_id}

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        ref = SnapshotRef(agent_version_id, vm_id, snapshot_id, "")
        ok = await asyncio.to_thread(self.store.verify, ref)
        meta = await asyncio.to_thread(self.store.read_meta, ref) if ok else None
        return SnapshotStatus(complete=ok, meta=meta)

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        if snapshot_id in self._mapped_snapshots():
            raise Conflict(f"snapshot {snapshot_id} is mapped by a live fork")
        await asyncio.to_thread(self.store.delete, SnapshotRef(agent_version_id, vm_id, snapshot_id, ""))

    async def apply_retention(self, agent_version_id: str, vm_id: str, protected: list[str]) -> list[str]:
        keep = set(protected) | self._mapped_snapshots()
        return await asyncio.to_thread(self.store.apply_retention, agent_version_id, vm_id, keep)

    # ------------------------------------------------------------------ exec and files
    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        lv = self._live(vm_id)
        msg: p.Message = {
            "k": p.K_EXEC,
            "tok": lv.token,
            "argv": [req.command, *req.argv],
            "env": req.env,
            "cwd": req.cwd,
            "timeout": req.timeout_secs,
            "user": req.user,
        }
        lv.active_execs += 1
        lv.last_activity_ms = int(time.time() * 1000)
        try:
            async for ev in self._exec_events(lv, msg):
                yield ev
        finally:
            lv.active_execs -= 1
            lv.last_activity_ms = int(time.time() * 1000)

    async def _exec_events(self, lv: LiveVm, msg: p.Message) -> AsyncIterator[ExecEvent]:
        decoders = {
            1: codecs.getincrementaldecoder("utf-8")("replace"),
            2: codecs.getincrementaldecoder("utf-8")("replace"),
        }
        async for reply in lv.channel.stream(msg):
            kind = reply["k"]
            if kind == p.K_OUT:
                fd = 2 if reply.get("fd") == 2 else 1
                text = decoders[fd].decode(p.payload(reply))
                if text:
                    yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=text)
            elif kind == p.K_EXIT:
                for fd, dec in decoders.items():
                    rest = dec.decode(b"", final=True)
                    if rest:
                        yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=rest)
                yield ExecEvent(type="exit", exit_code=int(reply.get("code", -1)))
            elif kind == p.K_ERR:
                yield ExecEvent(type="error", code=reply.get("code", p.ERR_IO), message=reply.get("msg", ""))

    async def _file_request(
        self, vm_id: str, msg: p.Message, data: bytes | None = None
    ) -> tuple[p.Message, bytes]:
        lv = self._live(vm_id)
        lv.last_activity_ms = int(time.time() * 1000)
        try:
            return await lv.channel.request({**msg, "tok": lv.token}, data)
        except GuestError as exc:
            raise to_pal_error(exc) from None

    async def list_files(self, vm_id: str, path: str) -> FileList:
        reply, _ = await self._file_request(vm_id, {"k": p.K_LS, "path": path})
        return FileList.model_validate(reply["result"])

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        reply, data = await self._file_request(
            vm_id, {"k": p.K_READ, "path": path, "limit": p.MAX_FILE_BYTES}
        )
        return data, bool(reply["result"].get("truncated"))

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        reply, _ = await self._file_request(vm_id, {"k": p.K_WRITE, "path": path}, data)
        return FileWritten.model_validate(reply["result"])

    # ------------------------------------------------------------------ heartbeat
    async def heartbeat(self) -> NodeHeartbeat:
        out: list[VmActivity] = []
        for lv in list(self.vms.values()):
            hb = lv.channel.heartbeat or {}
            alive = not lv.qemu.exited.is_set()
            out.append(
                VmActivity(
                    vm_id=lv.vm_id,
                    alive=alive,
                    pid=lv.qemu.pid,
                    incarnation=hb.get("incarnation", lv.incarnation),
                    has_active_exec=bool(hb.get("active")) or lv.active_execs > 0,
                    last_activity_unix_ms=max(int(hb.get("last_activity_ms") or 0), lv.last_activity_ms),
                    last_heartbeat_unix_ms=int(
                        (time.time() - (time.monotonic() - lv.channel.heartbeat_at)) * 1000
                    )
                    if lv.channel.heartbeat_at
                    else 0,
                )
            )
        return NodeHeartbeat(node_id=self.node_id, accel=self.accel.name, vms=out)


def _is_qemu_of(pid: int, vm_dir: Path) -> bool:
    """Whether ``pid`` is a live QEMU whose command line names ``vm_dir`` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"qemu-system" in cmdline and str(vm_dir).encode() in cmdline
