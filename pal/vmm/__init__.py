"""The VMM layer: QEMU microvm processes and their files. Knows nothing of tenants,
states, quotas or HTTP.

- ``qemu``: :class:`~pal.vmm.qemu.QemuVm` (boot, snapshot, restore, pause, kill)
- ``cmdline``: :class:`~pal.vmm.cmdline.VmSpec` and the QEMU argv built from it
- ``vmm_meta``: a snapshot's ``vmm.json`` and which machine it loads into
- ``disks``: reflink / qcow2 overlay / sparse copy of disks and RAM files
- ``datadir``: loop-mounted reflink XFS for a data dir on a non-reflink file system
- ``accel``: KVM-or-TCG probe, cached in ``<data dir>/images/accel.json``
- ``versions``: QEMU and kernel versions for ``pal doctor`` and snapshot meta
"""
