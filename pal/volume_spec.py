"""A sandbox's volume mounts in its AgentSpec (``volumes: [{name, path, readOnly}]``,
docs/volumes.md): the tenant's volume by name or id, an absolute path that is not the
guest's system, each volume and path at most once, none nested in another."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from pal.limits import STRICT

MAX_VOLUME_MOUNTS = 8
# Where no volume may be mounted: the guest's own system (and Pal's bundle at /.pal).
SYSTEM_DIRS = frozenset(
    "/bin /boot /dev /etc /lib /lib32 /lib64 /libx32 /proc /run /sbin /sys /usr /var /.pal".split()
)


class VolumeMountSpec(BaseModel):
    model_config = STRICT

    """A volume the sandbox mounts (docs/volumes.md): the tenant's volume, by name or id."""

    name: str = Field(min_length=1, max_length=80, description="the volume's name or id (`vol-...`)")
    path: str = Field(min_length=2, max_length=256, description="absolute path in the guest")
    read_only: bool = Field(False, description="mount read-only (the server enforces it)")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or "\0" in v or "\n" in v or any(p in (".", "..") for p in v.split("/")):
            raise ValueError("a volume's path must be absolute, without . or .. parts")
        norm = "/" + "/".join(p for p in v.split("/") if p)
        if norm == "/" or norm in SYSTEM_DIRS or any(norm.startswith(d + "/") for d in SYSTEM_DIRS):
            raise ValueError(f"a volume cannot be mounted at {norm} (the guest's system)")
        return norm


def check_mounts(cls: object, v: list[VolumeMountSpec]) -> list[VolumeMountSpec]:
    """Each volume and each path at most once; no path inside another."""
    paths = [m.path for m in v]
    if len(set(paths)) != len(paths) or len({m.name for m in v}) != len(v):
        raise ValueError("each volume and each path at most once")
    for a in paths:
        if any(b != a and b.startswith(a + "/") for b in paths):
            raise ValueError(f"volume paths may not nest ({a})")
    return v
