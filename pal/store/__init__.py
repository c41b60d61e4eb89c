"""Durable state: tenants, VMs and their events, behind one repository interface."""

from pal.store.records import EventRecord, Tenant, VmRecord
from pal.store.store import Store, WriteTx, hash_api_key, utcnow

__all__ = ["EventRecord", "Store", "Tenant", "VmRecord", "WriteTx", "hash_api_key", "utcnow"]
