"""Warm templates: a snapshot of a freshly booted VM per (image build, RAM, vCPUs, disk).

A manager concern: the runtime builds them with its own spawn and capture and restores
from them in ``NodeRuntime.spawn``.

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
from typing import TYPE_CHECKING, Any

from pal.guest import protocol as p
from pal.images.paths import ImagePaths
from pal.manager.models import SpawnRequest
from pal.sizes import size_name

if TYPE_CHECKING:  # runtime.py imports this module
    from pal.manager.runtime import NodeRuntime

log = logging.getLogger(__name__)

COMPLETE = "template.json"


class TemplateCache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._building: dict[str, asyncio.Task[Path | None]] = {}

    @staticmethod
    def key(image: ImagePaths, memory_mib: int, vcpus: int, disk_mib: int) -> str:
        return f"{image.agent_version_id}-{size_name(memory_mib, vcpus, disk_mib)}"

    def lookup(self, image: ImagePaths, memory_mib: int, vcpus: int, disk_mib: int) -> Path | None:
        path = self.root / self.key(image, memory_mib, vcpus, disk_mib)
        return path if (path / COMPLETE).exists() else None

    def ensure_in_background(
        self,
        runtime: NodeRuntime,
        image: ImagePaths,
        memory_mib: int,
        vcpus: int,
        disk_mib: int,
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
        disk_mib: int,
    ) -> Path | None:
        """Cold-boot a VM, wait for its harness, capture it, keep the capture as a template."""

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
            await lv.channel.request({"k": p.K_PING})
            staging.mkdir(parents=True, exist_ok=True)
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

    def sizes(self, agent_version_id: str) -> list[str]:
        """The sizes (``<mem>m-<vcpus>c-<disk>d``) with a complete template of an image build."""
        prefix = agent_version_id + "-"
        if not self.root.is_dir():
            return []
        return sorted(
            d.name[len(prefix) :]
            for d in self.root.iterdir()
            if d.name.startswith(prefix) and (d / COMPLETE).exists()
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
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads((d / COMPLETE).read_text()))
        return out

    def prune(self, keep_versions: set[str]) -> None:
        """Drop templates of image builds that no longer exist."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            if d.name.startswith(".staging-") or not any(d.name.startswith(v + "-") for v in keep_versions):
                shutil.rmtree(d, ignore_errors=True)
