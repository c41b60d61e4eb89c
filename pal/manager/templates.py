"""Warm templates: a snapshot of a freshly booted VM per (image build, RAM, vCPUs, disk).

A manager concern: the node builds them with its own spawn and capture (through a
:class:`TemplateHost`) and restores from them in spawn.py (restore.py picks the source).

Booting is the slow part (seconds under TCG), so ``schedule`` restores from a template
instead: the restored guest then takes its own identity (token, clock, RNG seed) and gets
its own reflinked disk and memory file. Templates are a local cache, keyed by the image's
``agent_version_id``, so a rebuilt image never restores from a stale template; they are
written to a temporary directory and renamed into place only when complete.

Bounded, because a tenant picks the sizes it schedules: only the operator's sizes
(``PAL_TEMPLATE_SIZES``) get a template, at most ``PAL_TEMPLATE_BUILDS`` build at once
(each boots a VM), and past ``PAL_TEMPLATES_KEEP`` the least recently used are removed
(never one a spawn is restoring from, nor one being built).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pal.guest import protocol as p
from pal.guest import volumes as guest_volumes
from pal.images.paths import ImagePaths
from pal.manager import admission
from pal.manager.vm import LiveVm
from pal.sizes import DEFAULT_TEMPLATE_SIZES, parse_size_name
from pal.spec import ExecRequest
from pal.wire.models import ExecEvent, SpawnRequest, SpawnResult

if TYPE_CHECKING:
    from pal.config import Settings

log = logging.getLogger(__name__)

COMPLETE = "template.json"
# What a first exec runs (pal bench: /bin/true; agents: a shell; E2B's commands.run: a
# login bash, its profile and libraries), run once before capture.
PRIME_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("/bin/true",),
    ("/bin/sh", "-c", "true"),
    ("/bin/bash", "-l", "-c", "true"),
)
# As root, in the template only: the NFS client's modules (pal/guest/volumes.py) loaded before
# the capture, so a VM started from the template mounts its volumes without loading them
# (measured under TCG: ~0.5 s of a schedule with a volume; the modules' ~3 MiB are the
# template's pages, shared by its VMs). An image without them: a no-op.
ROOT_PRIME_COMMANDS: tuple[tuple[str, ...], ...] = (
    (
        guest_volumes.BUSYBOX,
        "sh",
        "-c",
        f'o={guest_volumes.MODULES_DIR}/order; [ -f "$o" ] || exit 0; for m in $(cat "$o"); do '
        f'[ -d "/sys/module/$m" ] || {guest_volumes.BUSYBOX} insmod "{guest_volumes.MODULES_DIR}/$m.ko"'
        " || exit 1; done",
    ),
)
PRIME_TIMEOUT_S = 60.0  # a hang guard: an image whose shell never returns still gets its template
# What a build of this code runs before its capture. A template is a cache kept across
# upgrades (its key is the image's digest): one built by a Pal that primed otherwise is
# rebuilt, not restored, so an upgrade's priming reaches every VM.
RECIPE = hashlib.sha256(repr((PRIME_COMMANDS, ROOT_PRIME_COMMANDS)).encode()).hexdigest()[:16]


def current_meta(template: Path) -> dict[str, Any] | None:
    """``template``'s record if it is complete and was built by this recipe, else None."""
    try:
        meta = json.loads((template / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("recipe") == RECIPE else None


@dataclass(frozen=True)
class TemplateHost:
    """Exactly what a template build needs of the node: its own spawn, exec and stop, and
    the VM it spawned (its channel and QEMU, to capture)."""

    spawn: Callable[[SpawnRequest], Awaitable[SpawnResult]]
    exec_stream: Callable[[str, ExecRequest], AsyncIterator[ExecEvent]]
    stop: Callable[[str], Awaitable[object]]
    live: Callable[[str], LiveVm]


class TemplateCache:
    def __init__(
        self,
        root: Path,
        *,
        sizes: Iterable[str] | None = DEFAULT_TEMPLATE_SIZES,
        max_builds: int = 1,
        keep: int = 8,
    ) -> None:
        self.root = root
        self.sizes_allowed = None if sizes is None else frozenset(sizes)
        self.keep = keep
        self._building: dict[str, asyncio.Task[Path | None]] = {}
        self._build_slots = asyncio.Semaphore(max_builds)
        self._in_use: dict[str, int] = {}
        self._current: set[str] = set()  # templates whose record was read: of this recipe

    @classmethod
    def from_settings(cls, settings: Settings) -> TemplateCache:
        return cls(
            settings.data_dir / "templates",
            sizes=settings.template_sizes,
            max_builds=settings.template_builds,
            keep=settings.templates_keep,
        )

    def allowed(self, size: str) -> bool:
        """Whether this size (``<mem>m-<vcpus>c-<disk>d``) gets a template (PAL_TEMPLATE_SIZES)."""
        return self.sizes_allowed is None or size in self.sizes_allowed

    @contextlib.contextmanager
    def use(self, image: ImagePaths, size: str) -> Iterator[Path | None]:
        """The complete template of this build and size (or None), kept from pruning while
        the caller restores from it, and marked as just used."""
        path = self.lookup(image, size)
        if path is None:
            yield None
            return
        key = path.name
        self._in_use[key] = self._in_use.get(key, 0) + 1
        with contextlib.suppress(OSError):
            os.utime(path / COMPLETE)  # its last use: what pruning goes by
        try:
            yield path
        finally:
            self._in_use[key] -= 1
            if not self._in_use[key]:
                del self._in_use[key]

    @staticmethod
    def key(image: ImagePaths, size: str) -> str:
        return f"{image.agent_version_id}-{size}"

    def current(self, template: Path) -> bool:
        """Complete and of this recipe. A schedule's hot path: a stat once a template's
        record was read (a template dir is only ever replaced by a build of this code)."""
        if not (template / COMPLETE).exists():
            return False
        if template.name not in self._current:
            if current_meta(template) is None:
                return False
            self._current.add(template.name)
        return True

    def lookup(self, image: ImagePaths, size: str) -> Path | None:
        path = self.root / self.key(image, size)
        return path if self.current(path) else None

    def ensure_in_background(
        self, runtime: TemplateHost, image: ImagePaths, size: str
    ) -> asyncio.Task[Path | None] | None:
        """Start building this template unless one is built or building; None when the
        size gets no template (PAL_TEMPLATE_SIZES)."""
        if not self.allowed(size):
            return None
        key = self.key(image, size)
        task = self._building.get(key)
        if task is None or task.done():
            task = asyncio.create_task(self.build(runtime, image, size), name=f"template-{key}")
            self._building[key] = task
        return task

    async def build(self, runtime: TemplateHost, image: ImagePaths, size: str) -> Path | None:
        """Cold-boot a VM, wait for its harness, capture it, keep the capture as a template
        (then prune the least recently used past the limit). At most ``max_builds`` at once."""
        key = self.key(image, size)
        final = self.root / key
        async with self._build_slots:
            if self.current(final):
                return final
            built = await self._build(runtime, image, key, size)
        if built is not None:
            await asyncio.to_thread(self.prune_least_recently_used)
        return built

    async def _build(self, runtime: TemplateHost, image: ImagePaths, key: str, size: str) -> Path | None:
        memory_mib, vcpus, disk_mib = parse_size_name(size)
        final = self.root / key
        vm_id = "tmpl-" + secrets.token_hex(6)
        staging = self.root / f".staging-{vm_id}"
        t0 = time.perf_counter()
        try:
            await runtime.spawn(
                SpawnRequest(
                    vm_id=vm_id,
                    tenant_id="",
                    image=image.name,
                    vcpus=vcpus,
                    memory_mib=memory_mib,
                    disk_mib=disk_mib,
                    token=secrets.token_urlsafe(16),
                    boot="cold",
                )
            )
            lv = runtime.live(vm_id)
            # Let the freshly booted guest settle (page cache, late init) before capture.
            await lv.channel.request({"k": p.K_PING})
            primed = await self._prime(runtime, vm_id)
            primed += await warm_kernel(lv, image)
            staging.mkdir(parents=True, exist_ok=True)
            # Like a pause: the capture's RAM file must fit (a full disk fails it cleanly).
            await asyncio.to_thread(admission.check_disk, self.root, memory_mib, f"the template of {key}")
            art = await lv.qemu.capture(staging)
            meta = {
                "key": key,
                "image": image.name,
                "agentVersionId": image.agent_version_id,
                "boot": image.boot_id,
                "memoryMib": memory_mib,
                "vcpus": vcpus,
                "diskMib": disk_mib,
                "memoryKind": art.memory_kind,
                "primedWith": primed,
                "recipe": RECIPE,
                "createdAt": time.time(),
                "buildMs": (time.perf_counter() - t0) * 1000,
            }
            (staging / COMPLETE).write_text(json.dumps(meta))
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(final)
            staging.rename(final)
            log.info("template %s ready in %.1f s", key, (time.perf_counter() - t0))
            return final
        except Exception as exc:
            log.warning("template %s could not be built: %s", key, exc)
            return None
        finally:
            await runtime.stop(vm_id)
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    async def _prime(runtime: TemplateHost, vm_id: str) -> list[str]:
        """Run what a first exec runs once before the capture, so every VM restored from the
        template starts past the first-exec work of its harness and kernel (what one exec
        leaves behind in the guest: measured under TCG, a schedule's first exec took 146-152
        ms from a primed template against 199-224 ms from an unprimed one, the warm exec
        51-65 ms). Returns the commands that ran (an image may lack them: no priming)."""
        ran = []
        for argv, user in [(a, None) for a in PRIME_COMMANDS] + [(a, "root") for a in ROOT_PRIME_COMMANDS]:
            req = ExecRequest(
                command=argv[0],
                argv=list(argv[1:]),
                cwd=None,
                timeout_secs=PRIME_TIMEOUT_S,
                user=user,
                yield_after_ms=None,
            )
            try:
                async for ev in runtime.exec_stream(vm_id, req):
                    if ev.type == "exit" and ev.exit_code == 0:
                        ran.append(" ".join(argv))
            except Exception as exc:
                log.info("template %s: priming with %s failed: %s", vm_id, argv[0], exc)
        return ran

    def sizes(self, agent_version_id: str) -> list[str]:
        """The sizes (``<mem>m-<vcpus>c-<disk>d``) with a complete template of an image build."""
        prefix = agent_version_id + "-"
        if not self.root.is_dir():
            return []
        return sorted(
            d.name[len(prefix) :]
            for d in self.root.iterdir()
            if d.name.startswith(prefix) and self.current(d)
        )

    def drop(self, agent_version_id: str) -> None:
        """Remove the complete templates of one image build (it was replaced or removed).
        Builds in progress (``.staging-*``) are left to their builder."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name.startswith(agent_version_id + "-"):
                shutil.rmtree(d, ignore_errors=True)

    def warm(self) -> list[dict[str, Any]]:
        """The complete templates held here (their template.json), for the node heartbeat."""
        out: list[dict[str, Any]] = []
        if not self.root.is_dir():
            return out
        for d in sorted(self.root.iterdir()):
            meta = current_meta(d)  # another recipe's is rebuilt before any use
            if meta is not None:
                out.append(meta)
        return out

    def prune_least_recently_used(self) -> list[str]:
        """Remove the least recently used complete templates beyond ``keep`` (never one in
        use or being built); returns the removed keys."""
        if not self.root.is_dir():
            return []
        # A build counts until its capture is complete; one that is only pruning after it
        # (as this call may be, in another thread) holds nothing.
        busy = set(self._in_use) | {
            k for k, t in self._building.items() if not t.done() and not (self.root / k / COMPLETE).exists()
        }
        complete = []
        for d in self.root.iterdir():
            with contextlib.suppress(OSError):
                complete.append(((d / COMPLETE).stat().st_mtime, d))
        complete.sort(reverse=True)  # newest use first
        removed = []
        for _, d in complete[self.keep :]:
            if d.name in busy:
                continue
            # Renamed first, so a lookup never sees a half-removed template.
            gone = self.root / f".staging-gone-{d.name}"
            with contextlib.suppress(OSError):
                d.rename(gone)
                shutil.rmtree(gone, ignore_errors=True)
                removed.append(d.name)
                log.info("template %s removed: least recently used of more than %d", d.name, self.keep)
        return removed

    def prune(self, keep_versions: set[str]) -> None:
        """Drop templates of image builds that no longer exist."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name.startswith(".staging-") or not any(d.name.startswith(v + "-") for v in keep_versions):
                shutil.rmtree(d, ignore_errors=True)


WARM_KERNEL_ENV = "PAL_WARM_KERNEL"  # an image's ENV naming the language whose kernel its template starts
WARM_KERNEL_TIMEOUT_S = 240.0  # ipykernel's first start under TCG imports a lot


def warm_kernel_language(image: ImagePaths) -> str | None:
    """The language whose kernel the image's template starts (PAL_WARM_KERNEL), if any."""
    language = image.config.env.get(WARM_KERNEL_ENV)
    return language if language in ("python", "bash") else None


async def warm_kernel(lv: Any, image: ImagePaths) -> list[str]:
    """Start the image's default code context before the capture (the code-interpreter
    image sets PAL_WARM_KERNEL=python), so a VM restored from the template answers its
    first cell without a kernel start: an empty cell, which leaves no count nor history.
    The warm pool runs it again in a pooled VM (pool.prime: its kernel runs, warm)."""
    language = warm_kernel_language(image)
    if language is None:
        return []
    msg = {"k": p.K_CRUN, "tok": lv.token, "ctx": None, "language": language, "code": "", "timeout": 60}
    try:
        async with asyncio.timeout(WARM_KERNEL_TIMEOUT_S):
            async for reply in lv.channel.stream(msg):
                if reply["k"] == p.K_OK:
                    return [f"{language} kernel"]
                if reply["k"] == p.K_ERR:
                    raise RuntimeError(reply.get("msg"))
    except Exception as exc:  # the template still serves: its first cell starts the kernel
        log.warning("template of %s: the %s kernel did not start: %s", image.name, language, exc)
    return []
