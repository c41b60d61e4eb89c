"""Readiness: can this server schedule at full speed now?

`/healthz` is liveness (the server can schedule at all). Readiness is stricter: the default
image's warm template at the default size exists on a node, so a schedule restores it in a
fraction of a second instead of booting cold (seconds) or racing the template build that
starts with the server. A node with templates turned off (PAL_TEMPLATES=0) is ready as soon
as it is healthy: there is nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pal.sizes import DEFAULT_MEMORY_MIB, size_name
from pal.wire import verbs
from pal.wire.models import Empty

if TYPE_CHECKING:
    from pal.scheduler.nodes import NodePool

DEFAULT_IMAGE = "default"


def default_template_size() -> str:
    """The size a schedule without limits asks for: the template readiness waits for."""
    return size_name(DEFAULT_MEMORY_MIB)


def default_template_warm(images: Iterable[Mapping[str, Any]]) -> bool:
    """``images`` (a node's ImageInfo list, camelCase) hold the default image with a warm
    template of the default size."""
    want = default_template_size()
    return any(i.get("name") == DEFAULT_IMAGE and want in (i.get("templates") or []) for i in images)


def node_readiness(images: Iterable[Mapping[str, Any]], *, templates: bool) -> dict[str, Any]:
    """One node's readiness report: ``ready`` and, when not, what it waits for."""
    if not templates or default_template_warm(images):
        return {"ready": True}
    return {
        "ready": False,
        "waitingFor": f"the warm template of image {DEFAULT_IMAGE!r} at {default_template_size()}",
    }


def cluster_readiness(nodes: Iterable[Any]) -> dict[str, Any]:
    """A control plane without a node of its own: ready when an active, healthy node has
    the default template warm (their last heartbeats say)."""
    from pal.scheduler.nodes import ACTIVE

    live = [n for n in nodes if n.state == ACTIVE and n.healthy]
    if not live:
        return {"ready": False, "waitingFor": "an active, healthy node"}
    if any(default_template_warm(n.images) for n in live):
        return {"ready": True}
    return node_readiness([], templates=True)


class WithNodes(Protocol):
    """What readiness reads of the scheduler: its node pool."""

    @property
    def nodes(self) -> NodePool: ...


async def readiness(scheduler: WithNodes, *, templates: bool) -> dict[str, Any]:
    """This server's readiness. With embedded nodes (`pal up`) their live heartbeat is
    asked (a template that just finished counts at once); a control plane of remote nodes
    judges their last heartbeats. ``templates``: this server's PAL_TEMPLATES (an embedded
    node shares it)."""
    local = scheduler.nodes.local_clients()
    if not local:
        return cluster_readiness(scheduler.nodes.nodes())
    report: dict[str, Any] = {"ready": False, "waitingFor": "an embedded node"}
    for client in local:
        hb = await client.call(verbs.HEARTBEAT, Empty())
        report = node_readiness([i.model_dump(by_alias=True) for i in hb.images], templates=templates)
        if report["ready"]:
            break
    return report
