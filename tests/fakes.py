"""In-memory test doubles. ``FakeManager`` is a node in memory: it serves the node RPC's
verbs (pal/wire/verbs.py) from a handler table as a real node does, and the scheduler
reaches it through :class:`InProcessNode`, which makes every request and answer travel
by the wire's encoding (pal/wire/http.py) without a socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pal.config import Settings
from pal.errors import NotFound, PalError
from pal.guest.protocol import MAX_FILE_BYTES
from pal.manager.channel import HarnessChannel
from pal.manager.vm import LiveVm
from pal.manager.volume_content import VolumeContent
from pal.manager.volumes import VolumeFiles
from pal.scheduler.scheduler import Scheduler
from pal.spec import ExecRequest
from pal.store import Store
from pal.wire import http
from pal.wire import verbs as v
from pal.wire.code import ContextDeleted, ContextInterrupted, ContextList
from pal.wire.handlers import Handlers
from pal.wire.models import (
    BrokeredSet,
    BrokeredSetResult,
    EgressCounters,
    EgressEvent,
    EgressEvents,
    EgressSet,
    EgressSetResult,
    ExecEvent,
    FileContent,
    FileDeleted,
    FileList,
    FileWritten,
    ImageInfo,
    ImageList,
    LivePauseRequest,
    LivePauseResult,
    LiveResumeResult,
    LiveState,
    LiveStatus,
    MetricSample,
    NodeCapacity,
    NodeHeartbeat,
    NodeStats,
    Notice,
    Notices,
    SnapshotDeleted,
    SnapshotInfo,
    SnapshotList,
    SnapshotOwners,
    SnapshotRequest,
    SnapshotResult,
    SnapshotsDeleted,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
    Stopped,
    Uploaded,
    VmActivity,
    VmMetrics,
    WarmRequest,
    WarmResult,
    WarmTemplate,
)
from pal.wire.processes import ProcessList, Resized, SignalSent
from pal.wire.verbs import Call, Stream, Tunnel

AGENT_VERSION = "default-0123456789ab"


class Crash(BaseException):
    """The control plane dies right here, like a SIGKILL at a failpoint: being a
    BaseException, no ``except Exception`` rollback runs and nothing more is written."""


def crash_at(monkeypatch: Any, point: str) -> None:
    """Make ``failpoints.hit(point)`` raise :class:`Crash` in this process."""
    from pal import failpoints

    real = failpoints.hit

    def hit(name: str) -> None:
        if name == point:
            raise Crash(point)
        real(name)

    monkeypatch.setattr(failpoints, "hit", hit)


@dataclass
class FakeVm:
    vm_id: str
    incarnation: int
    token: str
    mem_mode: str | None = None
    has_active_exec: bool = False
    last_activity_unix_ms: int = 0
    guest_active: bool = False  # the guest's claims (untrusted; idle.py bounds them)
    guest_last_activity_unix_ms: int = 0
    last_heartbeat_unix_ms: int = 0  # 0: never reported (not judged stale)
    silent_cpu_ms: int | None = None  # that silence in CPU time, as a node counts it
    files: dict[str, bytes] = field(default_factory=dict)
    egress: Any = "none"
    counters: dict[str, int] = field(default_factory=dict)
    live: LiveState | None = None  # live-paused on the "node"
    wait_pause: Any = None
    brokered: dict[str, str] = field(default_factory=dict)  # name -> the value its gateway inserts


@dataclass
class _Failure:
    exc: Exception
    vm_id: str | None
    times: int
    kill: bool


class LoopbackStream:
    """A TunnelStream's interface over a plain loopback TCP connection."""

    route = "direct"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.closers: list[Any] = []

    def on_close(self, fn: Any) -> None:
        self.closers.append(fn)

    async def read(self, max_bytes: int = 65536) -> bytes:
        return await self.reader.read(max_bytes)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def write_eof(self) -> None:
        if self.writer.can_write_eof():
            self.writer.write_eof()

    async def aclose(self) -> None:
        self.writer.close()
        closers, self.closers = self.closers, []
        for fn in closers:
            fn()


class InProcessNode:
    """A node living in this process, reached as the control plane reaches one (it
    implements :class:`pal.wire.handlers.NodeCalls`): each request and answer is encoded and
    decoded by the wire's rule, so a model that cannot travel fails here as it would over
    HTTP; errors come as the handler raised them. A subclass says what it serves
    (:meth:`handlers`)."""

    _table: Handlers | None = None

    def __init__(self, handlers: Handlers | None = None) -> None:
        self._table = handlers

    def handlers(self) -> Handlers:
        raise NotImplementedError

    @property
    def table(self) -> Handlers:
        if self._table is None:
            self._table = self.handlers()
        return self._table

    async def call(self, verb: Call[Any, Any], req: Any) -> Any:
        ans = await self.table.call_fn(verb)(travel(verb, req))
        body, _, headers = http.encode_answer(ans)
        return http.decode_answer(verb, headers, body)

    async def stream(self, verb: Stream[Any, Any], req: Any) -> AsyncIterator[Any]:
        events = self.table.stream_fn(verb)(travel(verb, req))
        try:
            async for ev in events:
                yield http.decode_event(verb, http.event_line(ev).decode())
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def open(self, verb: Tunnel[Any], req: Any) -> Any:
        conn = await self.table.tunnel_fn(verb)(travel(verb, req))
        return LoopbackStream(conn.reader, conn.writer)

    async def aclose(self) -> None:
        pass


def travel(verb: Any, req: Any) -> Any:
    """``req`` as the node decodes it from what the client encodes (pal/wire/http.py)."""
    out = http.encode_request(verb, req)
    dumped = req.model_dump(by_alias=True, mode="json", exclude={http.raw_field(type(req))} - {None})
    path = {n: str(dumped[n]) for n in http.path_names(verb.path)}
    query: list[tuple[str, str]] = []
    for key, value in out.params.items():
        for one in value if isinstance(value, list) else [value]:
            query.append((key, str(one).lower() if isinstance(one, bool) else str(one)))
    body = out.content if out.content is not None else json.dumps(out.json).encode() if out.json else b""
    return http.decode_request(verb, path, query, body)


class FakeManager(InProcessNode):
    """A node in memory: ``alive`` VMs, ``snapshots`` (key -> complete), scripted failures.

    ``fail(call, exc, vm_id=..., times=..., kill=...)`` makes the next ``times`` matching
    calls raise ``exc``; with ``kill`` the VM's "QEMU" dies as it fails.
    """

    def __init__(self, node_id: str = "node-1") -> None:
        super().__init__()
        self.node_id = node_id
        self.alive: dict[str, FakeVm] = {}
        self.snapshots: dict[tuple[str, str, str], bool] = {}
        self.calls: list[tuple[str, str]] = []
        self.spawn_requests: list[SpawnRequest] = []
        self.snapshot_requests: list[tuple[str, SnapshotRequest]] = []
        self.deleted_snapshots: list[tuple[str, str, str]] = []
        self.snapshot_size = 4096  # stored bytes each snapshot reports (list_snapshots)
        self.uploaded: set[tuple[str, str, str]] = set()  # snapshots published to "S3"
        self.spawn_delay = 0.0
        self.concurrent_spawns = 0
        self.max_concurrent_spawns = 0
        self.heartbeat_error: Exception | None = None
        self.exec_requests: list[ExecRequest] = []
        # The node's images: `default` for every tenant unless a test says otherwise.
        self.image_infos: list[ImageInfo] = [
            ImageInfo(name="default", agent_version_id="sha256-" + "d" * 64, kind="debian")
        ]
        self.warmed: list[WarmRequest] = []
        self.memory_mib = 1 << 20  # the node's capacity for guest RAM
        self.url = ""  # a remote node's RPC URL (its heartbeat says where it is)
        self.region = ""
        self.labels: dict[str, str] = {}
        # guest port -> a server on 127.0.0.1 that plays the guest's (open_port connects to it)
        self.port_servers: dict[int, int] = {}
        self.templates: list[WarmTemplate] = []
        self.gate = threading.Event()
        self.slow_done = False
        self.slow_cancelled = threading.Event()
        self._failures: dict[str, list[_Failure]] = {}
        self.egress_log: list[EgressEvent] = []
        self.egress_seq = 0
        self.egress_epoch = "fake-1"
        self.live_requests: list[tuple[str, LivePauseRequest]] = []
        self.nothing_waiting: set[str] = set()  # VMs whose if_waiting pause finds nothing
        self.live_pauses = 0
        self.notice_log: list[Notice] = []
        self.notice_epoch = "fake-notices-1"
        self._posted = asyncio.Event()
        self._volume_files: VolumeFiles | None = None
        self._volume_content: VolumeContent | None = None

    @property
    def volume_files(self) -> VolumeFiles:
        """The node's real volume code, over a temporary dir made on first use."""
        if self._volume_files is None:
            root = Path(tempfile.mkdtemp(prefix="pal-fake-volumes-"))
            weakref.finalize(self, shutil.rmtree, root, True)
            self._volume_files = VolumeFiles(root / "volumes")
        return self._volume_files

    @property
    def volume_content(self) -> VolumeContent:
        """The node's real files API of its volumes, as the workload user when root (the
        node is), else as this process's own user."""
        if self._volume_content is None:
            ids = (1000, 1000) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
            self._volume_content = VolumeContent(self.volume_files, *ids)
        return self._volume_content

    # -- scripting ------------------------------------------------------------------------

    def fail(
        self, call: str, exc: Exception, *, vm_id: str | None = None, times: int = 1, kill: bool = False
    ) -> None:
        self._failures.setdefault(call, []).append(_Failure(exc, vm_id, times, kill))

    def _maybe_fail(self, call: str, vm_id: str) -> None:
        for f in self._failures.get(call, []):
            if f.times > 0 and (f.vm_id is None or f.vm_id == vm_id):
                f.times -= 1
                if f.kill:
                    self.alive.pop(vm_id, None)
                raise f.exc

    def kill(self, vm_id: str) -> None:
        """Simulate a QEMU crash."""
        self.alive.pop(vm_id, None)

    # -- what the node does (its verbs are bound to these below) -----------------------------

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        self.calls.append(("spawn", req.vm_id))
        self.spawn_requests.append(req)
        self.concurrent_spawns += 1
        self.max_concurrent_spawns = max(self.max_concurrent_spawns, self.concurrent_spawns)
        try:
            if self.spawn_delay:
                await asyncio.sleep(self.spawn_delay)
            if req.vm_id in self.alive:
                raise PalError(f"VM {req.vm_id} already runs", status=409, code="FAILED_PRECONDITION")
            self._maybe_fail("spawn", req.vm_id)
            mem_snapshot_id = None
            if req.restore is not None:
                r = req.restore
                if not self.snapshots.get((r.agent_version_id, r.source_vm_id, r.snapshot_id)):
                    raise NotFound(f"snapshot {r.snapshot_id} not found")
                if r.mem_mode == "private":
                    mem_snapshot_id = r.snapshot_id
            self.alive[req.vm_id] = FakeVm(
                req.vm_id,
                req.incarnation,
                req.token,
                req.restore.mem_mode if req.restore else None,
                egress=req.egress,
                wait_pause=req.wait_pause,
                brokered={r.name: r.value for r in req.brokered},
            )
            return SpawnResult(
                vm_id=req.vm_id,
                pid=1000 + len(self.spawn_requests),
                incarnation=req.incarnation,
                boot_ms=1.0,
                method="restore" if req.restore else "cold",
                agent_version_id=AGENT_VERSION,
                mem_snapshot_id=mem_snapshot_id,
            )
        finally:
            self.concurrent_spawns -= 1

    async def stop(self, vm_id: str, incarnation: int | None = None) -> None:
        self.calls.append(("stop", vm_id))
        self._maybe_fail("stop", vm_id)
        vm = self.alive.get(vm_id)
        if vm is not None and (incarnation is None or vm.incarnation == incarnation):
            self.alive.pop(vm_id, None)

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        self.calls.append(("ensure_uploaded", vm_id))
        if not self.snapshots.get((agent_version_id, vm_id, snapshot_id)):
            raise NotFound(f"snapshot {snapshot_id} not found")
        self.uploaded.add((agent_version_id, vm_id, snapshot_id))

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        self.calls.append(("snapshot", vm_id))
        self.snapshot_requests.append((vm_id, req))
        if vm_id not in self.alive:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        self._maybe_fail("snapshot", vm_id)
        self.snapshots[(req.agent_version_id, vm_id, req.snapshot_id)] = True
        counters = None
        if not req.keep_running:
            counters = dict(self.alive.pop(vm_id).counters)
        mine = [k for k, ok in self.snapshots.items() if ok and k[:2] == (req.agent_version_id, vm_id)]
        return SnapshotResult(
            snapshot_id=req.snapshot_id,
            path="/fake",
            sizes={},
            durations_ms={},
            memory_kind="file",
            egress_counters=counters,
            stored_bytes=self.snapshot_size * len(mine),  # as the node measures them (list_snapshots)
        )

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """A few scripted commands (anything else is not found):
        ``echo ARGS`` prints them (also as ``/bin/sh -c "echo ARGS"``); ``fail [CODE]``
        prints ``warn`` on stderr and exits CODE (1); ``true``; ``sleepy`` prints
        ``partial`` then times out; ``slow`` prints ``first``, waits for ``self.gate``,
        prints ``second`` (``slow_cancelled`` is set when the caller goes away first); ``flood N
        [hold]`` prints N characters, then (hold) waits for ``self.gate``."""
        self.calls.append(("exec", vm_id))
        if vm_id not in self.alive:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        if self.alive[vm_id].live is not None:
            raise PalError(f"VM {vm_id} is live-paused", status=409, code="LIVE_PAUSED")
        self._maybe_fail("exec", vm_id)
        self.exec_requests.append(req)
        cmd, argv = req.command, req.argv
        if cmd == "/bin/sh" and len(argv) == 2 and argv[0] == "-c":  # a simple shell line
            cmd, *argv = shlex.split(argv[1]) or [""]
        if cmd == "echo":
            yield ExecEvent(type="stdout", data=" ".join(argv) + "\n")
            yield ExecEvent(type="exit", exit_code=0)
        elif cmd == "fail":
            yield ExecEvent(type="stderr", data="warn\n")
            yield ExecEvent(type="exit", exit_code=int(argv[0]) if argv else 1)
        elif cmd == "true":
            yield ExecEvent(type="exit", exit_code=0)
        elif cmd == "sleepy":
            yield ExecEvent(type="stdout", data="partial")
            yield ExecEvent(type="error", code="ETIMEDOUT", message=f"killed after {req.timeout_secs}s")
        elif cmd == "flood":  # flood N [hold]: N characters of stdout, then (hold) the gate
            left = int(argv[0])
            while left > 0:
                yield ExecEvent(type="stdout", data="x" * min(left, 65536))
                left -= 65536
            if argv[1:] == ["hold"]:
                await asyncio.to_thread(self.gate.wait, 30)
            yield ExecEvent(type="exit", exit_code=0)
        elif cmd == "slow":
            try:
                yield ExecEvent(type="stdout", data="first\n")
                await asyncio.to_thread(self.gate.wait, 30)  # the test opens it
                self.slow_done = True
            except (asyncio.CancelledError, GeneratorExit):
                # The real cleanup awaits (it closes the stream to the manager, which sends
                # the guest cancel): it must be able to finish, not be cancelled again.
                for _ in range(20):
                    await asyncio.sleep(0)
                self.slow_cancelled.set()  # what the real manager turns into a guest cancel
                raise
            yield ExecEvent(type="stdout", data="second\n")
            yield ExecEvent(type="exit", exit_code=0)
        else:
            yield ExecEvent(type="error", code="ENOENT", message=f"{cmd}: not found")

    def _vm(self, call: str, vm_id: str) -> FakeVm:
        self.calls.append((call, vm_id))
        vm = self.alive.get(vm_id)
        if vm is None:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        self._maybe_fail(call, vm_id)
        if vm.live is not None and call in ("list_files", "read_file", "write_file"):
            raise PalError(f"VM {vm_id} is live-paused", status=409, code="LIVE_PAUSED")
        return vm

    # -- live pause -------------------------------------------------------------------------

    async def live_pause(self, vm_id: str, req: LivePauseRequest) -> LivePauseResult:
        vm = self._vm("live_pause", vm_id)
        self.live_requests.append((vm_id, req))
        if vm.live is not None:
            if req.by == "operator":
                vm.live.by = "operator"
            if req.offload and not vm.live.offloaded:
                self.offload(vm_id)
            return LivePauseResult(paused=True, pause_ms=0.5, state=vm.live)
        if req.if_waiting and vm_id in self.nothing_waiting:
            return LivePauseResult(paused=False)
        self.live_pauses += 1
        vm.live = LiveState(by=req.by, since=1.8e9 + self.live_pauses)  # each pause its own start
        if req.offload:
            self.offload(vm_id)
        return LivePauseResult(paused=True, pause_ms=0.5, state=vm.live)

    def offload(self, vm_id: str, freed_mib: int = 250) -> None:
        """The live-paused VM's RAM is handed back; like the real node (manager/live.py),
        the node posts an ``offloaded`` notice, whether or not a pause's answer says it too."""
        live = self.alive[vm_id].live
        assert live is not None
        live.offloaded, live.resident_mib, live.freed_mib, live.offload_ms = True, 3, freed_mib, 100.0
        self.post(
            vm_id, "offloaded", ms=100.0, freed_mib=freed_mib, resident_mib=3, since=live.since, by=live.by
        )

    async def live_resume(self, vm_id: str) -> LiveResumeResult:
        vm = self._vm("live_resume", vm_id)
        if vm.live is None:
            return LiveResumeResult(resumed=False)
        live, vm.live = vm.live, None
        return LiveResumeResult(
            resumed=True, resume_ms=1.0, paused_ms=1500, offloaded=live.offloaded, buffered_bytes=2048
        )

    async def live_status(self, vm_id: str) -> LiveState | None:
        return self._vm("live_status", vm_id).live

    def post(self, vm_id: str, kind: str, **fields: Any) -> None:
        """The node noticed something (wait-ready, wake, offloaded) for the scheduler."""
        seq = len(self.notice_log) + 1
        self.notice_log.append(Notice(seq=seq, at=1.8e9, vm_id=vm_id, kind=kind, **fields))  # type: ignore[arg-type]
        self._posted.set()

    async def notices(self, after: int, epoch: str, wait_s: float) -> Notices:
        if epoch != self.notice_epoch:
            after = 0
        new = [n for n in self.notice_log if n.seq > after]
        if not new and wait_s > 0:
            self._posted.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._posted.wait(), wait_s)
            new = [n for n in self.notice_log if n.seq > after]
        return Notices(notices=new, seq=len(self.notice_log), epoch=self.notice_epoch)

    async def list_files(self, vm_id: str, path: str) -> FileList:
        vm = self._vm("list_files", vm_id)
        entries: list[dict[str, object]] = [
            {"name": n, "type": "file", "size": len(b)} for n, b in sorted(vm.files.items())
        ]
        return FileList(path=path, entries=entries, truncated=False)

    # -- processes and kernels: the fake guest has none (their tests use real VMs) --------

    def _no_process(self, call: str, vm_id: str, pid: int) -> NotFound:
        self._vm(call, vm_id)
        return NotFound(f"process {pid} not found", code="PROCESS_NOT_FOUND")

    def _no_kernel(self, call: str, vm_id: str) -> PalError:
        self._vm(call, vm_id)
        return PalError("the fake guest has no kernels", status=409, code="KERNEL_UNAVAILABLE")

    async def start_process(self, vm_id: str, req: Any) -> Any:
        self._vm("start_process", vm_id)
        raise PalError("the fake guest runs no processes", status=409, code="FAILED_PRECONDITION")

    async def list_processes(self, vm_id: str) -> list[Any]:
        self._vm("list_processes", vm_id)
        return []

    async def get_process(self, vm_id: str, pid: int) -> Any:
        raise self._no_process("get_process", vm_id, pid)

    async def delete_process(self, vm_id: str, pid: int) -> Any:
        raise self._no_process("delete_process", vm_id, pid)

    async def read_output(self, vm_id: str, pid: int, *args: Any) -> Any:
        raise self._no_process("read_output", vm_id, pid)

    async def attach_process(self, vm_id: str, pid: int, start: int) -> AsyncIterator[Any]:
        raise self._no_process("attach_process", vm_id, pid)
        yield  # an async generator, as the real one

    async def write_stdin(self, vm_id: str, pid: int, data: bytes, eof: bool) -> Any:
        raise self._no_process("write_stdin", vm_id, pid)

    async def signal_process(self, vm_id: str, pid: int, req: Any) -> None:
        raise self._no_process("signal_process", vm_id, pid)

    async def resize_process(self, vm_id: str, pid: int, size: Any) -> None:
        raise self._no_process("resize_process", vm_id, pid)

    async def wait_process(self, vm_id: str, pid: int, timeout_ms: int) -> Any:
        raise self._no_process("wait_process", vm_id, pid)

    async def run_code(self, vm_id: str, req: Any) -> AsyncIterator[Any]:
        raise self._no_kernel("run_code", vm_id)
        yield  # an async generator, as the real one

    async def create_context(self, vm_id: str, req: Any) -> Any:
        raise self._no_kernel("create_context", vm_id)

    async def list_contexts(self, vm_id: str) -> list[Any]:
        self._vm("list_contexts", vm_id)
        return []

    async def delete_context(self, vm_id: str, ctx: str) -> None:
        self._vm("delete_context", vm_id)
        raise NotFound(f"context {ctx} not found", code="CONTEXT_NOT_FOUND")

    async def interrupt_context(self, vm_id: str, ctx: str) -> bool:
        self._vm("interrupt_context", vm_id)
        raise NotFound(f"context {ctx} not found", code="CONTEXT_NOT_FOUND")

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        vm = self._vm("read_file", vm_id)
        if path not in vm.files:
            raise NotFound(f"{path} not found", code="FILE_NOT_FOUND")
        data = vm.files[path]
        return data[:MAX_FILE_BYTES], len(data) > MAX_FILE_BYTES

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        vm = self._vm("write_file", vm_id)
        vm.files[path] = data
        return FileWritten(path=path, bytes_written=len(data))

    async def delete_file(self, vm_id: str, path: str) -> FileDeleted:
        vm = self._vm("delete_file", vm_id)
        if vm.files.pop(path, None) is None:
            raise NotFound(f"{path} not found", code="FILE_NOT_FOUND")
        return FileDeleted(path=path, deleted=True)

    async def images(self) -> list[ImageInfo]:
        self.calls.append(("images", ""))
        return list(self.image_infos)

    async def warm(self, req: WarmRequest) -> WarmResult:
        self.warmed.append(req)
        return WarmResult(key=f"{req.image}-{req.memory_mib}m", ready=True)

    async def set_egress(self, vm_id: str, req: EgressSet) -> EgressSetResult:
        vm = self._vm("set_egress", vm_id)
        vm.egress = req.egress
        return EgressSetResult(closed=0)

    async def set_brokered(self, vm_id: str, req: BrokeredSet) -> None:
        # like the real node: any VM with a QEMU here, its vCPUs stopped or not
        self._vm("set_brokered", vm_id).brokered = {r.name: r.value for r in req.brokered}

    async def egress_counters(self, vm_id: str) -> dict[str, int] | None:
        return dict(self._vm("egress_counters", vm_id).counters)

    def deny(self, vm_id: str, name: str, port: int = 443, rule: str = "not in the allow list") -> None:
        """The gateway refused a connection of ``vm_id`` (an event for the scheduler to pull)."""
        self.egress_seq += 1
        self.egress_log.append(
            EgressEvent(
                seq=self.egress_seq,
                at=1.8e9,
                vm_id=vm_id,
                kind="egress_denied",
                name=name,
                address="203.0.113.9",
                port=port,
                rule=rule,
            )
        )

    async def egress_events(self, after: int, epoch: str) -> EgressEvents:
        if epoch != self.egress_epoch:
            after = 0
        return EgressEvents(
            events=[e for e in self.egress_log if e.seq > after], seq=self.egress_seq, epoch=self.egress_epoch
        )

    async def open_port(self, vm_id: str, port: int) -> LoopbackStream:
        """A byte stream to ``port_servers[port]`` on loopback, as the node's tunnel is one
        to the guest's server; 502 when nothing plays that port."""
        from pal.errors import BadGateway

        self.calls.append(("open_port", vm_id))
        if vm_id not in self.alive or port not in self.port_servers:
            raise BadGateway(f"nothing is listening on port {port} in VM {vm_id}")
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port_servers[port])
        return LoopbackStream(reader, writer)

    async def heartbeat(self) -> NodeHeartbeat:
        self.calls.append(("heartbeat", ""))
        if self.heartbeat_error is not None:
            raise self.heartbeat_error
        return NodeHeartbeat(
            node_id=self.node_id,
            accel="tcg",
            epoch="fake",
            url=self.url,
            region=self.region,
            labels=dict(self.labels),
            templates=list(self.templates),
            capacity=NodeCapacity(memory_mib=self.memory_mib, vcpus=64, disk_free_mib=1 << 20),
            images=list(self.image_infos),
            vms=[
                VmActivity(
                    vm_id=v.vm_id,
                    alive=True,
                    pid=1,
                    incarnation=v.incarnation,
                    has_active_exec=v.has_active_exec,
                    last_activity_unix_ms=v.last_activity_unix_ms,
                    guest_active=v.guest_active,
                    guest_last_activity_unix_ms=v.guest_last_activity_unix_ms,
                    last_heartbeat_unix_ms=v.last_heartbeat_unix_ms,
                    silent_cpu_ms=v.silent_cpu_ms,
                    live=v.live,
                )
                for v in self.alive.values()
            ],
        )

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        self.calls.append(("snapshot_status", vm_id))
        return SnapshotStatus(complete=self.snapshots.get((agent_version_id, vm_id, snapshot_id), False))

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        self.calls.append(("delete_snapshot", vm_id))
        self.deleted_snapshots.append((agent_version_id, vm_id, snapshot_id))
        self.snapshots.pop((agent_version_id, vm_id, snapshot_id), None)

    async def vm_metrics(self, vm_id: str) -> VmMetrics:
        self.calls.append(("vm_metrics", vm_id))
        samples = (
            [MetricSample(t=1000 * i, cpu_pct=float(i)) for i in range(3)] if vm_id in self.alive else []
        )
        return VmMetrics(
            vm_id=vm_id, interval_secs=5, window_secs=900, live=vm_id in self.alive, samples=samples
        )

    async def stats(self) -> NodeStats:
        self.calls.append(("stats", ""))
        if self.heartbeat_error is not None:
            raise self.heartbeat_error
        return NodeStats(
            node_id=self.node_id,
            accel="tcg",
            vms_live=len(self.alive),
            snapshot_bytes_local=4096 * len(self.snapshots),
            snapshot_bytes_s3=None,
            s3_queue_depth=0,
            seal_queue_depth=0,
            stats_age_secs=0.0,
        )

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[SnapshotInfo]:
        self.calls.append(("list_snapshots", vm_id))
        return [
            SnapshotInfo(
                snapshot_id=sid,
                created_at=f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z",  # in the order taken
                sizes={"mem": 4096},
                sealed=True,
                stored_bytes=self.snapshot_size,
            )
            for i, ((av, vid, sid), ok) in enumerate(self.snapshots.items())
            if ok and av == agent_version_id and vid == vm_id
        ]

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        self.calls.append(("delete_vm_snapshots", vm_id))
        mapped = {v.mem_snapshot_id for v in self.alive.values() if getattr(v, "mem_snapshot_id", None)}
        gone = [
            sid
            for (av, vid, sid) in list(self.snapshots)
            if av == agent_version_id and vid == vm_id and sid not in set(keep) | mapped
        ]
        for sid in gone:
            self.snapshots.pop((agent_version_id, vm_id, sid), None)
            self.deleted_snapshots.append((agent_version_id, vm_id, sid))
        return gone

    async def snapshot_owners(self) -> SnapshotOwners:
        self.calls.append(("snapshot_owners", ""))
        return SnapshotOwners(vms=sorted({(av, vid) for (av, vid, _) in self.snapshots}))

    # -- the verbs it serves: each bound to the method of its name above, looked up when
    #    called (a test may replace one) -------------------------------------------------

    def _volume_call(self, name: str, fn: Any) -> Any:
        """A volume verb, recorded and failing as scripted (``fail(name, exc)``)."""

        async def call(r: Any) -> Any:
            self.calls.append((name, r.volume_id))
            self._maybe_fail(name, r.volume_id)
            return await fn(r)

        return call

    def handlers(self) -> Handlers:
        h = Handlers()

        async def stop(r: Any) -> Stopped:
            await self.stop(r.vm_id, r.incarnation)
            return Stopped(vm_id=r.vm_id, stopped=True)

        async def live_status(r: Any) -> LiveStatus:
            return LiveStatus(live=await self.live_status(r.vm_id))

        async def read_file(r: Any) -> FileContent:
            data, truncated = await self.read_file(r.vm_id, r.path)
            return FileContent(data=data, truncated=truncated)

        async def set_brokered(r: Any) -> BrokeredSetResult:
            await self.set_brokered(r.vm_id, r)
            return BrokeredSetResult(vm_id=r.vm_id, rules=len(r.brokered))

        async def egress_counters(r: Any) -> EgressCounters:
            return EgressCounters(counters=await self.egress_counters(r.vm_id))

        async def images(_: Any) -> ImageList:
            return ImageList(images=await self.images())

        async def snapshots(r: Any) -> SnapshotList:
            return SnapshotList(snapshots=await self.list_snapshots(r.agent_version_id, r.vm_id))

        async def delete_vm_snapshots(r: Any) -> SnapshotsDeleted:
            return SnapshotsDeleted(
                deleted=await self.delete_vm_snapshots(r.agent_version_id, r.vm_id, r.keep)
            )

        async def uploaded(r: Any) -> Uploaded:
            await self.ensure_uploaded(r.agent_version_id, r.vm_id, r.snapshot_id)
            return Uploaded(uploaded=True)

        async def deleted(r: Any) -> SnapshotDeleted:
            await self.delete_snapshot(r.agent_version_id, r.vm_id, r.snapshot_id)
            return SnapshotDeleted(deleted=True)

        async def processes(r: Any) -> ProcessList:
            return ProcessList(processes=await self.list_processes(r.vm_id))

        async def signal(r: Any) -> SignalSent:
            await self.signal_process(r.vm_id, r.pid, r)
            return SignalSent(process_id=r.pid, signal=r.signal)

        async def resize(r: Any) -> Resized:
            await self.resize_process(r.vm_id, r.pid, r)
            return Resized(process_id=r.pid, cols=r.cols, rows=r.rows)

        async def contexts(r: Any) -> ContextList:
            return ContextList(contexts=await self.list_contexts(r.vm_id))

        async def delete_context(r: Any) -> ContextDeleted:
            await self.delete_context(r.vm_id, r.context_id)
            return ContextDeleted(context_id=r.context_id)

        async def interrupt(r: Any) -> ContextInterrupted:
            done = await self.interrupt_context(r.vm_id, r.context_id)
            return ContextInterrupted(context_id=r.context_id, interrupted=done)

        h.on(v.SPAWN, lambda r: self.spawn(r))
        h.on(v.STOP, stop)
        h.on(v.SNAPSHOT, lambda r: self.snapshot(r.vm_id, r))
        h.on(v.LIVE_PAUSE, lambda r: self.live_pause(r.vm_id, r))
        h.on(v.LIVE_RESUME, lambda r: self.live_resume(r.vm_id))
        h.on(v.LIVE_STATUS, live_status)
        h.on(v.NOTICES, lambda r: self.notices(r.after, r.epoch, r.wait_s))
        h.on(v.WARM, lambda r: self.warm(r))
        h.on(v.HEARTBEAT, lambda _: self.heartbeat())
        h.on(v.IMAGES, images)
        h.on(v.VM_METRICS, lambda r: self.vm_metrics(r.vm_id))
        h.on(v.STATS, lambda _: self.stats())
        h.on(v.SET_EGRESS, lambda r: self.set_egress(r.vm_id, r))
        h.on(v.SET_BROKERED, set_brokered)
        h.on(v.EGRESS_COUNTERS, egress_counters)
        h.on(v.EGRESS_EVENTS, lambda r: self.egress_events(r.after, r.epoch))
        h.on(v.CREATE_VOLUME, self._volume_call("create_volume", lambda r: self.volume_files.create(r)))
        h.on(v.RESIZE_VOLUME, self._volume_call("resize_volume", lambda r: self.volume_files.resize(r)))
        h.on(v.DELETE_VOLUME, self._volume_call("delete_volume", lambda r: self.volume_files.delete(r)))
        for verb in (
            v.VOLUME_LIST,
            v.VOLUME_STAT,
            v.VOLUME_READ,
            v.VOLUME_WRITE,
            v.VOLUME_MKDIR,
            v.VOLUME_REMOVE,
            v.VOLUME_SET_ATTRS,
        ):
            op = {"volume_list": "list_dir"}.get(verb.name, verb.name.removeprefix("volume_"))
            h.on(verb, self._volume_call(verb.name, lambda r, op=op: getattr(self.volume_content, op)(r)))
        h.on(v.SNAPSHOT_OWNERS, lambda _: self.snapshot_owners())
        h.on(v.LIST_SNAPSHOTS, snapshots)
        h.on(v.DELETE_VM_SNAPSHOTS, delete_vm_snapshots)
        h.on(v.SNAPSHOT_STATUS, lambda r: self.snapshot_status(r.agent_version_id, r.vm_id, r.snapshot_id))
        h.on(v.ENSURE_UPLOADED, uploaded)
        h.on(v.DELETE_SNAPSHOT, deleted)
        h.on_stream(v.EXEC, lambda r: self.exec_stream(r.vm_id, r))
        h.on(v.LIST_FILES, lambda r: self.list_files(r.vm_id, r.path))
        h.on(v.READ_FILE, read_file)
        h.on(v.WRITE_FILE, lambda r: self.write_file(r.vm_id, r.path, r.data))
        h.on(v.DELETE_FILE, lambda r: self.delete_file(r.vm_id, r.path))
        h.on(v.START_PROCESS, lambda r: self.start_process(r.vm_id, r))
        h.on(v.LIST_PROCESSES, processes)
        h.on(v.GET_PROCESS, lambda r: self.get_process(r.vm_id, r.pid))
        h.on(v.DELETE_PROCESS, lambda r: self.delete_process(r.vm_id, r.pid))
        h.on(v.READ_OUTPUT, lambda r: self.read_output(r.vm_id, r.pid, r.start, r.max_bytes, r.wait_ms))
        h.on_stream(v.ATTACH_PROCESS, lambda r: self.attach_process(r.vm_id, r.pid, r.start))
        h.on(v.WRITE_STDIN, lambda r: self.write_stdin(r.vm_id, r.pid, r.data, r.eof))
        h.on(v.SIGNAL_PROCESS, signal)
        h.on(v.RESIZE_PROCESS, resize)
        h.on(v.WAIT_PROCESS, lambda r: self.wait_process(r.vm_id, r.pid, r.timeout_ms))
        h.on_stream(v.RUN_CODE, lambda r: self.run_code(r.vm_id, r))
        h.on(v.CREATE_CONTEXT, lambda r: self.create_context(r.vm_id, r))
        h.on(v.LIST_CONTEXTS, contexts)
        h.on(v.DELETE_CONTEXT, delete_context)
        h.on(v.INTERRUPT_CONTEXT, interrupt)
        return h

    async def open(self, verb: Tunnel[Any], req: Any) -> Any:
        return await self.open_port(req.vm_id, req.port)  # a stream to its stand-in guest server


class FakeClock:
    """A settable ``time.time`` for the scheduler (seconds)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


@dataclass
class SchedEnv:
    store: Store
    manager: FakeManager
    sched: Scheduler
    clock: FakeClock
    tenant_id: str
    settings: Settings
    api_key: str  # the tenant's


def make_env(tmp_path: Path, *, max_vms: int = 10, **settings_kw: Any) -> SchedEnv:
    """A real store (SQLite in tmp_path), a FakeManager and a Scheduler on a fake clock.
    Nothing heartbeats for the FakeManager's node, so its silence is counted in hours, not
    the default seconds: a slow test on a loaded machine must not see it go silent."""
    settings_kw.setdefault("node_heartbeat_interval_s", 3600.0)
    settings = Settings(data_dir=tmp_path, **settings_kw)
    store = Store.open(settings)
    tenant, key = store.create_tenant("acme", max_vms)
    manager = FakeManager()
    clock = FakeClock()
    sched = Scheduler(settings, store, manager, clock=clock)
    return SchedEnv(store, manager, sched, clock, tenant.id, settings, key)


def bytes_read() -> int:
    """Bytes this process has read through read(2) and friends so far (/proc/self/io):
    how much a step reads, measured without a clock."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def live_vm(tmp_path: Path, vm_id: str, *, pid: int = 1, **kw: Any) -> LiveVm:
    """A node-side VM with a stand-in QEMU (its exit event, a pid, no cgroup) and a channel
    that never connects: for unit tests of what the node reads and reports."""
    return LiveVm(
        vm_id=vm_id,
        tenant_id="t",
        qemu=SimpleNamespace(exited=asyncio.Event(), pid=pid, cgroup=None),  # type: ignore[arg-type]
        channel=kw.pop("channel", None) or HarnessChannel(tmp_path / "x", vm_id),
        image=None,  # type: ignore[arg-type]
        incarnation=1,
        token="t",
        env={},
        memory_mib=kw.pop("memory_mib", 128),
        vcpus=1,
        disk_mib=512,
        **kw,
    )
