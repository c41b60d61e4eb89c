"""Secrets at rest: authenticated encryption of small values under the host's secrets key.

AES-256-GCM (``cryptography``) with a fresh 96-bit nonce per value. A sealed value is the
text ``v1:<base64(nonce + ciphertext + tag)>``. A *context* (the tenant id, for a VM's
secrets) is bound in as associated data, so a ciphertext copied into another tenant's row
does not open there. The key is a file (``pal.keyfile``, ``PAL_SECRETS_KEY_FILE``, 0600),
never in the store.

The one box for every secret Pal keeps: a VM's plain (environment) secrets and the real
values of its brokered ones (pal/scheduler/brokering.py). The bottom of the stack: imports
nothing from ``pal`` but the error types.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pal.errors import BackendError

PREFIX = "v1:"
NONCE_BYTES = 12


class SecretUnreadable(BackendError):
    """A sealed value that does not open: another key, or damaged, or another context."""


def is_sealed(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


class SecretBox:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("a secret box key is 32 bytes")
        self._aead = AESGCM(key)

    def seal(self, value: str, context: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        ct = self._aead.encrypt(nonce, value.encode(), context.encode())
        return PREFIX + base64.b64encode(nonce + ct).decode("ascii")

    def open(self, sealed: str, context: str) -> str:
        if not is_sealed(sealed):
            raise SecretUnreadable("not a sealed value")
        try:
            raw = base64.b64decode(sealed.removeprefix(PREFIX), validate=True)
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], context.encode()).decode()
        except (InvalidTag, ValueError):
            raise SecretUnreadable(
                "a stored secret does not open with this server's key (PAL_SECRETS_KEY_FILE), "
                "or it was damaged"
            ) from None
