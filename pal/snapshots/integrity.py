"""What meta.json promises about a snapshot dir, and checking that the dir keeps it.

A meta is *sealed* when it carries a checksum for every artifact it lists (``"sealed":
true``; metas written before sealing existed have no flag and count as sealed when every
artifact has a checksum). An unsealed meta has sizes for all artifacts but checksums only
for the small ones; the big ones are checksummed by the background seal (store.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pal.snapshots.hashing import HASH_ALGO, hash_files
from pal.snapshots.layout import REQUIRED_ARTIFACTS


def is_sealed(meta: dict[str, Any]) -> bool:
    sizes, digests = meta.get("sizes"), meta.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return False
    return meta.get("sealed", True) is True and set(digests) == set(sizes)


def unsealed_artifacts(meta: dict[str, Any]) -> list[str]:
    """Artifacts listed in meta that have no checksum yet."""
    sizes, digests = meta.get("sizes"), meta.get("sha256")
    if not isinstance(sizes, dict):
        return []
    have = digests if isinstance(digests, dict) else {}
    return sorted(name for name in sizes if name not in have)


def verify_dir(snap_dir: Path, meta: dict[str, Any], *, allow_unsealed: bool = False) -> bool:
    """Every artifact in meta is present with its recorded size and every recorded
    checksum matches. An unsealed meta passes only with ``allow_unsealed`` (then its big
    artifacts are checked for presence and size only)."""
    sizes, digests = meta.get("sizes"), meta.get("sha256")
    if meta.get("hashAlgo") != HASH_ALGO or not isinstance(sizes, dict) or not isinstance(digests, dict):
        return False
    if not set(digests) <= set(sizes) or not REQUIRED_ARTIFACTS <= set(sizes):
        return False
    if not is_sealed(meta) and not allow_unsealed:
        return False
    for name, size in sizes.items():
        try:
            if os.stat(snap_dir / name).st_size != size:
                return False
        except OSError:
            return False
    try:
        hashed = hash_files({name: snap_dir / name for name in digests})
    except OSError:
        return False
    return all(hashed[name] == (sizes[name], digests[name]) for name in digests)
