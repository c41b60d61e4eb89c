"""Warm templates: a snapshot of a freshly booted VM per (image build, RAM, vCPUs).

Booting is the slow part (seconds under TCG), so ``schedule`` restores from a template
instead: the restored guest then takes its own identity (token, clock, RNG seed) and gets
its own reflinked disk and memory file. Templates are a local cache, keyed by the image's
``agent_version_id``, so a rebuilt image never restores from a stale template; they are
written to a temporary directory and renamed into place only when complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pal.images.paths import ImagePaths

if TYPE_CHECKING:
    from pal.manager.runtime import NodeRuntime

log = logging.getLogger(__name__)

COMPLETE = "template.json"
DEFAULT_DISK_MIB = 2048  # AgentSpec's default (pal/scheduler/spec.py)


class TemplateCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._building: dict[str, asyncio.Task[Path | None]] = {}

    @staticmethod
    def key(image: ImagePaths, memory_mib: int, vcpus: int, disk_mib: int = DEFAULT_DISK_MIB) -> str:
        # The disk size is part of the key: the guest grows its file system at boot.
        return f"{image.agent_version_id}-{memory_mib}m-{vcpus}c-{disk_mib}d"

    def lookup(
        self, image: ImagePaths, memory_mib: int, vcpus: int, disk_mib: int = DEFAULT_DISK_MIB
    ) -> Path | None:
        path = self.root / self.key(image, memory_mib, vcpus, disk_mib)
        return path if (path / COMPLETE).exists() else None

    def ensure_in_background(
        self,
        runtime: NodeRuntime,
        image: ImagePaths,
        memory_mib: int,
        vcpus: int,
        disk_mib: int = DEFAULT_DISK_MIB,
    ) -> asyncio.Task[Path | None]:
        key = self.key(image, memory_mib, vcpus, disk_mib)
        task = self._building.get(key)
        if task is None or task.done():
            task = asyncio.create_task(
                self.build(runtime, image, memory_mib, vcpus, disk_mib), name=f"template-{key}"
            )
            self._building[key] = task
        return task

    async def build(
        self,
        runtime: NodeRuntime,
        image: ImagePaths,
        memory_mib: int,
        vcpus: int,
        disk_mib: int = DEFAULT_DISK_MIB,
    ) -> Path | None:
        """Cold-boot a VM, wait for its harness, capture it, keep the capture as a template."""
        from pal.manager.models import SpawnRequest  # manager imports images, not vice versa

        key = self.key(image, memory_mib, vcpus, disk_mib)
        final = self.root / key
        if (final / COMPLETE).exists():
            return final
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
            lv = runtime.vms[vm_id]
            # Let the freshly booted guest settle (page cache, late init) before capture.
            await lv.channel.request({"k": "ping"})
            staging.mkdir(parents=True, exist_ok=True)
            art = await lv.qemu.capture(staging)
            meta = {
                "key": key,
                "image": image.name,
                "agentVersionId": image.agent_version_id,
                "memoryMib": memory_mib,
                "vcpus": vcpus,
                "diskMib": disk_mib,
                "memoryKind": art.memory_kind,
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

    def prune(self, keep_versions: set[str]) -> None:
        """Drop templates of image builds that no longer exist."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name.startswith(".staging-") or not any(d.name.startswith(v + "-") for v in keep_versions):
                shutil.rmtree(d, ignore_errors=True)
