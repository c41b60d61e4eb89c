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
