"""Request and answer models of the node's volume verbs (pal/wire/verbs.py; the node side:
pal/manager/volumes.py). A volume's files live on the node that holds it (docs/volumes.md)."""

from __future__ import annotations

from pydantic import Field

from pal.ids import SafeId, TenantId
from pal.sizes import VOLUME_MIB_RANGE
from pal.wire.models import WireModel

_SIZE = Field(ge=VOLUME_MIB_RANGE[0], le=VOLUME_MIB_RANGE[1])


class VolumeCreate(WireModel):
    volume_id: SafeId
    tenant_id: TenantId  # the owner the control plane read from the row; never a user's word
    size_mib: int = _SIZE


class VolumeResize(WireModel):
    volume_id: SafeId
    size_mib: int = _SIZE


class VolumeRef(WireModel):
    volume_id: SafeId


class VolumeInfo(WireModel):
    volume_id: str
    size_mib: int


class VolumeDeleted(WireModel):
    volume_id: str
    deleted: bool  # false: there was nothing to delete


# -- a volume's files (the files API without a sandbox; pal/manager/volume_content.py) ------
MAX_VOLUME_PATH = 4096  # PATH_MAX: a longer path names nothing
MAX_LIST_DEPTH = 16
_PATH = Field(default="", max_length=MAX_VOLUME_PATH)


class VolumePath(WireModel):
    """A path in a volume, relative to its root ("" is the root)."""

    volume_id: SafeId
    path: str = _PATH


class VolumeList(WireModel):
    volume_id: SafeId
    path: str = _PATH
    depth: int = Field(default=1, ge=1, le=MAX_LIST_DEPTH)  # 1: the directory's own entries


class VolumeWrite(WireModel):
    volume_id: SafeId
    path: str = _PATH
    data: bytes  # the body (pal/wire/http.py: a bytes field travels raw)
    mode: int | None = Field(default=None, ge=0, le=0o777)  # None: 0644


class VolumeMkdir(WireModel):
    volume_id: SafeId
    path: str = _PATH
    parents: bool = False  # mkdir -p: the missing parents too, and no error if it exists
    mode: int | None = Field(default=None, ge=0, le=0o777)  # None: 0755


class VolumeRemove(WireModel):
    volume_id: SafeId
    path: str = _PATH
    recursive: bool = False  # a directory and everything in it


class VolumeAttrs(WireModel):
    volume_id: SafeId
    path: str = _PATH
    mode: int | None = Field(default=None, ge=0, le=0o777)  # the permission bits
    uid: int | None = Field(default=None, ge=0, le=65534)
    gid: int | None = Field(default=None, ge=0, le=65534)


class VolumeEntry(WireModel):
    """One file of a volume as lstat sees it (a symlink is never followed)."""

    name: str = Field(max_length=255)
    path: str = Field(max_length=MAX_VOLUME_PATH)  # from the volume's root
    type: str  # file | dir | symlink | other (a fifo, a socket, a device)
    size: int = Field(ge=0)
    mode: int = Field(ge=0)  # the permission bits
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)
    mtime: float
    atime: float
    ctime: float
    target: str | None = Field(default=None, max_length=MAX_VOLUME_PATH)  # a symlink's text


class VolumeListing(WireModel):
    path: str
    entries: list[VolumeEntry]
    truncated: bool  # more entries than one answer holds (1000)


class VolumeContent(WireModel):
    data: bytes  # cut at MAX_FILE_BYTES
    truncated: bool
    size: int  # the file's size


class VolumeWritten(WireModel):
    path: str
    bytes_written: int


class VolumeMade(WireModel):
    path: str
    created: bool  # false: it was there (``parents``)


class VolumeRemoved(WireModel):
    path: str
    deleted: bool
