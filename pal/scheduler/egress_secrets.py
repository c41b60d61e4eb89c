"""Changes to a VM's egress policy and brokered secrets while it lives: applied by its node
at once when it has a live QEMU (states.has_live_qemu), kept for its next start otherwise.
Stored only once the node took them, so the row and the node never disagree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pal.scheduler import states
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.deps import Deps
from pal.scheduler.states import Action, has_live_qemu
from pal.spec import EgressUpdate, SecretUpdate, egress_to_json
from pal.store import VmRecord
from pal.store.due import id_page
from pal.wire import verbs
from pal.wire.models import BrokeredSet, EgressSet

log = logging.getLogger(__name__)
RESEAL_PAGE = 1000  # rows resealed per leader tick
A = Action

EGRESS_CHANGED_EVENT = "egress_changed"
SECRET_ROTATED_EVENT = "secret_rotated"


@dataclass(frozen=True)
class EgressAndSecrets:
    d: Deps
    brokering: SecretBroker
    # Where the pass of reseal_secrets is: the last VM id it read, and whether it is over.
    _reseal: dict[str, object] = field(default_factory=lambda: {"after": "", "done": False})

    async def set_egress(self, tenant_id: str, vm_id: str, update: EgressUpdate) -> VmRecord:
        """Change a VM's egress policy.

        Prerequisites: the tenant's VM (404); SET_EGRESS allowed (running or paused, 409).
        Success: with a live QEMU the node applies it at once (new connections follow it,
        open ones it refuses are reset); any other VM keeps it for its next incarnation; an
        egress_changed event. Failure: the node's error, nothing stored."""
        d = self.d
        d.own(tenant_id, vm_id)
        async with d.locks.op_lock(vm_id):
            vm = d.reload(vm_id)
            states.check(vm_id, vm.state, A.SET_EGRESS, vm.marker)
            if has_live_qemu(vm.state, vm.marker):
                await d.node(vm).call(
                    verbs.SET_EGRESS,
                    EgressSet(
                        vm_id=vm_id,
                        egress=update.egress,
                        egress_mbps=vm.limits.get("egress_mbps"),
                        max_connections=vm.limits.get("max_connections"),
                    ),
                )
            d.store.update_vm(vm_id, egress=egress_to_json(update.egress))
            d.store.add_event(
                vm_id, vm.tenant_id, EGRESS_CHANGED_EVENT, details={"egress": egress_to_json(update.egress)}
            )
        return d.own(tenant_id, vm_id)

    async def rotate_secret(self, tenant_id: str, vm_id: str, name: str, update: SecretUpdate) -> bool:
        """A brokered secret's new value. True when applied live.

        Prerequisites: the tenant's VM (404), a brokered secret of that name (404; 400 for a
        plain one); SET_SECRET allowed (running or paused, 409).
        Success: with a live QEMU its gateway uses it from its next request (the guest is
        not touched: it only ever held the placeholder; a live resume registers nothing
        again, so the value stays); any other VM gets it at its next start; a
        secret_rotated event. Failure: the node's error, nothing stored."""
        d = self.d
        d.own(tenant_id, vm_id)
        async with d.locks.op_lock(vm_id):
            vm = d.reload(vm_id)
            new = self.brokering.rotated(vm.tenant_id, vm.secrets, name, update.value)
            states.check(vm_id, vm.state, A.SET_SECRET, vm.marker)
            live = has_live_qemu(vm.state, vm.marker)
            if live:
                rules = self.brokering.rules(vm.tenant_id, new)
                await d.node(vm).call(verbs.SET_BROKERED, BrokeredSet(vm_id=vm_id, brokered=rules))
            d.store.update_vm(vm_id, secrets=new)
            d.store.add_event(vm_id, vm.tenant_id, SECRET_ROTATED_EVENT, details={"name": name})
        return live

    def reseal_secrets(self, page: int = RESEAL_PAGE) -> int:
        """Seal the plain secrets a Pal from before secrets were sealed stored in clear (each
        VM's row, once per leadership, by the leader): the next ``page`` rows by id, each
        call, until a whole pass is done (then nothing). Returns how many rows changed."""
        if self._reseal["done"]:
            return 0
        n = 0
        rows = id_page(self.d.store, str(self._reseal["after"]), page)
        for vm in rows:
            new = self.brokering.reseal(vm.tenant_id, vm.secrets or {})
            if new is not None:
                self.d.store.update_vm(vm.vm_id, secrets=new)
                n += 1
        self._reseal.update(after=rows[-1].vm_id if rows else "", done=len(rows) < page)
        if n:
            log.info("sealed the secrets of %d VM(s) stored in clear by an older Pal", n)
        return n

    def reseal_again(self) -> None:
        """A new leadership: one more pass (a replica that led before may have left some)."""
        self._reseal.update(after="", done=False)
