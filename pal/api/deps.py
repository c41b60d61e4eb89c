"""What the route handlers get from the app: the calling tenant's id, and typed handles to
the scheduler's operation objects each route uses (built once, in pal/scheduler/scheduler.py,
the composition root ``create_app`` puts on ``app.state``). A route names only the
operations it calls; nothing forwards on its way there."""

# No `from __future__ import annotations`: FastAPI resolves these aliases where they are used.

from typing import Annotated, Any

from fastapi import Depends, Request

from pal.scheduler.delete import Deleting
from pal.scheduler.egress_secrets import EgressAndSecrets
from pal.scheduler.fork import Forking
from pal.scheduler.guest import GuestCalls
from pal.scheduler.lifetime import Lifetimes
from pal.scheduler.listing import Listing
from pal.scheduler.live import LiveOps
from pal.scheduler.pause_resume import PauseResume
from pal.scheduler.reads import Reads
from pal.scheduler.schedule import Scheduling
from pal.scheduler.scheduler import Scheduler

from .auth import require_tenant


def scheduler_of(state: Any) -> Scheduler:
    """The app's scheduler (``app.state.scheduler``), checked: for handlers FastAPI does not
    inject (WebSockets, the ports app)."""
    sched = state.scheduler
    if not isinstance(sched, Scheduler):
        raise RuntimeError("this app was created without a scheduler")
    return sched


def _scheduler(request: Request) -> Scheduler:
    return scheduler_of(request.app.state)


def _scheduling(request: Request) -> Scheduling:
    return _scheduler(request).scheduling


def _pauses(request: Request) -> PauseResume:
    return _scheduler(request).pauses


def _live(request: Request) -> LiveOps:
    return _scheduler(request).live


def _forking(request: Request) -> Forking:
    return _scheduler(request).forking


def _deleting(request: Request) -> Deleting:
    return _scheduler(request).deleting


def _guest(request: Request) -> GuestCalls:
    return _scheduler(request).guest


def _reads(request: Request) -> Reads:
    return _scheduler(request).reads


def _listing(request: Request) -> Listing:
    return _scheduler(request).listing


def _egress_secrets(request: Request) -> EgressAndSecrets:
    return _scheduler(request).egress_secrets


def _lifetimes(request: Request) -> Lifetimes:
    return _scheduler(request).lifetimes


Tenant = Annotated[str, Depends(require_tenant)]
SchedulerOf = Annotated[Scheduler, Depends(_scheduler)]
Schedule = Annotated[Scheduling, Depends(_scheduling)]
Pauses = Annotated[PauseResume, Depends(_pauses)]
Live = Annotated[LiveOps, Depends(_live)]
Forks = Annotated[Forking, Depends(_forking)]
Deletes = Annotated[Deleting, Depends(_deleting)]
Guest = Annotated[GuestCalls, Depends(_guest)]
ReadsOf = Annotated[Reads, Depends(_reads)]
Lists = Annotated[Listing, Depends(_listing)]
EgressSecrets = Annotated[EgressAndSecrets, Depends(_egress_secrets)]
LifetimesOf = Annotated[Lifetimes, Depends(_lifetimes)]
