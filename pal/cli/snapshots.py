"""`pal snapshots`: operator commands on the snapshots in S3 (run on a host with the keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .output import fail, print_json
from .settings import say, server_settings

snapshots_app = typer.Typer(help="Snapshots in S3 (opens the bucket directly).", no_args_is_help=True)


@snapshots_app.command("rekey")
def snapshots_rekey(
    new_key_file: Annotated[
        Path, typer.Option("--new-key-file", help="the new snapshot encryption key (made, 0600, if missing)")
    ],
    old_key_file: Annotated[
        Path | None,
        typer.Option(
            "--old-key-file", help="the key to rewrap from (default: PAL_SNAPSHOT_ENCRYPTION_KEY_FILE)"
        ),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="data directory (default PAL_DATA_DIR or /var/lib/pal)")
    ] = None,
) -> None:
    """Rotate the snapshot encryption key: rewrap every data key in the bucket under a new key.

    The bucket is S3_ENDPOINT/S3_BUCKET. Only the small key.json objects are rewritten,
    never the data. Re-run it after every node holds the new key, to catch the snapshots
    uploaded under the old one meanwhile (docs/security.md, "Snapshots at rest")."""
    from pal import keyfile
    from pal.errors import PalError
    from pal.snapshots.crypt import key_id
    from pal.snapshots.rekey import rekey
    from pal.snapshots.s3 import S3Mirror

    settings = server_settings(data_dir)
    if not settings.s3_enabled:
        fail("no S3 bucket configured (S3_ENDPOINT, S3_BUCKET): nothing to rekey", "FAILED_PRECONDITION")
    old_path = old_key_file or settings.snapshot_encryption_key_path
    try:
        if not old_path.exists():
            fail(f"no snapshot encryption key at {old_path}", "NOT_FOUND")
        old_key = keyfile.load_or_create(old_path)
        new_key = keyfile.load_or_create(new_key_file)
        if new_key == old_key:
            fail("the new key is the old key: give a new key file", "INVALID_ARGUMENT")
        say(f"rewrapping data keys from key {key_id(old_key)} to {key_id(new_key)}")
        mirror = S3Mirror(
            settings.s3_endpoint,
            settings.s3_bucket,
            settings.s3_region,
            encryption_key=new_key,
            sse=settings.s3_sse,
            sse_kms_key_id=settings.s3_sse_kms_key_id,
        )
        report = rekey(mirror, old_key, new_key)
    except PalError as exc:
        fail(exc.message, exc.code)
    print_json({"oldKeyId": key_id(old_key), "newKeyId": key_id(new_key), **report.to_json()})
    if report.failed:
        raise typer.Exit(1)
