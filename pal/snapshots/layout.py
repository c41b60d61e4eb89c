"""Where a snapshot lives: its reference, id validation, local paths and S3 keys.

Layout (both tiers, see docs/internals.md "Data dir layout"):
    local  <root>/<agent_version_id>/<vm_id>/<snapshot_id>/{snapshot,mem,rootfs,vmm.json,meta.json}
    S3     snapshots/<agent_version_id>/<vm_id>/<snapshot_id>/{same files, key.json}

S3 objects of an encrypted snapshot (the default) are ``pal-enc-v1`` objects and its data
key is in ``key.json``: see crypt.py.

Sealing: ``commit`` checksums and fsyncs only the small artifacts (at most
``INLINE_SEAL_MAX_BYTES``) and publishes meta.json with ``"sealed": false``; a background
seal job checksums + fsyncs the large ones and rewrites meta.json with ``"sealed": true``
and a sha256 for every artifact. Only sealed snapshots go to S3.

S3 object encoding of large artifacts, ``pal-sparse-v1`` (object metadata
``pal-encoding: pal-sparse-v1``; artifacts up to ``INLINE_SEAL_MAX_BYTES`` are stored raw,
without that metadata). All integers little-endian u64::

    header   b"PALSPRS1" + logical_size
    record*  offset + length + <length bytes>     one per non-zero 1 MiB block, in
                                                  ascending offset order; offset is a
                                                  multiple of 1 MiB; length <= 1 MiB
    end      0xFFFF_FFFF_FFFF_FFFF + 0            terminator (a truncated object has none)

Blocks that are all zeros are not stored (the same rule as ``sha256-sparse-v1``), so an
object costs about the data a file holds, not its apparent size. Decoding = truncate a new
file to ``logical_size`` and write each record at its offset: holes stay holes. The
format is a stream (no table up front), so both ends work in constant memory. A new
incompatible format gets a new name and magic; readers refuse names they do not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pal.errors import InvalidRequest
from pal.ids import validate_id

# Artifacts of a snapshot. ``snapshot`` (device state) is always there; ``mem`` is absent
# when the RAM was streamed into ``snapshot`` (a fork child's private RAM); ``rootfs`` is
# absent in a legacy snapshot taken before disks were captured.
SNAPSHOT_ARTIFACT = "snapshot"
MEM_ARTIFACT = "mem"
ROOTFS_ARTIFACT = "rootfs"
# What the VMM needs to rebuild the same machine on restore (memory kind, RAM size, devices).
VMM_ARTIFACT = "vmm.json"
# The guest's synthetic DNS table (names it may have cached the addresses of); see
# pal/network/names.py. Absent in snapshots taken before VMs had a network.
NET_ARTIFACT = "net.json"
ARTIFACTS: tuple[str, ...] = (SNAPSHOT_ARTIFACT, MEM_ARTIFACT, ROOTFS_ARTIFACT, VMM_ARTIFACT, NET_ARTIFACT)
REQUIRED_ARTIFACTS: frozenset[str] = frozenset({SNAPSHOT_ARTIFACT})
META_FILE = "meta.json"

S3_PREFIX = "snapshots"
# Dot-dirs under the local root are bookkeeping, never snapshots; ids may not start with
# a dot so an agent version can never collide with them.
STAGING_DIRNAME = ".staging"
S3_QUEUE_DIRNAME = ".s3-queue"
SEAL_QUEUE_DIRNAME = ".seal-queue"
# Reflinked copies of snapshot RAM files that live fork children map (store.fork_mem).
FORK_MEM_DIRNAME = ".fork-mem"

# Artifacts bigger than this are checksummed and fsynced by the background seal, not by
# commit (the pause waits for commit). Device state with x-ignore-shared and vmm.json are
# far below it; mem, rootfs and a streamed-RAM ``snapshot`` are above it.
INLINE_SEAL_MAX_BYTES = 8 << 20

SPARSE_ENCODING = "pal-sparse-v1"
SPARSE_MAGIC = b"PALSPRS1"
SPARSE_BLOCK = 1 << 20
SPARSE_END_OFFSET = (1 << 64) - 1
# S3 user metadata key (sent as x-amz-meta-pal-encoding) naming an object's encoding.
S3_ENCODING_METADATA_KEY = "pal-encoding"
# An encrypted object: the pal-sparse-v1 stream of the artifact sealed in pal-enc-v1
# chunks (format: crypt.py). Every artifact of an encrypted snapshot is one, small or big.
ENCRYPTED_ENCODING = "pal-enc-v1+pal-sparse-v1"
# The S3 object holding an encrypted snapshot's wrapped data key (crypt.py), and the field
# of the uploaded meta.json (under its HMAC) naming the scheme its objects are sealed with.
KEY_FILE = "key.json"
ENCRYPTION_META_FIELD = "s3Encryption"


@dataclass(frozen=True)
class SnapshotRef:
    """Names one snapshot. ``tenant_id`` is who asks for it: when set, a snapshot whose
    meta names another tenant is reported as NotFound (spec: another tenant's snapshot is
    NOT_FOUND). ``None`` (or ``""``, normalised to None) skips the ownership check
    (retention, node-internal status and cleanup)."""

    agent_version_id: str
    vm_id: str
    snapshot_id: str
    tenant_id: str | None = None

    def __post_init__(self) -> None:
        validate_id(self.agent_version_id, "agent_version_id")
        validate_id(self.vm_id, "vm_id")
        validate_id(self.snapshot_id, "snapshot_id")
        if self.tenant_id == "":
            object.__setattr__(self, "tenant_id", None)
        elif self.tenant_id is not None and not isinstance(self.tenant_id, str):
            raise InvalidRequest("tenant_id must be a string or None")

    def local_dir(self, root: Path) -> Path:
        return root / self.agent_version_id / self.vm_id / self.snapshot_id

    @property
    def s3_prefix(self) -> str:
        """Key prefix with a trailing slash, so listing it never matches a sibling id."""
        return f"{S3_PREFIX}/{self.agent_version_id}/{self.vm_id}/{self.snapshot_id}/"

    def s3_key(self, artifact: str) -> str:
        return self.s3_prefix + artifact

    def to_json(self) -> dict[str, str | None]:
        return {
            "agentVersionId": self.agent_version_id,
            "vmId": self.vm_id,
            "snapshotId": self.snapshot_id,
            "tenantId": self.tenant_id,
        }

    @classmethod
    def from_json(cls, data: dict[str, str | None]) -> SnapshotRef:
        return cls(
            agent_version_id=str(data["agentVersionId"]),
            vm_id=str(data["vmId"]),
            snapshot_id=str(data["snapshotId"]),
            tenant_id=data.get("tenantId"),
        )


def vm_dir(root: Path, agent_version_id: str, vm_id: str) -> Path:
    return root / validate_id(agent_version_id, "agent_version_id") / validate_id(vm_id, "vm_id")


def vm_s3_prefix(agent_version_id: str, vm_id: str) -> str:
    validate_id(agent_version_id, "agent_version_id")
    validate_id(vm_id, "vm_id")
    return f"{S3_PREFIX}/{agent_version_id}/{vm_id}/"
