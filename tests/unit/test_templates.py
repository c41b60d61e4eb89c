"""Template cache: keyed by image build, RAM and vCPUs; stale builds' templates dropped."""

from __future__ import annotations

from pathlib import Path

from pal.images.paths import ImagePaths
from pal.manager.templates import COMPLETE, TemplateCache


def image(tmp: Path, content_hash: str) -> ImagePaths:
    return ImagePaths.at("default", tmp / "img", {"contentHash": content_hash})


def test_lookup_needs_a_complete_template_of_the_same_build_and_size(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates")
    v1, v2 = image(tmp_path, "a" * 64), image(tmp_path, "b" * 64)
    d = cache.root / cache.key(v1, 256, 1, 2048)
    d.mkdir(parents=True)
    assert cache.lookup(v1, 256, 1, 2048) is None, "a template still being written is not used"
    (d / COMPLETE).write_text("{}")
    assert cache.lookup(v1, 256, 1, 2048) == d
    assert cache.lookup(v1, 512, 1, 2048) is None
    assert cache.lookup(v1, 256, 2, 2048) is None
    assert cache.lookup(v2, 256, 1, 2048) is None, "a rebuilt image never restores an old template"


def test_prune_keeps_only_current_builds(tmp_path: Path) -> None:
    cache = TemplateCache(tmp_path / "templates")
    v1, v2 = image(tmp_path, "a" * 64), image(tmp_path, "b" * 64)
    for v in (v1, v2):
        d = cache.root / cache.key(v, 256, 1, 2048)
        d.mkdir(parents=True)
        (d / COMPLETE).write_text("{}")
    (cache.root / ".staging-tmpl-x").mkdir()
    cache.prune({v2.agent_version_id})
    assert cache.lookup(v1, 256, 1, 2048) is None
    assert cache.lookup(v2, 256, 1, 2048) is not None
    assert not (cache.root / ".staging-tmpl-x").exists()
