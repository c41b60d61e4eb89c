"""Brokered secrets on the control plane: how a spec's secrets are stored, what the guest
gets, what the node's gateway gets, and each tenant's CA (docs/secrets.md).

In the VM's row (``VmRecord.secrets``) a plain secret is ``{box}``, its value sealed; a
brokered one is ``{placeholder, sealed, hosts, header, format}``, the real value sealed. Both
are sealed by the one ``pal.secretbox.SecretBox`` (AES-256-GCM) under the server's secrets key
(``PAL_SECRETS_KEY_FILE``, default ``<data dir>/keys/secrets.key``, 0600) and bound to the
tenant, so the database file never holds a secret in clear. A bare string is a plain secret
stored by a Pal from before they were sealed: read as is, and sealed by ``reseal`` when a
server takes the lead.
The guest's environment holds the placeholder; the spawn request carries the opened value
to the node, whose egress gateway alone ever puts it on the wire. Forks copy the row's
secrets (same placeholders, same tenant): their gateways broker the same values; the secrets
a fork or a start from a kept snapshot gives are stored as a schedule's and set over them.

Each tenant's CA is made on first use and kept in the store (``tenant_cas``), its key sealed
by the same box (the context names it a CA key of that tenant), so every control-plane
replica, on any machine, signs with the same CA: guests trust one CA per tenant whichever
replica built their spawn request. A CA an older Pal kept in
``<data dir>/keys/tenant-ca/<tenant>.{pem,key}`` is moved into the store as it is (guests
already trust it); the files are left for that older Pal and no longer read once stored.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pal import keyfile
from pal.config import Settings
from pal.errors import InvalidRequest, NotFound
from pal.network.ca import constrained, new_ca
from pal.secretbox import SecretBox
from pal.spec import BrokeredSecret
from pal.store import Store
from pal.wire.models import BrokeredRule, TenantCa

_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def is_brokered(stored: Any) -> bool:
    return isinstance(stored, dict) and "sealed" in stored


def is_sealed_plain(stored: Any) -> bool:
    return isinstance(stored, dict) and "box" in stored


class SecretBroker:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.legacy_ca_dir = settings.keys_dir / "tenant-ca"  # where an older Pal kept them
        self._box: SecretBox | None = None

    @property
    def box(self) -> SecretBox:
        if self._box is None:  # made on first use: servers without secrets need no key
            self._box = SecretBox(keyfile.load_or_create(self.settings.secrets_key_path))
        return self._box

    # -- the VM's row ----------------------------------------------------------------------

    def store_form(self, tenant_id: str, given: dict[str, str | BrokeredSecret]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, val in given.items():
            if isinstance(val, str):
                out[name] = {"box": self.box.seal(val, tenant_id)}
                continue
            out[name] = {
                # Looks like a credential (some clients check that one is set), says what it is.
                "placeholder": f"pal-brokered-{name.lower()}-{secrets.token_hex(16)}",
                "sealed": self.box.seal(val.value, tenant_id),
                "hosts": list(val.brokered.hosts),
                "header": val.brokered.header,
                "format": val.brokered.format,
            }
        return out

    def env(self, tenant_id: str, stored: dict[str, Any]) -> dict[str, str]:
        """What the guest's environment holds: plain values (opened), and placeholders."""
        out = {}
        for k, v in stored.items():
            if is_brokered(v):
                out[k] = str(v["placeholder"])
            elif is_sealed_plain(v):
                out[k] = self.box.open(str(v["box"]), tenant_id)
            else:
                out[k] = str(v)  # stored in clear by an older Pal (``reseal`` seals it)
        return out

    def reseal(self, tenant_id: str, stored: dict[str, Any]) -> dict[str, Any] | None:
        """The row's secrets with the plain ones an older Pal stored in clear sealed; None
        when there are none."""
        if not any(isinstance(v, str) for v in stored.values()):
            return None
        box = self.box
        return {k: ({"box": box.seal(v, tenant_id)} if isinstance(v, str) else v) for k, v in stored.items()}

    def rules(self, tenant_id: str, stored: dict[str, Any]) -> list[BrokeredRule]:
        return [
            BrokeredRule(
                name=k,
                value=self.box.open(v["sealed"], tenant_id),
                placeholder=v["placeholder"],
                hosts=list(v["hosts"]),
                header=v.get("header"),
                format=v.get("format") or "{value}",
            )
            for k, v in stored.items()
            if is_brokered(v)
        ]

    def rotated(self, tenant_id: str, stored: dict[str, Any], name: str, value: str) -> dict[str, Any]:
        """The row's secrets with ``name``'s value replaced (its placeholder stays)."""
        cur = stored.get(name)
        if cur is None:
            raise NotFound(f"the VM has no secret {name!r}")
        if not is_brokered(cur):
            raise InvalidRequest(
                f"secret {name!r} is a plain environment variable: only brokered secrets can be "
                "rotated without touching the guest"
            )
        return {**stored, name: {**cur, "sealed": self.box.seal(value, tenant_id)}}

    # -- the tenant's CA -------------------------------------------------------------------

    def tenant_ca(self, tenant_id: str) -> TenantCa:
        """The tenant's CA, made (or moved from an older Pal's file) on first use."""
        if not _TENANT.match(tenant_id):
            raise InvalidRequest(f"invalid tenant id {tenant_id!r}")
        context = f"tenant-ca:{tenant_id}"  # a sealed CA key opens as nothing else
        stored = self.store.tenant_ca(tenant_id)
        if stored is None:
            cert, key = self._legacy_ca(tenant_id) or new_ca(tenant_id)
            stored = self.store.add_tenant_ca(tenant_id, cert, self.box.seal(key, context))
        cert, sealed = stored
        return TenantCa(cert=cert, key=self.box.open(sealed, context))

    def vm_ca(self, tenant_id: str, rules: list[BrokeredRule]) -> TenantCa:
        """The tenant's CA as one VM uses it: its certificate name-constrained to the VM's
        brokered hosts (pal/network/ca.py), the key as is."""
        ca = self.tenant_ca(tenant_id)
        hosts = [h for r in rules for h in r.hosts]
        return TenantCa(cert=constrained(ca.cert, ca.key, hosts), key=ca.key)

    def _legacy_ca(self, tenant_id: str) -> tuple[str, str] | None:
        cert_path = self.legacy_ca_dir / f"{tenant_id}.pem"
        key_path = self.legacy_ca_dir / f"{tenant_id}.key"
        try:
            return cert_path.read_text(), key_path.read_text()
        except FileNotFoundError:
            return None
