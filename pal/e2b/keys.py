"""The E2B API key form: ``e2b_`` and hex, which both SDKs insist on before they send
anything (``^e2b_[0-9a-f]+$``, unless ``E2B_VALIDATE_API_KEY=false``).

Storage (migration ``0012_e2b_keys``, pal/store/e2b_keys.py): an E2B key is an extra key
of a tenant, kept like its Pal key as a sha256 only, in a table of its own
(``tenant_e2b_keys``: id, tenant id, key hash unique, name, mask, created), so a tenant may
hold several (one per app) beside its rotating Pal key. The key check the E2B surface is
given (binding.py) accepts either kind; revoking deletes the row (``pal tenants keys
revoke``, ``DELETE /e2b/api-keys/{id}``), and removing a tenant deletes its rows with its
VMs and events. An E2B key never authenticates `/v1`: it is for the E2B surface.
"""

from __future__ import annotations

import re
import secrets

PREFIX = "e2b_"
HEX_CHARS = 40  # 160 bits, as long as E2B's own keys
_FORM = re.compile(r"\Ae2b_[0-9a-f]+\Z")


def new_key() -> str:
    """A fresh key of E2B's form (shown once; only its hash is kept)."""
    return PREFIX + secrets.token_hex(HEX_CHARS // 2)


def is_e2b_key(key: str) -> bool:
    """Whether the SDKs accept ``key`` without ``E2B_VALIDATE_API_KEY=false``."""
    return bool(_FORM.match(key))
