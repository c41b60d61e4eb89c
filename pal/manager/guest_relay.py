"""The node's handler of every guest verb declared without one of its own
(pal/wire/verbs.py, ``guest=``): the request goes to the guest's harness as the declared
kind, with the request's fields (but the VM's id), under exec's rules (exec_files.py): the
VM must be running (409, 409 LIVE_PAUSED), the request enters the channel under the VM's
operation lock and counts as one in flight (unless the declaration says not), its error
codes map through guest_errors.py's table for the declared ``errors``, and what the guest
answers is hostile: its ``result`` must validate as the verb's answer model (whose fields
bound it), else 503 GUEST_ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pal.errors import Unavailable
from pal.guest import protocol as p
from pal.manager import guest_input as gi
from pal.manager.channel import GuestError
from pal.manager.vm import VmRegistry
from pal.wire.guest_errors import to_pal_error
from pal.wire.verbs import GUEST_REQUEST_TIMEOUT_S, Call

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)


def relay(registry: VmRegistry, verb: Call[Req, Ans]) -> Callable[[Req], Awaitable[Ans]]:
    guest = verb.guest
    assert guest is not None, f"{verb.name} is not a guest verb"

    async def handle(req: Req) -> Ans:
        fields = req.model_dump(mode="json")
        vm_id = str(fields.pop("vm_id"))
        lv = registry.running(vm_id)
        msg: p.Message = {"k": guest.kind, **fields}
        try:
            reply, _ = await lv.request_in_flight(msg, timeout=GUEST_REQUEST_TIMEOUT_S, counted=guest.counted)
        except GuestError as exc:
            raise to_pal_error(exc.guest_code, exc.message, guest.errors) from None
        try:
            return verb.answer.model_validate(_known(verb.answer, reply.get("result")))
        except ValidationError as exc:
            log.warning("VM %s: invalid %s reply from the guest: %s", vm_id, guest.kind, gi.text(str(exc)))
            raise Unavailable(
                f"VM {vm_id}: the guest sent an invalid reply to {guest.kind}", code="GUEST_ERROR"
            ) from None

    return handle


def _known(model: type[BaseModel], result: object) -> Any:
    """The answer's own fields of what the guest sent (anything else it sent is dropped)."""
    if not isinstance(result, dict):
        return result
    names = {n for n, f in model.model_fields.items()} | {
        f.alias for f in model.model_fields.values() if f.alias
    }
    return {k: v for k, v in result.items() if k in names}
