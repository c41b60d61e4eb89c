"""Settings of the server-side commands (up, server, image, tenants, doctor, data-dir): they
all come here first, so whatever they create in the data dir (store, images, the XFS
image) is root's alone, and the data dir's set-up says what it did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .output import err_console


def server_settings(data_dir: Path | None) -> Any:
    from pal.config import Settings
    from pal.server import secure_umask

    secure_umask()
    return Settings.from_env(data_dir)


def prepare_data_dir(settings: Any) -> None:
    """Make the data dir reflink-capable (creating and mounting its XFS image if needed),
    saying so on stderr: the first run creates a large sparse file beside the data dir."""
    from pal.server import prepare_data_dir as prepare
    from pal.vmm.datadir import ensure_reflink_datadir

    ensure_reflink_datadir(settings, say)  # what it does, said (the server only logs it)
    prepare(settings)  # idempotent: finds it done, and makes the data dir root-only


def say(message: str) -> None:
    """A line of progress on stderr, whole (paths are not wrapped or read as markup)."""
    err_console.print(message, soft_wrap=True, markup=False, highlight=False)
