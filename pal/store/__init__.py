"""Durable state: tenants, VMs and their events, behind one repository interface."""

from pal.store.records import EventRecord, LeaseInfo, NodeRecord, Tenant, VmRecord, VolumeRecord
from pal.store.store import Store, database_url, hash_api_key, redacted
from pal.store.write_tx import LIFECYCLE_COLUMNS, WriteTx, utcnow

__all__ = [
    "LIFECYCLE_COLUMNS",
    "EventRecord",
    "LeaseInfo",
    "NodeRecord",
    "Store",
    "Tenant",
    "VmRecord",
    "VolumeRecord",
    "WriteTx",
    "database_url",
    "hash_api_key",
    "redacted",
    "utcnow",
]
