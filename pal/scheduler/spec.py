"""AgentSpec: what a schedule request asks for, validated once, here.

The API uses these models as request bodies (camelCase on the wire); the scheduler and
store use them as the domain objects, so validation rules live in one place.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

IMAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Limits(_Model):
    vcpus: int = Field(1, ge=1, le=16, description="virtual CPUs")
    memory_mib: int = Field(256, ge=128, le=16384, description="guest RAM in MiB")
    disk_mib: int = Field(2048, ge=512, le=65536, description="root disk size in MiB")


class AgentSpec(_Model):
    image: str = Field("default", description="guest image name (`pal image build NAME`)")
    isolation: str = Field("microvm", description="isolation kind; only `microvm` exists")
    limits: Limits = Field(default_factory=Limits)  # type: ignore[arg-type]
    egress: str = Field("none", description="network egress policy; `none` (no NIC) for now")
    secrets: dict[str, str] = Field(default_factory=dict, description="env vars for every exec")
    idle_timeout_secs: int = Field(0, ge=0, le=7 * 24 * 3600, description="0 = never suspend")
    boot: str = Field("auto", description="`auto` (warm template when one fits) or `cold`")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not IMAGE_NAME.match(v):
            raise ValueError("image must be a lowercase name like 'default'")
        return v

    @field_validator("isolation")
    @classmethod
    def _isolation(cls, v: str) -> str:
        if v != "microvm":
            raise ValueError("isolation must be 'microvm'")
        return v

    @field_validator("egress")
    @classmethod
    def _egress(cls, v: str) -> str:
        if v not in ("none",):
            raise ValueError("egress must be 'none' (network egress is not available yet)")
        return v

    @field_validator("boot")
    @classmethod
    def _boot(cls, v: str) -> str:
        if v not in ("auto", "cold"):
            raise ValueError("boot must be 'auto' or 'cold'")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 secrets")
        for k, val in v.items():
            if not ENV_NAME.match(k):
                raise ValueError(f"secret name {k!r} is not a valid environment variable name")
            if len(val) > 16384:
                raise ValueError(f"secret {k!r} is longer than 16 KiB")
        return v


class ExecRequest(_Model):
    command: str = Field(..., min_length=1, max_length=4096, description="executable (path or name)")
    argv: list[str] = Field(default_factory=list, description="arguments, without argv[0]")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="working directory, default /workspace")
    timeout_secs: float | None = Field(None, gt=0, le=24 * 3600)
    user: str | None = Field(None, description="`pal` (default) or `root`")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not ENV_NAME.match(k):
                raise ValueError(f"env name {k!r} is not a valid environment variable name")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v not in (None, "pal", "root"):
            raise ValueError("user must be 'pal' or 'root'")
        return v


class ForkRequest(_Model):
    count: int = Field(..., description="number of children, 1..PAL_MAX_FORK_COUNT")
