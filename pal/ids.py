"""The one rule for ids that become host path components: vm ids, snapshot ids, agent
version ids (``vms/<vm_id>``, ``snapshots/<agent_version_id>/<vm_id>/<snapshot_id>``).

A safe id is one path component: 1-128 of ``[A-Za-z0-9._-]``, not starting with a dot (so
never ``.``, ``..`` or a bookkeeping dot-dir), no ``/``, no NUL. Every boundary that turns
an id into a path checks it: the manager's RPC models and path parameters (pydantic
:data:`SafeId`), the runtime's own path helpers and the snapshot layout
(:func:`validate_id`). The bottom of the stack: imports nothing from ``pal``
but the error types.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import StringConstraints

from pal.errors import InvalidRequest

ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"
# A code context's id (a kernel in the guest; pal/guest/kernels.py): ``default-python``,
# ``ctx-<hex>``, or a client's own name.
CONTEXT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_ID_RE = re.compile(ID_PATTERN)

# A safe id, for pydantic models and FastAPI path parameters.
SafeId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
# A tenant id as the manager sees it: a safe id, or "" for the node's own VMs (templates).
TenantId = Annotated[str, StringConstraints(pattern=r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$")]


def is_safe_id(value: object) -> bool:
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def validate_id(value: str, what: str) -> str:
    """Return ``value`` if it is a safe single path component, else raise InvalidRequest."""
    if not is_safe_id(value):
        shown = repr(value)[:80]
        raise InvalidRequest(f"invalid {what} {shown}: use 1-128 of [A-Za-z0-9._-], not starting with '.'")
    return value
