"""What meta.json promises about a snapshot dir, and checking that the dir keeps it.

A meta is *sealed* when it carries a checksum for every artifact it lists (``"sealed":
true``; metas written before sealing existed have no flag and count as sealed when every
artifact has a checksum). An unsealed meta has sizes for all artifacts but checksums only
for the small ones; the big ones are checksummed by the background seal (store.py).

The big artifacts (RAM, disk) also carry a *fingerprint* in the meta: inode, size, mtime and
ctime (ns) as ``stat`` gives them, taken at commit and again when they are sealed. A local
restore compares them instead of re-hashing gigabytes (store.py ``open_for_restore``): any
write, truncation, chmod or replacement of the file changes its ctime (or inode), and the
kernel sets ctime to *now* on every such change, so no user can set it back; only a clock
step or raw writes to the block device could, and both need root.

A meta is *authentic* when its ``mac`` is the HMAC-SHA256, under the snapshot key that only
the control plane and the nodes hold (``PAL_SNAPSHOT_KEY_FILE``), of the rest of the meta
in canonical JSON. Every meta this store writes is signed; a meta read from S3 is used
only if it is authentic, names the snapshot it is fetched as, and lists only known
artifacts with plausible sizes and digests (:func:`check_meta`). Its digests then vouch
for the artifacts, which are checked after the download.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Any

from pal.snapshots.hashing import HASH_ALGO, hash_files
from pal.snapshots.layout import ARTIFACTS, REQUIRED_ARTIFACTS, SnapshotRef

MAC_FIELD = "mac"
MAC_PREFIX = "hmac-sha256:"
# Bigger than any RAM or disk Pal makes (AgentSpec caps disks at 64 GiB): a larger size in
# a meta is a forgery or corruption, never an artifact to allocate.
MAX_ARTIFACT_BYTES = 1 << 40
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


FINGERPRINTS_FIELD = "fingerprints"


def fingerprint(path: Path) -> list[int]:
    """What says a file is still the one recorded (see the module's doc); OSError if gone."""
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def fingerprints(snap_dir: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: fingerprint(snap_dir / name) for name in names}


def recorded_fingerprint(meta: dict[str, Any], name: str) -> list[int] | None:
    """The fingerprint meta records for ``name`` (None if none, or not one)."""
    table = meta.get(FINGERPRINTS_FIELD)
    got = table.get(name) if isinstance(table, dict) else None
    if isinstance(got, list) and len(got) == 4 and all(type(v) is int for v in got):
        return got
    return None


def _canonical(meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_meta(meta: dict[str, Any], key: bytes) -> dict[str, Any]:
    """A copy of ``meta`` carrying its ``mac``."""
    mac = hmac.new(key, _canonical(meta), hashlib.sha256).hexdigest()
    return {**meta, MAC_FIELD: MAC_PREFIX + mac}


def is_signed(meta: dict[str, Any]) -> bool:
    return MAC_FIELD in meta


def meta_authentic(meta: dict[str, Any], key: bytes) -> bool:
    """The meta carries a ``mac`` and it is right (compared in constant time)."""
    got = meta.get(MAC_FIELD)
    if not isinstance(got, str) or not got.startswith(MAC_PREFIX):
        return False
    try:
        want = MAC_PREFIX + hmac.new(key, _canonical(meta), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):  # a value JSON cannot encode canonically
        return False
    return hmac.compare_digest(got, want)


def check_meta(meta: Any, ref: SnapshotRef) -> str | None:
    """Why ``meta`` cannot describe the snapshot ``ref`` (None when it can): it must name
    the same agent version, VM and snapshot, list only known artifacts (never a path),
    each with a size in range and a well-formed digest, and use our checksum algorithm."""
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    for field, want in (
        ("agentVersionId", ref.agent_version_id),
        ("vmId", ref.vm_id),
        ("snapshotId", ref.snapshot_id),
    ):
        if meta.get(field) != want:
            return f"meta.json names another snapshot ({field})"
    if meta.get("hashAlgo") != HASH_ALGO:
        return "meta.json uses an unknown checksum algorithm"
    sizes, digests = meta.get("sizes"), meta.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return "meta.json has no sizes or checksums"
    unknown = (set(sizes) | set(digests)) - set(ARTIFACTS)
    if unknown:
        return f"meta.json lists unknown artifacts {sorted(map(str, unknown))[:5]}"
    if not REQUIRED_ARTIFACTS <= set(sizes) or not set(digests) <= set(sizes):
        return "meta.json lacks required artifacts"
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_ARTIFACT_BYTES:
            return f"meta.json has an impossible size for {name}"
    for name, digest in digests.items():
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            return f"meta.json has a malformed checksum for {name}"
    return None


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
