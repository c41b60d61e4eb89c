"""File modes inside a guest image are the guest's business, not the host's.

Pal's server-side commands run under ``umask 077`` (host files are root's alone), but a
guest's ``/etc/resolv.conf``, ``/etc/hosts`` or its initramfs directories must keep the
modes a Linux system expects, or the guest's unprivileged workload user cannot read them.
So building guest files happens under the ordinary ``022``. The host-side artifacts it
leaves (kernel, initrd, root fs image, meta) are not secret and sit in the 0700 data dir
(docs/security.md). Builds run alone in their process (`pal image build`) or before the
server starts serving (`pal up`), so the process-wide umask is not raced.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

GUEST_UMASK = 0o022


@contextlib.contextmanager
def guest_umask() -> Iterator[None]:
    old = os.umask(GUEST_UMASK)
    try:
        yield
    finally:
        os.umask(old)
