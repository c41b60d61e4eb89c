"""E2B's file metadata on the node RPC (pal/guest/xattrs.py): the ``user.e2b.*`` xattrs of
paths of the guest, read and replaced. What the guest answers is checked as what it may
hold."""

from __future__ import annotations

from pydantic import Field, field_validator

from pal.guest.xattrs import MAX_PATHS as MAX_XATTR_PATHS
from pal.guest.xattrs import check_metadata
from pal.ids import SafeId
from pal.wire.models import WireModel as _Model


def _checked(value: dict[str, str]) -> dict[str, str]:
    why = check_metadata(value)
    if why is not None:
        raise ValueError(why)
    return value


class FileMetadataOf(_Model):
    """E2B's file metadata of these absolute paths of the guest (pal/guest/xattrs.py), read
    as the workload user unless ``root``."""

    vm_id: SafeId
    paths: list[str] = Field(max_length=MAX_XATTR_PATHS)
    root: bool = False


class FileMetadataList(_Model):
    metadata: list[dict[str, str]] = Field(max_length=MAX_XATTR_PATHS)  # one map a path, in order

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, maps: list[dict[str, str]]) -> list[dict[str, str]]:
        return [_checked(one) for one in maps]  # the guest is hostile: only what it may hold


class FileMetadataSet(_Model):
    """Replace a file's E2B metadata (``{}``: clear it)."""

    vm_id: SafeId
    path: str = Field(pattern=r"^/", max_length=4096)
    metadata: dict[str, str]
    root: bool = False

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str]) -> dict[str, str]:
        return _checked(value)


class FileMetadataDone(_Model):
    path: str = Field(max_length=4096)
    metadata: dict[str, str]

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str]) -> dict[str, str]:
        return _checked(value)
