"""E2B's REST shapes (its published openapi.yml) for the calls the SDKs make.

Field names are E2B's own (``templateID``, ``sandboxID``, ``memoryMB``...), not Pal's
camelCase: the SDKs' generated clients parse exactly these. Requests ignore fields they do
not know (newer SDKs add some); a field of the wrong type is a 400.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import ops
from .versions import CLIENT_ID, ENVD_VERSION


class _In(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NetworkConfig(_In):
    allow_public_traffic: bool = Field(True, alias="allowPublicTraffic")
    allow_out: list[str] = Field(default_factory=list, alias="allowOut", max_length=1000)
    deny_out: list[str] = Field(default_factory=list, alias="denyOut", max_length=1000)


class AutoResume(_In):
    enabled: bool = False


class VolumeMount(_In):
    name: str = Field(min_length=1, max_length=80)
    path: str = Field(min_length=1, max_length=256)


class NewSandbox(_In):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: int = Field(15, ge=0, le=366 * 24 * 3600)
    auto_pause: bool = Field(False, alias="autoPause")
    auto_pause_memory: bool = Field(True, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    secure: bool = False
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=100)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars", max_length=1000)
    volume_mounts: list[VolumeMount] = Field(default_factory=list, alias="volumeMounts", max_length=100)

    def spec(self) -> ops.CreateSandbox:
        net = self.network or NetworkConfig.model_validate({})
        return ops.CreateSandbox(
            template=self.template_id,
            timeout_s=self.timeout,
            metadata=dict(self.metadata),
            env_vars=dict(self.env_vars),
            secure=self.secure,
            auto_pause=self.auto_pause,
            auto_pause_memory=self.auto_pause_memory,
            auto_resume=bool(self.auto_resume and self.auto_resume.enabled),
            network=ops.NetworkPolicy(
                allow_internet=self.allow_internet_access is not False,
                allow_out=tuple(net.allow_out),
                deny_out=tuple(net.deny_out),
                allow_public_traffic=net.allow_public_traffic,
            ),
            volume_mounts=tuple(ops.VolumeMount(m.name, m.path) for m in self.volume_mounts),
        )


class NetworkUpdate(_In):
    allow_out: list[str] = Field(default_factory=list, alias="allowOut", max_length=1000)
    deny_out: list[str] = Field(default_factory=list, alias="denyOut", max_length=1000)
    allow_internet_access: bool | None = None

    def policy(self) -> ops.NetworkPolicy:
        return ops.NetworkPolicy(
            allow_internet=self.allow_internet_access is not False,
            allow_out=tuple(self.allow_out),
            deny_out=tuple(self.deny_out),
        )


class TimeoutRequest(_In):
    timeout: int = Field(ge=0, le=366 * 24 * 3600)


class RefreshRequest(_In):
    duration: int = Field(0, ge=0, le=3600)


class PauseRequest(_In):
    memory: bool = True


class ResumeRequest(_In):
    timeout: int = Field(15, ge=0, le=366 * 24 * 3600)
    auto_pause: bool | None = Field(None, alias="autoPause")


class ForkRequest(_In):
    timeout: int = Field(15, ge=0, le=366 * 24 * 3600)
    count: int = Field(1, ge=1, le=100)


class SnapshotRequest(_In):
    name: str | None = Field(None, max_length=256)


class NewApiKey(_In):
    name: str = Field("", max_length=200)


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def sandbox(s: ops.Sandbox, domain: str | None) -> dict[str, Any]:
    """``Sandbox``: the answer of create, connect, resume and each fork."""
    out: dict[str, Any] = {
        "templateID": s.template_id,
        "sandboxID": s.sandbox_id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "domain": domain,
        "trafficAccessToken": None,
    }
    if s.alias is not None:
        out["alias"] = s.alias
    if s.access_token is not None:
        out["envdAccessToken"] = s.access_token
    return out


def listed_sandbox(s: ops.Sandbox) -> dict[str, Any]:
    """``ListedSandbox``: an entry of the lists."""
    out: dict[str, Any] = {
        "templateID": s.template_id,
        "sandboxID": s.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(s.started_at),
        "endAt": rfc3339(s.end_at),
        "cpuCount": s.cpu_count,
        "memoryMB": s.memory_mb,
        "diskSizeMB": s.disk_size_mb,
        "metadata": dict(s.metadata),
        "state": s.state,
        "envdVersion": ENVD_VERSION,
        "volumeMounts": [{"name": m.name, "path": m.path} for m in s.volume_mounts],
    }
    if s.alias is not None:
        out["alias"] = s.alias
    return out


def sandbox_detail(s: ops.Sandbox, domain: str | None) -> dict[str, Any]:
    """``SandboxDetail``: ``GET /sandboxes/{id}``."""
    out = listed_sandbox(s)
    out["domain"] = domain
    out["allowInternetAccess"] = s.allow_internet
    out["lifecycle"] = {"autoResume": s.auto_resume, "onTimeout": "pause" if s.auto_pause else "kill"}
    if s.access_token is not None:
        out["envdAccessToken"] = s.access_token
    return out


def metric(m: ops.MetricSample) -> dict[str, Any]:
    return {
        "timestamp": rfc3339(m.timestamp),
        "timestampUnix": int(m.timestamp.timestamp()),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": m.mem_cache,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    }


def log_entry(e: ops.LogEntry) -> dict[str, Any]:
    return {
        "timestamp": rfc3339(e.timestamp),
        "level": e.level,
        "message": e.message,
        "fields": dict(e.fields),
    }


def snapshot(s: ops.Snapshot) -> dict[str, Any]:
    return {"snapshotID": s.snapshot_id, "names": list(s.names)}


def fork_result(f: ops.ForkOutcome, domain: str | None) -> dict[str, Any]:
    if f.sandbox is not None:
        return {"sandbox": sandbox(f.sandbox, domain)}
    status = f.error_status or 500
    return {"error": {"code": status, "message": f.error_message or "fork failed"}}


def template(t: ops.Template) -> dict[str, Any]:
    """``Template`` of ``GET /templates``."""
    created = rfc3339(t.created_at)
    return {
        "templateID": t.template_id,
        "buildID": t.template_id,
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "public": t.public,
        "aliases": list(t.aliases),
        "names": list(t.aliases),
        "createdAt": created,
        "updatedAt": created,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": ENVD_VERSION,
        "buildStatus": "ready",
        "createdBy": None,
    }


StateFilter = Literal["running", "paused"]
