"""placeholder"""

from __future__ import annotations


def hot_reads(tenant_id: str, team: str) -> dict[str, str]:
    return {}
