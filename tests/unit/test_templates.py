"""Template cache: keyed by image build, RAM and vCPUs; stale builds' templates dropped."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from pal.config import parse_template_sizes
from pal.errors import PalError
from pal.images.paths import ImagePaths
from pal.manager.templates import COMPLETE, RECIPE, TemplateCache, TemplateHost
from pal.sizes import DEFAULT_TEMPLATE_SIZES
from pal.wire.models import SpawnRequest


def image(tmp: Path, content_hash: str) -> ImagePaths:
    return ImagePaths.at("default", tmp / "img", {"contentHash": content_hash})


DONE = json.dumps({"recipe": RECIPE})  # a complete template of this code's recipe


def test_lookup_needs_a_complete_template_of_the_same_build_and_size(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates")
    v1, v2 = image(tmp_path, "a" * 64), image(tmp_path, "b" * 64)
    d = cache.root / cache.key(v1, "256m-1c-2048d")
    d.mkdir(parents=True)
    assert cache.lookup(v1, "256m-1c-2048d") is None, "a template still being written is not used"
    (d / COMPLETE).write_text(DONE)
    assert cache.lookup(v1, "256m-1c-2048d") == d
    assert cache.lookup(v1, "512m-1c-2048d") is None
    assert cache.lookup(v1, "256m-2c-2048d") is None
    assert cache.lookup(v2, "256m-1c-2048d") is None, "a rebuilt image never restores an old template"


def test_prune_keeps_only_current_builds(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates")
    v1, v2 = image(tmp_path, "a" * 64), image(tmp_path, "b" * 64)
    for v in (v1, v2):
        d = cache.root / cache.key(v, "256m-1c-2048d")
        d.mkdir(parents=True)
        (d / COMPLETE).write_text(DONE)
    (cache.root / ".staging-tmpl-x").mkdir()
    cache.prune({v2.agent_version_id})
    assert cache.lookup(v1, "256m-1c-2048d") is None
    assert cache.lookup(v2, "256m-1c-2048d") is not None
    assert not (cache.root / ".staging-tmpl-x").exists()


def _complete(cache: TemplateCache, v: ImagePaths, mem: int, mtime: float) -> Path:
    d = cache.root / cache.key(v, f"{mem}m-1c-2048d")
    d.mkdir(parents=True)
    (d / COMPLETE).write_text(DONE)
    os.utime(d / COMPLETE, (mtime, mtime))
    return d


def test_only_the_operators_sizes_get_a_template(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates", sizes=["256m-1c-2048d"])
    assert cache.allowed("256m-1c-2048d") and not cache.allowed("384m-1c-2048d")
    runtime = _FakeRuntime()
    assert cache.ensure_in_background(runtime.host(), image(tmp_path, "a" * 64), "384m-1c-2048d") is None
    assert runtime.spawned == 0
    assert TemplateCache(tmp_path / "t2", sizes=None).allowed("384m-3c-999d")  # PAL_TEMPLATE_SIZES=*


def test_the_least_recently_used_go_past_the_limit_but_never_one_in_use(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates", keep=2)
    v = image(tmp_path, "a" * 64)
    oldest = _complete(cache, v, 128, 1000)
    _complete(cache, v, 256, 2000)
    _complete(cache, v, 512, 3000)
    with cache.use(v, "128m-1c-2048d") as pinned:  # in use (and now the most recently used)
        assert pinned == oldest
        _complete(cache, v, 1024, 4000)
        removed = cache.prune_least_recently_used()
    assert sorted(removed) == sorted([cache.key(v, "256m-1c-2048d"), cache.key(v, "512m-1c-2048d")])
    assert cache.lookup(v, "128m-1c-2048d") is not None, "used last: kept"
    assert cache.lookup(v, "1024m-1c-2048d") is not None
    assert cache.lookup(v, "256m-1c-2048d") is None
    assert sorted(p.name for p in cache.root.iterdir()) == sorted(
        [cache.key(v, "128m-1c-2048d"), cache.key(v, "1024m-1c-2048d")]
    ), "nothing half-removed is left"


def test_a_template_in_use_outlives_the_limit(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates", keep=1)
    v = image(tmp_path, "a" * 64)
    _complete(cache, v, 128, 1000)
    _complete(cache, v, 256, 2000)
    with cache.use(v, "128m-1c-2048d"):
        os.utime(cache.root / cache.key(v, "128m-1c-2048d") / COMPLETE, (500, 500))
        assert cache.prune_least_recently_used() == [], "the other is newer; this one is in use"
    assert cache.prune_least_recently_used() == [cache.key(v, "128m-1c-2048d")]


class _FakeRuntime:
    """Just what TemplateCache.build uses of NodeRuntime: spawn, the VM's channel and
    capture, stop. Each spawn waits until released, so the test sees how many overlap."""

    def __init__(self) -> None:
        self.spawned = 0
        self.running = 0
        self.most_at_once = 0
        self.release = asyncio.Event()
        self.vms: dict[str, SimpleNamespace] = {}

    async def spawn(self, req: SpawnRequest) -> None:
        self.spawned += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        await self.release.wait()

        async def capture(staging: Path) -> SimpleNamespace:
            (staging / "mem").write_bytes(b"m")
            return SimpleNamespace(memory_kind="file")

        async def request(_: object) -> None:
            return None

        self.vms[req.vm_id] = SimpleNamespace(
            channel=SimpleNamespace(request=request), qemu=SimpleNamespace(capture=capture)
        )

    async def stop(self, vm_id: str) -> None:
        self.running -= 1

    async def exec_stream(self, vm_id: str, req: object) -> AsyncIterator[object]:
        raise PalError("the fake guest runs nothing: the template is not primed")
        yield  # an async generator, as the real one

    def host(self) -> TemplateHost:
        """What a template build gets of the node (pal/manager/templates.py)."""
        return TemplateHost(
            spawn=self.spawn,  # type: ignore[arg-type]
            exec_stream=self.exec_stream,  # type: ignore[arg-type]
            stop=self.stop,
            live=lambda vm_id: self.vms[vm_id],  # type: ignore[arg-type,return-value]
        )


async def test_template_builds_are_capped_and_the_cache_stays_within_its_limit(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates", sizes=None, max_builds=1, keep=2)
    runtime = _FakeRuntime()
    v = image(tmp_path, "a" * 64)
    tasks = [cache.ensure_in_background(runtime.host(), v, f"{mem}m-1c-2048d") for mem in (128, 256, 512)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert runtime.spawned == 1, "one build at a time"
    runtime.release.set()
    built = await asyncio.gather(*[t for t in tasks if t is not None])
    assert all(b is not None for b in built)
    assert runtime.most_at_once == 1 and runtime.spawned == 3
    assert len(cache.warm()) == 2, "the least recently used beyond PAL_TEMPLATES_KEEP went"


async def test_a_template_an_older_pal_primed_otherwise_is_rebuilt_not_restored(tmp_path: Path) -> None:
    """Templates outlive an upgrade (their key is the image's digest): one whose build ran
    other priming commands is neither used nor advertised, and the next build replaces it."""
    cache = TemplateCache(tmp_path / "templates", sizes=None)
    v = image(tmp_path, "a" * 64)
    size = "256m-1c-2048d"
    old = cache.root / cache.key(v, size)
    old.mkdir(parents=True)
    (old / COMPLETE).write_text(json.dumps({"recipe": "an-older-one", "primedWith": ["/bin/true"]}))
    (old / "mem").write_bytes(b"old")
    assert cache.lookup(v, size) is None and cache.sizes(v.agent_version_id) == [] and cache.warm() == []
    runtime = _FakeRuntime()
    runtime.release.set()
    task = cache.ensure_in_background(runtime.host(), v, size)
    assert task is not None and await task == old and runtime.spawned == 1
    assert cache.lookup(v, size) == old and (old / "mem").read_bytes() == b"m"
    assert [m["recipe"] for m in cache.warm()] == [RECIPE]


def test_template_sizes_setting() -> None:
    assert parse_template_sizes(None) == DEFAULT_TEMPLATE_SIZES
    assert parse_template_sizes("*") is None
    assert parse_template_sizes(" 512m-2c-4096d, 256m-1c-2048d ") == ("512m-2c-4096d", "256m-1c-2048d")
    with pytest.raises(ValueError, match="PAL_TEMPLATE_SIZES: '512' is not a size"):
        parse_template_sizes("512")
    with pytest.raises(ValueError, match="memory 64 is outside"):
        parse_template_sizes("64m-1c-2048d")
